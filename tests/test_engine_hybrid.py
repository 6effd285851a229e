"""The engine on a hybrid model (Qwen3-Next: Gated DeltaNet layers beside full attention):
state slots follow sequences through chunked prefill, preemption, aborts and reuse, and are
always given back; prefix caching is off; memory sizing counts the states."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine_testing import GREEDY, one_torch_thread, prompt_ids  # noqa: F401 (fixture)
from r3srv import LLM, SamplingParams
from r3srv.errors import ConfigError
from r3srv.models.model import MoeForCausalLM
from tiny_checkpoints import write_tiny_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next", seed=5, num_layers=3))


def _outputs_equal(got, want):
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        np.testing.assert_array_equal(b.outputs[0].routed_experts, a.outputs[0].routed_experts)


def _one_at_a_time(path, prompts, params):
    llm = LLM(path, max_model_len=128, max_num_seqs=1)
    return [llm.generate([p], params)[0] for p in prompts]


def test_prefix_caching_is_off_and_repeats_are_identical(hybrid_path):
    llm = LLM(hybrid_path, max_model_len=128, block_size=4)
    assert llm.engine.config.enable_prefix_caching is False
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = llm.generate([prompt_ids(20)], params)
    again = llm.generate([prompt_ids(20)], params)
    assert again[0].num_cached_tokens == 0 and llm.stats().prefix_cache_queries == 0
    _outputs_equal(again, first)


def test_more_sequences_than_slots_reuse_them_from_zero_states(hybrid_path):
    """Seven prompts through three slots, in one batch: each output equals its own lone run,
    so a reused slot never leaks the previous sequence's state."""
    prompts = [prompt_ids(5 + 3 * i, base=i) for i in range(7)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    llm = LLM(hybrid_path, max_model_len=128, max_num_seqs=3)
    _outputs_equal(llm.generate(prompts, params), _one_at_a_time(hybrid_path, prompts, params))
    assert llm.engine.block_manager.num_used_state_slots == 0


def test_chunked_prefill_preemption_and_aborts_keep_states_straight(hybrid_path):
    """Chunked prefills (8-token budget), preemptions by recompute (a 20-block pool), n=2 and
    aborts mid-flight: every output equals a roomy engine's, and every slot comes back."""
    rng = random.Random(3)
    prompts = [prompt_ids(rng.randint(3, 30), base=i) for i in range(8)]
    params = [SamplingParams(max_tokens=rng.randint(4, 16), routed_experts_prompt_start=rng.randint(0, 3), **GREEDY)
              for _ in prompts]
    roomy = LLM(hybrid_path, max_model_len=64).generate(prompts, params)
    tight = LLM(hybrid_path, max_model_len=64, block_size=4, num_kv_blocks=20, max_num_batched_tokens=8,
                max_num_seqs=4)
    engine = tight.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    for j in range(2):
        engine.add_request(f"x{j}", prompt_ids(12, base=50 + j), SamplingParams(max_tokens=30, **GREEDY))
    finished, steps = {}, 0
    while engine.has_unfinished():
        step = engine.step()
        assert not step.failed
        finished.update((o.request_id, o) for o in step.outputs if o.finished)
        steps += 1
        if steps == 6:
            for j in range(2):
                assert engine.abort_request(f"x{j}").outputs[0].finish_reason == "abort"
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.state_slots_total == 4
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0
    _outputs_equal([finished[f"r{i}"] for i in range(len(prompts))], roomy)


def test_release_and_resume_drop_and_restore_the_states(hybrid_path):
    llm = LLM(hybrid_path, max_model_len=64)
    params = SamplingParams(max_tokens=6, **GREEDY)
    before = llm.generate([prompt_ids(9)], params)
    llm.release_memory(["kv_cache"])
    linear = llm.engine.model.layers[0].linear_attn
    assert linear.recurrent_state is None and linear.conv_state is None
    llm.resume_memory(["kv_cache"])
    assert linear.recurrent_state.shape[0] == llm.engine.config.max_num_seqs
    _outputs_equal(llm.generate([prompt_ids(9)], params), before)


def test_kv_sizing_counts_the_states(hybrid_path, monkeypatch):
    llm = LLM(hybrid_path, max_model_len=64, max_num_seqs=4)
    model, cfg = llm.engine.model, llm.engine.model_config
    # only the full-attention layer has K/V; each linear layer a conv window and a float32 matrix
    assert cfg.attention_layers == [1] and cfg.linear_attention_layers == [0, 2]
    assert model.kv_cache_bytes_per_block(16) == 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    conv_channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    per_layer = conv_channels * 3 * 4 + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    assert model.state_bytes_per_slot() == 2 * per_layer
    assert model.layers[1].linear_attn is None and model.layers[0].attn is None
    monkeypatch.setattr(MoeForCausalLM, "state_bytes_per_slot", lambda self: 1 << 50)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        LLM(hybrid_path, max_model_len=64)

"""The engine on hybrid models (Qwen3-Next: Gated DeltaNet layers beside full attention;
Nemotron-H and Granite-4.0-H: Mamba-2 layers beside attention; Kimi-Linear: Kimi Delta
Attention beside MLA; LFM2-MoE: short convolutions, a window and no recurrent state): state slots follow sequences through chunked
prefill, preemption, aborts and reuse, and are always given back; prefix caching resumes
from state snapshots; memory sizing counts the states."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine_testing import GREEDY, one_torch_thread, prompt_ids, run_with_aborts  # noqa: F401 (fixture)
from r3srv import LLM, SamplingParams
from r3srv.errors import ConfigError
from r3srv.models.model import MoeForCausalLM
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.slow  # an engine per test on several checkpoints

pytest.importorskip("transformers")


HYBRIDS = {"qwen3_next": dict(num_layers=3), "nemotron_h": {}, "kimi_linear": dict(num_layers=3),
           "granitemoehybrid": dict(num_layers=3), "lfm2_moe": dict(num_layers=3)}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid_path(request, tmp_path_factory):
    family = request.param
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp(family), family, seed=5, **HYBRIDS[family]))


@pytest.fixture(params=["alone", "padded"])
def scan_grouping(request, monkeypatch):
    """Multi-token sequences scan one by one (the CPU's way) or padded in groups (CUDA's way), in
    the engines built meanwhile (the CPU backend reads the factor when a model is built)."""
    from r3srv.ops import cpu, cuda

    monkeypatch.setattr(cpu, "SCAN_PAD_FACTOR", cpu.SCAN_PAD_FACTOR if request.param == "alone" else cuda.SCAN_PAD_FACTOR)
    return request.param


def _outputs_equal(got, want):
    for a, b in zip(want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        np.testing.assert_array_equal(b.outputs[0].routed_experts, a.outputs[0].routed_experts)


def _one_at_a_time(path, prompts, params):
    llm = LLM(path, max_model_len=128, max_num_seqs=1)
    return [llm.generate([p], params)[0] for p in prompts]


def _no_snapshot_leaks(llm):
    pool = llm.engine.block_manager.states
    assert pool.num_used_slots == 0 and pool.num_owned_snapshots == 0
    return pool


def test_repeated_prompts_and_siblings_resume_from_the_prompt_snapshot(hybrid_path):
    """A prompt's states at its last block boundary are kept: the same prompt again, and the
    siblings of an n=3 request, compute only the tokens after it, with identical outputs."""
    params = SamplingParams(max_tokens=6, **GREEDY)
    cold = LLM(hybrid_path, max_model_len=128, block_size=4, enable_prefix_caching=False)
    llm = LLM(hybrid_path, max_model_len=128, block_size=4)
    prompt = prompt_ids(21)
    first, again = llm.generate([prompt], params), llm.generate([prompt], params)
    assert first[0].num_cached_tokens == 0 and again[0].num_cached_tokens == 20
    _outputs_equal(again, cold.generate([prompt], params))
    hits = llm.stats().prefix_cache_hits
    sampled = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
    siblings = llm.generate([prompt_ids(18, base=4)], sampled)[0]
    assert llm.stats().prefix_cache_hits - hits == 2 * 16  # the two siblings after the first
    reference = cold.generate([prompt_ids(18, base=4)], sampled)[0]
    for a, b in zip(reference.outputs, siblings.outputs):
        assert a.token_ids == b.token_ids
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    assert _no_snapshot_leaks(llm).num_kept_snapshots > 0


def test_the_next_turn_resumes_where_the_last_one_ended(hybrid_path):
    """Multi-turn: turn 2's prompt is turn 1's prompt, output and a new message; it resumes from
    the snapshot turn 1 left at its last block boundary (its rows skip what turn 1 returned)."""
    llm = LLM(hybrid_path, max_model_len=128, block_size=4)
    cold = LLM(hybrid_path, max_model_len=128, block_size=4, enable_prefix_caching=False)
    turn1 = prompt_ids(21)
    out1 = llm.generate([turn1], SamplingParams(max_tokens=10, **GREEDY))[0].outputs[0]
    turn2 = turn1 + list(out1.token_ids) + prompt_ids(7, base=9)
    start = len(turn1) + len(out1.token_ids) - 1  # the rows turn 1 already returned
    params = SamplingParams(max_tokens=8, routed_experts_prompt_start=start, **GREEDY)
    warm = llm.generate([turn2], params)
    assert warm[0].num_cached_tokens == (len(turn1) + 10 - 1) // 4 * 4  # 28: the last boundary turn 1 computed
    _outputs_equal(warm, cold.generate([turn2], params))
    _no_snapshot_leaks(llm)


def test_snapshots_are_evicted_oldest_first_and_a_reset_forgets_them(hybrid_path):
    llm = LLM(hybrid_path, max_model_len=128, block_size=4, max_num_seqs=1)  # 2 snapshots in all
    params = SamplingParams(max_tokens=3, **GREEDY)
    prompts = [prompt_ids(13, base=i) for i in range(4)]
    outs = [llm.generate([p], params)[0] for p in prompts]
    assert llm.generate([prompts[3]], params)[0].num_cached_tokens == 12  # the newest is kept
    assert llm.generate([prompts[0]], params)[0].num_cached_tokens == 0  # the oldest was evicted
    _outputs_equal([llm.generate([prompts[0]], params)[0]], [outs[0]])  # hits its own fresh snapshot
    assert llm.engine.reset_prefix_cache() > 0
    assert llm.generate([prompts[0]], params)[0].num_cached_tokens == 0
    assert _no_snapshot_leaks(llm).num_kept_snapshots <= 2


def test_more_sequences_than_slots_reuse_them_from_zero_states(hybrid_path, scan_grouping):
    """Ten prompts through three slots, in one batch: each output equals its own lone run,
    so a reused slot never leaks the previous sequence's state."""
    # one-token prompts join steps of decodes only: a fresh state in the batched decode path
    prompts = [prompt_ids(5 + 3 * i, base=i) for i in range(7)] + [[65], [66], [67]]
    params = SamplingParams(max_tokens=10, **GREEDY)
    llm = LLM(hybrid_path, max_model_len=128, max_num_seqs=3)
    _outputs_equal(llm.generate(prompts, params), _one_at_a_time(hybrid_path, prompts, params))
    assert llm.engine.block_manager.num_used_state_slots == 0


def test_chunked_prefill_preemption_and_aborts_keep_states_straight(hybrid_path, scan_grouping):
    """Chunked prefills (8-token budget), preemptions by recompute (a 20-block pool), prompts
    sharing prefixes (snapshot hits), aborts mid-flight: every output equals a roomy engine's
    without prefix caching, and every slot and owned snapshot comes back."""
    rng = random.Random(3)
    shared = prompt_ids(30, base=77)
    prompts = [shared[: rng.choice([0, 9, 17])] + prompt_ids(rng.randint(3, 20), base=i) for i in range(8)]
    params = [SamplingParams(max_tokens=rng.randint(4, 16), routed_experts_prompt_start=rng.randint(0, 3), **GREEDY)
              for _ in prompts]
    roomy = LLM(hybrid_path, max_model_len=64, enable_prefix_caching=False).generate(prompts, params)
    tight = LLM(hybrid_path, max_model_len=64, block_size=4, num_kv_blocks=20, max_num_batched_tokens=8,
                max_num_seqs=4)
    requests = {f"r{i}": (prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))}
    aborted = {f"x{j}": (prompt_ids(12, base=50 + j), SamplingParams(max_tokens=30, **GREEDY)) for j in range(2)}
    finished = run_with_aborts(tight.engine, requests, aborted, abort_at_step=6)
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.state_slots_total == 4
    assert stats.state_slots_used == 0 and stats.kv_blocks_used == 0
    _no_snapshot_leaks(tight)
    _outputs_equal([finished[f"r{i}"] for i in range(len(prompts))], roomy)


def test_release_and_resume_drop_and_restore_the_states(hybrid_path):
    llm = LLM(hybrid_path, max_model_len=64)
    params = SamplingParams(max_tokens=6, **GREEDY)
    before = llm.generate([prompt_ids(40)], params)
    assert llm.generate([prompt_ids(40)], params)[0].num_cached_tokens == 32
    llm.release_memory(["kv_cache"])
    linear = llm.engine.model.layers[0].linear_attn
    assert linear.recurrent_state is None and linear.conv_state is None
    llm.resume_memory(["kv_cache"])
    # a slot per sequence, and twice as many snapshots (owned by running sequences, or kept)
    assert all(pool.shape[0] == 3 * llm.engine.config.max_num_seqs for pool in linear.pools())
    again = llm.generate([prompt_ids(40)], params)
    assert again[0].num_cached_tokens == 0  # the release forgot the prefix cache and its snapshots
    _outputs_equal(again, before)


def test_kv_sizing_counts_the_states(hybrid_path, monkeypatch):
    llm = LLM(hybrid_path, max_model_len=64, max_num_seqs=4)
    model, cfg = llm.engine.model, llm.engine.model_config
    # K/V only in the attention layers, states only in the linear ones: the sizes the
    # engine budgets are those of the tensors allocated
    linear = [layer.linear_attn for layer in model.layers if layer.linear_attn is not None]
    attention = [layer.attn for layer in model.layers if layer.attn is not None]
    assert [layer.index for layer in model.layers if layer.linear_attn is not None] == cfg.linear_attention_layers
    assert [layer.index for layer in model.layers if layer.attn is not None] == cfg.attention_layers
    assert len(linear) >= 2 and len(attention) >= 1
    def cached_row_bytes(a):  # K and V, or MLA's one latent (its values are a view of it)
        shared = a.v_cache.untyped_storage().data_ptr() == a.k_cache.untyped_storage().data_ptr()
        return (a.k_cache[0].numel() + (0 if shared else a.v_cache[0].numel())) * 4

    assert model.kv_cache_bytes_per_block(16) == sum(16 * cached_row_bytes(a) for a in attention)
    assert model.state_bytes_per_slot() == sum(pool[0].numel() * pool.itemsize for m in linear for pool in m.pools())
    monkeypatch.setattr(MoeForCausalLM, "state_bytes_per_slot", lambda self: 1 << 50)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        LLM(hybrid_path, max_model_len=64)


def test_a_failed_step_leaks_no_state(hybrid_path, monkeypatch):
    """A step that raises after snapshots were planned: the request fails, and its slot, its
    owned snapshot and the prompt snapshot it was to keep all go back to the pool."""
    llm = LLM(hybrid_path, max_model_len=128, block_size=4, max_num_seqs=2)
    engine = llm.engine
    monkeypatch.setattr(engine.core.executor, "execute", lambda sched: (_ for _ in ()).throw(RuntimeError("device lost")))
    engine.add_request("r", prompt_ids(30), SamplingParams(max_tokens=4, **GREEDY))
    step = engine.step()
    assert [rid for rid, _ in step.failed] == ["r"] and not engine.has_unfinished()
    pool = _no_snapshot_leaks(llm)
    assert pool.num_kept_snapshots == 0 and len(pool._free_snapshots) == pool.num_snapshots
    monkeypatch.undo()
    assert llm.generate([prompt_ids(30)], SamplingParams(max_tokens=4, **GREEDY))[0].outputs[0].finish_reason == "length"

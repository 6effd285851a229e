"""Start-up checks (ConfigError before serving) and the routed-experts dtype/dense-layer rules,
on tiny random checkpoints."""

import numpy as np
import pytest
from tiny_checkpoints import write_tiny_checkpoint

from engine_testing import GREEDY, one_torch_thread  # noqa: F401 (autouse fixture)
from r3srv import LLM, SamplingParams
from r3srv.engine.routed_experts import routed_experts_dtype, row_bytes_per_slot
from r3srv.errors import ConfigError

@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
        (dict(decode_context_parallel_size=2), "decode_context_parallel_size=2"),
        (dict(prefill_context_parallel_size=4), "prefill_context_parallel_size=4"),
        (dict(block_size=0), "block_size=0"),
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(dtype="int8"), "dtype='int8'"),
        (dict(device="tpu"), "device='tpu'"),
        (dict(kv_cache_memory_fraction=1.5), "kv_cache_memory_fraction"),
    ],
)
def test_bad_engine_configs_fail_at_construction(kwargs, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        LLM(**kwargs)


def test_routed_experts_on_a_dense_model_is_a_config_error(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "dense", "qwen3_moe", num_layers=2, mlp_only_layers=[0, 1])
    with pytest.raises(ConfigError, match="no MoE layers"):
        LLM(str(path))
    llm = LLM(str(path), enable_return_routed_experts=False, max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].routed_experts is None


def test_kv_pool_and_length_checks(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "small", "mixtral")  # max_position_embeddings=512
    with pytest.raises(ConfigError, match="max_position_embeddings=512"):
        LLM(str(path), max_model_len=1024)
    with pytest.raises(ConfigError, match="fewer than the 8"):
        LLM(str(path), max_model_len=128, block_size=16, num_kv_blocks=7)


def test_dtype_rule():
    assert routed_experts_dtype(8) == np.uint8
    assert routed_experts_dtype(256) == np.uint8
    assert routed_experts_dtype(257) == np.uint16
    assert routed_experts_dtype(65536) == np.uint16
    assert routed_experts_dtype(65537) == np.int32


def test_300_experts_give_uint16_rows_with_ids_above_255(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "wide", "qwen3_moe", num_experts=300, top_k=4, num_layers=2)
    llm = LLM(str(path), max_model_len=128)
    assert llm.routed_experts_info == {
        "num_layers": 2, "top_k": 4, "num_experts": 300, "dtype": "uint16", "moe_layers": [0, 1]
    }
    prompt = list(range(40, 80))
    out = llm.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))[0]
    arr = out.outputs[0].routed_experts
    assert arr.dtype == np.uint16 and arr.shape == (len(prompt) + 10 - 1, 2, 4)
    assert arr.max() > 255 and arr.max() < 300  # ids that uint8 would have wrapped
    warm = llm.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))[0]
    assert warm.num_cached_tokens > 0
    np.testing.assert_array_equal(warm.outputs[0].routed_experts, arr)


def test_kv_sizing_counts_each_slots_rows_in_their_dtype(tmp_path, monkeypatch):
    """A KV block's share of the budget includes its slots' rows as the buffer stores them: one
    byte per id up to 256 experts, two up to 65536 (uint16), four above."""
    from r3srv.engine import core as core_module

    assert [row_bytes_per_slot(2, 4, e) for e in (64, 256, 257, 300, 65536, 65537)] == [8, 8, 16, 16, 16, 32]
    path = write_tiny_checkpoint(tmp_path / "wide", "qwen3_moe", num_experts=300, top_k=4, num_layers=2)
    monkeypatch.setattr(core_module, "available_bytes", lambda: 64 << 20)
    llm = LLM(str(path), max_model_len=512, max_num_seqs=256, kv_cache_memory_fraction=0.5)  # useful: 8192 blocks
    core = llm.engine.core
    per_block = core.executor.kv_cache_bytes_per_block(16) + 16 * 2 * 4 * np.dtype(np.uint16).itemsize
    assert core.rows.rows.dtype == np.uint16
    assert core.config.num_kv_blocks == (32 << 20) // per_block


def test_dense_layers_have_zero_rows(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "mixed", "qwen3_moe", num_layers=3, mlp_only_layers=[1])
    llm = LLM(str(path), max_model_len=64)
    assert llm.routed_experts_info["moe_layers"] == [0, 2]
    arr = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=5, **GREEDY))[0].outputs[0].routed_experts
    assert arr.shape == (8, 3, 2)
    assert not arr[:, 1].any()
    # the MoE layers picked two distinct experts per token
    assert all(len(set(r)) == 2 for r in arr[:, [0, 2]].reshape(-1, 2).tolist())

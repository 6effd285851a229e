"""CUDA graphs for decode steps (engine/cuda_graphs.py), and benches/gpu_throughput.py.

On the CPU: the pure logic (bucket ladder, padding of a step's inputs into a bucket, which
steps are graph steps, the KV budget with the graphs' memory taken out, the flags), the padded
inputs against eager steps in Triton's interpreter (tests/cuda_graph_cases.py), the bench's
roofline bytes and its --smoke run. On CUDA (marked gpu, skipped with the reason elsewhere): a
replay equals the eager forward of the same inputs, and an engine with graphs gives the eager
engine's tokens and routed-experts rows for batch sizes on and between buckets, with an abort
mid-generation, for a hybrid, and after its memory is released and resumed.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_testing import GREEDY, one_torch_thread, prompt_ids, run_with_aborts  # noqa: F401 (fixture)
from r3srv import SamplingParams, engine_options
from r3srv.cli import build_parser
from r3srv.config import EngineConfig, engine_config
from r3srv.engine import core as core_module
from r3srv.engine import cuda_graphs
from r3srv.engine.cuda_graphs import batch_size_buckets, bucket_for, is_graph_decode, pad_decode_inputs
from r3srv.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow  # kernel compiles and timings

# ---- CPU: pure logic -------------------------------------------------------------------------
def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    ladder = batch_size_buckets(64)
    assert ladder == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    for n in range(1, 65):
        b = bucket_for(n, ladder)
        assert b >= n and (b - n < 8) and all(x < n for x in ladder if x < b)
    assert bucket_for(65, ladder) is None


def test_padding_rows_go_to_the_scratch_block_and_state():
    rng = np.random.default_rng(0)
    n, bucket, width, bs = 3, 8, 6, 4
    ids, positions = rng.integers(0, 100, n), np.array([5, 9, 2])
    tables = rng.integers(0, 40, (n, 3)).astype(np.int32)
    slots = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
    host = pad_decode_inputs(ids, positions, slots, tables, np.array([2, 0, 1]), bucket, width, bs,
                             scratch_block=50, scratch_state=7)
    head = host[: 5 * bucket].reshape(5, bucket)
    table = host[5 * bucket:].reshape(bucket, width)
    np.testing.assert_array_equal(head[:, :n], [ids, positions, slots, positions + 1, [2, 0, 1]])
    np.testing.assert_array_equal(head[:, n:], np.array([[0, 0, 200, 1, 7]] * (bucket - n)).T)
    np.testing.assert_array_equal(table[:n, :3], tables)
    assert (table[:n, 3:] == -1).all() and (table[n:, 0] == 50).all() and (table[n:, 1:] == -1).all()
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_inputs(ids, positions, slots, tables, None, 2, width, bs, 50, 7)
    with pytest.raises(ValueError, match="exceed"):
        pad_decode_inputs(ids, positions, slots, tables, None, bucket, 2, bs, 50, 7)


def _seq(scheduled=1, computed=5, restore=-1, snapshots=(), lora_slot=-1, multimodal=None):
    return SimpleNamespace(num_scheduled_tokens=scheduled, num_computed_tokens=computed, restore_from=restore,
                           snapshot_plan=list(snapshots), lora_slot=lora_slot, multimodal=multimodal)


def test_only_plain_decode_steps_replay():
    assert is_graph_decode([_seq(), _seq(computed=1)])
    assert not is_graph_decode([_seq(), _seq(scheduled=4)])  # a prefill chunk: mixed step
    assert not is_graph_decode([_seq(computed=0)])  # a one-token prompt is a prefill
    assert not is_graph_decode([_seq(), _seq(restore=3)])  # a hybrid's prefix hit restores states
    assert is_graph_decode([_seq(snapshots=[(16, 9)])])  # snapshots are copied after the replay
    assert not is_graph_decode([_seq(), _seq(lora_slot=0)])  # under an adapter: graphs hold the base path only
    assert not is_graph_decode([_seq(multimodal=object())])  # an image prompt's M-RoPE positions


def test_graph_memory_comes_out_of_the_kv_budget(monkeypatch):
    monkeypatch.setattr(core_module, "available_bytes", lambda: 1 << 30)
    engine = LLMEngine.from_kwargs(max_num_seqs=64, max_model_len=4096, kv_cache_memory_fraction=0.05)
    per_block = engine.model.kv_cache_bytes_per_block(16) + 16 * engine.model_config.num_layers * \
        engine.model_config.top_k  # uint8 rows
    eager = engine.core._auto_num_blocks()
    assert eager < 64 * 256  # the budget, not the useful cap, decides here
    engine.core.executor.graphs_reserved = cuda_graphs.reserved_bytes(10 * per_block, per_block, 0)
    assert engine.core._auto_num_blocks() == eager - 11


def _config(args) -> EngineConfig:
    """The EngineConfig the CLI's arguments make."""
    return engine_config(**engine_options.from_args(args))


def test_flags(r3srv_settings):
    parser = build_parser()
    argv = ["serve", "--device", "cpu"]
    r3srv_settings(cuda_graphs=False)
    assert _config(parser.parse_args(argv)).cuda_graphs is False  # off by default
    r3srv_settings(cuda_graphs=True)  # $R3SRV_CUDA_GRAPHS=1
    assert _config(parser.parse_args(argv)).cuda_graphs is True
    r3srv_settings(cuda_graphs=False)
    asked = _config(parser.parse_args(argv + ["--cuda-graphs"]))
    assert asked.cuda_graphs and not asked.use_cuda_graphs  # on the CPU there is nothing to capture
    cuda = dict(device="cuda") if torch.cuda.is_available() else None
    if cuda:
        assert EngineConfig(cuda_graphs=True, **cuda).use_cuda_graphs
        assert not EngineConfig(cuda_graphs=True, enforce_eager=True, **cuda).use_cuda_graphs
    eager = parser.parse_args(argv + ["--cuda-graphs", "--enforce-eager"])
    assert engine_options.from_args(eager)["enforce_eager"] is True


def test_cpu_engine_asked_for_graphs_runs_eagerly():
    engine = LLMEngine.from_kwargs(cuda_graphs=True, max_model_len=64, num_kv_blocks=8, block_size=8)
    assert engine.runner.graphs is None and engine.core.executor.graphs_reserved == 0
    engine.add_request("a", prompt_ids(5), SamplingParams(max_tokens=3, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert engine.runner.graph_steps == 0


# ---- CUDA --------------------------------------------------------------------------------------
def _engine(graphs: bool, path=None, **kw):
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=256, block_size=16, max_num_seqs=16,
              kv_cache_memory_fraction=0.05, cuda_graphs=graphs, **kw)
    return LLMEngine.from_kwargs(None if path is None else str(path), **kw)


def _run(engine, prompts, aborted=(), abort_at=0):
    params = SamplingParams(max_tokens=12, **GREEDY)
    reqs = {f"r{i}": (p, params) for i, p in enumerate(prompts)}
    gone = {f"x{i}": (p, SamplingParams(max_tokens=40, **GREEDY)) for i, p in enumerate(aborted)}
    done = run_with_aborts(engine, reqs, gone, abort_at)
    assert engine.stats().kv_blocks_used == 0
    return {rid: (o.outputs[0].token_ids, o.outputs[0].routed_experts) for rid, o in done.items() if rid in reqs}


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        np.testing.assert_array_equal(got[rid][1], want[rid][1])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 8, 13])  # 3 and 13: padded into the buckets of 4 and 16
def test_graph_decode_equals_eager(batch):
    prompts = [prompt_ids(5 + 7 * i, base=i) for i in range(batch)]
    graphed = _engine(True)
    assert graphed.runner.graphs is not None, "graphs were not captured"
    got = _run(graphed, prompts)
    assert graphed.runner.graph_steps > 0
    _assert_same(got, _run(_engine(False), prompts))


@pytest.mark.gpu
def test_replay_equals_the_eager_forward_of_the_same_inputs():
    engine = _engine(True)
    graphs = engine.runner.graphs
    engine.add_request("a", prompt_ids(30), SamplingParams(max_tokens=2, **GREEDY))
    engine.add_request("b", prompt_ids(9, base=4), SamplingParams(max_tokens=2, **GREEDY))
    engine.step()  # the prefill: their K/V in the cache
    seqs = [r.seqs[0] for r in engine.requests.values()]
    for s in seqs:
        s.num_scheduled_tokens = 1
        s.num_computed_tokens = s.num_tokens - 1
    ids, positions, slots, tables, _, _ = engine.runner.host_arrays(seqs)
    logits, capture = graphs.run(seqs, ids, positions, slots, tables)
    logits, capture = logits.clone(), capture.clone()
    eager = engine.model.forward(graphs.batch(bucket_for(2, graphs.buckets)))  # the same static inputs
    # the same kernels on the same shapes; only the experts' index_add_ (atomics) may sum in
    # another order, a bfloat16 rounding apart
    torch.testing.assert_close(logits, eager[:2], rtol=2e-2, atol=5e-2)
    assert torch.equal(logits.argmax(-1), eager[:2].argmax(-1))
    torch.testing.assert_close(capture, graphs.capture[:2], rtol=0, atol=0)
    assert capture.any()


@pytest.mark.gpu
def test_abort_mid_generation():
    prompts, aborted = [prompt_ids(6 + i, base=i) for i in range(5)], [prompt_ids(11, base=9), prompt_ids(4)]
    graphed = _engine(True)
    got = _run(graphed, prompts, aborted, abort_at=4)
    assert graphed.runner.graph_steps > 0
    _assert_same(got, _run(_engine(False), prompts, aborted, abort_at=4))


@pytest.mark.gpu
def test_hybrid_graphs_equal_eager(tmp_path):
    pytest.importorskip("transformers")
    from tiny_checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_next", seed=5, num_layers=3)
    prompts = [prompt_ids(5 + 9 * i, base=i) for i in range(3)]
    graphed = _engine(True, path, block_size=4)
    assert graphed.runner.graphs is not None
    got = _run(graphed, prompts)
    assert graphed.runner.graph_steps > 0
    _assert_same(got, _run(_engine(False, path, block_size=4), prompts))


@pytest.mark.gpu
def test_enforce_eager_wins():
    engine = _engine(True, enforce_eager=True)
    assert engine.runner.graphs is None and engine.core.executor.graphs_reserved == 0


# ---- benches/gpu_throughput.py on the CPU (--smoke: the script itself, at toy size) ------------
def _throughput_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benches" / "gpu_throughput.py"
    spec = importlib.util.spec_from_file_location("gpu_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_throughput_roofline_bytes():
    bench = _throughput_bench()
    cfg = dict(bench.QWEN3_30B_A3B, **bench.SMOKE)
    sizes = bench.Bytes(bench.random_model(cfg, torch.device("cpu")))
    h, i, layers, kvh, d = cfg["hidden_size"], cfg["moe_intermediate_size"], 2, 2, 16
    assert sizes.expert == 3 * h * i * 2  # gate, up and down of one bf16 expert
    assert sizes.kv_token == layers * 2 * kvh * d * 2
    attention = h * (4 * d + 2 * kvh * d) + 4 * d * h + 2 * d  # qkv, o, q/k norms
    dense = layers * (attention + 2 * h + cfg["num_experts"] * h) + h + cfg["vocab_size"] * h  # norms, router, final, lm_head
    assert sizes.dense == dense * 2
    assert sizes.step(3, 100, 10.0) == dense * 2 + 3 * h * 2 + 10 * sizes.expert + 300 * sizes.kv_token


def test_throughput_bench_skips_on_cpu_and_smokes(tmp_path, capsys):
    bench = _throughput_bench()
    if not torch.cuda.is_available():
        assert bench.main([]) == 0 and "skipped" in capsys.readouterr().out
        assert bench.main(["--require-gpu"]) == 1
    out = tmp_path / "table.md"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    table = out.read_text()
    assert table.count("| on | eager |") == 2 and table.count("| off | eager |") == 2  # batches 1 and 3
    assert "routed experts on/off step time" in table


def test_padded_graph_inputs_equal_eager_steps_in_the_triton_interpreter():
    """tests/cuda_graph_cases.py in a fresh TRITON_INTERPRET=1 process: a bucket's padded static
    inputs through the graph-mode metadata equal the eager steps (qwen3_moe and a hybrid)."""
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    from pathlib import Path

    from interpreter_testing import assert_cases_pass_in_interpreter

    assert_cases_pass_in_interpreter(Path(__file__).with_name("cuda_graph_cases.py"))


@pytest.mark.gpu
def test_graphs_are_captured_again_after_memory_is_released():
    engine = _engine(True)
    prompts = [prompt_ids(7 + i, base=i) for i in range(3)]
    first = _run(engine, prompts)
    engine.release_memory()
    assert not engine.runner.graphs.graphs  # they pointed into the memory that moved
    engine.resume_memory()
    assert sorted(engine.runner.graphs.graphs) == engine.runner.graphs.buckets
    steps = engine.runner.graph_steps
    _assert_same(_run(engine, prompts), first)
    assert engine.runner.graph_steps > steps

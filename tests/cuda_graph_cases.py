"""Cases for the inputs of a graph-captured decode step (engine/cuda_graphs.py), on the CPU: the
padded static buffers of a bucket, read through the graph-mode metadata (the paged decode kernel
in Triton's interpreter, a hybrid's recurrent layers from the static state slots), against the
eager step. No CUDA graph is captured here: these check what a graph would replay.

Every decode step of a generation runs both ways from the same cache: the padded step's logits
and routed-experts rows equal the eager step's, and it leaves every K/V slot and state entry
but the scratch ones as the eager step does (padding rows leak nowhere); the generation then
continues from the padded step's results and its tokens equal an eager engine's.

Like tests/paged_decode_cases.py, this file only runs in a process started with
TRITON_INTERPRET=1: tests/test_cuda_graphs.py starts one.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a process started with TRITON_INTERPRET=1 (see tests/test_cuda_graphs.py)",
                allow_module_level=True)

from engine_testing import GREEDY, prompt_ids  # noqa: E402
from r3srv import SamplingParams  # noqa: E402
from r3srv.engine.cuda_graphs import DecodeGraphs, is_graph_decode  # noqa: E402
from r3srv.engine.llm_engine import LLMEngine  # noqa: E402
from r3srv.engine.model_runner import RunOutput  # noqa: E402
from r3srv.engine.routed_experts import capture_torch_dtype  # noqa: E402
from r3srv.kernels.paged_decode_triton import paged_decode_triton  # noqa: E402
from r3srv.ops import cpu  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

BLOCK = 4
FAMILIES = {"qwen3_moe": {}, "qwen3_next": dict(num_layers=3)}
PROMPTS = [prompt_ids(5), prompt_ids(11, base=3), prompt_ids(2, base=6)]  # 3 rows: padded into the bucket of 4


@pytest.fixture(autouse=True)
def kernel_on_cpu_tensors(monkeypatch):
    """The models built here decode through the Triton kernel (on CPU tensors, in the interpreter)."""
    build = cpu.build
    monkeypatch.setattr(cpu, "build", lambda *args: build(*args).replace(decode_attention=paged_decode_triton))


def _memory(model) -> list[torch.Tensor]:
    """Every K/V cache and state pool of the model."""
    out = []
    for layer in model.layers:
        if layer.linear_attn is not None:
            out += list(layer.linear_attn.pools())
        elif layer.attn is not None:
            out += [layer.attn.k_cache, layer.attn.v_cache]
    return out


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine.from_kwargs(str(path), dtype="float32", max_model_len=64, block_size=BLOCK, max_num_seqs=4,
                                 num_kv_blocks=48, **kw)


def _generate(engine) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, **GREEDY))
    done = {}
    while engine.has_unfinished():
        step = engine.step()
        assert not step.failed, step.failed
        done.update((o.request_id, o) for o in step.outputs if o.finished)
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))]


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_decode_inputs_equal_the_eager_step(family, tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt", family, seed=5, **FAMILIES[family])
    engine = _engine(path)
    model, cfg = engine.model, engine.config
    graphs = DecodeGraphs(model, BLOCK, cfg.max_num_seqs, 64, engine.core.num_state_snapshots,
                          capture_torch_dtype(model.config.num_experts))
    graphs.init_kv_cache(cfg.num_kv_blocks, capture=False)  # as the engine allocates for graphs, less the capture
    scratch_state = graphs.scratch_state
    runner, eager_run = engine.runner, engine.runner.run
    real_slots = cfg.num_kv_blocks * BLOCK
    checked, snapshotted = [], []

    def real(t: torch.Tensor) -> torch.Tensor:
        """A cache's or pool's rows but the scratch block's slots or the scratch state entry."""
        return t[:real_slots] if t.shape[0] == real_slots + BLOCK else t[:scratch_state]

    @torch.inference_mode()
    def both_ways(seqs, prompt_spans=()):
        if prompt_spans or not is_graph_decode(seqs):
            return eager_run(seqs, prompt_spans)
        before = [t.clone() for t in _memory(model)]
        batch, _ = runner.prepare(seqs)
        want_logits, want_rows = model.forward(batch), batch.routing_capture.clone()
        want_memory = [t.clone() for t in _memory(model)]
        for t, saved in zip(_memory(model), before):
            t.copy_(saved)
        ids, positions, slots, tables, _, _ = runner.host_arrays(seqs)
        snapshotted.extend(e for s in seqs for _, e in s.snapshot_plan)
        bucket = graphs.load(seqs, ids, positions, slots, tables)
        assert bucket == 4 or len(seqs) == bucket
        logits = model.forward(graphs.batch(bucket))[: len(seqs)]
        graphs.snapshot(seqs)
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(graphs.capture[: len(seqs)].numpy(), want_rows.numpy())
        for got, want in zip(_memory(model), want_memory):
            torch.testing.assert_close(real(got), real(want), rtol=1e-4, atol=1e-5)
        checked.append(len(seqs))
        return RunOutput(logits, None, graphs.capture[: len(seqs)].clone(), slots)  # the core stores the rows

    runner.run = both_ways
    tokens = _generate(engine)
    assert len(checked) >= 4 and 3 in checked  # decode steps of all three, padded into the bucket of 4
    if engine.core.num_state_snapshots:  # prefix caching snapshotted states in some of those steps
        assert snapshotted
    assert tokens == _generate(_engine(path))

"""Shared by the engine tests: greedy settings, deterministic prompts, one torch thread, a model
bound to another backend."""

import contextlib

import pytest
import torch

GREEDY = dict(temperature=0.0, ignore_eos=True)
# the built-in model's parallel layouts on two CPU ranks (gloo), each compared with one device
PARALLEL_MODES = {"tp2": dict(tensor_parallel_size=2), "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True)}


def prompt_ids(n: int, base: int = 0) -> list[int]:
    """Distinct printable-byte prompts (the built-in tokenizer maps bytes to ids 0..255)."""
    return [32 + (base * 7 + i * 13) % 90 for i in range(n)]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Import into a test module to run its torch ops outside the model on one thread: tiny
    ops gain nothing from a second intra-op thread, and on a shared 2-core machine a busy
    core makes OpenMP's spin-waits 10-50x slower. (The forward itself uses
    $R3SRV_CPU_THREADS, default 1, whatever this says.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def full_precision_matmuls():
    """float32 matmuls without TF32 on CUDA, so GPU results can equal the CPU's."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture
def fused_calls(monkeypatch):
    """The layer steps that took the CPU backend's fused decode step since the test began
    (ops/cpu_decode.py; reset by calls.clear())."""
    from r3srv.ops.cpu_decode import FusedDecoderLayer

    calls = []
    run = FusedDecoderLayer.__call__

    def counted(self, *args, **kwargs):
        calls.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(FusedDecoderLayer, "__call__", counted)
    return calls


def counting(kernel, runs: list):
    """`kernel` (a Rust kernel's wrapper, None where it does not apply) that also appends to
    `runs` whether it ran."""

    def counted(*args, **kwargs):
        out = kernel(*args, **kwargs)
        runs.append(out is not None)
        return out

    return counted


def model_of(llm):
    """The model an LLM (or an AsyncLLM) runs."""
    core = llm.engine.core if hasattr(llm, "engine") else llm.core
    return core.executor.runner.model


@contextlib.contextmanager
def rebound(model, **switches):
    """`model` bound to the backend these settings give its device (r3srv.ops.ops_for; the
    kernels are chosen when ops are selected, not per call) for a with block, then to the ops
    it had."""
    from r3srv import settings

    before = model.ops
    with settings.overridden(**switches):
        model.select_ops()
    try:
        yield model.ops
    finally:
        model.select_ops(before)


@contextlib.contextmanager
def recording_routers(model, record: list):
    """Every MoE layer's route function appends its router logits (float32 copies, call order)
    to `record` for a with block: the modules' path (no fused decode step, which routes in Rust
    without calling them)."""
    with rebound(model, fast_cpu_decode=False):
        for layer in model.layers:
            if layer.is_moe:
                layer.mlp.route = _recorded(layer.mlp.route, record)
        yield


def _recorded(route, record: list):
    def spy(router_logits, top_k, **kwargs):
        record.append(router_logits.detach().float().clone())
        return route(router_logits, top_k, **kwargs)

    return spy


def assert_same_outputs_either_way(llm, prompts: list, kernel_runs: list, setting: str, every_call: bool = True) -> None:
    """Greedy generations of `prompts` with the backend setting `setting` on, then off (the
    model's ops selected again each time, without the fused decode step so the modules' wiring
    runs): the same tokens and routed-experts rows, and the kernel ran (each call appends
    whether it did to `kernel_runs`) at every call the first time (with every_call=False: at
    some) and never the second."""
    import numpy as np

    from r3srv import SamplingParams

    def run(on: bool):
        with rebound(model_of(llm), fast_cpu_decode=False, **{setting: on}):
            outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
        return [(o.outputs[0].token_ids, o.outputs[0].routed_experts) for o in outs]

    on = run(True)
    assert kernel_runs and (all(kernel_runs) if every_call else any(kernel_runs))
    runs_on = len(kernel_runs)
    off = run(False)
    assert not any(kernel_runs[runs_on:])  # not taken (the backend without it does not call it at all)
    for (tokens_on, rows_on), (tokens_off, rows_off) in zip(on, off):
        assert tokens_on == tokens_off and rows_on is not None
        np.testing.assert_array_equal(rows_on, rows_off)


def run_with_aborts(engine, requests: dict, aborted: dict, abort_at_step: int) -> dict:
    """Add `requests` and `aborted` (request id -> (prompt, SamplingParams)) to an LLMEngine and
    step it to the end, aborting the `aborted` ones after `abort_at_step` steps (each must end
    with finish_reason "abort"); no step may fail. Returns the finished outputs by request id."""
    for rid, (prompt, params) in {**requests, **aborted}.items():
        engine.add_request(rid, prompt, params)
    finished, steps = {}, 0
    while engine.has_unfinished():
        step = engine.step()
        assert not step.failed
        finished.update((o.request_id, o) for o in step.outputs if o.finished)
        steps += 1
        if steps == abort_at_step:
            for rid in aborted:
                assert engine.abort_request(rid).outputs[0].finish_reason == "abort"
    return finished


def single_and_split(engine: dict):
    """Module fixtures `single` (one device) and `split` (each of PARALLEL_MODES, its worker
    processes gone after shutdown) of r3srv.LLM(**engine): `single, split = single_and_split(ENGINE)`."""
    from r3srv import LLM

    @pytest.fixture(scope="module")
    def single():
        return LLM(**engine)

    @pytest.fixture(scope="module", params=list(PARALLEL_MODES))
    def split(request):
        llm = LLM(**engine, **PARALLEL_MODES[request.param])
        yield llm
        llm.shutdown()
        assert all(not w.is_alive() for w in llm.engine.core.executor.ranks.workers)

    return single, split

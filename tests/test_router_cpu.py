"""The Rust CPU router (kernels/router_cpu.py, rust/src/router_cpu.rs) against route_reference on
generated logits (ties, NaN, infinities, float32 and bfloat16), where it must step aside, the
CPU backend's route function with it, its ValueErrors, and the built-in model's tokens and
routed experts with it on and off."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings as hsettings
from hypothesis import strategies as st

from engine_testing import assert_same_outputs_either_way, counting, prompt_ids
from r3srv import LLM, settings
from r3srv.kernels import router_cpu
from r3srv.kernels.router_cpu import BUILT, route_cpu
from r3srv.kernels.router_reference import route_reference
from r3srv.ops import ops_for, router
from r3srv.ops.router import RouterShape


def cpu_route(shape=RouterShape(64, 8), **switches):
    """The CPU backend's route function for a layer of this shape, under these settings."""
    with settings.overridden(**switches):
        return ops_for("cpu", torch.float32).router(shape)

CAPTURE_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
SPECIALS = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])


def generated_logits(seed: int, tokens: int, experts: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, experts] logits: "normal" draws, "ties" (small integers: many equal logits) or
    "specials" (normal draws with NaN, +-inf and signed zeros sprinkled in, whole rows too)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "ties":
        logits = torch.randint(-2, 3, (tokens, experts), generator=gen).float()
    else:
        logits = torch.randn(tokens, experts, generator=gen) * 3
    if kind == "specials":
        where = torch.rand(tokens, experts, generator=gen) < 0.1
        picks = SPECIALS[torch.randint(0, len(SPECIALS), (tokens, experts), generator=gen)]
        logits = torch.where(where, picks, logits)
        row = int(torch.randint(0, tokens, (1,), generator=gen))
        logits[row] = SPECIALS[int(torch.randint(0, len(SPECIALS), (1,), generator=gen))]
    return logits.to(dtype)


def capture_view(tokens: int, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer [tokens, 3, top_k] of sevens, its layer-1 view), as the engine hands a layer its rows."""
    buffer = torch.full((tokens, 3, top_k), 7, dtype=dtype)
    return buffer, buffer[:, 1]


def assert_same_routing(got, want) -> None:
    """ids exactly; weights up to the rounding of another exp and another order of summation."""
    assert got[1].dtype == torch.int32 and got[0].dtype == torch.float32
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7, equal_nan=True)


def test_a_fresh_build_has_the_kernel():
    assert BUILT, "r3srv._core lacks route_experts: rebuild the extension (make install)"


@hsettings(max_examples=150, deadline=None)
@given(
    tokens=st.integers(1, 64),
    experts=st.sampled_from([4, 8, 60, 64, 128]),
    top_k=st.integers(1, 8),
    bfloat16=st.booleans(),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    renormalize=st.booleans(),
    scaling=st.sampled_from([1.0, 2.5, 0.37]),
    capture=st.sampled_from([None, *CAPTURE_DTYPES]),
    kind=st.sampled_from(["normal", "ties", "specials"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_equals_the_reference(tokens, experts, top_k, bfloat16, scoring, renormalize, scaling, capture, kind, seed):
    top_k = min(top_k, experts)
    logits = generated_logits(seed, tokens, experts, kind, torch.bfloat16 if bfloat16 else torch.float32)
    kwargs = dict(scoring=scoring, renormalize=renormalize, scaling=scaling)
    if capture is not None:
        buffer, view = capture_view(tokens, top_k, capture)
        want_buffer, want_view = capture_view(tokens, top_k, capture)
        got, want = route_cpu(logits, top_k, capture=view, **kwargs), route_reference(logits, top_k, capture=want_view, **kwargs)
        assert torch.equal(buffer, want_buffer)  # layer 1 written, layers 0 and 2 untouched
    else:
        got, want = route_cpu(logits, top_k, **kwargs), route_reference(logits, top_k, **kwargs)
    assert got is not None
    assert_same_routing(got, want)


@pytest.mark.parametrize("experts,top_k", [(128, 10), (512, 10), (512, 8), (16, 16)])
@pytest.mark.parametrize("kind", ["normal", "ties", "specials"])
def test_the_scalar_top_k_beyond_the_vector_ones_limits(experts, top_k, kind):
    # the AVX2 top-k takes k <= 8 of at most 256 experts; the others take the scalar insertion
    logits = generated_logits(experts + top_k, 24, experts, kind, torch.float32)
    for scoring in ("softmax", "sigmoid"):
        assert_same_routing(route_cpu(logits, top_k, scoring=scoring), route_reference(logits, top_k, scoring=scoring))


def test_the_cpu_backend_routes_with_it(monkeypatch):
    logits = generated_logits(3, 11, 64, "ties", torch.float32)
    route = cpu_route(force_torch_router=False, rust_router=True)
    monkeypatch.setattr(router, "route_reference", None)  # must not run
    buffer, view = capture_view(11, 8, torch.uint8)
    got = route(logits, 8, scoring="sigmoid", renormalize=False, capture=view)
    monkeypatch.undo()
    want_buffer, want_view = capture_view(11, 8, torch.uint8)
    assert_same_routing(got, route_reference(logits, 8, scoring="sigmoid", renormalize=False, capture=want_view))
    assert torch.equal(buffer, want_buffer)


@pytest.mark.parametrize("kind", ["normal", "ties", "specials"])
def test_threads_give_the_same_routes_and_rows(kind, monkeypatch):
    """A prefill's rows split over the kernel's threads (items of 64 rows): the same ids, weights
    and captured rows on 1, 2 and 3 threads, and the CPU backend passes its thread count on."""
    logits = generated_logits(7, 300, 64, kind, torch.bfloat16)
    results = []
    for threads in (1, 2, 3):
        buffer, view = capture_view(300, 8, torch.int16)
        weights, ids = route_cpu(logits, 8, capture=view, threads=threads)
        results.append((weights, ids, buffer))
    for weights, ids, buffer in results[1:]:
        assert torch.equal(ids, results[0][1]) and torch.equal(buffer, results[0][2])
        assert torch.equal(weights.view(torch.int32), results[0][0].view(torch.int32))
    calls = []
    monkeypatch.setattr(router_cpu, "route_cpu", lambda *a, **k: calls.append(k.get("threads")) or route_cpu(*a, **k))
    with settings.overridden(cpu_threads=3, force_torch_router=False, rust_router=True):
        ops_for("cpu", torch.float32).router(RouterShape(64, 8))(logits.float(), 8)
    assert calls == [3]


def test_no_tokens():
    weights, ids = route_cpu(torch.randn(0, 8), 2, capture=torch.zeros(0, 2, dtype=torch.uint8))
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("case", ["bias", "groups", "float16", "float64", "non-contiguous", "setting off",
                                  "strided capture", "requires grad"])
def test_falls_back_to_the_reference(case):
    logits, kwargs = torch.randn(6, 16, generator=torch.Generator().manual_seed(5)), {}
    shape, switches = RouterShape(16, 4), dict(force_torch_router=False)
    if case == "bias":
        kwargs = dict(scoring="sigmoid", correction_bias=torch.randn(16))
        shape = RouterShape(16, 4, correction_bias=True)
    elif case == "groups":
        kwargs = dict(num_groups=4, topk_groups=2)
        shape = RouterShape(16, 4, num_groups=4)
    elif case in ("float16", "float64"):
        logits = logits.to(getattr(torch, case))
    elif case == "non-contiguous":
        logits = torch.randn(16, 6).t()
    elif case == "setting off":
        switches["rust_router"] = False
    elif case == "strided capture":
        kwargs = dict(capture=torch.zeros(6, 4, 2, dtype=torch.int16)[:, :, 0])  # ids 2 apart in a row
    else:
        logits.requires_grad_()
    route = cpu_route(shape, **switches)
    if case in ("bias", "groups", "setting off"):  # known when the model is built: the reference itself
        assert route is route_reference
    else:
        assert route_cpu(logits, 4, **kwargs) is None
    want_kwargs = {k: (v.clone() if k == "capture" else v) for k, v in kwargs.items()}
    weights, ids = route(logits, 4, **kwargs)
    want_weights, want_ids = route_reference(logits, 4, **want_kwargs)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)  # the reference itself
    if "capture" in kwargs:
        assert torch.equal(kwargs["capture"], want_kwargs["capture"])


@pytest.mark.parametrize("logits,top_k,kwargs,match", [
    (torch.randn(3, 8), 0, {}, "top_k"),
    (torch.randn(3, 8), 9, {}, "top_k"),
    (torch.randn(3, 8), True, {}, "top_k"),
    (torch.randn(3, 8), 2, dict(scoring="softplus"), "scoring"),
    (torch.randn(8), 2, {}, "2-D"),
    (torch.randn(3, 8), 2, dict(capture=torch.zeros(3, 3, dtype=torch.uint8)), "capture must have shape"),
    (torch.randn(3, 300), 2, dict(capture=torch.zeros(3, 2, dtype=torch.uint8)), "cannot hold expert ids"),
    (torch.randn(3, 8), 2, dict(capture=torch.zeros(3, 2)), "cannot hold expert ids"),
])
def test_bad_arguments_raise_the_references_value_errors(logits, top_k, kwargs, match):
    for route in (cpu_route(force_torch_router=False, rust_router=True), route_reference):
        with pytest.raises(ValueError, match=match):
            route(logits, top_k, **kwargs)


def test_the_kernel_checks_what_it_is_given():
    logits = torch.randn(3, 8)
    for top_k in (0, 9):
        with pytest.raises(ValueError, match="top_k"):
            route_cpu(logits, top_k)
    with pytest.raises(ValueError, match="scoring"):
        route_cpu(logits, 2, scoring="softplus")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)


def test_the_builtin_model_generates_the_same_tokens_and_rows_either_way(r3srv_settings, monkeypatch, llm):
    r3srv_settings(force_torch_router=False)
    prompts = [prompt_ids(5, 1), prompt_ids(17, 2), prompt_ids(40, 3)]
    kernel_runs = []

    monkeypatch.setattr(router_cpu, "route_cpu", counting(route_cpu, kernel_runs))

    assert_same_outputs_either_way(llm, prompts, kernel_runs, "rust_router")


def test_the_serve_flag_turns_it_off():
    from r3srv.cli import build_parser

    args = build_parser().parse_args(["serve", "--no-rust-router"])
    assert not settings.from_args(args, {}).rust_router
    assert settings.from_args(build_parser().parse_args(["serve"]), {}).rust_router
    assert not settings.Settings.from_environ({"R3SRV_RUST_ROUTER": "0"}).rust_router

"""Cases for the fused Triton router kernel, run on CPU tensors in Triton's interpreter
against the torch reference on seeded random logits.

Triton reads TRITON_INTERPRET when it is first imported, so this file only runs in a
process started with TRITON_INTERPRET=1: tests/test_router_triton.py starts one (the file
name keeps a plain pytest run from collecting it). Replay a failure with
`TRITON_INTERPRET=1 R3SRV_ROUTER_TEST_SEED=<seed> python -m pytest tests/router_triton_cases.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a process started with TRITON_INTERPRET=1 (see tests/test_router_triton.py)",
                allow_module_level=True)

from r3srv import settings  # noqa: E402
from r3srv.kernels import router_triton  # noqa: E402
from r3srv.kernels.router_reference import route_reference  # noqa: E402
from r3srv.kernels.router_triton import route_triton  # noqa: E402
from r3srv.ops import cpu, cuda  # noqa: E402
from r3srv.ops.router import RouterShape  # noqa: E402

# A fixed seed, in every failure message; R3SRV_ROUTER_TEST_SEED explores others by hand.
SEED = int(os.environ.get("R3SRV_ROUTER_TEST_SEED") or 20261201)
CAPTURE_DTYPES = (torch.uint8, torch.uint16, torch.int32)
POISON = 0x5A  # a valid-looking id: an unwritten cell would not stand out as garbage


def generator(*salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash((SEED, *salt)) & 0xFFFFFFFF)


def block_rows(num_experts: int) -> int:
    """The kernel's BLOCK_T at this expert count: the rows of one program."""
    return router_triton.kernel_constants(num_experts, 1, scoring="softmax", has_bias=False, renormalize=False,
                                          has_capture=False)[0]["BLOCK_T"]


def rows_for_programs(num_experts: int, programs: int = 2, tail: int | None = None) -> int:
    """Rows that make the kernel launch `programs` programs at this expert count, the last with
    `tail` rows (half a block by default) and the rest masked. The interpreter's time grows with
    the programs launched, not with the rows of one, so every shape costs a few programs."""
    block_t = block_rows(num_experts)
    return (programs - 1) * block_t + (tail or max(1, block_t // 2))


def check_against_reference(logits, top_k, *, capture_dtype=torch.int32, layers=3, **kwargs):
    """Run both, capturing into layer 1 of a poisoned [T, layers, k] buffer; compare everything."""
    where = f"seed={SEED} E={logits.shape[1]} k={top_k} {kwargs}"
    buffer = torch.full((logits.shape[0], layers, top_k), POISON, dtype=capture_dtype)
    weights, ids = route_triton(logits, top_k, capture=buffer[:, 1], **kwargs)
    want_w, want_ids = route_reference(logits, top_k, **kwargs)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32, where
    assert torch.equal(ids, want_ids), f"{where}\n{ids}\n{want_ids}"
    torch.testing.assert_close(weights, want_w, atol=1e-6 * max(1.0, abs(kwargs.get("scaling", 1.0))), rtol=0,
                               equal_nan=True, msg=lambda m: f"{where}\n{m}")
    assert torch.equal(buffer[:, 1].to(torch.int32), want_ids), where  # every row written
    assert (buffer[:, 0] == POISON).all() and (buffer[:, 2] == POISON).all(), where  # neighbours intact
    return ids


def test_runs_in_the_interpreter():
    assert router_triton.interpreter_enabled()


MODES = [
    dict(scoring="softmax"),
    dict(scoring="sigmoid"),
    dict(scoring="sigmoid", with_bias=True),
]


@pytest.mark.parametrize("num_experts", [16, 60, 64, 160, 384, 512])
@pytest.mark.parametrize("top_k", [1, 2, 6, 8, 10, 16])
@pytest.mark.parametrize("mode", MODES, ids=["softmax", "sigmoid", "sigmoid+bias"])
def test_random_logits_match_reference(num_experts, top_k, mode):
    gen = generator(num_experts, top_k, len(mode))
    bias = torch.randn(num_experts, generator=gen) * 0.3 if mode.get("with_bias") else None
    # three programs, the last one row short of a block: programs placed a row too close together
    # (or any other offset error) leave rows unwritten
    rows = rows_for_programs(num_experts, programs=3, tail=max(1, block_rows(num_experts) - 1))
    logits = torch.randn(rows, num_experts, generator=gen) * 2
    for i, renormalize in enumerate((True, False)):
        capture_dtype = CAPTURE_DTYPES[(i + top_k) % 3]
        if capture_dtype == torch.uint8 and num_experts > 256:
            capture_dtype = torch.uint16
        check_against_reference(
            logits, top_k, scoring=mode["scoring"], correction_bias=bias, renormalize=renormalize,
            scaling=1.0 if renormalize else 2.5, capture_dtype=capture_dtype,
        )


@pytest.mark.parametrize("mode", MODES + [dict(scoring="softmax", with_bias=True)],
                         ids=["softmax", "sigmoid", "sigmoid+bias", "softmax+bias"])
@pytest.mark.parametrize("num_experts", [8, 60, 160])
def test_forced_ties_go_to_the_lower_id(mode, num_experts):
    gen = generator(num_experts, 99)
    rows = rows_for_programs(num_experts, tail=1)
    logits = torch.randint(-2, 3, (rows, num_experts), generator=gen).float()  # integer logits: many ties
    logits[0] = 1.0  # a row of all-equal logits: ids 0..k-1
    bias = None
    if mode.get("with_bias"):
        bias = torch.randint(0, 2, (num_experts,), generator=gen).float() * 0.25  # equal biases keep ties
    ids = check_against_reference(logits, 8, scoring=mode["scoring"], correction_bias=bias)
    if bias is None:
        assert ids[0].tolist() == list(range(8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_logits(dtype):
    gen = generator(7)
    logits = (torch.randn(21, 64, generator=gen) * 2).to(dtype)  # bf16 rounding makes real ties
    check_against_reference(logits, 8, scoring="softmax", capture_dtype=torch.uint8)
    check_against_reference(logits, 8, scoring="sigmoid", correction_bias=torch.randn(64, generator=gen),
                            capture_dtype=torch.uint8)


def test_strided_logits_and_capture():
    gen = generator(11)
    wide = torch.randn(50, 2 * 96, generator=gen)
    logits = wide[::2, 1::2]  # row and column strides != natural
    assert not logits.is_contiguous()
    check_against_reference(logits, 6, capture_dtype=torch.uint8, layers=5)


# The all-masked row computes -inf - (-inf) = NaN on purpose (torch's softmax gives NaN too).
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_masked_and_nan_logits():
    logits = torch.randn(6, 16, generator=generator(5))
    logits[1, ::2] = float("-inf")  # half the experts masked out
    logits[2] = float("-inf")  # everything masked: ids in order, weights NaN like torch
    logits[3, 5] = float("nan")
    logits[4, [2, 9]] = float("nan")
    check_against_reference(logits, 8, scoring="softmax")
    check_against_reference(logits, 8, scoring="sigmoid", renormalize=False)


# (experts, top_k, groups, top groups): DeepSeek-V3 (256, 8, 8, 4), V2 (160, 6, 8, 3), uneven cases
GROUP_LAYOUTS = [(256, 8, 8, 4), (160, 6, 8, 3), (64, 6, 8, 1), (60, 4, 5, 3), (8, 2, 8, 2), (384, 8, 32, 4)]


@pytest.mark.parametrize("layout", GROUP_LAYOUTS, ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("mode", ["v3", "v2", "sigmoid-top1", "softmax-top2"])
def test_group_limited_routing_matches_reference(layout, mode):
    num_experts, top_k, groups, top_groups = layout
    gen = generator(num_experts, groups, len(mode))
    scoring = "sigmoid" if mode in ("v3", "sigmoid-top1") else "softmax"
    group_score_top = 2 if mode in ("v3", "softmax-top2") else 1
    bias = torch.randn(num_experts, generator=gen) * 0.3 if mode == "v3" else None
    logits = torch.randn(rows_for_programs(num_experts), num_experts, generator=gen) * 2
    kwargs = dict(scoring=scoring, correction_bias=bias, num_groups=groups, topk_groups=top_groups,
                  group_score_top=group_score_top)
    check_against_reference(logits, top_k, renormalize=mode == "v3", scaling=2.5 if mode == "v3" else 1.0,
                            capture_dtype=torch.uint16 if num_experts > 256 else torch.uint8, **kwargs)
    ties = torch.randint(-1, 2, (rows_for_programs(num_experts, tail=1), num_experts), generator=gen).float()  # equal experts and equal groups
    check_against_reference(ties, top_k, **kwargs)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_group_limited_routing_with_masked_and_nan_logits():
    logits = torch.randn(5, 32, generator=generator(77))
    logits[0, :16] = float("-inf")  # two whole groups masked
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    logits[3, ::2] = float("-inf")
    for scoring in ("sigmoid", "softmax"):
        check_against_reference(logits, 4, scoring=scoring, num_groups=4, topk_groups=2)


@pytest.mark.parametrize("num_tokens", [0, 1, 2])
def test_tiny_batches(num_tokens):
    logits = torch.randn(num_tokens, 128, generator=generator(num_tokens))
    check_against_reference(logits, 8, capture_dtype=torch.uint8)


def test_largest_supported_expert_count():
    gen = generator(1024)
    check_against_reference(torch.randn(5, 1024, generator=gen), 8, scoring="sigmoid",
                            correction_bias=torch.randn(1024, generator=gen))


@pytest.mark.parametrize("block_t", [1, 4, 32])
def test_block_size_override_gives_same_result(block_t):
    logits = torch.randn(19, 64, generator=generator(block_t))
    weights, ids = route_triton(logits, 8, block_t=block_t)
    want_w, want_ids = route_reference(logits, 8)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=0)


def test_rejects_bad_arguments():
    logits = torch.randn(4, 16)
    with pytest.raises(ValueError, match="top_k <= 16"):
        route_triton(torch.randn(4, 32), 17)
    with pytest.raises(ValueError, match="<= 1024 experts"):
        route_triton(torch.randn(2, 1025), 2)
    with pytest.raises(ValueError, match="scoring"):
        route_triton(logits, 2, scoring="tanh")
    with pytest.raises(ValueError, match="cannot hold"):
        route_triton(torch.randn(4, 300), 2, capture=torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="<= 32 expert groups"):
        route_triton(torch.randn(4, 128), 2, num_groups=64, topk_groups=2)
    with pytest.raises(ValueError, match="must divide"):
        route_triton(logits, 2, num_groups=3, topk_groups=1)


def test_the_cuda_backend_routes_with_the_kernel(monkeypatch):
    calls = []
    real = router_triton.route_triton
    monkeypatch.setattr(router_triton, "route_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    route = cuda.build(torch.float32, settings.current().replace(force_torch_router=False)).router(RouterShape(60, 4))
    logits = torch.randn(9, 60, generator=generator(1))
    capture = torch.full((9, 2, 4), 200, dtype=torch.uint8)
    weights, ids = route(logits, 4, capture=capture[:, 1])  # CPU tensors: the interpreter runs it
    want_w, want_ids = route_reference(logits, 4)
    assert calls == [1]
    assert torch.equal(ids, want_ids) and torch.equal(capture[:, 1].int(), want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=0)


def test_the_cpu_backend_never_takes_the_kernel(monkeypatch):
    monkeypatch.setattr(router_triton, "route_triton", lambda *a, **k: pytest.fail("kernel used for CPU tensors"))
    logits = torch.randn(3, 8, generator=generator(2))
    for switches in ({}, {"rust_router": False}):
        route = cpu.build(torch.float32, settings.current().replace(force_torch_router=False, **switches)).router(
            RouterShape(8, 2))
        route(logits, 2)

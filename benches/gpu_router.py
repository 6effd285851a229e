"""GPU check and timing of the fused Triton router, in one command:

    python benches/gpu_router.py [--skip-engine | --engine-only] [--require-gpu] [--out table.md]

`TRITON_INTERPRET=1 python benches/gpu_router.py --smoke` runs every part on the CPU at toy
sizes (kernel in Triton's interpreter, wall-clock timer, engine on the CPU): it checks the
script itself, not the GPU, and its numbers mean nothing.

1. correctness: the fused kernel against the torch reference on fresh random logits, on the
   GPU, over expert counts 8..512 (powers of two or not), top_k 1..8 (and Qwen3-Next's 10), softmax / sigmoid /
   sigmoid+bias, renormalize on/off, capture dtypes uint8/uint16/int32 into a poisoned
   [T, L, K] buffer (every row must be written, the other layers untouched);
2. router timing (triton.testing.do_bench, median; the lower of two passes over the grid, after
   a warm-up) of the fused kernel against the torch reference (softmax, stable sort,
   renormalize, copy into the buffer) and a torch.topk path, for tokens {1, 64, 4096, 32768}
   x experts {8, 64, 128, 256} x top_k {2, 8};
3. a decode step of the engine (built-in model) with routed-experts capture on and off (and
   the capture's own work per step, timed by itself), with the torch router, with the paged
   decode kernel.

Prints one markdown table. Exits 1 if correctness fails; without CUDA it says so and exits 0
(1 with --require-gpu). Sized for a few minutes on one GPU, most of it Triton compiles.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import traceback

import torch

ROUTER_TOKENS = (1, 64, 4096, 32768)
ROUTER_EXPERTS = (8, 64, 128, 256)
ROUTER_TOP_K = (2, 8)
CHECK_EXPERTS = (8, 60, 64, 128, 160, 256, 384, 512)
CHECK_TOP_K = (1, 2, 6, 8)
CHECK_TOKENS = 3001  # odd: the last program of every BLOCK_T is partly masked
HEADLINE = (4096, 128, 8)  # the fused router's target: >= 3x the torch reference here
POISON = 0x5A
DEVICE = "cuda"  # "cpu" under --smoke


def fail_without_cuda(require_gpu: bool) -> int:
    print("benches/gpu_router.py: no CUDA device visible (torch.cuda.is_available() is False); "
          "nothing was checked or measured. Run it on a machine with an NVIDIA GPU.")
    return 1 if require_gpu else 0


# ---------------------------------------------------------------- 1. correctness


def check_correctness() -> list[str]:
    from r3srv.kernels.router_reference import route_reference
    from r3srv.kernels.router_triton import route_triton

    failures: list[str] = []
    modes = [
        dict(scoring="softmax", renormalize=True, bias=False),
        dict(scoring="sigmoid", renormalize=False, bias=False),
        dict(scoring="sigmoid", renormalize=True, bias=True),
    ]
    checked = 0
    cases = [(e, k, m) for e in CHECK_EXPERTS for k in CHECK_TOP_K for m in modes]
    if DEVICE == "cpu":
        cases = cases[::7]
    # a few more paths: softmax + bias, bf16 logits (real ties), scaling, strided logits, 1 token
    cases += [(64, 8, dict(scoring="softmax", renormalize=True, bias=True)),
              (128, 8, dict(scoring="softmax", renormalize=True, bias=False, dtype=torch.bfloat16, scaling=2.5)),
              (160, 6, dict(scoring="sigmoid", renormalize=True, bias=True, strided=True)),
              (256, 8, dict(scoring="softmax", renormalize=False, bias=False, tokens=1)),
              (60, 4, dict(scoring="softmax", renormalize=True, bias=False, ties=True)),
              (384, 8, dict(scoring="sigmoid", renormalize=True, bias=True, ties=True)),
              # expert groups: DeepSeek-V3 (sum of the best two) and V2's group_limited_greedy (the best one)
              (256, 8, dict(scoring="sigmoid", renormalize=True, bias=True, scaling=2.5, groups=(8, 4, 2))),
              (160, 6, dict(scoring="softmax", renormalize=False, bias=False, groups=(8, 3, 1))),
              (64, 6, dict(scoring="sigmoid", renormalize=True, bias=True, ties=True, groups=(8, 2, 2))),
              # Qwen3-Next's router: 512 experts, top-10, softmax renormalised
              (512, 10, dict(scoring="softmax", renormalize=True, bias=False, dtype=torch.bfloat16))]
    for i, (num_experts, top_k, mode) in enumerate(cases):
        # --smoke: few rows (tests/router_triton_cases.py checks the kernel in the interpreter)
        tokens = mode.get("tokens", CHECK_TOKENS if DEVICE == "cuda" else 5)
        if mode.get("ties"):
            logits = torch.randint(-2, 3, (tokens, num_experts), device=DEVICE).float()
        elif mode.get("strided"):
            logits = (torch.randn(tokens, 2 * num_experts, device=DEVICE) * 2)[:, 1::2]
        else:
            logits = (torch.randn(tokens, num_experts, device=DEVICE) * 2).to(mode.get("dtype", torch.float32))
        bias = None
        if mode["bias"]:
            bias = (torch.randint(0, 2, (num_experts,), device=DEVICE).float() * 0.25 if mode.get("ties")
                    else torch.randn(num_experts, device=DEVICE) * 0.3)
        capture_dtype = (torch.uint8, torch.uint16, torch.int32)[i % 3]
        if capture_dtype == torch.uint8 and num_experts > 256:
            capture_dtype = torch.int32
        buffer = torch.full((tokens, 3, top_k), POISON, dtype=capture_dtype, device=DEVICE)
        kwargs = dict(scoring=mode["scoring"], renormalize=mode["renormalize"], correction_bias=bias,
                      scaling=mode.get("scaling", 1.0))
        if "groups" in mode:
            kwargs.update(zip(("num_groups", "topk_groups", "group_score_top"), mode["groups"]))
        weights, ids = route_triton(logits, top_k, capture=buffer[:, 1], **kwargs)
        want_w, want_ids = route_reference(logits, top_k, **kwargs)
        # the CPU reference too: the ids must not depend on where torch ran
        cpu_w, cpu_ids = route_reference(logits.cpu(), top_k, **{**kwargs, "correction_bias": None if bias is None else bias.cpu()})
        synchronize()
        where = f"E={num_experts} k={top_k} {mode} capture={capture_dtype}"
        tol = 1e-6 * max(1.0, kwargs["scaling"])
        if not torch.equal(ids, want_ids) or not torch.equal(ids.cpu(), cpu_ids):
            bad = (ids != want_ids).any(dim=1).nonzero()[:3].flatten().tolist()
            failures.append(f"ids differ: {where}, rows {bad}")
        elif (weights - want_w).abs().max().item() > tol or (weights.cpu() - cpu_w).abs().max().item() > tol:
            failures.append(f"weights differ by {(weights - want_w).abs().max().item():.3g}: {where}")
        elif not torch.equal(buffer[:, 1].to(torch.int32), want_ids):
            failures.append(f"capture rows not all written: {where}")
        elif not ((buffer[:, 0] == POISON).all() and (buffer[:, 2] == POISON).all()):
            failures.append(f"capture wrote outside its layer: {where}")
        checked += 1
    print(f"correctness: {checked} configurations, {len(failures)} failures")
    return failures


# ---------------------------------------------------------------- 2. router timing


def torch_topk_route(logits, top_k, capture):
    """The usual eager path: softmax, torch.topk, renormalize, copy into the buffer."""
    scores = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    capture.copy_(ids)
    return weights, ids.to(torch.int32)


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_us(fn) -> float:
    if DEVICE == "cpu":  # --smoke: triton's do_bench needs a GPU; one timed call (numbers mean nothing)
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def time_router() -> list[dict]:
    from r3srv.kernels.router_reference import route_reference
    from r3srv.kernels.router_triton import route_triton

    rows = []
    smoke = DEVICE == "cpu"
    for tokens in ROUTER_TOKENS if not smoke else (1, 64):
        for num_experts in ROUTER_EXPERTS if not smoke else (8, 128):
            for top_k in ROUTER_TOP_K:
                logits = torch.randn(tokens, num_experts, device=DEVICE, dtype=torch.bfloat16)
                buffer = torch.zeros((tokens, 4, top_k), dtype=torch.uint8, device=DEVICE)
                view = buffer[:, 1]
                fused = median_us(lambda: route_triton(logits, top_k, capture=view))
                reference = median_us(lambda: route_reference(logits, top_k, capture=view))
                topk = median_us(lambda: torch_topk_route(logits, top_k, view))
                rows.append(dict(tokens=tokens, experts=num_experts, top_k=top_k,
                                 fused=fused, reference=reference, topk=topk))
    # DeepSeek-V3's router (sigmoid, correction bias, 8 groups of which 4, scaling 2.5): no topk baseline
    tokens = 64 if smoke else HEADLINE[0]
    logits = torch.randn(tokens, 256, device=DEVICE, dtype=torch.bfloat16)
    view = torch.zeros((tokens, 4, 8), dtype=torch.uint8, device=DEVICE)[:, 1]
    kwargs = dict(scoring="sigmoid", correction_bias=torch.randn(256, device=DEVICE) * 0.3, scaling=2.5,
                  num_groups=8, topk_groups=4, capture=view)
    rows.append(dict(tokens=tokens, experts="256 (DeepSeek-V3: 8 groups, top 4)", top_k=8,
                     fused=median_us(lambda: route_triton(logits, 8, **kwargs)),
                     reference=median_us(lambda: route_reference(logits, 8, **kwargs)), topk=None))
    # Qwen3-Next's router: 512 experts, top-10
    logits = torch.randn(tokens, 512, device=DEVICE, dtype=torch.bfloat16)
    view = torch.zeros((tokens, 4, 10), dtype=torch.uint16, device=DEVICE)[:, 1]
    rows.append(dict(tokens=tokens, experts="512 (Qwen3-Next)", top_k=10,
                     fused=median_us(lambda: route_triton(logits, 10, capture=view)),
                     reference=median_us(lambda: route_reference(logits, 10, capture=view)),
                     topk=median_us(lambda: torch_topk_route(logits, 10, view))))
    return rows


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Busy the GPU for a while first: clocks ramp up (an H200 idles at 345 MHz)."""
    if DEVICE == "cpu":
        return
    a = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        synchronize()


def lower_of(first: list[dict], second: list[dict]) -> list[dict]:
    """Per cell the lower of two passes' medians: the first H200 run had a ~30 s window in which
    every kernel, fused and torch alike, took 2-6x longer (ratios held; absolute times did not)."""
    merged = []
    for a, b in zip(first, second):
        merged.append({key: (min(a[key], b[key]) if key in ("fused", "reference", "topk") and a[key] is not None
                             else a[key]) for key in a})
    return merged


def sweep_launch_config() -> list[tuple[str, float]]:
    """(BLOCK_T, num_warps) choices at the headline shape, to tune router_triton's defaults."""
    from r3srv.kernels.router_triton import kernel_constants, route_triton

    tokens, num_experts, top_k = HEADLINE
    logits = torch.randn(tokens, num_experts, device=DEVICE, dtype=torch.bfloat16)
    view = torch.zeros((tokens, 4, top_k), dtype=torch.uint8, device=DEVICE)[:, 1]
    constants, default_warps = kernel_constants(num_experts, top_k, scoring="softmax", has_bias=False,
                                                renormalize=True, has_capture=True)
    default = (constants["BLOCK_T"], default_warps)
    choices = sorted({(bt, w) for bt in (4, 8, 16, 32) for w in (1, 2, 4, 8)} | {default})
    if DEVICE == "cpu":
        tokens, logits, view, choices = 64, logits[:64], view[:64], [default]
    out = []
    for block_t, warps in choices:
        us = median_us(lambda: route_triton(logits, top_k, capture=view, block_t=block_t, num_warps=warps))
        label = (f"BLOCK_T={block_t} num_warps={warps}{' (default)' if (block_t, warps) == default else ''} "
                 f"at T={tokens} E={num_experts} k={top_k}")
        out.append((label, us))
    return out


# ---------------------------------------------------------------- 3. engine decode step


def time_decode_step(batch: int = 32, prompt_len: int = 32, decode_steps: int = 64, rounds: int = 12) -> dict:
    """Median seconds per decode step, from generate(N+1) - generate(1) tokens, of ONE engine
    with capture on, off (its rows taken away: the same weights, cache and allocator, so only
    the capture differs), with the torch router, and with gather + SDPA decodes. Each round runs
    the variants in a rotated order, after a garbage collection: two engines with "on" always
    first in its round read +3.5% on an H200, this form -3.8% and +0.4% (order, not capture)."""
    if DEVICE == "cpu":
        batch, prompt_len, decode_steps, rounds = 2, 8, 2, 2
    from r3srv import LLM, SamplingParams

    llm = LLM(device=DEVICE, enable_return_routed_experts=True, max_num_seqs=batch,
              enable_prefix_caching=False, max_model_len=256, num_kv_blocks=batch * 16)
    engine = llm.engine
    prompts = [[(7 * i + j) % 250 + 1 for j in range(prompt_len)] for i in range(batch)]

    @contextlib.contextmanager
    def capture_off():
        core, runner = engine.core, engine.core.executor.runner
        rows, capture = core.rows, runner.rows
        core.rows = runner.rows = None
        try:
            yield
        finally:
            core.rows, runner.rows = rows, capture

    sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from engine_testing import model_of, rebound  # the model's ops selected again under other settings

    variants = {"on": contextlib.nullcontext, "off": capture_off,
                "on_torch_router": lambda: rebound(model_of(llm), force_torch_router=True),
                "on_torch_decode": lambda: rebound(model_of(llm), triton_decode=False)}  # gather + SDPA

    def run(max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        synchronize()
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return time.perf_counter() - start, outs

    def step_seconds(variant):
        gc.collect()
        with variants[variant]():
            short, _ = run(1)
            long, outs = run(decode_steps + 1)
        return (long - short) / decode_steps, outs

    for variant in variants:
        _, outs = step_seconds(variant)  # warm-up: compiles, allocator, cuBLAS handles
        routed = outs[0].outputs[0].routed_experts
        assert (routed is None) == (variant == "off"), f"capture {variant}, but routed_experts is {routed!r}"
    samples = {variant: [] for variant in variants}
    order = list(variants)
    for r in range(rounds):
        for variant in order[r % len(order):] + order[: r % len(order)]:
            samples[variant].append(step_seconds(variant)[0])
    for key, values in samples.items():  # the spread says how far a median can be trusted
        print(f"decode step, capture {key}: " + " ".join(f"{v * 1e3:.3f}" for v in values) + " ms")
    medians = {key: statistics.median(values) for key, values in samples.items()}
    # each round pairs on with off seconds apart: the median of their ratios rides out host drift
    paired = statistics.median(a / b for a, b in zip(samples["on"], samples["off"]))
    return medians | {"batch": batch, "paired": paired, "capture_work": time_capture_work(llm, batch)}


@torch.inference_mode()  # as the engine's steps run: the capture's tensors are inference tensors
def time_capture_work(llm, batch: int, steps: int = 200) -> float:
    """Seconds per decode step of the capture's own work (take the step's [batch, layers, top_k]
    capture, queue its copy to the host, scatter the previous step's rows), in a tight loop: the
    H200's host ran decode steps 7 or 11 ms in turns of seconds (gVisor), too noisy for an on/off
    difference of 1%; this measures the difference itself. Leaves out the routers' id stores
    (inside their kernels) and the one gather per finished request."""
    import numpy as np

    rows = llm.engine.rows
    slots = np.arange(batch)
    rows.store(slots, rows.new_capture(batch, DEVICE))
    rows.flush()
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        rows.store(slots, rows.new_capture(batch, DEVICE))
    rows.flush()
    synchronize()
    return (time.perf_counter() - start) / steps


# ---------------------------------------------------------------- report


def render(router_rows, sweep, decode, decode_error) -> str:
    lines = ["| case | fused / measured | torch reference / baseline | ratio | torch topk | topk / fused |",
             "|---|---|---|---|---|---|"]
    for r in router_rows:
        topk = "| | |" if r["topk"] is None else f"| {r['topk']:.1f} µs | {r['topk'] / r['fused']:.2f}x |"
        lines.append(
            f"| router T={r['tokens']} E={r['experts']} k={r['top_k']} | {r['fused']:.1f} µs | "
            f"{r['reference']:.1f} µs | {r['reference'] / r['fused']:.2f}x {topk}"
        )
    for label, us in sweep:
        lines.append(f"| {label} | {us:.1f} µs | | | | |")
    if decode is not None:
        on, off, torch_router = decode["on"], decode["off"], decode["on_torch_router"]
        lines.append(f"| decode step B={decode['batch']}, capture on vs off (medians; paired ratio) | {on * 1e3:.3f} ms | "
                     f"{off * 1e3:.3f} ms | capture {(decode['paired'] - 1) * 100:+.2f}% | | |")
        lines.append(f"| capture work per decode step B={decode['batch']} | {decode['capture_work'] * 1e6:.1f} µs | "
                     f"{off * 1e3:.3f} ms (step, capture off) | {decode['capture_work'] / off * 100:.2f}% of a step | | |")
        lines.append(f"| decode step B={decode['batch']}, capture on: fused vs torch router | {on * 1e3:.3f} ms | "
                     f"{torch_router * 1e3:.3f} ms | {torch_router / on:.2f}x | | |")
        gathered = decode["on_torch_decode"]
        lines.append(f"| decode step B={decode['batch']}, capture on: paged decode kernel vs gather + SDPA | "
                     f"{on * 1e3:.3f} ms | {gathered * 1e3:.3f} ms | {gathered / on:.2f}x | | |")
    else:
        lines.append(f"| decode step | failed: {decode_error} | | | | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    torch.manual_seed(0)  # the same inputs on every run
    parser.add_argument("--skip-engine", action="store_true", help="skip the engine decode-step measurement")
    parser.add_argument("--engine-only", action="store_true", help="only the engine decode-step measurement")
    parser.add_argument("--require-gpu", action="store_true", help="exit 1 (not 0) when there is no CUDA device")
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--smoke", action="store_true",
                        help="check this script on the CPU at toy sizes (needs TRITON_INTERPRET=1); numbers mean nothing")
    args = parser.parse_args()
    global DEVICE
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if args.smoke:
        if not interpret:
            print("benches/gpu_router.py --smoke: run it with TRITON_INTERPRET=1 (the kernel runs in Triton's interpreter)")
            return 1
        DEVICE = "cpu"
    else:
        if not torch.cuda.is_available():
            return fail_without_cuda(args.require_gpu)
        if interpret:
            print("benches/gpu_router.py: unset TRITON_INTERPRET; this measures the compiled kernel")
            return 1
    import triton

    start = time.perf_counter()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run: numbers mean nothing)"
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    failures, router_rows, sweep = [], [], []
    if not args.engine_only:
        failures = check_correctness()
        for failure in failures[:20]:
            print(f"  FAIL {failure}")
        print(f"[{time.perf_counter() - start:.0f}s] timing the router...")
        warm_up_gpu()
        router_rows = lower_of(time_router(), time_router())
        try:
            sweep = sweep_launch_config()
        except Exception:  # tuning data only: never lose the table over it
            traceback.print_exc()
    else:
        warm_up_gpu()
    decode, decode_error = None, None
    if not args.skip_engine:
        print(f"[{time.perf_counter() - start:.0f}s] timing engine decode steps...")
        try:
            decode = time_decode_step()
        except Exception as exc:  # the engine is not this script's subject: still print the router table
            traceback.print_exc()
            decode_error = f"{type(exc).__name__}: {exc}".replace("|", "/")[:200]
    else:
        decode_error = "skipped (--skip-engine)"
    table = render(router_rows, sweep, decode, decode_error)
    print()
    print(table)
    print()
    for r in router_rows:
        if (r["tokens"], r["experts"], r["top_k"]) == HEADLINE:
            speedup = r["reference"] / r["fused"]
            print(f"target: fused >= 3x torch reference at T={HEADLINE[0]} E={HEADLINE[1]} k={HEADLINE[2]}: "
                  f"{speedup:.2f}x {'MET' if speedup >= 3 else 'NOT MET'}")
    if decode is not None:
        share = decode["capture_work"] / decode["off"]
        print(f"target: capture <= 1% of a decode step: its work {share * 100:.2f}% of a step "
              f"{'MET' if share <= 0.01 else 'NOT MET'} (end to end, paired: {(decode['paired'] - 1) * 100:+.2f}%)")
    print(f"correctness: {'PASS' if not failures else 'FAIL'}; total {time.perf_counter() - start:.0f}s")
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

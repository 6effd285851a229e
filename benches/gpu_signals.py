"""What two replay signals cost on a device, in one run each: sampling masks on a decode step's
sampling (benches/bench_sampling_masks.py's batches: temperature 1, top-k 50, top-p 0.9) and
--enable-return-indexer-topk's capture on a DSA decode step (benches/bench_dsa_decode.py's layer:
the selections written into the step's capture and copied into the host buffer by slot), each
without ("reference") and with ("r3srv"), as medians of timed calls (each call ends with the
device synchronized, as the engine's step does when it reads the sample back).

    python3 benches/gpu_signals.py --device cuda --out table.md   # benches/gpu_check.sh's step
    .venv/bin/python benches/gpu_signals.py --device cpu --rounds 2   # the CPU smoke

pytest-benchmark is not assumed on the device image; pytest is (the bench modules import it)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import bench_dsa_decode as dsa_bench  # benches/ is on the path: the script's folder, or conftest's
import bench_sampling_masks as mask_bench
import torch

from r3srv.engine.indexer_topk import IndexerTopkBuffer
from r3srv.engine.sampler import sample
from r3srv.engine.sequence import Sequence
from r3srv.sampling_params import SamplingParams


def median_ms(call, device: torch.device, rounds: int) -> float:
    """The median of `rounds` timed calls after one warm-up, the device synchronized after each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    call()
    sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def sampling_mask_rows(device: torch.device, rounds: int) -> list[tuple[str, float, float]]:
    rows = []
    for seqs_n, vocab in mask_bench.SHAPES:
        logits = (torch.randn(seqs_n, vocab, generator=torch.Generator().manual_seed(seqs_n + vocab)) * 3).to(device)
        times = {}
        for candidate in ("reference", "r3srv"):
            params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, return_sampling_mask=candidate == "r3srv")
            seqs = [Sequence(str(i), 0, [1], params, 8, None) for i in range(seqs_n)]
            generator = torch.Generator(device=device).manual_seed(0)
            results = sample(logits, seqs, [], generator)
            if candidate == "r3srv":  # a support of 1..50 ids holding the drawn one
                assert all(r.token_id in r.mask_ids.tolist() and 1 <= len(r.mask_ids) <= 50 for r in results)
            times[candidate] = median_ms(lambda: sample(logits, seqs, [], generator), device, rounds)
        rows.append((f"sampling {seqs_n} x {vocab}, masks off / on", times["reference"], times["r3srv"]))
    return rows


def indexer_capture_row(device: torch.device, rounds: int) -> tuple[str, float, float]:
    attn, x, cos, sin, meta = dsa_bench.decode_step(device)
    buffer = IndexerTopkBuffer(dsa_bench.SEQS * dsa_bench.CONTEXT, 1, dsa_bench.TOPK, dsa_bench.CONTEXT)
    slots = meta.slot_mapping.cpu().numpy()
    times = {}
    with torch.inference_mode():
        for candidate in ("reference", "r3srv"):
            def step():
                meta.indexer_capture = buffer.new_capture(dsa_bench.SEQS, device) if candidate == "r3srv" else None
                attn(x, cos, sin, meta)
                if meta.indexer_capture is not None:
                    buffer.store(slots, meta.indexer_capture)

            times[candidate] = median_ms(step, device, rounds)
    picked = buffer.values[slots, 0]  # each sequence's selection: top-k distinct positions of its context
    assert all(len(set(row.tolist())) == dsa_bench.TOPK and 0 <= row.min() and row.max() < dsa_bench.CONTEXT
               for row in picked)
    name = (f"DSA decode {dsa_bench.SEQS} x {dsa_bench.CONTEXT} top-{dsa_bench.TOPK}, "
            "indexer top-k capture off / on")
    return name, times["reference"], times["r3srv"]


def main(argv: list[str] | None = None) -> list[tuple[str, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--out", help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    lines = [f"| step ({device.type}, median of {args.rounds}) | off ms | on ms | on / off |", "|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    rows = []
    for row in [*sampling_mask_rows(device, args.rounds), indexer_capture_row(device, args.rounds)]:
        rows.append(row)
        lines.append(f"| {row[0]} | {row[1]:.3f} | {row[2]:.3f} | {row[2] / row[1]:.2f}x |")
        print(lines[-1], flush=True)  # row by row: a run cut short keeps what it measured
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()

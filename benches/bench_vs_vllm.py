"""r3srv against vLLM-CPU, side by side on this machine: `python benches/bench_vs_vllm.py`.

Installs nothing. Prepare the peer once with `benches/vllm_cpu/install_vllm_cpu.sh DIR`, then
`export VLLM_VENV=DIR`; without it the benchmark skips with that hint. Both servers serve the
same checkpoint (the built-in model unless --model is given) in each --dtype (float32 and
bfloat16 by default), r3srv with routed experts ON, vLLM in its default CPU mode
(torch.compile, no routed experts): the speed to beat. Defaults against defaults: each server
is started as a user would start it, with only the model, dtype, context length (4,096 for
both) and served name given; the thread count is the workload's (R3SRV_CPU_THREADS for r3srv,
the peer recipe's VLLM_THREADS for vLLM). It prints the processor and the instruction sets
each side can use first, the long prompt against its compute floor (benches/prefill_floor.py)
after each table, and the decode roofline (benches/decode_roofline.py) last.

Three workloads, each timed end to end over HTTP with token-id prompts and ignore_eos:
  single      one request of 512 prompt + 64 output tokens at a time (latency)
  throughput  64 requests of 256 + 64 tokens, 16 in flight (wall time for all)
  long        one 4,000-token prompt + 16 output tokens (prefill)
and, asked for by name (--workloads), the throughput workload's two halves, to see which one a
ratio comes from:
  throughput-prefill  its 64 prompts of 256 tokens with one output token each
  throughput-decode   64 prompts of 8 tokens + 64 output tokens each, 16 in flight
Rounds alternate the servers (and who goes first), so drift in the machine's load hits both,
and each run waits until both servers are idle (a server's threads spin on after its last
request and would take a core from the other);
each line prints the median of the per-round ratios vLLM time / r3srv time (> 1: r3srv is
faster) with their min and max, and the same for the CPU seconds each server's processes spent
on the workload (benches/process_cpu.py): on a loaded machine wall time also measures the share
of the cores each server got, CPU seconds the work it did. Run at 1 and 2 threads each (--threads 1 2). A benchmark, not
a CI gate: under pytest (`make bench-smoke`) it only runs when VLLM_VENV is set.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benches" / "vllm_cpu"  # the recipes that install and start vLLM-CPU
sys.path.insert(0, str(ROOT / "tests"))

from process_cpu import tree_cpu_seconds  # noqa: E402
from server_fixture import RemoteServer, free_port, wait_healthy  # noqa: E402

MAX_MODEL_LEN = 4096
HINT = f"set VLLM_VENV to a directory prepared by {PEERS / 'install_vllm_cpu.sh'} DIR"
WORKLOADS = {
    # name: (prompt tokens, output tokens, number of requests, requests in flight)
    "single": (512, 64, 1, 1),
    "throughput": (256, 64, 64, 16),
    "long": (4000, 16, 1, 1),
}
# the throughput workload's prefill and decode halves: run only when named
SPLIT_WORKLOADS = {
    "throughput-prefill": (256, 1, 64, 16),
    "throughput-decode": (8, 64, 64, 16),
}


# r3srv.kernels.expert_pairs_cpu.bf16_products() in words
BF16_PRODUCTS = {"amx": "AMX tiles", "avx512_bf16": "AVX-512 BF16 dot products", "float32": "float32 FMA"}


class VllmServer:
    """`vllm serve` from VLLM_VENV with the peer recipe's environment (vllm_cpu_env.sh)."""

    def __init__(self, venv: str, model: str, threads: int, dtype: str, startup_timeout: float = 900.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False)
        serve = (
            f'source "{PEERS / "vllm_cpu_env.sh"}" && exec "$VLLM_VENV/bin/vllm" serve "{model}" '
            f"--host 127.0.0.1 --port {self.port} --dtype {dtype} --max-model-len {MAX_MODEL_LEN} "
            "--served-model-name bench"
        )
        env = dict(os.environ, VLLM_VENV=venv, VLLM_THREADS=str(threads), VLLM_MODE="default")
        self.proc = subprocess.Popen(["bash", "-c", serve], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            wait_healthy(self.url, self.proc, startup_timeout, "vllm serve", lambda: self.log[-4000:], interval=1.0)
        except BaseException:
            self.stop()
            raise

    @property
    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        os.unlink(self._log.name)


async def run_workload(url: str, prompts: list[list[int]], gen: int, in_flight: int, rows: bool) -> float:
    """Seconds for all prompts, `in_flight` at a time; checks every answer's length."""
    limit = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(timeout=600) as http:

        async def one(prompt: list[int]) -> None:
            async with limit:
                body = {"model": "bench", "prompt": prompt, "max_tokens": gen, "ignore_eos": True,
                        "temperature": 0, "return_token_ids": True}
                r = await http.post(url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert len(choice["token_ids"]) == gen, choice
                assert (choice.get("routed_experts") is not None) == rows

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start


def compare(r3srv: tuple[str, int], vllm: tuple[str, int], vocab: int, rounds: int,
            seed: int = 0, workloads: tuple[str, ...] = tuple(WORKLOADS)) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Each round's wall seconds and CPU seconds (benches/process_cpu.py) per workload and server,
    `[workload][server]["wall" | "cpu"]`; the servers given as (URL, pid). Fresh prompts every
    round (no cache hits)."""
    rng = np.random.default_rng(seed)
    servers = {"r3srv": r3srv, "vllm": vllm}
    measures: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name in workloads:
        prompt_len, gen, count, in_flight = {**WORKLOADS, **SPLIT_WORKLOADS}[name]
        warm = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(min(count, in_flight))]
        for who, (url, _) in servers.items():
            asyncio.run(run_workload(url, warm, gen, in_flight, who == "r3srv"))
        for i in range(rounds):
            prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(count)]
            order = list(servers) if i % 2 == 0 else list(servers)[::-1]
            for who in order:
                url, pid = servers[who]
                wait_until_idle([p for _, p in servers.values()])
                cpu = tree_cpu_seconds(pid)
                wall = asyncio.run(run_workload(url, prompts, gen, in_flight, who == "r3srv"))
                took = measures.setdefault(name, {}).setdefault(who, {"wall": [], "cpu": []})
                took["wall"].append(wall)
                took["cpu"].append(tree_cpu_seconds(pid) - cpu)
    return measures


def wait_until_idle(pids: list[int], window: float = 0.1, limit: float = 5.0) -> None:
    """Until the servers' processes together spend under a tenth of a core over `window` seconds
    (at most `limit` seconds): a server's threads keep spinning for a while after its last
    request (Intel's OpenMP, which vLLM-CPU preloads, spins 200 ms by default), and on a 2-core
    machine they would take a core from the server timed next."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        before = sum(tree_cpu_seconds(p) for p in pids)
        time.sleep(window)
        if sum(tree_cpu_seconds(p) for p in pids) - before < 0.1 * window:
            return


def round_ratios(took: dict[str, dict[str, list[float]]], kind: str) -> list[float]:
    """Per-round vLLM / r3srv ratios of one measure ("wall" or "cpu"): > 1, r3srv took less."""
    return [v / r for v, r in zip(took["vllm"][kind], took["r3srv"][kind], strict=True)]


def print_table(label: str, measures: dict[str, dict[str, dict[str, list[float]]]]) -> None:
    for name, took in measures.items():
        parts = []
        for kind in ("wall", "cpu"):
            ratios = round_ratios(took, kind)
            parts.append(f"{kind} {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
                         f"[vLLM {statistics.median(took['vllm'][kind]):.2f}, "
                         f"r3srv {statistics.median(took['r3srv'][kind]):.2f} s]")
        print(f"{label} {name:10s} vLLM/r3srv, median of {len(took['r3srv']['wall'])} rounds: "
              + "; ".join(parts), flush=True)


# what the bfloat16 flash prefill kernel's tiles are, as the processor line names them
BF16_ATTENTION = {"amx": "Rust, AMX tiles", "avx512": "Rust, AVX-512 BF16"}


def processor_line() -> str:
    """The processor, its vector and matrix extensions, and the kernels each server can use."""
    import torch

    from r3srv import _core
    from r3srv.kernels import cpu_isa, expert_pairs_cpu
    from r3srv.kernels.paged_prefill_cpu import FLASH, flash_tiles
    from r3srv.ops.cpu import torch_prefills

    model = "unknown processor"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
    flags = [f for f in wanted if f in cpu_isa.cpu_flags()]
    return (f"processor: {model} x {os.cpu_count()}; ISA {' '.join(flags) or 'none of ' + ' '.join(wanted)}; "
            f"r3srv matrix kernel {_core.expert_pairs_isa()} (bfloat16 prefill GEMMs: "
            f"{'torch/oneDNN' if cpu_isa.torch_has_fast_bfloat16() else 'Rust, widened to float32'}; bfloat16 expert "
            f"chunks: {BF16_PRODUCTS.get(expert_pairs_cpu.bf16_products(), 'torch')}; bfloat16 prefill attention: "
            f"{'torch SDPA (AMX)' if torch_prefills(torch.bfloat16) else BF16_ATTENTION.get(flash_tiles(torch.bfloat16), 'SDPA')}"
            f"; float32 prefill attention: {'AVX-512 flash kernel' if 'float32' in FLASH else 'Rust to 1,024, SDPA'}); "
            f"torch CPU capability {torch.backends.cpu.get_cpu_capability()} (vLLM's kernels follow it)")


def run(model: str | None, threads_list: list[int], rounds: int, venv: str, dtypes: tuple[str, ...] = ("float32",),
        workloads: tuple[str, ...] = tuple(WORKLOADS)) -> dict[tuple[str, int], dict[str, list[float]]]:
    from r3srv.models.builtin import builtin_model_dir

    from prefill_floor import model_config

    checkpoint = model or str(builtin_model_dir())
    config = model_config(checkpoint)
    vocab = config["vocab_size"]
    print(processor_line(), flush=True)
    results = {}
    for dtype in dtypes:
        for threads in threads_list:
            os.environ["R3SRV_CPU_THREADS"] = str(threads)
            # r3srv's defaults but for what both servers are given (a user's command line)
            r3srv_args = (checkpoint, "--device", "cpu", "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN),
                          "--served-model-name", "bench", "--enable-return-routed-experts")
            # each server in a session of its own, as vLLM's: with the kernel's autogroup scheduling a
            # loaded machine shares its cores between sessions, and a server left in this script's
            # session would split one share with the client while the other has one alone
            with RemoteServer(*r3srv_args, own_session=True) as ours:
                try:
                    theirs = VllmServer(venv, checkpoint, threads, dtype)
                except Exception as exc:  # a dtype the peer cannot serve here: say so, go on
                    print(f"{dtype} threads={threads}: vLLM did not start: {str(exc)[-600:]}", flush=True)
                    continue
                try:
                    results[dtype, threads] = compare((ours.url, ours.proc.pid), (theirs.url, theirs.proc.pid),
                                                      vocab, rounds, workloads=workloads)
                finally:
                    theirs.stop()
            print_table(f"{dtype} threads={threads}", results[dtype, threads])
            if "long" in workloads:
                print_long_floor(config, dtype, threads, results[dtype, threads]["long"])
    return results


def print_long_floor(config: dict, dtype: str, threads: int, took: dict[str, dict[str, list[float]]]) -> None:
    """The long workload's median times against its prompt's compute floor (benches/prefill_floor.py),
    where the model is one prefill_floor counts."""
    from prefill_floor import floor_line

    times = {who: statistics.median(took[key]["wall"]) for who, key in (("vLLM", "vllm"), ("r3srv", "r3srv"))}
    try:
        line = floor_line(config, WORKLOADS["long"][0], dtype, threads, times)
    except ValueError as exc:
        line = f"prefill floor: {exc}"
    print(f"{line} (each time with its {WORKLOADS['long'][1]} decode steps and HTTP)", flush=True)


def test_r3srv_vs_vllm_cpu():
    """Runs the comparison once (3 rounds, 1 thread) when the peer is installed; no speed gate."""
    import pytest

    venv = os.environ.get("VLLM_VENV")
    if not venv:
        pytest.skip(HINT)
    results = run(None, [1], rounds=3, venv=venv)
    for took in results["float32", 1].values():
        assert all(len(r) == 3 and all(x > 0 for x in r) for r in (round_ratios(took, "wall"), round_ratios(took, "cpu")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--no-roofline", action="store_true", help="skip the decode roofline after the table")
    parser.add_argument("--workloads", nargs="+", choices=(*WORKLOADS, *SPLIT_WORKLOADS), default=list(WORKLOADS),
                        help="a subset (a large checkpoint's throughput workload takes minutes a round), or the "
                             "throughput workload's halves by name")
    args = parser.parse_args()
    venv = os.environ.get("VLLM_VENV")
    if not venv:
        sys.exit(f"skipped: {HINT}")
    run(args.model, args.threads, args.rounds, venv, tuple(args.dtype), tuple(args.workloads))
    if not args.no_roofline:
        from decode_roofline import roofline

        for dtype in args.dtype:
            for threads in args.threads:
                print("\n".join(roofline(args.model, dtype, threads)), flush=True)


if __name__ == "__main__":
    main()

"""What bench_lora.py and bench_lora_shaped.py share: the workloads (16 sequences under no adapter
or spread round-robin over 1, 4 or 16 adapters, against the base model's engine), timed steps
on the calling thread's CPU clock, rounds alternating the workloads' order, and the report of
same-run ratios to the base model."""

from __future__ import annotations

import statistics
import time

from serial_cases import machine_description

from r3srv import LLM, SamplingParams, _core

WORKLOADS = {"base model": None, "lora engine, no adapter": 0, "1 adapter": 1, "4 adapters": 4, "16 adapters": 16}
Times = dict[str, list[tuple[float, float]]]


def names(adapters_in_batch: int | None, count: int) -> list[str | None]:
    """Adapter names a0.. round-robin over `count` sequences (None each without adapters)."""
    return [None if not adapters_in_batch else f"a{s % adapters_in_batch}" for s in range(count)]


def prompts(count: int, length: int, round_no: int) -> list[list[int]]:
    return [[32 + (round_no * 31 + s * 17 + i * 13) % 90 for i in range(length)] for s in range(count)]


def clock(fn) -> tuple[float, float]:
    """(wall, calling thread's CPU) seconds of fn()."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def prefill(llm: LLM, workload: int | None, r: int, count: int, length: int) -> tuple[float, float]:
    """One step of `count` prompts of `length` tokens."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    batch = prompts(count, length, r)
    kwargs = {} if workload is None else {"lora_name": names(workload, count)}
    return clock(lambda: llm.generate(batch, params, **kwargs))


def decode(llm: LLM, workload: int | None, r: int, count: int, length: int, steps: int) -> tuple[float, float]:
    """`steps` decode steps of `count` sequences of `length`-token prompts, their prefill untimed."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i, (p, name) in enumerate(zip(prompts(count, length, r), names(workload, count))):
        engine.add_request(f"d{time.perf_counter_ns()}-{i}", p, params, lora_name=name)
    while engine.step().num_prefill_tokens == 0:  # the prefill step, untimed
        pass

    def run_steps() -> None:
        while engine.has_unfinished():
            engine.step()

    return clock(run_steps)


def run(base: LLM, lora: LLM, one, rounds: int) -> Times:
    """one(engine, workload, round) for every workload, after a warm-up, `rounds` times."""
    times: Times = {name: [] for name in WORKLOADS}
    order = list(WORKLOADS)
    for workload in WORKLOADS.values():
        one(base if workload is None else lora, workload, 9999)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            workload = WORKLOADS[name]
            times[name].append(one(base if workload is None else lora, workload, r))
    return times


def report(title: str, times: Times, per: int) -> None:
    cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
    wall = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
    print(f"\n{title} (one torch thread; thread CPU per step, wall per step; ratio to the base model's CPU time)")
    for name in WORKLOADS:
        print(f"  {name:24s} {1e3 * cpu[name] / per:9.3f} ms  {1e3 * wall[name] / per:9.3f} ms wall  "
              f"{cpu[name] / cpu['base model']:5.2f}x")
    print(f"  matrix kernel (the Rust expert and LoRA passes): {_core.expert_pairs_isa()}")
    for key, value in machine_description().items():
        print(f"  {key}: {value}")


def rounds_for(benchmark, rounds: int) -> int:
    return 1 if benchmark.disabled else rounds  # bench-smoke: one checked round

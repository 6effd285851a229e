#!/usr/bin/env bash
# Every GPU check of r3srv in ONE device call (a lent task has 15 minutes of device time in all):
# first the CUDA-graph tests (tests/test_cuda_graphs.py: graph decode == eager in tokens and
# routed-experts rows, padding, abort, hybrid) and the decode throughput table of a
# Qwen3-30B-A3B-shaped model against the HBM roofline (benches/gpu_throughput.py), both never
# run on a GPU yet (docs/cuda_graphs.md); then the router table of benches/gpu_router.py (correctness grid, do_bench timings, engine
# decode step with capture on/off: the fused router's measured cost, so it runs before anything
# can eat the time), then the CUDA tests (fused router vs torch reference, CUDA models vs CPU, engine
# rows on CUDA, hybrid engines with the fused decode steps vs the CPU and the torch steps),
# then the hybrid-prefill grouping ratio and the fused delta-rule decode step against
# gather-step-scatter, then the Triton paged decode attention against gather + SDPA, then what
# two replay signals cost (benches/gpu_signals.py: sampling masks on a decode step's sampling,
# the indexer top-k capture on a DSA decode step; never run on a GPU yet). Every log lands in
# $OUT, so a run cut short still returns what it did.
#
# The device image has python3 3.12 with torch and triton but reaches no registry, and lacks
# msgspec (SamplingParams); its transformers (5.17) predates some families the tiny test
# checkpoints are written with, so 5.23 (as pinned here) travels too. Nothing there needs the
# Rust extension. So, on the dev machine first:
#   bash benches/gpu_check.sh --fetch-wheels
# then call the device tool's run with
#   command="bash benches/gpu_check.sh", carry=[".whl"], timeout_s=600 (the default steps, estimated
#   at about 520 s on an H200: graphs ~90, throughput ~200 (estimated, unmeasured), tests 110,
#   tp ~60 with two GPUs (with one it says so and skips), syncs 15, router 125, signals ~20 s (estimated,
#   unmeasured); each step also has its own limit below; "hybrid decode", measured
#   before, run only when R3SRV_GPU_STEPS names them)
# and copy the tables it prints ($OUT/throughput_table.md, $OUT/router_table.md, $OUT/signals_table.md) into
# docs/benchmarks.md, with the date. Every command is printed before it runs.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--fetch-wheels" ]; then
    grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl msgspec==0.22.0 transformers==5.23.0
fi

out=${OUT:-/tmp/r3srv-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/python"

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } 2>&1 | tee "$out/machine.txt"

# R3SRV_GPU_STEPS picks steps (default "graphs throughput tests tp syncs router signals"; also "hybrid",
# "decode", "engine"): a follow-up call in the same session reruns only
# what changed, e.g. R3SRV_GPU_STEPS="engine tests syncs decode" (engine: the router script's
# decode-step rows only) with R3SRV_GPU_TESTS naming the test files.
steps=" ${R3SRV_GPU_STEPS:-graphs throughput tests tp syncs router signals} "
wants() { [[ "$steps" == *" $1 "* ]]; }
status=0
# step LOG SECONDS COMMAND...: prints the command, runs it under a limit, its output also in $out/LOG
step() {
    local log=$1 limit=$2
    shift 2
    echo "+ timeout $limit $*" | tee "$out/$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$out/$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
if wants graphs; then
    step cuda_graphs.log 150 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_cuda_graphs.py
fi
if wants throughput; then  # prints each batch's line as it goes: a run cut short keeps them
    step throughput.log 240 python3 benches/gpu_throughput.py --require-gpu --out "$out/throughput_table.md"
fi
if wants tests; then
    # R3SRV_GPU_TESTS: the test files to run (default all the CUDA ones but the graphs')
    step gpu_tests.log 280 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu ${R3SRV_GPU_TESTS:-\
        tests/test_router_gpu.py tests/test_models_gpu.py tests/test_engine_hybrid_gpu.py tests/test_engine.py \
        tests/test_memory_release.py tests/test_routed_experts_buffer.py tests/test_attention_gpu.py tests/test_transfer.py}
fi
if wants tp; then  # TP=2 against TP=1 (NCCL, one GPU per rank): only where there are two GPUs
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    if [ "$gpus" -ge 2 ]; then
        step tp_bench.log 150 python3 benches/bench_tp.py --device cuda --rounds 3
    else
        echo "tp: this machine has $gpus GPU(s); the TP=2 run needs two, so it did not run" | tee "$out/tp_bench.log"
    fi
fi
if wants syncs; then  # -rP: its lines say where a decode step synchronizes
    step syncs.log 90 python3 -m pytest -q -p no:cacheprovider -rfEP tests/test_engine_gpu_syncs.py
fi
if wants router; then
    step router_bench.log 220 python3 benches/gpu_router.py --require-gpu --out "$out/router_table.md"
elif wants engine; then
    step engine_bench.log 150 python3 benches/gpu_router.py --require-gpu --engine-only --out "$out/engine_table.md"
fi
if wants signals; then  # prints each row as it goes; 30 rounds a row keep it within its limit
    step signals_bench.log 60 python3 benches/gpu_signals.py --device cuda --rounds 30 --out "$out/signals_table.md"
fi
if wants hybrid; then
    step hybrid_prefill.log 45 python3 benches/bench_hybrid_prefill.py
fi
if wants decode; then
    step decode_attention.log 150 python3 benches/gpu_decode_attention.py
fi
exit $status

#!/usr/bin/env bash
# Every GPU check of r3srv in ONE device call (a lent task has 15 minutes of device time in all):
# first the router table of benches/gpu_router.py (correctness grid, do_bench timings, engine
# decode step with capture on/off: issue 5's deliverable, so it runs before anything can eat
# the time), then the CUDA tests (fused router vs torch reference, CUDA models vs CPU, engine
# rows on CUDA, hybrid engines with the fused decode steps vs the CPU and the torch steps),
# then the hybrid-prefill grouping ratio and the fused delta-rule decode step against
# gather-step-scatter, then the Triton paged decode attention against gather + SDPA. Every log
# lands in $OUT, so a run cut short still returns what it did.
#
# The device image has python3 3.12 with torch and triton but reaches no registry, and lacks
# msgspec (SamplingParams); its transformers (5.17) predates some families the tiny test
# checkpoints are written with, so 5.23 (as pinned here) travels too. Nothing there needs the
# Rust extension. So, on the dev machine first:
#   bash benches/gpu_check.sh --fetch-wheels
# then call the device tool's run with
#   command="bash benches/gpu_check.sh", carry=[".whl"], timeout_s=600 (about 380 s on an H200:
#   router 125, tests 110, syncs 15, decode attention 90 s; each step also has its own limit below)
# and copy the table it prints (also in $OUT/router_table.md) into docs/benchmarks.md, with the date.
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

# R3SRV_GPU_STEPS picks steps (default all): a follow-up call in the same session reruns only
# what changed, e.g. R3SRV_GPU_STEPS="engine tests syncs decode" (engine: the router script's
# decode-step rows only) with R3SRV_GPU_TESTS naming the test files.
steps=" ${R3SRV_GPU_STEPS:-router tests syncs hybrid decode} "
wants() { [[ "$steps" == *" $1 "* ]]; }
status=0
if wants router; then
    timeout 220 python3 benches/gpu_router.py --require-gpu --out "$out/router_table.md" 2>&1 | tee "$out/router_bench.log" || status=1
elif wants engine; then
    timeout 150 python3 benches/gpu_router.py --require-gpu --engine-only --out "$out/engine_table.md" 2>&1 | tee "$out/engine_bench.log" || status=1
fi
if wants tests; then
    # R3SRV_GPU_TESTS: the test files to run (default all the CUDA ones)
    timeout 280 python3 -m pytest -q -p no:cacheprovider -rfE -k "cuda or gpu" ${R3SRV_GPU_TESTS:-\
        tests/test_router_gpu.py tests/test_models_gpu.py tests/test_engine_hybrid_gpu.py tests/test_engine.py \
        tests/test_memory_release.py tests/test_routed_experts_buffer.py tests/test_attention_gpu.py tests/test_transfer.py} 2>&1 | tee "$out/gpu_tests.log" || status=1
fi
if wants syncs; then  # -rP: its lines say where a decode step synchronizes
    timeout 90 python3 -m pytest -q -p no:cacheprovider -rfEP tests/test_engine_gpu_syncs.py 2>&1 | tee "$out/syncs.log" || status=1
fi
if wants hybrid; then
    timeout 45 python3 benches/bench_hybrid_prefill.py 2>&1 | tee "$out/hybrid_prefill.log" || status=1
fi
if wants decode; then
    timeout 150 python3 benches/gpu_decode_attention.py 2>&1 | tee "$out/decode_attention.log" || status=1
fi
exit $status

#!/usr/bin/env bash
# SkyRL's and AReaL's own client code for tests/test_rl_framework_clients.py: skyrl and areal from
# PyPI with --no-deps (their declared requirements pin CUDA torch, vLLM/SGLang and transformers
# ranges r3srv's venv does not hold, and skyrl declares Python>=3.12), plus only the modules their
# client modules import, every one pinned in tools/rl_clients_constraints.txt. Layered over r3srv's
# .venv as tools/verl_env.sh does, so it reuses .venv's torch. Run after `make install`.
#     tools/rl_clients_env.sh [VENV (default .rl_clients_venv)]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.rl_clients_venv}
tools/layered_venv.sh "$VENV"
"$VENV/bin/pip" install -q --no-deps --ignore-requires-python -r tools/rl_clients_constraints.txt
"$VENV/bin/python" tests/rl_clients_driver.py check

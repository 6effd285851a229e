#!/usr/bin/env bash
# verl's own environment for tests/test_verl_rollout.py: verl 0.9.1 from PyPI with its own ray and
# transformers (tools/verl_constraints.txt pins every package), layered over r3srv's .venv, which
# supplies torch and r3srv itself (its `verl.plugins` entry point included). Run after `make install`.
#     tools/verl_env.sh [VERL_VENV (default .verl_venv)]
set -euo pipefail
cd "$(dirname "$0")/.."
VERL_VENV=${1:-.verl_venv}
tools/layered_venv.sh "$VERL_VENV"
# cachetools and pyzmq: imported by verl's rollout router and agent loop, not in its requirements
"$VERL_VENV/bin/pip" install -q -c tools/verl_constraints.txt verl cachetools pyzmq
"$VERL_VENV/bin/python" -c 'import verl; from verl.workers.rollout.replica import RolloutReplicaRegistry as R; print("verl", verl.__version__, "resolves rollout.name=r3srv:", R.get("r3srv").__name__)'

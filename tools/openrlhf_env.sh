#!/usr/bin/env bash
# OpenRLHF's own environment for tests/test_openrlhf_rollout.py: openrlhf 0.11.2 from PyPI with
# --no-deps (its requirements pin deepspeed, flash-attn and a CUDA stack that its rollout path does
# not import), its Ray, and what its agent module (openrlhf.utils.agent, through openrlhf.utils)
# imports that r3srv's .venv lacks: pylatexenc. Layered over r3srv's .venv, which supplies torch,
# transformers, aiohttp, sympy and r3srv itself. tools/openrlhf_constraints.txt pins every package.
# Run after `make install`.
#     tools/openrlhf_env.sh [OPENRLHF_VENV (default .openrlhf_venv)]
set -euo pipefail
cd "$(dirname "$0")/.."
OPENRLHF_VENV=${1:-.openrlhf_venv}
tools/layered_venv.sh "$OPENRLHF_VENV"
"$OPENRLHF_VENV/bin/pip" install -q --no-deps -c tools/openrlhf_constraints.txt openrlhf
"$OPENRLHF_VENV/bin/pip" install -q -c tools/openrlhf_constraints.txt ray pylatexenc
"$OPENRLHF_VENV/bin/python" -c 'import importlib.metadata as m, ray, openrlhf.utils.agent, r3srv.integrations.openrlhf; print("openrlhf", m.version("openrlhf"), "ray", ray.__version__, "and r3srv.integrations.openrlhf import")'

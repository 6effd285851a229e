#!/usr/bin/env bash
# prime-rl's rollout clients for tests/test_verifiers_client.py: verifiers and renderers from PyPI in
# a venv of their own (verifiers pins openai<3, which r3srv's test pins cannot share), every package
# pinned by tools/verifiers_constraints.txt. No torch: the clients only tokenize and talk HTTP.
#     tools/verifiers_env.sh [VENV (default .verifiers_venv)]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.verifiers_venv}
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q -c tools/verifiers_constraints.txt verifiers==0.4.0 renderers==0.1.12
"$VENV/bin/python" -c 'import verifiers.v1.clients.train, renderers; print("verifiers and renderers ready")'

#!/usr/bin/env bash
# A framework's own venv layered over r3srv's .venv (tools/verl_env.sh, tools/openrlhf_env.sh):
# on its sys.path the framework's own packages come first, then r3srv's sources, then the .venv's
# site-packages (torch, transformers, r3srv's metadata), through one .pth file.
#     tools/layered_venv.sh VENV    (BASE: the .venv, default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-.venv}
VENV=$1
[ -x "$BASE/bin/python" ] || { echo "no $BASE: run make install first" >&2; exit 1; }
"$BASE/bin/python" -m venv "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n%s\n' "$(pwd)/python" "$(cd "$base_site" && pwd)" > "$site/zz_r3srv_base.pth"

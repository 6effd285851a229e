#!/usr/bin/env bash
# A venv layered over r3srv's .venv (BASE): made from its Python, with a .pth that puts PATHS (if any)
# and then the .venv's site-packages after the venv's own packages, so a framework's environment
# reuses .venv's torch instead of downloading another. Used by tools/verl_env.sh,
# tools/openrlhf_env.sh and tools/rl_clients_env.sh.
#     tools/layered_venv.sh VENV [PATH ...]
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-.venv}
VENV=$1
shift
[ -x "$BASE/bin/python" ] || { echo "no $BASE: run make install first" >&2; exit 1; }
"$BASE/bin/python" -m venv "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n' "$@" "$(cd "$base_site" && pwd)" > "$site/zz_r3srv_base.pth"

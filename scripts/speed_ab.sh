#!/usr/bin/env bash
# Speed A/B against a revision (scripts/speed_ab.py): scripts/speed_ab.sh REV [--rounds N] [BENCH SPEED ARGUMENTS]
# Both sides run under one interpreter, $PY; by default the main checkout's .venv, which its worktrees share.
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
common=$(git -C "$root" rev-parse --path-format=absolute --git-common-dir)
PY=${PY:-$(dirname "$common")/.venv/bin/python}
exec "$PY" "$root/scripts/speed_ab.py" "$@"

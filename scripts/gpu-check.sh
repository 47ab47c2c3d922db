#!/usr/bin/env bash
# labkit's self-contained GPU check, in two halves (labkit/gpu_check/ says what each does):
#
#   here, in this checkout with its .venv:
#     scripts/gpu-check.sh --bundle [DIR] [--python 3.12]
#       builds what a bare GPU machine lacks into DIR (default runs/gpu-bundle), at most 60 MiB
#   there, on the GPU machine, from the checkout's root with DIR carried along:
#     scripts/gpu-check.sh --run DIR --out OUT [--budget-s 420]
#       starts Triton with KIND_GPU instances, checks and measures, writes OUT/gpu-check.json;
#       needs only python3 with torch, transformers and numpy there (PYTHON= names another)
#
# --run exits 0 when every check passed, 1 when one failed, 2 on an error, 3 when it could not
# run (no GPU, another Python than the bundle's): the reason is in OUT/gpu-check.json.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

usage() {
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
}

case "${1:-}" in
  --bundle)
    shift
    cd "$root"
    dir=runs/gpu-bundle
    if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then dir=$1; shift; fi
    exec "${LABKIT_PYTHON:-.venv/bin/python}" -m labkit.cli gpu bundle "$dir" "$@"
    ;;
  --run)
    shift
    [ $# -gt 0 ] || { usage; exit 2; }
    bundle=$1
    shift
    python=${PYTHON:-python3}
    # The runner bounds itself (--budget-s, default 420 s); this is the backstop for a hang.
    if command -v timeout >/dev/null; then
      exec timeout --kill-after=15 480 "$python" "$bundle/run.py" --bundle "$bundle" "$@"
    fi
    exec "$python" "$bundle/run.py" --bundle "$bundle" "$@"
    ;;
  *)
    usage
    exit 2
    ;;
esac

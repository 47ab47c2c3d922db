#!/usr/bin/env bash
# Set up an AWS inf2 / trn1 (or inf1) workshop host for the lab's Neuron path:
#   1. the Neuron apt repository, driver (aws-neuronx-dkms), runtime and tools (neuron-ls, neuron-top);
#   2. the Neuron pip repository and its packages (torch-neuronx + neuronx-cc, or torch-neuron +
#      neuron-cc on inf1) into a Python virtual environment (the LLM's vLLM Neuron plugin has its
#      own venv: labkit/templates/neuron/vllm_neuron_setup.sh);
#   3. the lab itself (pip install -e .) into that environment.
# Safe to run again: every step checks what is there first. Needs sudo for the apt part.
#
# Usage: scripts/setup-neuron-host.sh [--inf1|--inf2|--trn1] [--venv DIR] [--skip-apt] [--dry-run]
set -euo pipefail

TARGET=""
VENV_DIR="${VENV_DIR:-$HOME/neuron-venv}"
SKIP_APT=0
DRY_RUN=0
APT_REPO="https://apt.repos.neuron.amazonaws.com"
PIP_REPO="https://pip.repos.neuron.amazonaws.com"
KEYRING=/etc/apt/keyrings/neuron.gpg

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
say() { printf '[setup-neuron-host] %s\n' "$*"; }
run() { if [ "$DRY_RUN" = 1 ]; then say "would run: $*"; else "$@"; fi; }

while [ $# -gt 0 ]; do
    case "$1" in
        --inf1|--inf2|--trn1) TARGET="${1#--}"; shift ;;
        --venv) VENV_DIR="$2"; shift 2 ;;
        --skip-apt) SKIP_APT=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) say "unknown option: $1"; usage; exit 2 ;;
    esac
done

detect_target() {
    local product=""
    if [ -r /sys/devices/virtual/dmi/id/product_name ]; then
        product="$(cat /sys/devices/virtual/dmi/id/product_name)"
    fi
    case "$product" in
        inf1.*) echo inf1 ;;
        inf2.*) echo inf2 ;;
        trn1.*|trn1n.*) echo trn1 ;;
        *) echo "" ;;
    esac
}

if [ -z "$TARGET" ]; then
    TARGET="$(detect_target)"
    if [ -z "$TARGET" ]; then
        say "this is not an inf1/inf2/trn1 instance; pass --inf1, --inf2 or --trn1 to set one up anyway"
        exit 2
    fi
fi
say "setting up for $TARGET, Python environment in $VENV_DIR"

# shellcheck source=/dev/null
. /etc/os-release
if [ "${ID:-}" != "ubuntu" ] && [ "$SKIP_APT" = 0 ]; then
    say "the apt steps support Ubuntu (found ${ID:-unknown}); use the Neuron DLAMI or pass --skip-apt"
    exit 2
fi

if [ "$SKIP_APT" = 0 ]; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    if [ ! -f "$KEYRING" ]; then
        run $SUDO install -d -m 0755 /etc/apt/keyrings
        if [ "$DRY_RUN" = 1 ]; then
            say "would fetch the Neuron apt key into $KEYRING"
        else
            wget -qO - "$APT_REPO/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB" | $SUDO gpg --dearmor -o "$KEYRING"
        fi
    fi
    LIST=/etc/apt/sources.list.d/neuron.list
    LINE="deb [signed-by=$KEYRING] $APT_REPO ${VERSION_CODENAME} main"
    if [ ! -f "$LIST" ] || ! grep -qxF "$LINE" "$LIST"; then
        if [ "$DRY_RUN" = 1 ]; then say "would write $LIST"; else echo "$LINE" | $SUDO tee "$LIST" > /dev/null; fi
    fi
    run $SUDO apt-get update
    # The driver builds against the running kernel's headers.
    run $SUDO apt-get install -y "linux-headers-$(uname -r)" git libb64-0d python3-venv
    if [ "$TARGET" = inf1 ]; then
        run $SUDO apt-get install -y aws-neuronx-dkms aws-neuronx-tools aws-neuronx-runtime-lib
    else
        run $SUDO apt-get install -y aws-neuronx-dkms aws-neuronx-collectives \
            aws-neuronx-runtime-lib aws-neuronx-tools
    fi
    if [ -d /opt/aws/neuron/bin ] && ! grep -qs '/opt/aws/neuron/bin' "$HOME/.bashrc"; then
        if [ "$DRY_RUN" = 1 ]; then say "would add /opt/aws/neuron/bin to PATH in ~/.bashrc"; else
            # shellcheck disable=SC2016  # $PATH must expand when .bashrc runs, not now
            echo 'export PATH="/opt/aws/neuron/bin:$PATH"' >> "$HOME/.bashrc"
        fi
    fi
fi

if [ ! -x "$VENV_DIR/bin/python" ]; then
    run python3 -m venv "$VENV_DIR"
fi
PIP="$VENV_DIR/bin/pip"
run "$PIP" install --upgrade pip
run "$PIP" config --site set global.extra-index-url "$PIP_REPO"
if [ "$TARGET" = inf1 ]; then
    run "$PIP" install "torch-neuron" "neuron-cc[tensorflow]" "numpy<2"
else
    # torch-neuronx pins the torch it was built for; install it first so the lab keeps that torch.
    run "$PIP" install "neuronx-cc==2.*" "torch-neuronx" "numpy<2"
fi
REPO_ROOT="$(cd "$(dirname "$0")/.." && pwd)"
run "$PIP" install -e "$REPO_ROOT"

if [ "$DRY_RUN" = 0 ] && command -v /opt/aws/neuron/bin/neuron-ls > /dev/null; then
    /opt/aws/neuron/bin/neuron-ls || say "neuron-ls found no device yet: reboot if the driver was just installed"
fi
run "$VENV_DIR/bin/labkit" neuron detect
say "done. Activate with: source $VENV_DIR/bin/activate"

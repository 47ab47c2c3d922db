#!/usr/bin/env bash
# Install AWS's vLLM Neuron plugin (vllm-neuron) into the venv that the Neuron vLLM model's
# EXECUTION_ENV_PATH names, on an inf2 / trn1 host (written beside the model by
# labkit.neuron.vllm.write_neuron_vllm_model).
#
# Follows the AWS Neuron "vLLM User Guide for NxD Inference": clone vllm-project/vllm-neuron at a
# release and `pip install --extra-index-url=https://pip.repos.neuron.amazonaws.com -e .`; the
# plugin pulls its pinned vLLM. The Neuron compiler and torch-neuronx are not in the plugin: they
# come from the same pip repository, or from the Neuron DLAMI's venv (--from-dlami copies none of
# it: it makes the new venv see the DLAMI venv's packages).
#
# Usage: vllm_neuron_setup.sh --venv DIR [--plugin-ref REF] [--from-dlami] [--dry-run]
set -euo pipefail

VENV_DIR=""
PLUGIN_REF="0.5.0"
PLUGIN_GIT="https://github.com/vllm-project/vllm-neuron.git"
PIP_REPO="https://pip.repos.neuron.amazonaws.com"
FROM_DLAMI=0
DRY_RUN=0

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
say() { printf '[vllm-neuron-setup] %s\n' "$*"; }
run() { if [ "$DRY_RUN" = 1 ]; then say "would run: $*"; else "$@"; fi; }

while [ $# -gt 0 ]; do
    case "$1" in
        --venv) VENV_DIR="${2:?--venv needs a folder}"; shift 2 ;;
        --plugin-ref) PLUGIN_REF="${2:?--plugin-ref needs a git tag or branch}"; shift 2 ;;
        --from-dlami) FROM_DLAMI=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) say "unknown option: $1"; usage; exit 2 ;;
    esac
done

if [ -z "$VENV_DIR" ]; then
    say "give --venv: the folder the model's EXECUTION_ENV_PATH parameter names"
    exit 2
fi

if [ "$DRY_RUN" = 0 ] && ! ls /dev/neuron0 > /dev/null 2>&1; then
    say "no /dev/neuron0: this is not an inf2/trn1 host with the Neuron driver; run scripts/setup-neuron-host.sh first, or pass --dry-run to see the steps"
    exit 2
fi

if [ ! -x "$VENV_DIR/bin/python" ]; then
    if [ "$FROM_DLAMI" = 1 ]; then
        DLAMI_VENV=""
        for candidate in /opt/aws_neuronx_venv_pytorch_inference_vllm_*; do
            if [ -x "$candidate/bin/python" ]; then DLAMI_VENV="$candidate"; fi
        done
        if [ -z "$DLAMI_VENV" ] && [ "$DRY_RUN" = 0 ]; then
            say "--from-dlami: no /opt/aws_neuronx_venv_pytorch_inference_vllm_* venv here; use the Neuron DLAMI or drop --from-dlami"
            exit 2
        fi
        run "${DLAMI_VENV:-/opt/aws_neuronx_venv_pytorch_inference_vllm_X}/bin/python" -m venv --system-site-packages "$VENV_DIR"
    else
        run python3 -m venv "$VENV_DIR"
    fi
fi

PIP="$VENV_DIR/bin/pip"
run "$PIP" install --upgrade pip
if [ "$FROM_DLAMI" = 0 ]; then
    # The Neuron framework the plugin runs on (not a dependency of the plugin itself).
    run "$PIP" install --extra-index-url "$PIP_REPO" "neuronx-cc==2.*" torch-neuronx
fi

SRC_DIR="$VENV_DIR/src/vllm-neuron"
if [ ! -d "$SRC_DIR/.git" ]; then
    run git clone --depth 1 --branch "$PLUGIN_REF" "$PLUGIN_GIT" "$SRC_DIR"
fi
run "$PIP" install --extra-index-url "$PIP_REPO" -e "$SRC_DIR"

run "$VENV_DIR/bin/python" -c "import vllm, vllm_neuron; print('vllm', vllm.__version__, 'with the Neuron plugin')"
say "done. The model's config.pbtxt sets NEURON_RT_VISIBLE_CORES, VLLM_PLUGINS=neuron and"
say "VLLM_NEURON_FRAMEWORK for the engine; EXECUTION_ENV_PATH must be $VENV_DIR"

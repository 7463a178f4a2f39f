#!/usr/bin/env bash
# Fresh-machine set-up: a venv in .venv with torch, the build dependencies and
# primemoe built from this checkout (CUDA extension included). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${PRIMEMOE_TORCH:-torch==2.14.1}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "== installing $TORCH_SPEC and build/test dependencies"
python -m pip install -q "$TORCH_SPEC" ninja setuptools wheel "nvidia-cutlass==4.2.0.0" pytest numpy matplotlib transformers torch-abi-audit 2>&1 \
  | { grep -v "^WARNING: Location" || true; }
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== building and installing primemoe (CUDA extension for sm_${PRIMEMOE_CUDA_ARCHS:-90a})"
start=$(date +%s)
python -m pip install -q --no-build-isolation --no-deps . 2>&1 | { grep -v "^WARNING: Location" || true; }
python -c "import primemoe; print('primemoe', primemoe.__version__, 'installed')"
echo "== build took $(( $(date +%s) - start )) s"

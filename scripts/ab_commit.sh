#!/usr/bin/env bash
# One device call: build this checkout and a base tree, then compare them through scripts/ab_commit.py: checksums of
# every output (one process per build) and, ROUNDS times, timings of each build in turn. The base tree is an
# extract of the base commit, made here and carried (an ignored folder), e.g.
#   mkdir -p .ab/base && git archive e426a2c -- csrc python setup.py pyproject.toml third_party scripts | tar -x -C .ab/base
# (carry .ab and .whl, the nvidia-cutlass wheel). NEW (default: this checkout) is the tree compared with it; TESTS
# (pytest arguments) runs those tests of NEW against its build first. Results: $OUT/ab-summary.json and logs (the
# per-build checksums and timings stay in $AB_DIR, default /tmp/ab: a device call returns few files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
BASE=${BASE:-.ab/base}
NEW=${NEW:-.}
ROUNDS=${ROUNDS:-2}
AB_DIR=${AB_DIR:-/tmp/ab}
mkdir -p "$OUT" "$AB_DIR"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
PY=python3
$PY -m pip install -q --no-index --no-deps --target /tmp/cutlass-site .whl/nvidia_cutlass-*.whl || exit 1
NVSHMEM_LIB=$($PY -c "import os, torch; print(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), 'nvidia', 'nvshmem', 'lib'))")
export LD_LIBRARY_PATH=$NVSHMEM_LIB:${LD_LIBRARY_PATH:-}
build() {  # build SRC NAME: wheel of SRC installed into /tmp/site-NAME
  local start=$(date +%s)
  (cd "$1" && PYTHONPATH=/tmp/cutlass-site PRIMEMOE_BUILD_JOBS=$(nproc) $PY -m pip wheel -q --no-build-isolation \
     --no-deps --no-index -w "/tmp/wheel-$2" .) > "$OUT/build-$2.log" 2>&1 || { tail -40 "$OUT/build-$2.log"; exit 1; }
  $PY -m pip install -q --no-index --no-deps --target "/tmp/site-$2" /tmp/wheel-$2/primemoe*.whl || exit 1
  echo "build $2: $(( $(date +%s) - start )) s"
}
build "$BASE" base
build "$NEW" new
if [ -n "${TESTS:-}" ]; then
  (cd "$NEW" && PYTHONPATH=/tmp/site-new $PY -m pytest $TESTS -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" \
     | tail -25)
fi
for b in base new; do
  PYTHONPATH=/tmp/site-$b $PY scripts/ab_commit.py hash --out "$AB_DIR/hash-$b.json" || echo "hash $b failed"
done
for r in $(seq "$ROUNDS"); do
  for b in base new; do
    echo "== time $b, round $r"
    PYTHONPATH=/tmp/site-$b $PY scripts/ab_commit.py time --out "$AB_DIR/time-$b-$r.json" ${AB_TIME_ARGS:-} \
      || echo "time $b failed"
  done
done
$PY scripts/ab_commit.py report --out "$AB_DIR" && cp "$AB_DIR/ab-summary.json" "$OUT/"

#!/usr/bin/env bash
# One device call: build primemoe on the GPU machine (no network there: the nvidia-cutlass wheel travels in
# .whl/), then run the named steps. Logs and JSON results land in $OUT (default ./gpu-out), the benchmark's
# tables and plots in $TABLES (default /tmp/primemoe-tables) and the wheel in /tmp/primemoe-wheel: a device call
# returns only a few files, and those should be the logs and JSONs. docs/development.md has the details.
#
#   scripts/gpu_run.sh [smoke|tests|gputests|multigpu|ep|main|bench|stages|ncu|comm|commprof|sanitize|sass ...]
#                      (default: tests main bench)
#
# smoke     one small forward+backward (scripts/sanitize_case.py); stops the run if it fails or hangs
# tests     the whole suite (CPU and GPU tests); gputests: tests/gpu without the multi-GPU tests;
#           multigpu: only the multi-GPU tests
# ep        the expert-parallel tests (marker ep, EP = 2 and 4; on one GPU every rank shares it) twice: without
#           MPS, then under CUDA MPS (scripts/mps.sh; each rank takes 100 // ranks-per-GPU percent of the SMs),
#           stopping MPS afterwards even on failure. EP_PASSES picks the passes (default "plain mps"), EP_MARK
#           the tests (default "ep and not slow"), EP_TIMEOUT the seconds each pytest may run (default 270)
# main      python -m primemoe (the main job)
# bench     the layer benchmark, EP = 1 and 2 (EP = 2 is reported skipped on one GPU); BENCH_ARGS replaces its
#           arguments, e.g. BENCH_ARGS="--shapes qwen3-235b-a22b --tokens 8192 --ep 1"
# stages    per-stage times of the single-GPU layer (scripts/stage_times.py; STAGES_ARGS adds options)
# timeline  per-kernel timeline of one forward+backward, the single-GPU layer against the Buffer path over a Buffer of
#           one rank (scripts/ep_timeline.py; TIMELINE_ARGS adds options) -> timeline.txt
# ncu       Nsight Compute sections of the engine's forward GEMMs (scripts/ncu_engine.py; NCU_ARGS adds options,
#           e.g. NCU_ARGS="--shape qwen3-235b-a22b --tokens 8192", or --dgrad)
# comm      the dispatch/combine benchmark at EP = 2; commprof: their region and kernel times on every GPU
#           (scripts/comm_profile.py)
# sanitize  compute-sanitizer memcheck, racecheck and synccheck on scripts/sanitize_case.py, then racecheck and
#           synccheck on a small case with the forward GEMMs forced to the claimed order and 192-row tiles
# sass      register and local-memory report of the built extension (cuobjdump)
# pytest    pytest with $PYTEST_ARGS (e.g. PYTEST_ARGS="tests/gpu/test_fp8_gemm_gpu.py -x")
#
# REUSE_BUILD=1 skips the build when an earlier call on the same (still warm) machine built these sources.
# PREBUILT_WHEEL=<path> installs that wheel (e.g. one built on the CPU machine against another torch minor, carried
# in .whl/) instead of building: the GPU suite then runs on exactly that binary.
# PRIMEMOE_GIT_COMMIT=<hash> names the commit in the benchmark JSONs (the copy here has no .git).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
TABLES=${TABLES:-/tmp/primemoe-tables}
WHEEL_DIR=/tmp/primemoe-wheel
mkdir -p "$OUT" "$TABLES"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
STEPS=${*:-tests main bench}
PY=python3
BENCH_SHAPES="--shapes qwen3-30b-a3b qwen3-235b-a22b --tokens 4096 8192 16384"

nvidia-smi -L | tee "$OUT/gpus.txt"
$PY -m pip install -q --no-index --no-deps --target /tmp/cutlass-site .whl/nvidia_cutlass-*.whl || exit 1
export PYTHONPATH=/tmp/cutlass-site
start=$(date +%s)
src_hash=$(find csrc python third_party .whl setup.py pyproject.toml CMakeLists.txt -type f ! -name '*.so' \
             ! -path '*__pycache__*' ! -path '*.egg-info*' | sort | xargs sha1sum | sha1sum)
if [ -n "${PREBUILT_WHEEL:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --force-reinstall "$PREBUILT_WHEEL" > "$OUT/build.log" 2>&1 \
    || { tail -20 "$OUT/build.log"; exit 1; }
  echo "installed the prebuilt $(basename "$PREBUILT_WHEEL") (torch here: $($PY -c 'import torch; print(torch.__version__)'))"
elif [ "${REUSE_BUILD:-0}" = 1 ] && [ "$(cat /tmp/primemoe-built-sources 2>/dev/null)" = "$src_hash" ] \
   && $PY -c "import primemoe._C" 2>/dev/null; then
  echo "build: reusing the earlier install of these sources"
else
  PRIMEMOE_BUILD_JOBS=$(nproc) $PY -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$WHEEL_DIR" . \
    > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  $PY -m pip install -q --no-index --no-deps --force-reinstall "$WHEEL_DIR"/primemoe*.whl >> "$OUT/build.log" 2>&1 \
    || exit 1
  echo "$src_hash" > /tmp/primemoe-built-sources
  echo "build+install: $(( $(date +%s) - start )) s; wheel: $(ls "$WHEEL_DIR")"
fi
export PYTHONPATH=
SO=$($PY -c "import primemoe._C as c; print(c.__file__)")

keep_json() { cp "$TABLES/$1/results.json" "$OUT/$1.json" 2>/dev/null || echo "no $TABLES/$1/results.json"; }

status=0  # a failed test step makes the script exit 1, after the remaining steps
for step in $STEPS; do
  echo "=== $step"
  case $step in
    smoke) timeout 120 $PY scripts/sanitize_case.py 2>&1 | tee "$OUT/smoke.log" | tail -5
           [ "${PIPESTATUS[0]}" = 0 ] || { echo "smoke case failed: stopping"; exit 1; } ;;
    tests) $PY -m pytest tests -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -40
           [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    gputests) $PY -m pytest tests/gpu -q -rs -p no:cacheprovider -m "not multigpu and not slow" 2>&1 | tee "$OUT/pytest.log" \
                | tail -40
              [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    multigpu) $PY -m pytest tests/gpu -q -rs -p no:cacheprovider -m multigpu 2>&1 | tee "$OUT/pytest-multigpu.log" \
                | tail -20
              [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    ep) sms() { $PY -c "import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)"; }
        full_sms=$(sms)
        for pass in ${EP_PASSES:-plain mps}; do
          case $pass in
            plain) log=$OUT/pytest-ep.log ;;
            mps) log=$OUT/pytest-ep-mps.log
                 scripts/mps.sh start || { echo "ep: MPS did not start: no MPS pass"; status=1; continue; }
                 trap 'scripts/mps.sh stop' EXIT
                 trap 'scripts/mps.sh stop; exit 1' INT TERM ;;
            *) echo "ep: unknown pass $pass (plain or mps)"; status=1; continue ;;
          esac
          (
            if [ "$pass" = mps ]; then
              eval "$(scripts/mps.sh env)"
              export PRIMEMOE_TEST_MPS=1 PRIMEMOE_TEST_FULL_SMS="$full_sms" CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
              share=$(sms)
              echo "ep: under MPS at 50% the GPU reports ${share:-?} of its ${full_sms:-?} SMs"
              [ -n "$share" ] && [ -n "$full_sms" ] && [ "$share" -lt "$full_sms" ] \
                || { echo "ep: MPS is not in effect"; exit 1; }
            fi
            # timeout signals pytest's whole process group, the spawned ranks too.
            timeout -k 20 "${EP_TIMEOUT:-270}" $PY -m pytest tests/gpu -q -rs -p no:cacheprovider \
              -m "${EP_MARK:-ep and not slow}" 2>&1 | tee "$log" | tail -30
            rc=${PIPESTATUS[0]}
            case $rc in 124|137) echo "ep: pytest ($pass) still running after ${EP_TIMEOUT:-270} s: killed" ;; esac
            exit "$rc"
          ) || status=1
          if [ "$pass" = mps ]; then
            scripts/mps.sh stop || status=1
            trap - EXIT INT TERM
          fi
        done ;;
    pytest) $PY -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-tests/gpu} 2>&1 | tee "$OUT/pytest-args.log" | tail -40
            [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    main) $PY -m primemoe 2>&1 | tee "$OUT/main.log" ;;
    bench) $PY -m primemoe.bench ${BENCH_ARGS:-$BENCH_SHAPES --ep 1 2} --out "$TABLES/bench" 2>&1 \
             | tee "$OUT/bench.log" | tail -30; keep_json bench ;;
    stages) $PY scripts/stage_times.py --out "$OUT/stages.json" ${STAGES_ARGS:-} 2>&1 | tee "$OUT/stages.log" ;;
    timeline) $PY scripts/ep_timeline.py ${TIMELINE_ARGS:-} > "$OUT/timeline.txt" 2>&1
              grep "==" "$OUT/timeline.txt" ;;
    ncu) skip=2; case " ${NCU_ARGS:-} " in *" --dgrad "*) skip=4 ;; esac  # the launches ncu_engine.py warms up with
         ncu --clock-control none -k regex:grouped_gemm --launch-skip $skip --launch-count 2 \
           --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
           --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
           $PY scripts/ncu_engine.py ${NCU_ARGS:-} > "$OUT/ncu.log" 2>&1
         grep -E "grouped_gemm|Duration|Throughput|Hit Rate|Stall|Warp Cycles Per Issued|Issue Slots|SM Busy|Ipc|Bank" \
           "$OUT/ncu.log" | head -120 ;;
    comm) $PY -m primemoe.bench --comm $BENCH_SHAPES --ep 2 --out "$TABLES/comm" 2>&1 | tee "$OUT/comm.log" | tail -30
          keep_json comm ;;
    commprof) $PY scripts/comm_profile.py --out "$OUT/commprof.json" 2>&1 | tee "$OUT/commprof.log" ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 $PY scripts/sanitize_case.py > "$OUT/sanitize-$tool.log" 2>&1
        rc=$?; echo "$tool rc=$rc $(tail -1 "$OUT/sanitize-$tool.log")"; [ $rc = 0 ] || status=1
      done
      # The forward's GEMMs forced to the claimed order with 192-row tiles, at a small size.
      for tool in racecheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 $PY scripts/sanitize_case.py 600 256 256 4 2 1 1 \
          > "$OUT/sanitize-$tool-merged.log" 2>&1
        rc=$?; echo "$tool, 192-row tiles rc=$rc $(tail -1 "$OUT/sanitize-$tool-merged.log")"; [ $rc = 0 ] || status=1
      done ;;
    sass)
      cuobjdump --dump-resource-usage "$SO" > "$OUT/resource-usage.txt" 2>&1
      cuobjdump --dump-sass "$SO" > "$OUT/sass.txt" 2>&1
      grep -c "LDL\|STL" "$OUT/sass.txt" | sed 's/^/local-memory instructions: /'
      grep -E "Function|REG|STACK" "$OUT/resource-usage.txt" | head -40 ;;
    *) echo "unknown step: $step"; status=1 ;;
  esac
done
exit $status

#!/usr/bin/env bash
# One device call: build primemoe on the GPU machine (no network there: the
# nvidia-cutlass wheel travels in .whl/), run the GPU test suite, the main job and
# the benchmark. Logs and JSON results land in $OUT (default ./gpu-out), the benchmark's tables and plots
# in $TABLES (default /tmp/primemoe-tables) and the wheel in /tmp/primemoe-wheel: a device call returns
# only a few files, and those should be the logs and JSONs. REUSE_BUILD=1 skips the build when
# an earlier call on the same (still warm) machine built these sources.
# PRIMEMOE_GIT_COMMIT=<hash> names the commit in the benchmark JSONs (the copy here has no .git).
#   scripts/gpu_run.sh [smoke|engine|tests|gputests|multigpu|main|bench|bench1|bench2|stages|clocks|ncu|ncu235|ncumerge|comm|commprof|sanitize|probe|gatherbench|layoutcost|tiletrace|sass ...]   (default: tests main bench)
# gputests / multigpu: the GPU suite without / with only the two-GPU tests; bench1 / bench2: the
# benchmark at EP = 1 / EP = 2 only;
# engine: the engine's GPU tests alone, stopping at the first failure;
# smoke: one small forward+backward (stops the run if it fails or hangs); stages: per-stage times of the single-GPU layer
# (scripts/stage_times.py; STAGES_ARGS adds its options, e.g. --row-aligns 64 128 or --tile-orders static claimed);
# clocks: SM clock, power and power-cap state while the GEMMs run back to back vs with gaps (scripts/clock_state.py);
# gatherbench: the row gather against other ways to move its bytes (scripts/gather_bench.cu);
# layoutcost: FC1 and FC2 on the benchmark's row layout against even, rounded-down and 128-padded ones (scripts/layout_cost.py);
# tiletrace: per-tile timelines of FC1 and FC2 at Qwen3-235B T = 8192, 192-row tiles off then on, and FC1's activation jobs (scripts/tile_trace.cu,
# built with the engine's sources and PRIMEMOE_GEMM_TILE_TRACE; TRACE_ARGS adds options, e.g. --shape 30b);
# ncu / ncu235: Nsight Compute sections of the engine's forward GEMMs (scripts/ncu_engine.py) at 30B T = 16384
# / 235B T = 8192; commprof: dispatch/combine region and kernel times on every GPU (scripts/comm_profile.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
TABLES=${TABLES:-/tmp/primemoe-tables}
WHEEL_DIR=/tmp/primemoe-wheel
mkdir -p "$OUT" "$TABLES"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
STEPS=${*:-tests main bench}
PY=python3

nvidia-smi -L | tee "$OUT/gpus.txt"
$PY -m pip install -q --no-index --no-deps --target /tmp/cutlass-site .whl/nvidia_cutlass-*.whl || exit 1
export PYTHONPATH=/tmp/cutlass-site
start=$(date +%s)
src_hash=$(find csrc python third_party .whl setup.py pyproject.toml CMakeLists.txt -type f ! -name '*.so' \
             ! -path '*__pycache__*' ! -path '*.egg-info*' | sort | xargs sha1sum | sha1sum)
if [ "${REUSE_BUILD:-0}" = 1 ] && [ "$(cat /tmp/primemoe-built-sources 2>/dev/null)" = "$src_hash" ] \
   && $PY -c "import primemoe._C" 2>/dev/null; then
  echo "build: reusing the earlier install of these sources"
else
  PRIMEMOE_BUILD_JOBS=$(nproc) $PY -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$WHEEL_DIR" . \
    > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  $PY -m pip install -q --no-index --no-deps --force-reinstall "$WHEEL_DIR"/primemoe-*.whl >> "$OUT/build.log" 2>&1 || exit 1
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
    tests) $PY -m pytest tests -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -40
           [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    engine) timeout 300 $PY -m pytest tests/gpu/test_engine_gpu.py -x -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest-engine.log" | tail -5
            [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    smoke) timeout 120 $PY scripts/sanitize_case.py 2>&1 | tee "$OUT/smoke.log" | tail -5
           [ "${PIPESTATUS[0]}" = 0 ] || { echo "smoke case failed: stopping"; exit 1; } ;;
    multigpu) $PY -m pytest tests/gpu -q -rs -p no:cacheprovider -m multigpu 2>&1 | tee "$OUT/pytest-multigpu.log" | tail -20
              [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    bench2) $PY -m primemoe.bench --shapes qwen3-30b-a3b qwen3-235b-a22b --tokens 4096 8192 16384 --ep 2 \
             --out "$TABLES/bench2" 2>&1 | tee "$OUT/bench2.log" | tail -30; keep_json bench2 ;;
    gputests) $PY -m pytest tests/gpu -q -rs -p no:cacheprovider -m "not multigpu" 2>&1 | tee "$OUT/pytest.log" | tail -40
              [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    bench1) $PY -m primemoe.bench --shapes qwen3-30b-a3b qwen3-235b-a22b --tokens 4096 8192 16384 --ep 1 \
             --out "$TABLES/bench" 2>&1 | tee "$OUT/bench.log" | tail -30; keep_json bench ;;
    stages) $PY scripts/stage_times.py --out "$OUT/stages.json" ${STAGES_ARGS:-} 2>&1 | tee "$OUT/stages.log" ;;
    main) $PY -m primemoe 2>&1 | tee "$OUT/main.log" ;;
    clocks) OUT=$OUT $PY scripts/clock_state.py 2>&1 | tee "$OUT/clock_state.log" | tail -32 ;;
    bench) $PY -m primemoe.bench --shapes qwen3-30b-a3b qwen3-235b-a22b --tokens 4096 8192 16384 --ep 1 2 \
             --out "$TABLES/bench" 2>&1 | tee "$OUT/bench.log" | tail -30; keep_json bench ;;
    comm) $PY -m primemoe.bench --comm --shapes qwen3-30b-a3b qwen3-235b-a22b --tokens 4096 8192 16384 --ep 2 \
            --out "$TABLES/comm" 2>&1 | tee "$OUT/comm.log" | tail -30; keep_json comm ;;
    commprof) $PY scripts/comm_profile.py --out "$OUT/commprof.json" 2>&1 | tee "$OUT/commprof.log" ;;
    ncu|ncu235)  # ncu235: Qwen3-235B-A22B at T = 8192
      shape_args=""; [ "$step" = ncu235 ] && shape_args="--shape qwen3-235b-a22b --tokens 8192"
      ncu --clock-control none -k regex:grouped_gemm_kernel --launch-skip 3 --launch-count 3 \
           --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
           --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
           $PY scripts/ncu_engine.py $shape_args > "$OUT/$step.log" 2>&1
         grep -E "grouped_gemm_kernel|Duration|Throughput|Hit Rate|Stall|Warp Cycles Per Issued|Issue Slots|SM Busy|Ipc|Bank" "$OUT/$step.log" | head -120 ;;
    ncumerge)  # FC1 unmerged then merged on merge_layout_probe.py's 3f1m layout (NCU_LAYOUT), Qwen3-235B-A22B
      (cd scripts && ncu --clock-control none -k regex:grouped_gemm_kernel --launch-skip 2 --launch-count 2 \
           --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
           --section WarpStateStats --section SchedulerStats --section Occupancy \
           --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
           $PY merge_layout_probe.py --shapes qwen3-235b-a22b:8192 --once "${NCU_LAYOUT:-3f1m}") > "$OUT/$step.log" 2>&1
      grep -E "grouped_gemm_kernel|Duration|Throughput|Hit Rate|Stall|Warp Cycles Per Issued|Issue Slots|dram__|lts__t_sector|hmma" "$OUT/$step.log" | head -80 ;;
    sanitize)  # then racecheck and synccheck with FC1's and FC2's 192-row tiles forced (claimed order; ~300 rows
               # per expert)
      for tool in memcheck racecheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 $PY scripts/sanitize_case.py > "$OUT/sanitize-$tool.log" 2>&1
        echo "$tool rc=$? $(tail -1 "$OUT/sanitize-$tool.log")"
      done
      for tool in racecheck synccheck; do
        PRIMEMOE_GEMM_MERGE_TAILS=1 PRIMEMOE_GEMM_TILE_ORDER=claimed compute-sanitizer --tool $tool --error-exitcode 9 \
          $PY scripts/sanitize_case.py 600 256 256 4 2 > "$OUT/sanitize-$tool-merged.log" 2>&1
        echo "$tool, merged tails rc=$? $(tail -1 "$OUT/sanitize-$tool-merged.log")"
      done ;;
    gatherbench)  # the row gather against the memory ceilings (scripts/gather_bench.cu, no torch)
      nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc -o /tmp/gather_bench scripts/gather_bench.cu \
        && /tmp/gather_bench 2>&1 | tee "$OUT/gather_bench.log" || status=1 ;;
    layoutcost) (cd scripts && $PY layout_cost.py --out "$OUT/layout_cost.json") 2>&1 | tee "$OUT/layout_cost.log" ;;
    tiletrace)
      flags="-O3 -std=c++20 -DNDEBUG --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -DPRIMEMOE_HAVE_SM90A
             -DPRIMEMOE_GEMM_TILE_TRACE -I csrc -I /tmp/cutlass-site/cutlass_library/source/include"
      rm -rf /tmp/tile_trace_obj && mkdir -p /tmp/tile_trace_obj
      for f in scripts/tile_trace.cu csrc/gemm/grouped_gemm.cu csrc/gemm/instantiations/*.cu; do
        nvcc $flags -c "$f" -o "/tmp/tile_trace_obj/$(basename "$f" .cu).o" &
      done
      wait
      if nvcc -gencode=arch=compute_90a,code=sm_90a -o /tmp/tile_trace /tmp/tile_trace_obj/*.o; then
        (rc=0
         for g in fc1 fc2; do
           /tmp/tile_trace --gemm $g --merge 0 1 --csv "$OUT/tile_trace_$g.csv" ${TRACE_ARGS:-} || rc=1
         done
         exit $rc) 2>&1 | tee "$OUT/tile_trace.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      else
        status=1
      fi ;;
    probe)  # racecheck on the exchange forms of scripts/racecheck_probe.cu
      nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -o /tmp/racecheck_probe scripts/racecheck_probe.cu || status=1
      for m in 0 1 2 4 6 7 8 15 16 40; do
        timeout 120 compute-sanitizer --tool racecheck /tmp/racecheck_probe $m 2>&1 | grep -E "^mode|SUMMARY" | tr '\n' ' '; echo
      done | tee "$OUT/racecheck-probe.log" ;;
    sass)
      cuobjdump --dump-resource-usage "$SO" > "$OUT/resource-usage.txt" 2>&1
      cuobjdump --dump-sass "$SO" > "$OUT/sass.txt" 2>&1
      grep -c "LDL\|STL" "$OUT/sass.txt" | sed 's/^/local-memory instructions: /'
      grep -E "Function|REG|STACK" "$OUT/resource-usage.txt" | head -40 ;;
  esac
done
exit $status

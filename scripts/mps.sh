#!/usr/bin/env bash
# The CUDA MPS control daemon, for running several expert-parallel ranks on one GPU concurrently (DESIGN.md
# section 5; without MPS their kernels time-slice).
#
#   scripts/mps.sh start    start the daemon (nvidia-cuda-mps-control -d; needs root) unless ours already runs
#   scripts/mps.sh stop     stop it (echo quit | nvidia-cuda-mps-control) unless it is not running
#   scripts/mps.sh status   say whether it runs (exit 0 if it does)
#   scripts/mps.sh env      print the exports a client needs: eval "$(scripts/mps.sh env)"
#
# start and stop are idempotent and say what they did. The pipe and log directories are $PRIMEMOE_MPS_DIR/pipe and
# $PRIMEMOE_MPS_DIR/log (default /tmp/primemoe-mps); a client reaches this daemon only with the same
# CUDA_MPS_PIPE_DIRECTORY (else it runs without MPS). A client's share of the SMs: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
# in its environment before it creates its CUDA context (50 makes an H200 report 66 SMs to it).
set -uo pipefail
DIR=${PRIMEMOE_MPS_DIR:-/tmp/primemoe-mps}
export CUDA_MPS_PIPE_DIRECTORY=$DIR/pipe CUDA_MPS_LOG_DIRECTORY=$DIR/log

# The process name (/proc/PID/comm) keeps 15 characters, so match the command line.
mps_controls() { pgrep -f '(^|/)nvidia-cuda-mps-control( |$)' 2>/dev/null; }

# Control daemons whose pipe directory is ours (read from their environment).
our_daemons() {
  local pid
  for pid in $(mps_controls); do
    tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY" \
      && echo "$pid"
  done
}

other_daemons() {
  local ours pid
  ours=" $(our_daemons | tr '\n' ' ') "
  for pid in $(mps_controls); do
    [[ $ours == *" $pid "* ]] || echo "$pid"
  done
}

wait_for() {  # wait_for running|stopped SECONDS
  local i
  for ((i = 0; i < $2 * 5; i++)); do
    if [ -n "$(our_daemons)" ]; then [ "$1" = running ] && return 0; else [ "$1" = stopped ] && return 0; fi
    sleep 0.2
  done
  return 1
}

case ${1:-} in
  start)
    pids=$(our_daemons)
    if [ -n "$pids" ]; then
      echo "mps: already running (control daemon pid $(echo $pids); pipe $CUDA_MPS_PIPE_DIRECTORY)"
      exit 0
    fi
    others=$(other_daemons)
    [ -z "$others" ] || echo "mps: warning: other MPS control daemons run (pid $(echo $others))," \
                             "with another pipe directory"
    command -v nvidia-cuda-mps-control > /dev/null || { echo "mps: nvidia-cuda-mps-control not found"; exit 1; }
    [ "$(id -u)" = 0 ] || echo "mps: warning: not root (uid $(id -u)); the daemon usually needs root"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "mps: nvidia-cuda-mps-control -d failed (rc $?)"; exit 1; }
    if ! wait_for running 10; then
      echo "mps: the control daemon did not come up; $CUDA_MPS_LOG_DIRECTORY/control.log:"
      tail -20 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null
      exit 1
    fi
    echo "mps: started the control daemon (pid $(echo $(our_daemons));" \
         "CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_LOG_DIRECTORY)" ;;
  stop)
    pids=$(our_daemons)
    if [ -z "$pids" ]; then
      echo "mps: not running (pipe $CUDA_MPS_PIPE_DIRECTORY): nothing to stop"
      exit 0
    fi
    echo quit | timeout 30 nvidia-cuda-mps-control
    if wait_for stopped 30; then
      echo "mps: stopped the control daemon (pid $(echo $pids))"
    else
      # The daemon this script started, by its pid (quit waits for its clients; a hung client keeps it).
      echo "mps: the control daemon (pid $(echo $pids)) is still running 30 s after quit: killing it"
      kill $pids 2>/dev/null
      wait_for stopped 10 || { echo "mps: could not stop pid $(echo $pids)"; exit 1; }
    fi ;;
  status)
    pids=$(our_daemons)
    if [ -n "$pids" ]; then
      echo "mps: running (control daemon pid $(echo $pids); pipe $CUDA_MPS_PIPE_DIRECTORY)"
    else
      echo "mps: not running (pipe $CUDA_MPS_PIPE_DIRECTORY)"; exit 1
    fi ;;
  env)
    echo "export CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_LOG_DIRECTORY" ;;
  *)
    echo "usage: $0 start|stop|status|env"; exit 2 ;;
esac

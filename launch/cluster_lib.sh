# Shell functions for scripts that start `duet serve` (alone or under
# mpirun) in the background and stop it again. Source it; it sets no options.
#
#   serve_wait_ready PORTS_FILE PID LOG   waits until the server printed its
#       `http listening on` line into PORTS_FILE (its stdout); fails with the
#       log's tail if PID exits first or nothing comes within 60 s.
#   serve_stop PID   ends the server started as PID: under mpirun, SIGTERM to
#       rank 0 (the coordinator, mpirun's `duet serve` child), which drains
#       (running requests finish, --drain-timeout) and ends every rank in
#       order, mpirun following; otherwise SIGTERM to PID. Waits.

serve_wait_ready() {
  local ports=$1 pid=$2 log=$3 _
  for _ in $(seq 600); do
    grep -q '^http listening' "$ports" 2>/dev/null && return 0
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 20 "$log" >&2
      echo "the server exited before it was ready (log: $log)" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "the server did not come up within 60 s (log: $log)" >&2
  return 1
}

serve_stop() {
  local pid=$1 rank0
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  rank0=$(pgrep -P "$pid" -f "duet serve" | head -n 1 || true)
  kill -TERM "${rank0:-$pid}" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

#!/usr/bin/env bash
# Starts a Duet cluster and keeps it in the foreground until Ctrl-C:
#   mpirun --enable-recovery -np 1+P+D duet serve --prefill P --decode D [ARGS...]
# with the default model: the coordinator on rank 0, then P prefill and D
# decode instances of one rank each (of T ranks each with `--tp T`,
# `--prefill-tp T`, `--decode-tp T` among the arguments). Both fronts take free ports; the
# coordinator's `rpc listening on HOST:PORT` and `http listening on HOST:PORT`
# lines are printed on stdout once every instance is ready, everything else
# (every rank's log) goes to stderr.
#
# Ctrl-C or SIGTERM is passed on to rank 0 alone: the coordinator drains (new
# requests get 503, running ones finish, for up to --drain-timeout seconds,
# default 30), then tells every instance to shut down, so every rank ends in
# order and mpirun exits 0. A second Ctrl-C cuts the drain short (what still
# runs ends `unavailable`); a third signals mpirun, which kills every rank.
# (mpirun signalled itself reports a failure, exit 1, and forwards SIGTERM to
# the ranks only after its SIGKILL delay; mpirun runs in a session of its own
# so that the terminal's Ctrl-C does not reach it.) That delay,
# odls_base_sigkill_timeout, is set to the drain timeout plus 10 s, so that a
# SIGTERM sent to mpirun directly still lets the cluster drain (README:
# stopping a cluster).
#
# Replacements (clusters on the CPU): the coordinator opens a join port
# with a cluster key of this run's own, and while the cluster serves this
# script keeps its P + D instances: when /metrics shows fewer up than that,
# it starts a replacement on this host (with a hostfile: on the lost
# instance's host, by an mpirun of its own; an instance of T ranks always
# by `mpirun -np T`) that joins the running cluster (`duet serve --join`,
# README: joining a running cluster) and says how long the loss took to
# mend. In a disaggregated cluster the replacement takes the role that has
# fewer instances up than the cluster started with (prefill first), and that
# role's TP. DUET_REPLACE=0 turns this off.
#
# Counts that follow the load (DUET_MAX_EXTRA=N, with `--rebalance auto
# --slo ...` among the arguments, colocated clusters): the coordinator publishes
# how many instances its load wants (duet_cluster_instances_wanted: one more
# while a latency target is missed, one fewer while every one is under half
# its target or nothing runs), and this script starts joined instances up
# to P + D + N to match, and asks the newest one it started to leave
# (SIGTERM: it drains, then goes) when the load wants fewer, never going
# below P + D.
#
# Usage: launch/local.sh P D [duet serve arguments...]
#   e.g. launch/local.sh 1 1
#        launch/local.sh 1 2 --mode colocated --kv-cache-mem 512MiB
#        launch/local.sh 1 1 --decode-tp 3       # 5 ranks: the decode instance on 3
# Environment:
#   DUET_SKIP_SETUP=1   do not run launch/setup.sh (packages, model, test venv)
#   DUET_SKIP_BUILD=1   do not run launch/build.sh (it only rebuilds what changed)
#   DUET_BUILD_DIR      the build (default build/); DUET_BINARY the duet binary
#                       (default: the build's tools/duet); DUET_MODEL the GGUF
#                       file (default: the one launch/setup.sh fetches into models/)
#   DUET_THREADS        compute threads per rank (default 1)
#   DUET_HOST           address both fronts bind (default 127.0.0.1; 0.0.0.0: every one)
#   DUET_HTTP_PORT, DUET_RPC_PORT   fixed ports (default 0: free ones)
#   DUET_START_TIMEOUT  seconds to wait for the cluster to listen (default 600)
#   DUET_MPIRUN         mpirun (default: mpirun on the PATH)
#   DUET_MPIRUN_ARGS    more mpirun options, split on spaces
#   DUET_HOSTFILE       an Open MPI hostfile (launch/hostfile.sh sets it); without
#                       one every rank runs here, oversubscribing the cores
#   DUET_REPLACE        1 (default): replace lost instances (CPU); 0: do not
#   DUET_JOIN_PORT      the coordinator's join port for replacements and for lost ranks
#                       that wake and rejoin (default: a free port picked at start; with
#                       a hostfile 0, any free one, which the ranks cannot rejoin on)
#   DUET_MAX_EXTRA      joined instances beyond P + D the load may ask for (default 0)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { printf 'duet-cluster: %s\n' "$*" >&2; }
usage() { sed -n 's/^# \{0,1\}//; /^Usage:/,/^Environment:/p' "${BASH_SOURCE[0]}" | sed '$d' >&2; }

if [ $# -lt 2 ] || ! [[ $1 =~ ^[0-9]+$ && $2 =~ ^[0-9]+$ ]] || [ $(($1 + $2)) -eq 0 ]; then
  usage
  exit 2
fi
prefill=$1
decode=$2
shift 2
# Tensor parallelism: an instance takes --tp ranks (--prefill-tp and
# --decode-tp for one kind), so mpirun must start that many.
tp=1 prefill_tp='' decode_tp='' drain_timeout=30 mode=disaggregated device=cpu
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --mode) mode=${args[i + 1]:-} ;;
    --mode=*) mode=${args[i]#*=} ;;
    --drain-timeout) drain_timeout=${args[i + 1]:-30} ;;
    --drain-timeout=*) drain_timeout=${args[i]#*=} ;;
    --tp) tp=${args[i + 1]:-1} ;;
    --tp=*) tp=${args[i]#*=} ;;
    --prefill-tp) prefill_tp=${args[i + 1]:-1} ;;
    --prefill-tp=*) prefill_tp=${args[i]#*=} ;;
    --decode-tp) decode_tp=${args[i + 1]:-1} ;;
    --decode-tp=*) decode_tp=${args[i]#*=} ;;
    --device) device=${args[i + 1]:-cpu} ;;
    --device=*) device=${args[i]#*=} ;;
  esac
done
ranks=$((1 + prefill * ${prefill_tp:-$tp} + decode * ${decode_tp:-$tp}))
# A replacement's arguments: the cluster's, less its shape (the replacement
# is one instance of its own role and TP).
member_args=()
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --mode | --tp | --prefill-tp | --decode-tp | --ep | --prefill-ep | --decode-ep) i=$((i + 1)) ;;
    --mode=* | --tp=* | --prefill-tp=* | --decode-tp=* | --ep=* | --prefill-ep=* | --decode-ep=*) ;;
    *) member_args+=("${args[i]}") ;;
  esac
done

[ "${DUET_SKIP_SETUP:-0}" = 1 ] || "$root/launch/setup.sh"
[ "${DUET_SKIP_BUILD:-0}" = 1 ] || "$root/launch/build.sh" >&2
duet=${DUET_BINARY:-${DUET_BUILD_DIR:-$root/build}/tools/duet}
model=${DUET_MODEL:-${DUET_MODEL_DIR:-$root/models}/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -x "$duet" ] || { say "no $duet: build first (launch/build.sh) or unset DUET_SKIP_BUILD"; exit 1; }
[ -f "$model" ] || { say "no model $model: run launch/setup.sh or set DUET_MODEL"; exit 1; }

# --enable-recovery: one rank's death does not end the job; the coordinator
# counts its instance lost and re-runs its requests (docs/FAILURES.md).
# odls_base_sigkill_timeout: signalled, mpirun sends the ranks SIGCONT, then
# SIGTERM this many seconds later, then SIGKILL as many again later: longer
# than the drain, so that the coordinator's drain and shutdown end first.
whole_seconds=${drain_timeout%.*}
[ "$whole_seconds" = "$drain_timeout" ] || whole_seconds=$((${whole_seconds:-0} + 1))
sigkill_timeout=$((whole_seconds + 10))
mpirun_args=(--enable-recovery --bind-to none -x OMP_NUM_THREADS=1 -x OPENBLAS_NUM_THREADS=1
  --mca odls_base_sigkill_timeout "$sigkill_timeout")
[ "$(id -u)" -ne 0 ] || mpirun_args+=(--allow-run-as-root)
if [ -n "${DUET_HOSTFILE:-}" ]; then
  mpirun_args+=(--hostfile "$DUET_HOSTFILE")
else
  mpirun_args+=(--oversubscribe)
fi
# shellcheck disable=SC2206 # options split on spaces, as documented
mpirun_args+=(${DUET_MPIRUN_ARGS:-})

work=$(mktemp -d)
mpirun_pid=""
stopping=0
all_replacements=()  # every replacement's pid
# shellcheck disable=SC2317 # called from the trap
cleanup() {
  if [ -n "$mpirun_pid" ] && kill -0 "$mpirun_pid" 2>/dev/null; then
    kill -TERM "$mpirun_pid" 2>/dev/null || true
    wait "$mpirun_pid" 2>/dev/null || true
  fi
  # Replacements leave when the coordinator shuts down; one still here now
  # (its coordinator gone) is told to go, and leaves once its link ends.
  local pid
  for pid in "${all_replacements[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# The rank 0 process: the child of mpirun whose environment says rank 0 (it
# is mpirun's child when rank 0 runs on this host, as it always does here).
# shellcheck disable=SC2317 # called from the trap
rank0_pid() {
  local child
  # shellcheck disable=SC2013 # the file holds pids separated by spaces
  for child in $(cat /proc/"$mpirun_pid"/task/*/children 2>/dev/null); do
    # grep reads the file itself: `tr | grep -q` under pipefail fails
    # whenever grep finds the line and exits before tr has written the rest.
    if grep -qzxF OMPI_COMM_WORLD_RANK=0 "/proc/$child/environ" 2>/dev/null; then
      echo "$child"
      return 0
    fi
  done
  return 1
}

# shellcheck disable=SC2317 # called from the trap
stop() {
  local coordinator
  stopping=$((stopping + 1))
  if [ "$stopping" -eq 1 ] && coordinator=$(rank0_pid); then
    say "stopping: SIGTERM to the coordinator (rank 0, pid $coordinator): draining for up to ${drain_timeout} s; Ctrl-C again cuts it short"
    kill -TERM "$coordinator" 2>/dev/null || true
  elif [ "$stopping" -eq 2 ] && coordinator=$(rank0_pid); then
    say "stopping: SIGTERM again to the coordinator: what still runs ends now; Ctrl-C again kills every rank"
    kill -TERM "$coordinator" 2>/dev/null || true
  else
    say "stopping: SIGTERM to mpirun, which kills every rank (SIGTERM in ${sigkill_timeout} s, SIGKILL after)"
    kill -TERM "$mpirun_pid" 2>/dev/null || true
  fi
}

# Replacements need joins: on the CPU for a prefill or decode instance (its
# KV links are TCP) and for one of several ranks (its collectives).
replace=0
join_args=()
if [ "${DUET_REPLACE:-1}" = 1 ]; then
  if [ "$device" = cpu ] ||
    { [ "$mode" = colocated ] && [ "${prefill_tp:-$tp}" = 1 ] && [ "${decode_tp:-$tp}" = 1 ]; }; then
    replace=1
    (umask 077 && head -c 32 /dev/urandom | base64 >"$work/cluster.key")
    # A known number (not 0): the ranks read it too, to rejoin after a loss
    # they live through. Picked here only when rank 0 runs here (no hostfile).
    join_port=${DUET_JOIN_PORT:-0}
    if [ -z "${DUET_JOIN_PORT:-}" ] && [ -z "${DUET_HOSTFILE:-}" ]; then
      join_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])' 2>/dev/null || echo 0)
    fi
    join_args=(--join-port "$join_port" --cluster-key "$work/cluster.key")
  else
    say "lost instances will not be replaced: a joined prefill, decode or tensor-parallel instance runs on the CPU"
  fi
fi

command=("${DUET_MPIRUN:-mpirun}" "${mpirun_args[@]}" -np "$ranks"
  "$duet" serve --model "$model" --prefill "$prefill" --decode "$decode"
  --threads "${DUET_THREADS:-1}" --host "${DUET_HOST:-127.0.0.1}"
  --rpc-port "${DUET_RPC_PORT:-0}" --http-port "${DUET_HTTP_PORT:-0}" "${join_args[@]}" "$@")
say "starting: ${command[*]}"
# stdout (rank 0's listening lines) into a file read below; stderr to ours,
# noting rank 0's exit code from its last line on the way.
note_rank0_exit() {
  local line
  while IFS= read -r line; do
    printf '%s\n' "$line" >&2
    if [[ $line =~ "rank 0: exiting with code "([0-9]+) ]]; then
      echo "${BASH_REMATCH[1]}" >"$work/rank0_exit"
    elif [[ $line =~ "instances may join on port "([0-9]+) ]]; then
      echo "${BASH_REMATCH[1]}" >"$work/join_port"
    fi
  done
}
: >"$work/stdout"
setsid "${command[@]}" </dev/null >>"$work/stdout" 2> >(note_rank0_exit) &
mpirun_pid=$!
trap stop INT TERM

deadline=$((SECONDS + ${DUET_START_TIMEOUT:-600}))
until grep -q '^http listening on ' "$work/stdout"; do
  if ! kill -0 "$mpirun_pid" 2>/dev/null; then
    code=0
    wait "$mpirun_pid" || code=$?
    mpirun_pid=""
    say "the cluster exited with code $code before it listened"
    exit $((code == 0 ? 1 : code))
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    say "the cluster did not listen within ${DUET_START_TIMEOUT:-600} s"
    exit 1
  fi
  sleep 0.2
done
if [ "$stopping" -eq 0 ]; then
  grep -E '^(rpc|http) listening on ' "$work/stdout"
  rpc=$(sed -n 's/^rpc listening on //p' "$work/stdout")
  http=$(sed -n 's/^http listening on //p' "$work/stdout")
  say "ready: $ranks ranks (the coordinator, then --prefill $prefill --decode $decode instances)"
  say "  HTTP (OpenAI-compatible): curl http://$http/v1/completions -d '{\"prompt\":\"Hello\",\"max_tokens\":16}'"
  say "  Cap'n Proto:              $(dirname "$duet")/duet-client --connect $rpc generate --prompt Hello -n 16"
  say "Ctrl-C drains and stops every rank (again: at once)"
fi

# The host of each rank of the job: this one, or with a hostfile the one
# whose slot it takes (ranks fill the slots in hostfile order, --map-by slot).
rank_host() {
  local rank=$1 host slots line
  [ -n "${DUET_HOSTFILE:-}" ] || { echo localhost; return; }
  while read -r line; do
    line=${line%%#*}
    [ -n "${line// /}" ] || continue
    host=${line%% *}
    slots=1
    [[ $line =~ slots=([0-9]+) ]] && slots=${BASH_REMATCH[1]}
    if [ "$rank" -lt "$slots" ]; then
      echo "$host"
      return
    fi
    rank=$((rank - slots))
  done <"$DUET_HOSTFILE"
  echo localhost
}

# Keeps P + D instances up (replace=1): a replacement for each one missing,
# on the host the lost one ran on, joining through the coordinator's join
# port; its log goes to stderr. Called every half second while the cluster serves.
replacements=0
served=0  # replacements that said they serve
declare -A starting=()  # pid -> "host when-the-need-was-seen log-file loss|load role"
lost_since=""
leaving=""  # the joined instance asked to leave, until it exits
keep_counts() {
  [ "$replace" = 1 ] && [ "$stopping" -eq 0 ] && [ -s "$work/join_port" ] || return 0
  local metrics up joined pid host lost_at log n_starting=0
  metrics=$(curl -s --max-time 2 "http://$http/metrics") || return 0
  up=$(awk '/^duet_instance_up\{/ { n += $NF } END { print n + 0 }' <<<"$metrics")
  joined=$(awk '/^duet_instances_joined_total / { print $2 + 0 }' <<<"$metrics")
  local why role up_prefill starting_prefill=0
  up_prefill=$(awk '/^duet_instance_up\{/ && /role="prefill"/ { n += $NF } END { print n + 0 }' <<<"$metrics")
  for pid in "${!starting[@]}"; do
    read -r host lost_at log why role <<<"${starting[$pid]}"
    local what=replacement since="the loss was seen"
    [ "$why" = load ] && what="joined instance" since="the load asked for it"
    if ! kill -0 "$pid" 2>/dev/null; then
      say "$what (pid $pid, $host) exited before it served"
      unset "starting[$pid]"
    elif grep -q "joined): serving" "$log" 2>/dev/null; then
      say "$what (pid $pid, $host) serves: $((SECONDS - lost_at)) s after $since"
      unset "starting[$pid]"
      served=$((served + 1))
    else
      n_starting=$((n_starting + 1))
      [ "$role" != prefill ] || starting_prefill=$((starting_prefill + 1))
    fi
  done
  # A replacement that serves but that the coordinator has not counted yet
  # (its join still being applied) is not missing.
  [ "${joined:-0}" -ge "$served" ] || n_starting=$((n_starting + served - ${joined:-0}))
  local want=$((prefill + decode)) wanted
  wanted=$(awk '/^duet_cluster_instances_wanted / { print int($2) }' <<<"$metrics")
  if [ "${DUET_MAX_EXTRA:-0}" -gt 0 ] && [ "$mode" = colocated ] && [ -n "$wanted" ] &&
    [ "$wanted" -gt "$want" ]; then
    want=$((wanted < want + DUET_MAX_EXTRA ? wanted : want + DUET_MAX_EXTRA))
  fi
  [ -z "$leaving" ] || kill -0 "$leaving" 2>/dev/null || leaving=""
  if [ "$up" -gt "$want" ] && [ -z "$leaving" ] && [ "${#starting[@]}" -eq 0 ] &&
    [ "${DUET_MAX_EXTRA:-0}" -gt 0 ]; then
    # The load wants fewer: the newest joined instance still running leaves.
    local i
    for ((i = ${#all_replacements[@]} - 1; i >= 0; i--)); do
      pid=${all_replacements[i]}
      kill -0 "$pid" 2>/dev/null || continue
      say "the load wants $want instances ($up up): joined instance (pid $pid) asked to leave"
      kill -TERM "$pid" 2>/dev/null || true
      leaving=$pid
      break
    done
  fi
  if [ "$up" -ge "$want" ]; then
    lost_since=""
    return 0
  fi
  [ -n "$lost_since" ] || lost_since=$SECONDS
  while [ $((up + n_starting)) -lt "$want" ]; do
    # The lost instance's host: the first down one's leader rank in the job.
    local leader
    leader=$(awk -F'"' '/^duet_instance_up\{/ && / 0$/ { print $6; exit }' <<<"$metrics")
    host=localhost
    if [ -n "$leader" ] && [ "$leader" -ge 0 ] 2>/dev/null && [ "$leader" -lt "$ranks" ]; then
      host=$(rank_host "$leader")
    fi
    # Its role: a disaggregated cluster's prefill side first, while it has
    # fewer up (or starting) than the cluster started with; and its TP.
    role=both
    local member_tp=$tp
    if [ "$mode" != colocated ]; then
      role=decode member_tp=${decode_tp:-$tp}
      if [ $((up_prefill + starting_prefill)) -lt "$prefill" ]; then
        role=prefill member_tp=${prefill_tp:-$tp}
        starting_prefill=$((starting_prefill + 1))
      fi
    fi
    replacements=$((replacements + 1))
    local join_host=127.0.0.1
    [ "$host" = localhost ] || join_host=$(rank_host 0)
    log=$work/replacement-$replacements.log
    local member=("$duet" serve --model "$model" --threads "${DUET_THREADS:-1}" --role "$role"
      --tp "$member_tp" --join "$join_host:$(cat "$work/join_port")"
      --cluster-key "$work/cluster.key" "${member_args[@]}")
    local replacement=("${member[@]}")
    if [ "$host" != localhost ] || [ "$member_tp" -gt 1 ]; then
      # With a hostfile, always a host of it (this one for a lost member),
      # with a slot a rank. Not --enable-recovery: a group whose leader
      # leaves (exit code 1, when lost) must end its followers.
      local on=() rank_args=() arg
      if [ -n "${DUET_HOSTFILE:-}" ]; then
        [ "$host" != localhost ] || host=$(rank_host 0)
        on=(--host "$host:$member_tp")
      fi
      for arg in "${mpirun_args[@]}"; do
        [ "$arg" = --enable-recovery ] || rank_args+=("$arg")
      done
      replacement=("${DUET_MPIRUN:-mpirun}" "${rank_args[@]}" "${on[@]}" -np "$member_tp"
        "${member[@]}")
    fi
    : >"$log"
    # Its output to a file (read above) and, marked, to stderr.
    "${replacement[@]}" </dev/null > >(tee -a "$log" | sed -u "s/^/[replacement] /" >&2) 2>&1 &
    pid=$!
    all_replacements+=("$pid")
    if [ $((up + n_starting)) -ge $((prefill + decode)) ]; then
      starting[$pid]="$host $lost_since $log load $role"
      say "the load wants $want instances ($up up): joined instance $replacements (pid $pid) starting on $host"
    else
      starting[$pid]="$host $lost_since $log loss $role"
      say "an instance is down ($up of $want up): replacement $replacements ($role, pid $pid) starting on $host"
    fi
    n_starting=$((n_starting + 1))
  done
}

# Until mpirun exits. After a rank was lost, mpirun can outlive the ranks: it
# waits for a lost host's daemon that never answers, or runs its kill delay
# (odls_base_sigkill_timeout, twice) for the lost rank (docs/FAILURES.md). So
# once rank 0 has said its exit code, mpirun gets ${linger} s more, then its
# process group is killed and rank 0's code is the cluster's.
linger=10
rank0_done_at=""
while kill -0 "$mpirun_pid" 2>/dev/null; do
  if [ -z "$rank0_done_at" ] && [ -s "$work/rank0_exit" ]; then
    rank0_done_at=$SECONDS
  fi
  if [ -n "$rank0_done_at" ] && [ $((SECONDS - rank0_done_at)) -ge "$linger" ]; then
    say "mpirun outlived rank 0 by ${linger} s (it waits on ranks lost earlier): ending it"
    kill -KILL -- "-$mpirun_pid" 2>/dev/null || kill -KILL "$mpirun_pid" 2>/dev/null || true
    wait "$mpirun_pid" 2>/dev/null || true
    mpirun_pid=""
    code=$(cat "$work/rank0_exit")
    say "the cluster exited with code $code (rank 0's)"
    exit "$code"
  fi
  keep_counts "$@"
  sleep 0.5
done
code=0
wait "$mpirun_pid" || code=$?
mpirun_pid=""
say "the cluster exited with code $code"
exit "$code"

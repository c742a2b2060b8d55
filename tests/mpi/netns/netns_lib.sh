# shellcheck shell=bash
# Hosts that are network namespaces on this machine, for MPI runs over a real
# network interface: sourced by netns_serve_test.sh and
# bench/kv_transfer_netns.sh. A "switch" namespace holds a bridge; every host
# is a namespace of its own with one veth (duet0) on that bridge, addresses
# 10.77.0.1, 10.77.0.2, ... in host order on 10.77.0.0/24:
#
#   netns_preflight || ...         root and iproute2? (77: not permitted)
#   netns_up [PREFIX [HOST...]]    the switch and the hosts (default a b c);
#                                  removes what killed runs left behind first
#   netns_on_host ARRAY HOST       ARRAY=(the command prefix that runs a
#                                  command on HOST, under HOST's own host name)
#   netns_mpirun_args ARRAY        += mpirun's options that reach the hosts
#                                  through netns_agent.sh instead of ssh
#   netns_mpi_tcp_args ARRAY       += MPI over TCP on the subnet only
#   netns_hostfile FILE [SLOTS]    an Open MPI hostfile of the hosts' addresses
#   netns_start_cluster DUET MODEL HOSTFILE OUT LOG P D [ARGS...]
#                                  launch/hostfile.sh from the first host, in
#                                  the background (NETNS_CLUSTER: its pid)
#   netns_down                     kills what runs in the namespaces, removes them
#
# Open MPI takes processes with one host name for one node (and joins them
# over shared memory), hence a UTS namespace per host (netns_agent.sh).
# Namespaces are named PREFIX-switch and PREFIX-HOST, PREFIX by default
# duetnet<this shell's pid>: concurrent runs do not collide, and a later run
# removes the namespaces whose owner is dead. Call netns_down from an EXIT
# trap. Functions return non-zero on failure instead of exiting (they are
# called from `||` lists, where set -e does not apply), with NETNS_ERROR set
# where they say so; nothing here writes to stdout unless asked for a value.
#
# State (read it, do not change it): NETNS_PREFIX, NETNS_SUBNET,
# NETNS_HOSTS (host names, in address order), NETNS_NAMESPACES (every
# namespace created, the switch first), NETNS_HOST_MAP ("ADDRESS=NAMESPACE
# ...", netns_agent.sh's DUET_NETNS_HOSTS).

NETNS_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NETNS_SUBNET=10.77.0.0/24
NETNS_PREFIX=""
NETNS_HOSTS=()
NETNS_NAMESPACES=()
NETNS_HOST_MAP=""
NETNS_ERROR=""
NETNS_CLUSTER=""

netns_log() { printf 'netns: %s\n' "$*" >&2; }

# 0 when namespaces may be tried; 77 (not root) or 1 (no ip command) with
# NETNS_ERROR saying why.
netns_preflight() {
  if [ "$(id -u)" -ne 0 ]; then
    NETNS_ERROR="creating network namespaces needs root"
    return 77
  fi
  if ! command -v ip >/dev/null; then
    NETNS_ERROR="no ip command: install iproute2 (launch/setup.sh does)"
    return 1
  fi
}

# The namespace of host $1 (a host name of NETNS_HOSTS).
netns_namespace() { echo "$NETNS_PREFIX-$1"; }

# The address of host $1.
netns_address() {
  local i
  for i in "${!NETNS_HOSTS[@]}"; do
    if [ "${NETNS_HOSTS[i]}" = "$1" ]; then
      echo "10.77.0.$((i + 1))"
      return 0
    fi
  done
  netns_log "no host $1 (hosts: ${NETNS_HOSTS[*]})"
  return 1
}

# Ends what still runs in namespace $1, then removes it.
netns_kill_namespace() {
  local pids
  pids=$(ip netns pids "$1" 2>/dev/null || true)
  # shellcheck disable=SC2086 # a list of pids
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  ip netns delete "$1" 2>/dev/null || true
}

# Removes the namespaces of runs that were killed before their traps ran
# (duetnet<pid>-*, the pid no longer alive).
netns_remove_leftovers() {
  local ns owner
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^duetnet[0-9]+-' || true); do
    owner=${ns#duetnet}
    owner=${owner%%-*}
    if ! kill -0 "$owner" 2>/dev/null; then
      netns_log "removing $ns, left by a killed run"
      netns_kill_namespace "$ns"
    fi
  done
}

# Runs "$@"; on failure says which command failed.
netns_run_() {
  "$@" || { netns_log "failed: $*"; return 1; }
}

# Creates the switch and one namespace per host ($2..., default a b c) under
# PREFIX $1 (default duetnet$$). 0 when up; 77 when this machine does not
# permit network namespaces (NETNS_ERROR says why); 1 on another failure.
# After a failure netns_down removes what was made.
netns_up() {
  local prefix=${1:-duetnet$$} switch ns host i address
  [ $# -eq 0 ] || shift
  NETNS_PREFIX=$prefix
  NETNS_HOSTS=("$@")
  [ ${#NETNS_HOSTS[@]} -gt 0 ] || NETNS_HOSTS=(a b c)
  NETNS_HOST_MAP=""
  netns_remove_leftovers
  switch=$prefix-switch
  if ! NETNS_ERROR=$(ip netns add "$switch" 2>&1); then
    NETNS_ERROR="cannot create a network namespace: $NETNS_ERROR"
    return 77
  fi
  NETNS_ERROR=""
  NETNS_NAMESPACES+=("$switch")
  netns_run_ ip -n "$switch" link add br0 type bridge || return 1
  netns_run_ ip -n "$switch" link set dev br0 up || return 1
  for i in "${!NETNS_HOSTS[@]}"; do
    host=${NETNS_HOSTS[i]}
    ns=$prefix-$host
    address=10.77.0.$((i + 1))
    netns_run_ ip netns add "$ns" || return 1
    NETNS_NAMESPACES+=("$ns")
    netns_run_ ip link add duet0 netns "$ns" type veth peer name "port-$host" netns "$switch" ||
      return 1
    netns_run_ ip -n "$switch" link set dev "port-$host" master br0 up || return 1
    # No IPv6 on the link: its neighbour discovery would add bytes that MPI did not send.
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.duet0.disable_ipv6=1 2>/dev/null || true
    netns_run_ ip -n "$ns" addr add "$address/24" dev duet0 || return 1
    netns_run_ ip -n "$ns" link set dev duet0 up || return 1
    netns_run_ ip -n "$ns" link set dev lo up || return 1
    NETNS_HOST_MAP+="$address=$ns "
  done
}

# Kills what runs in every namespace netns_up created and removes them.
netns_down() {
  local ns
  for ns in "${NETNS_NAMESPACES[@]}"; do netns_kill_namespace "$ns"; done
  NETNS_NAMESPACES=()
}

# Sets the array named $1 to the command prefix that runs a command on host
# $2: in its namespace, in a UTS namespace named after it, with
# DUET_NETNS_HOSTS set for netns_agent.sh. The command replaces the prefix's
# processes (its pid is the one `"${ARRAY[@]}" COMMAND... &` gives).
netns_on_host() {
  local -n netns_prefix_=$1
  local netns_ns_
  netns_ns_=$(netns_namespace "$2")
  # shellcheck disable=SC2016,SC2034 # expanded by the inner shell; a nameref
  netns_prefix_=(ip netns exec "$netns_ns_" env "DUET_NETNS_HOSTS=$NETNS_HOST_MAP"
    unshare --uts sh -c 'hostname "$0" && exec "$@"' "$netns_ns_")
}

# Appends to the array named $1 the mpirun options that start the remote
# daemons through netns_agent.sh instead of ssh (mpirun must run on a host,
# netns_on_host, for the agent's DUET_NETNS_HOSTS).
netns_mpirun_args() {
  local -n netns_agent_args_=$1
  netns_agent_args_+=(--mca plm_rsh_agent "$NETNS_LIB_DIR/netns_agent.sh" --mca plm_rsh_no_tree_spawn 1)
}

# Appends to the array named $1 the mpirun options that keep MPI to TCP on
# the subnet: no shared memory between the hosts, no other interface.
netns_mpi_tcp_args() {
  local -n netns_tcp_args_=$1
  netns_tcp_args_+=(--mca btl "tcp,self" --mca btl_tcp_if_include "$NETNS_SUBNET"
    --mca oob_tcp_if_include "$NETNS_SUBNET")
}

# Writes an Open MPI hostfile to $1: every host's address, in host order,
# with $2 slots (default 1).
netns_hostfile() {
  local host address
  : >"$1" || return 1
  for host in "${NETNS_HOSTS[@]}"; do
    address=$(netns_address "$host") || return 1
    echo "$address slots=${2:-1}" >>"$1" || return 1
  done
}

# Bytes through host $1's veth: received + sent, or only $2 (rx or tx).
netns_veth_bytes() {
  local stats=/sys/class/net/duet0/statistics ns
  ns=$(netns_namespace "$1")
  # shellcheck disable=SC2016 # expanded by the inner shell
  case ${2:-} in
    rx | tx) ip netns exec "$ns" cat "$stats/${2}_bytes" ;;
    "") ip netns exec "$ns" sh -c 'echo $(($(cat "$0/rx_bytes") + $(cat "$0/tx_bytes")))' "$stats" ;;
    *) netns_log "netns_veth_bytes: rx, tx or nothing, not $2"; return 1 ;;
  esac
}

# Starts a Duet cluster across the hosts as launch/hostfile.sh starts one,
# from the first host (under its name): mpirun reaches the others through
# netns_agent.sh, MPI only over TCP on the subnet, the fronts on the first
# host's address. $1 the duet binary, $2 the model, $3 the hostfile
# (netns_hostfile), $4 and $5 the files for its stdout and stderr, $6 and $7
# the prefill and decode instances, the rest duet serve's arguments. In the
# background; NETNS_CLUSTER is its pid (a child of the caller's shell).
netns_start_cluster() {
  local duet=$1 model=$2 hostfile=$3 out=$4 log=$5 first
  shift 5
  local on_first=() agent_args=()
  first=${NETNS_HOSTS[0]}
  netns_on_host on_first "$first"
  netns_mpirun_args agent_args
  DUET_SKIP_SETUP=1 DUET_SKIP_BUILD=1 DUET_BINARY=$duet DUET_MODEL=$model \
    DUET_HOST=$(netns_address "$first") DUET_MPI_IF=$NETNS_SUBNET DUET_MPI_BTL=tcp,self \
    DUET_MPIRUN_ARGS="${agent_args[*]}" \
    "${on_first[@]}" "$NETNS_LIB_DIR/../../../launch/hostfile.sh" "$hostfile" "$@" \
    >"$out" 2>"$log" &
  # shellcheck disable=SC2034 # read by the scripts that source this file
  NETNS_CLUSTER=$!
}

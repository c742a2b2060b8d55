#!/usr/bin/env bash
# Starts a Duet cluster across the hosts of an Open MPI hostfile and keeps it
# in the foreground until Ctrl-C, as launch/local.sh does on one machine (it
# runs local.sh, which sets up, builds, prints where the cluster serves and
# passes Ctrl-C to the coordinator so that every rank ends in order):
#   mpirun --hostfile HOSTFILE -np 1+P+D duet serve --prefill P --decode D [ARGS...]
#
# Usage: launch/hostfile.sh HOSTFILE P D [duet serve arguments...]
#   e.g. with a hostfile of two lines, "node1 slots=2" and "node2 slots=1":
#        launch/hostfile.sh hosts.txt 1 1
#
# Placement: ranks fill each host's slots in hostfile order (--map-by slot):
# rank 0, the coordinator, takes the first slot of the first host, then come
# the P prefill and the D decode ranks. Write slots=N on each line for the
# ranks that host takes; the slots must add up to at least 1+P+D.
#
# Requirements:
# - run it on the first host of the hostfile (the coordinator runs beside
#   mpirun, which is how Ctrl-C reaches it);
# - every host reaches the others with ssh as this user without a password
#   (or set another launcher: DUET_MPIRUN_ARGS="--mca plm_rsh_agent PROGRAM");
# - every host has Open MPI 4.1, the same build of Duet and the model file at
#   the same paths as this one (a shared or copied checkout; DUET_MODEL and
#   DUET_BUILD_DIR or DUET_BINARY name them as for local.sh). Only this host
#   is set up and built.
# tests/mpi/netns/netns_serve_test.sh runs it across network namespaces.
#
# Transport: MPI's TCP transport between hosts, shared memory (vader) between
# ranks on one host. On hosts with several interfaces (docker0, a management
# network) name the one the hosts share in DUET_MPI_IF, as an interface name
# (eth1) or a subnet (10.0.0.0/24): it is used both for mpirun's own traffic
# with its daemons (oob_tcp_if_include) and for MPI's (btl_tcp_if_include);
# without it Open MPI tries every interface and can hang on one that does not
# route between the hosts.
#
# Environment (besides local.sh's):
#   DUET_MPI_IF    the interface or subnet between the hosts (default: any)
#   DUET_MPI_BTL   MPI's transports (default tcp,self,vader; tcp,self forces TCP
#                  even between ranks on one host)
#   DUET_HOST      where the fronts listen, on the first host (default
#                  127.0.0.1; 0.0.0.0 to take clients from other machines)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ $# -lt 3 ]; then
  sed -n 's/^# \{0,1\}//; /^Usage:/,/^$/p' "${BASH_SOURCE[0]}" >&2
  exit 2
fi
hostfile=$1
shift
[ -f "$hostfile" ] || { echo "duet-cluster: no hostfile $hostfile" >&2; exit 2; }

mpirun_args=(--map-by slot --mca btl "${DUET_MPI_BTL:-tcp,self,vader}")
if [ -n "${DUET_MPI_IF:-}" ]; then
  mpirun_args+=(--mca oob_tcp_if_include "$DUET_MPI_IF" --mca btl_tcp_if_include "$DUET_MPI_IF")
fi

DUET_HOSTFILE=$(cd "$(dirname "$hostfile")" && pwd)/$(basename "$hostfile") \
  DUET_MPIRUN_ARGS="${mpirun_args[*]} ${DUET_MPIRUN_ARGS:-}" \
  exec "$root/launch/local.sh" "$@"

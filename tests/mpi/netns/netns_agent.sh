#!/usr/bin/env bash
# Open MPI's launch agent for "hosts" that are network namespaces on this
# machine: mpirun --mca plm_rsh_agent netns_agent.sh uses it instead of ssh.
#
# mpirun runs `AGENT [ssh options] HOST COMMAND...`, where COMMAND is a shell
# command line (it starts orted on HOST). This agent drops the options, looks
# HOST up in DUET_NETNS_HOSTS ("HOST=NAMESPACE ...", HOST as written in the
# hostfile, e.g. an address), and runs COMMAND inside that namespace with its
# own UTS namespace whose host name is the namespace's name: Open MPI takes
# processes with the same host name for one node (and would join them over
# shared memory, not TCP), so every namespace must have a host name of its own.
set -euo pipefail
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
[ $# -ge 2 ] || { echo "netns_agent: usage: netns_agent.sh HOST COMMAND..." >&2; exit 1; }
host=$1
shift
namespace=""
for entry in ${DUET_NETNS_HOSTS:?netns_agent: DUET_NETNS_HOSTS must map hosts to namespaces}; do
  if [ "${entry%%=*}" = "$host" ]; then namespace=${entry#*=}; fi
done
[ -n "$namespace" ] || { echo "netns_agent: no namespace for host $host in DUET_NETNS_HOSTS" >&2; exit 1; }
# shellcheck disable=SC2016 # expanded by the inner shell
exec ip netns exec "$namespace" unshare --uts sh -c 'hostname "$1" && shift && exec sh -c "$*"' \
  netns_agent "$namespace" "$@"

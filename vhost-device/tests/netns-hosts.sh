# Sourced by multihost.sh and bench/multihost.sh: "hosts" on one machine
# as network namespaces, joined by veth links to one bridge, and the
# options that let one mpirun start a process in each of them over Open
# MPI's TCP transport. Needs root, iproute2 and Open MPI.
#
#   netns_hosts_up TAG H SUBNET   namespaces ${TAG}0 .. ${TAG}H-1 with the
#                                 addresses SUBNET.1 .. SUBNET.H (/24) on
#                                 bridge ${TAG}br (SUBNET.254); fills the
#                                 arrays NETNS (names) and NETNS_ADDR
#   netns_agent FILE              writes mpirun's agent (host address ->
#                                 `ip netns exec` in its namespace)
#   netns_mpirun_opts FILE        fills the array NETNS_MPIRUN with the
#                                 mpirun options that use agent FILE
#   netns_hosts_down              removes what netns_hosts_up made
# shellcheck shell=bash

NETNS=() NETNS_ADDR=() NETNS_TAG="" NETNS_SUBNET=""

netns_hosts_up() {
  local tag=$1 hosts=$2 subnet=$3 h name
  NETNS_TAG=$tag NETNS_SUBNET=$subnet
  ip link add "${tag}br" type bridge
  ip addr add "$subnet.254/24" dev "${tag}br"
  ip link set "${tag}br" up
  for ((h = 0; h < hosts; h++)); do
    name=$tag$h
    NETNS+=("$name")
    NETNS_ADDR+=("$subnet.$((h + 1))")
    ip netns add "$name"
    ip link add "${tag}v$h" type veth peer name "${tag}p$h"
    ip link set "${tag}p$h" netns "$name"
    ip link set "${tag}v$h" master "${tag}br" up
    ip -n "$name" addr add "$subnet.$((h + 1))/24" dev "${tag}p$h"
    ip -n "$name" link set "${tag}p$h" up
    ip -n "$name" link set lo up
  done
}

netns_hosts_down() {
  local name
  # Whatever still runs in a namespace (an orted whose mpirun is gone)
  # would keep it, and its veth, alive.
  for name in "${NETNS[@]}"; do
    ip netns pids "$name" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$name" 2>/dev/null || true
    rm -rf "/dev/shm/$name"
  done
  [[ -n $NETNS_TAG ]] && ip link del "${NETNS_TAG}br" 2>/dev/null
  NETNS=() NETNS_ADDR=()
  return 0
}

# The agent's own $1, $host, $ns and $* are meant literally.
# shellcheck disable=SC2016
netns_agent() {
  local file=$1 h
  {
    echo '#!/bin/sh'
    echo 'host=$1; shift'
    echo 'case $host in'
    for h in "${!NETNS[@]}"; do echo "  ${NETNS_ADDR[$h]}) ns=${NETNS[$h]} ;;"; done
    echo '  *) echo "unknown host $host" >&2; exit 1 ;;'
    echo 'esac'
    # Every "host" has the same hostname and /dev/shm, and Open MPI's
    # shared-memory transport names its files by hostname and local rank:
    # each host gets a folder of its own (the ranks of two hosts crashed
    # on each other's segments without it). The same goes for Open MPI's
    # session folder (/tmp/ompi.HOSTNAME.UID/jf.JOB): two orteds of one job
    # raced to make it, and one failed with "File exists" (CI, stop 45).
    echo 'mkdir -p "/dev/shm/$ns/session"'
    echo 'exec ip netns exec "$ns" env OMPI_MCA_btl_vader_backing_directory="/dev/shm/$ns" OMPI_MCA_orte_tmpdir_base="/dev/shm/$ns/session" sh -c "$*"'
  } >"$file"
  chmod +x "$file"
}

# mpi_preconnect_mpi: the TCP connections are made in MPI_Init, not under
# load mid-run (Open MPI 4.1 once failed a connect there with EINPROGRESS
# on this machine). rtc_hwloc_vmhole none: orted does not share its hwloc
# topology through a mapped hole (orted crashed once in
# hwloc_shmem_topology_write at start).
netns_mpirun_opts() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # shellcheck disable=SC2034 # read by the scripts that source this one
  NETNS_MPIRUN=(--allow-run-as-root --mca plm_rsh_agent "$1"
    --mca btl_tcp_if_include "$NETNS_SUBNET.0/24" --mca oob_tcp_if_include "$NETNS_SUBNET.0/24"
    --mca mpi_preconnect_mpi 1 --mca rtc_hwloc_vmhole none)
}

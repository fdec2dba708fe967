#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces joined by veth links to a
# bridge, one vhost-device-dmlc per namespace, both started by one mpirun
# (Open MPI's TCP transport over the veths), members that are host-transport
# dmlc-guest processes in their host's namespace. Called by
# vhost-device/tests/multihost.rs; needs root, iproute2 and Open MPI.
#
# multihost.sh BIN_DIR CASE: CASE is one of
#   selftest-l1   H=2, L=1: every opcode, every dtype and op, checked against
#                 the flat rank-order reference (equal to the hierarchical
#                 order when every host has one member); then SIGTERM to
#                 both daemons: both finalise MPI, mpirun ends with 0
#   selftest-l2   H=2, L=2: every opcode, every dtype and op, checked against
#                 the hierarchical reference (spec 5.X.6.5.4)
#   pipelined     H=2, L=2, pieces of 4 KiB: allreduce, reduce and
#                 reduce-scatter over many pieces and stretches (ragged
#                 tails included), every dtype and op, against the
#                 hierarchical reference
#   mismatch      H=2, L=1: ranks disagree on the count: MISMATCH on both
#   kill-member   H=2, L=2: a member is killed mid-run: the three others, on
#                 both hosts, get PEER_LOST naming it within 30 s; then four
#                 new members run collectives on the same daemons
#   kill-daemon   H=2, L=1: host 1's daemon is killed (-9): host 0's member
#                 ends with RESET (or, between requests, the disconnect)
#                 within 30 s, and host 0's daemon and mpirun exit
# Exits 0 on success; prints what failed otherwise.
set -euo pipefail

bin=$1
case_=$2
tag=d16$$
work=$(mktemp -d /tmp/dmlc-mh.XXXXXX)
pids=()
# shellcheck source=netns-hosts.sh
. "$(dirname "$0")/netns-hosts.sh"

cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  netns_hosts_down
  if [[ ${KEEP:-} == 1 ]]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
# A limit's SIGTERM (the Rust wrapper's `timeout`) still cleans up.
trap 'exit 1' TERM INT

netns_hosts_up "$tag" 2 10.16.0
nsa=${NETNS[0]} nsb=${NETNS[1]}
addr_a=${NETNS_ADDR[0]} addr_b=${NETNS_ADDR[1]}
netns_agent "$work/agent"
netns_mpirun_opts "$work/agent"

members=1 piece=4M timeout_ms=5000
# kill-member: the survivors wait in their collective while the victim is
# stopped (2.5 s) and then killed; a 20 s timeout keeps that wait far from
# TIMEOUT on a loaded machine, so the loss must be what ends it.
case $case_ in selftest-l2) members=2 ;; kill-member) members=2 timeout_ms=20000 ;; pipelined) members=2 piece=4K ;; esac

cat >"$work/daemon" <<EOF
#!/bin/sh
exec "$bin/vhost-device-dmlc" --mpi --socket-path "$work/h\${OMPI_COMM_WORLD_RANK}.sock" \
  --socket-count $members --mpi-piece $piece --timeout-ms $timeout_ms --reduce-threads 1 --log-level ${DMLC_MH_LOG:-info} \
  2>"$work/d\${OMPI_COMM_WORLD_RANK}.log"
EOF
chmod +x "$work/daemon"

mpirun -n 2 --host "$addr_a,$addr_b" "${NETNS_MPIRUN[@]}" --mca btl tcp,self \
  "$work/daemon" >"$work/mpirun.log" 2>&1 &
mpirun_pid=$!
pids+=("$mpirun_pid")

for _ in $(seq 200); do
  n=$(find "$work" -maxdepth 1 -name 'h*.sock*' | wc -l)
  [[ $n -ge $((2 * members)) ]] && break
  if ! kill -0 "$mpirun_pid" 2>/dev/null; then
    echo "mpirun ended before the daemons listened:"; cat "$work/mpirun.log"; exit 1
  fi
  sleep 0.1
done
if [[ $n -lt $((2 * members)) ]]; then
  echo "the daemons did not listen within 20 s:"; cat "$work/mpirun.log"; exit 1
fi

# member HOST LOCAL ARGS...: a dmlc-guest process in the host's namespace.
member() {
  local h=$1 l=$2; shift 2
  local ns=$nsa; [[ $h == 1 ]] && ns=$nsb
  ip netns exec "$ns" timeout 300 "$bin/dmlc-guest" --socket "$work/h$h.sock$l" "$@" \
    >"$work/m$h$l.log" 2>&1 &
  pids+=("$!")
  mpids+=("$!")
}

# wait_members: 0 if every member exited 0; logs are printed on failure.
wait_members() {
  local rc=0 p
  for p in "${mpids[@]}"; do wait "$p" || rc=1; done
  return $rc
}

# guest_of PID: the dmlc-guest process that member() started as PID
# (`ip netns exec` execs `timeout`, whose child it is).
guest_of() {
  local p
  for _ in $(seq 50); do
    p=$(pgrep -P "$1" -x dmlc-guest || true)
    [[ -n $p ]] && { echo "$p"; return 0; }
    sleep 0.1
  done
  echo "no dmlc-guest under $1" >&2
  return 1
}

# logged FILE TEXT: wait (up to 60 s) until FILE holds TEXT.
logged() {
  for _ in $(seq 600); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

show() {
  local f
  for f in "$work"/m*.log "$work/mpirun.log"; do echo "== $f"; tail -40 "$f"; done
}

mpids=()
case $case_ in
  selftest-l1)
    for h in 0 1; do member "$h" 0 selftest --quick --max-count 1000; done
    wait_members || { show; exit 1; }
    grep -h "passed\|PASS\|ok" "$work"/m00.log | tail -3
    # Then both daemons get SIGTERM, as the launcher's host parts send it at
    # the end of a job: each finalises MPI, so mpirun ends with 0 and does
    # not report a process that exited improperly.
    for ns in "$nsa" "$nsb"; do
      for p in $(ip netns pids "$ns"); do
        [[ $(cat /proc/"$p"/comm 2>/dev/null) == vhost-device-dm* ]] && kill -TERM "$p"
      done
    done
    for _ in $(seq 300); do kill -0 "$mpirun_pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$mpirun_pid" 2>/dev/null; then show; echo "mpirun still runs 30 s after SIGTERM"; exit 1; fi
    rc=0; wait "$mpirun_pid" || rc=$?
    if [[ $rc != 0 ]] || grep -qi "improperly" "$work/mpirun.log"; then
      show; echo "mpirun ended with $rc after the daemons' SIGTERM"; exit 1
    fi
    for h in 0 1; do
      grep -q "MPI finalised" "$work/d$h.log" || { show; cat "$work/d$h.log"; echo "host $h: no 'MPI finalised'"; exit 1; }
    done
    echo "both daemons finalised MPI; mpirun ended with 0"
    ;;
  selftest-l2)
    # Every opcode x dtype x op, float sums, products and averages included,
    # against dmlc-guest's own scalar reference in spec 5.X.6.5.4's order
    # (--members-per-host 2: per host in local rank order, then the host
    # partials in host order), computed by each member, not by the device.
    for h in 0 1; do for l in 0 1; do
      member "$h" "$l" selftest --quick --max-count 1000 --members-per-host 2
    done; done
    wait_members || { show; exit 1; }
    grep -h "^selftest" "$work"/m00.log
    ;;
  pipelined)
    # With 4 KiB pieces (stretches of 1 KiB), counts up to 4099 cross
    # several pieces and end in ragged ones; each member checks against
    # its own reference in spec 5.X.6.5.4's order.
    for h in 0 1; do for l in 0 1; do
      member "$h" "$l" selftest --quick --opcode allreduce --opcode reduce \
        --opcode reduce_scatter --members-per-host 2
    done; done
    wait_members || { show; exit 1; }
    grep -h "^selftest" "$work"/m00.log
    ;;
  mismatch)
    member 0 0 debug mismatch --field count
    member 1 0 debug mismatch --field count
    wait_members || true
    if ! grep -qi "mismatch" "$work/m00.log" || ! grep -qi "mismatch" "$work/m10.log"; then
      show; echo "expected MISMATCH on both hosts"; exit 1
    fi
    ;;
  kill-member)
    # Global rank 1 (host 0, local 1) is killed while all four run small
    # allreduces; the three survivors, on both hosts, must fail with
    # PEER_LOST naming rank 1 (the driver's "rank 1 was lost") within the
    # bound, and then a new set of four members must run collectives on
    # the same daemons (the group keeps serving, sequence numbers from 0).
    for h in 0 1; do for l in 0 1; do
      member "$h" "$l" bench -b 4 -e 64 -f 2 -n 1000 -w 0 --rotate 4096
    done; done
    # Rank 0 prints the floor (nops alone) before the collectives start.
    logged "$work/m00.log" "# floor" || { show; echo "the members did not start"; exit 1; }
    sleep 1
    # Stopped first, so that the three others are waiting in a collective
    # when it dies (a member between requests would instead meet the new
    # generation with its next request, and time out waiting for rank 1).
    victim=$(guest_of "${mpids[1]}")
    kill -STOP "$victim"
    sleep 2.5
    kill -9 "$victim"
    start=$SECONDS
    for i in 0 2 3; do
      if wait "${mpids[$i]}"; then show; echo "member $i went on after a peer was killed"; exit 1; fi
    done
    took=$((SECONDS - start))
    echo "survivors ended in ${took}s"
    [[ $took -le 30 ]] || { show; echo "took longer than 30 s"; exit 1; }
    # Every survivor was waiting in a collective rank 1 had not joined (it
    # was stopped first), so each must get PEER_LOST naming rank 1
    # ([DEV-MH-1]), not TIMEOUT: the timeout is 20 s, the bound above 30 s.
    for f in m00 m10 m11; do
      grep -q "rank 1 was lost" "$work/$f.log" ||
        { show; echo "$f did not get PEER_LOST naming rank 1"; exit 1; }
    done
    echo "PEER_LOST naming rank 1 on all 3 survivors"
    # Host 1's daemon learnt of the loss (the news, or the loss step).
    grep -q "member 1 on .* was lost" "$work/d1.log" ||
      { show; echo "host 1's daemon did not reset for rank 1"; exit 1; }
    grep -h "was lost" "$work"/m00.log "$work"/m1*.log || true
    # The daemons keep serving: four new members, a short self-test.
    mpids=()
    for h in 0 1; do for l in 0 1; do
      member "$h" "$l" selftest --quick --max-count 17 --opcode allreduce --opcode broadcast \
        --dtype f32 --dtype i32 --members-per-host 2
    done; done
    wait_members || { show; echo "the group did not serve again after the loss"; exit 1; }
    grep -h "^selftest" "$work"/m00.log
    ;;
  kill-daemon)
    # Host 1's daemon is killed (-9) while both members run small
    # allreduces. Open MPI (4.1, no ULFM) then ends the job: host 0's daemon
    # fails its pending requests with RESET (on mpirun's SIGTERM, or on its
    # own MPI error or missed bound) and exits. Host 0's member must end
    # with that RESET, or at worst see the daemon disconnect, within the
    # bound; host 0's daemon and mpirun must be gone.
    for h in 0 1; do member "$h" 0 bench -b 4 -e 64 -f 2 -n 1000 -w 0 --rotate 4096; done
    logged "$work/m00.log" "# floor" || { show; echo "the members did not start"; exit 1; }
    sleep 1
    pid=""
    for p in $(ip netns pids "$nsb"); do
      [[ $(cat /proc/"$p"/comm 2>/dev/null) == vhost-device-dm* ]] && { pid=$p; break; }
    done
    [[ -n $pid ]] || { show; echo "no daemon in $nsb"; exit 1; }
    kill -9 "$pid"
    start=$SECONDS
    if wait "${mpids[0]}"; then show; echo "host 0's member went on after host 1's daemon died"; exit 1; fi
    took=$((SECONDS - start))
    echo "host 0's member ended in ${took}s: $(tail -n 1 "$work/m00.log")"
    [[ $took -le 30 ]] || { show; echo "took longer than 30 s"; exit 1; }
    grep -q "the group was reset\|device backend disconnected" "$work/m00.log" ||
      { show; echo "host 0's member did not end with RESET or a disconnect"; exit 1; }
    grep -q "the group was reset" "$work/m00.log" ||
      echo "note: host 0's member saw the disconnect before a RESET"
    # The job ends: mpirun (and with it host 0's daemon) exits.
    for _ in $(seq 300); do kill -0 "$mpirun_pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$mpirun_pid" 2>/dev/null; then show; echo "mpirun still runs 30 s after"; exit 1; fi
    if [[ -n $(ip netns pids "$nsa") ]]; then show; echo "host 0's daemon still runs"; exit 1; fi
    echo "host 0's daemon: $(grep -h "RESET\|shutting down\|ending the MPI job" "$work/d0.log" | head -2)"
    ;;
  *) echo "unknown case $case_"; exit 2 ;;
esac
echo "case $case_ passed"

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
#                 order when every host has one member)
#   selftest-l2   H=2, L=2: every opcode; the dtypes and ops whose result does
#                 not depend on the order (integers, float min and max)
#   mismatch      H=2, L=1: ranks disagree on the count: MISMATCH on both
#   kill-member   H=2, L=2: a member is killed mid-run: the others end with
#                 an error status (not a hang)
#   kill-daemon   H=2, L=1: host 1's daemon is killed: host 0's member ends
#                 with an error (not a hang)
# Exits 0 on success; prints what failed otherwise.
set -euo pipefail

bin=$1
case_=$2
tag=d16$$
work=$(mktemp -d /tmp/dmlc-mh.XXXXXX)
nsa=${tag}a nsb=${tag}b br=${tag}br
addr_a=10.16.0.1 addr_b=10.16.0.2
pids=()

cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  ip netns del "$nsa" 2>/dev/null || true
  ip netns del "$nsb" 2>/dev/null || true
  ip link del "$br" 2>/dev/null || true
  if [[ ${KEEP:-} == 1 ]]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

ip link add "$br" type bridge
ip addr add 10.16.0.254/24 dev "$br"
ip link set "$br" up
for ns in a b; do
  name=${tag}$ns
  ip netns add "$name"
  ip link add "${tag}v$ns" type veth peer name "${tag}p$ns"
  ip link set "${tag}p$ns" netns "$name"
  ip link set "${tag}v$ns" master "$br" up
  eval "addr=\$addr_$ns"
  ip -n "$name" addr add "$addr/24" dev "${tag}p$ns"
  ip -n "$name" link set "${tag}p$ns" up
  ip -n "$name" link set lo up
done

# mpirun reaches the "hosts" through this agent: host address -> namespace.
cat >"$work/agent" <<EOF
#!/bin/sh
host=\$1; shift
case \$host in
  $addr_a) ns=$nsa ;;
  $addr_b) ns=$nsb ;;
  *) echo "unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" sh -c "\$*"
EOF
chmod +x "$work/agent"

members=1
case $case_ in selftest-l2 | kill-member) members=2 ;; esac

cat >"$work/daemon" <<EOF
#!/bin/sh
exec "$bin/vhost-device-dmlc" --mpi --socket-path "$work/h\${OMPI_COMM_WORLD_RANK}.sock" \
  --socket-count $members --timeout-ms 5000 --reduce-threads 1 --log-level ${DMLC_MH_LOG:-info} \
  2>"$work/d\${OMPI_COMM_WORLD_RANK}.log"
EOF
chmod +x "$work/daemon"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun --allow-run-as-root -n 2 --host "$addr_a,$addr_b" \
  --mca plm_rsh_agent "$work/agent" \
  --mca btl tcp,self --mca btl_tcp_if_include 10.16.0.0/24 \
  --mca oob_tcp_if_include 10.16.0.0/24 \
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

show() {
  for f in "$work"/m*.log "$work/mpirun.log"; do echo "== $f"; tail -40 "$f"; done
}

mpids=()
case $case_ in
  selftest-l1)
    for h in 0 1; do member "$h" 0 selftest --quick --max-count 1000; done
    wait_members || { show; exit 1; }
    grep -h "passed\|PASS\|ok" "$work"/m00.log | tail -3
    ;;
  selftest-l2)
    sel=(--dtype i8 --dtype u8 --dtype i32 --dtype u32 --dtype i64 --dtype u64)
    for h in 0 1; do for l in 0 1; do
      member "$h" "$l" selftest --quick --max-count 1000 "${sel[@]}"
    done; done
    wait_members || { show; exit 1; }
    mpids=()
    for h in 0 1; do for l in 0 1; do
      member "$h" "$l" selftest --quick --max-count 1000 --dtype f32 --dtype f64 \
        --dtype f16 --dtype bf16 --op min --op max
    done; done
    wait_members || { show; exit 1; }
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
    for h in 0 1; do for l in 0 1; do
      member "$h" "$l" bench -b 4 -e 64 -f 2 -n 50000 -w 0
    done; done
    sleep 3
    kill -9 "${mpids[1]}"
    unset 'mpids[1]'
    start=$SECONDS
    for p in "${mpids[@]}"; do
      if wait "$p"; then show; echo "a member went on after a peer was killed"; exit 1; fi
    done
    took=$((SECONDS - start))
    echo "survivors ended in ${took}s"
    [[ $took -le 30 ]] || { show; echo "took longer than 30 s"; exit 1; }
    grep -hi "peer\|lost\|reset\|error" "$work"/m0[0]*.log "$work"/m1*.log | head -6
    ;;
  kill-daemon)
    for h in 0 1; do member "$h" 0 bench -b 4 -e 64 -f 2 -n 50000 -w 0; done
    sleep 3
    pid=$(ip netns pids "$nsb" | while read -r p; do
      [[ $(cat /proc/"$p"/comm 2>/dev/null) == vhost-device-dm* ]] && echo "$p"; done | head -1)
    [[ -n $pid ]] || { show; echo "no daemon in $nsb"; exit 1; }
    kill -9 "$pid"
    start=$SECONDS
    if wait "${mpids[0]}"; then show; echo "host 0's member went on after host 1's daemon died"; exit 1; fi
    took=$((SECONDS - start))
    echo "host 0's member ended in ${took}s"
    [[ $took -le 30 ]] || { show; echo "took longer than 30 s"; exit 1; }
    tail -3 "$work/m00.log"
    ;;
  *) echo "unknown case $case_"; exit 2 ;;
esac
echo "case $case_ passed"

#!/usr/bin/env bash
# `dmlc-qemu submit --hosts` across two "hosts" on one machine: network
# namespaces joined by veth links to a bridge (10.17.0.0/24), mpirun
# reaching them through an agent that runs `ip netns exec`, Open MPI's TCP
# transport between the two backends (vhost-device-dmlc --mpi, one per
# namespace), and L TCG VMs per namespace. Called by
# launcher/tests/multihost.rs; needs root, iproute2, Open MPI and the
# patched QEMU (DMLC_QEMU, DMLC_QEMU_FIRMWARE in the environment).
#
# multihost-vms.sh BIN_DIR CASE L: BIN_DIR holds dmlc-qemu, vhost-device-dmlc
# (an mpi build) and dmlc-guest; CASE is one of
#   selftest   `dmlc-guest selftest --quick` in every VM (2L ranks; with
#              --members-per-host L when L > 1): exit status 0, every rank
#              prints its own PASS line as rank r of 2L, both hosts' logs
#              are kept in --log-dir
#   fail       rank 2L-1 (on host 1) exits 7 at once, the others sleep:
#              the launcher stops host 0 and exits 7 within 30 s of the
#              failure
#   interrupt  every rank sleeps; SIGINT (Ctrl-C) to the launcher once
#              every rank runs: exit status 130 within 60 s of it
# Each checks that nothing is left: no process in either namespace, no
# launcher process of the job, an empty TMPDIR.
set -euo pipefail

bin=$1
case_=$2
L=$3
n=$((2 * L))
tag=q16$$
work=$(mktemp -d /tmp/dmlc-mhq.XXXXXX)
nsa=${tag}a nsb=${tag}b br=${tag}br
addr_a=10.17.0.1 addr_b=10.17.0.2

cleanup() {
  local p
  for ns in "$nsa" "$nsb"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
  done
  if [[ -n ${job_pid:-} ]]; then kill -9 "$job_pid" 2>/dev/null || true; fi
  ip netns del "$nsa" 2>/dev/null || true
  ip netns del "$nsb" 2>/dev/null || true
  ip link del "$br" 2>/dev/null || true
  if [[ ${KEEP:-} == 1 ]]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 1' TERM INT

ip link add "$br" type bridge
ip addr add 10.17.0.254/24 dev "$br"
ip link set "$br" up
for ns in a b; do
  name=${tag}$ns
  ip netns add "$name"
  ip link add "${tag}v$ns" type veth peer name "${tag}p$ns"
  ip link set "${tag}p$ns" netns "$name"
  ip link set "${tag}v$ns" master "$br" up
  var=addr_$ns
  addr=${!var}
  ip -n "$name" addr add "$addr/24" dev "${tag}p$ns"
  ip -n "$name" link set "${tag}p$ns" up
  ip -n "$name" link set lo up
done

# mpirun reaches the "hosts" through this agent (in place of ssh): host
# address -> namespace.
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

printf '# the two namespaces\n%s\n%s  # host 1\n' "$addr_a" "$addr_b" >"$work/hosts"
mkdir "$work/tmp"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The job's private directories go here, so that the check below sees
# what it leaves.
export TMPDIR=$work/tmp
# As in vhost-device/tests/multihost.sh: TCP between the namespaces only,
# connections made in MPI_Init, no hwloc shared-memory hole for orted.
mpi=(--mpirun-arg=--mca --mpirun-arg=plm_rsh_agent --mpirun-arg="$work/agent"
  --mpirun-arg=--mca --mpirun-arg=btl "--mpirun-arg=tcp,self"
  --mpirun-arg=--mca --mpirun-arg=btl_tcp_if_include --mpirun-arg=10.17.0.0/24
  --mpirun-arg=--mca --mpirun-arg=oob_tcp_if_include --mpirun-arg=10.17.0.0/24
  --mpirun-arg=--mca --mpirun-arg=mpi_preconnect_mpi --mpirun-arg=1
  --mpirun-arg=--mca --mpirun-arg=rtc_hwloc_vmhole --mpirun-arg=none)

case $case_ in
  selftest)
    st=(selftest --quick --max-count 256)
    [[ $L -gt 1 ]] && st+=(--members-per-host "$L")
    args=(--hostfile "$work/hosts" --log-dir "$work/logs" --timeout 800
      -- "$bin/dmlc-guest" "${st[@]}")
    ;;
  fail)
    last=$((n - 1))
    args=(--hosts "$addr_a,$addr_b" --timeout 500
      -- sh -c "if [ \$DMLC_TASK_ID = $last ]; then echo failing; exit 7; fi; echo waiting; sleep 600")
    ;;
  interrupt)
    args=(--hosts "$addr_a,$addr_b" --timeout 500 -- sh -c 'echo waiting; sleep 600')
    ;;
  *) echo "unknown case $case_"; exit 2 ;;
esac

start=$SECONDS
set +e
"$bin/dmlc-qemu" submit -n "$n" --backend "$bin/vhost-device-dmlc" \
  --backend-arg=--timeout-ms=20000 "${mpi[@]}" "${args[@]}" \
  >"$work/out" 2>"$work/err" &
job_pid=$!
case $case_ in
  interrupt)
    for _ in $(seq 3000); do
      [[ $(grep -c "^\[rank [0-9]*\] waiting" "$work/out") -ge $n ]] && break
      kill -0 "$job_pid" 2>/dev/null || break
      sleep 0.1
    done
    start=$SECONDS
    kill -INT "$job_pid"
    ;;
  fail)
    # Timed from the failure (the boot's time depends on the load).
    for _ in $(seq 3000); do
      grep -q "^\[rank $last\] failing" "$work/out" && break
      kill -0 "$job_pid" 2>/dev/null || break
      sleep 0.1
    done
    start=$SECONDS
    ;;
esac
wait "$job_pid"
rc=$?
set -e
job_pid=
took=$((SECONDS - start))
echo "dmlc-qemu submit exited $rc after ${took}s"

show() {
  echo "== stdout"; tail -60 "$work/out"
  echo "== stderr"; tail -60 "$work/err"
  local f
  for f in "$work"/logs/host*/backend.log; do [[ -f $f ]] && { echo "== $f"; tail -20 "$f"; }; done
  return 0
}

case $case_ in
  selftest)
    [[ $rc -eq 0 ]] || { show; echo "expected exit status 0"; exit 1; }
    for r in $(seq 0 $((n - 1))); do
      line=$(grep "^\[rank $r\] selftest PASS: " "$work/out" || true)
      [[ $line == *", rank $r of $n" ]] ||
        { show; echo "rank $r printed no PASS line as rank $r of $n"; exit 1; }
      echo "$line"
    done
    for h in 0 1; do
      grep -q "host $h of 2" "$work/logs/host$h/backend.log" ||
        { show; echo "host $h's backend log does not show it as host $h of 2"; exit 1; }
      for r in $(seq $((h * L)) $((h * L + L - 1))); do
        grep -q "selftest PASS" "$work/logs/host$h/rank$r.out" ||
          { show; echo "no rank$r.out with the PASS line in host$h/"; exit 1; }
      done
    done
    ;;
  fail)
    [[ $rc -eq 7 ]] || { show; echo "expected the failed worker's status 7"; exit 1; }
    [[ $took -le 30 ]] || { show; echo "took ${took}s after the failure, more than 30"; exit 1; }
    grep -q "^\[rank $last\] failing" "$work/out" || { show; echo "rank $last did not run"; exit 1; }
    grep -q "stopping the other hosts" "$work/err" ||
      { show; echo "the launcher did not stop the other host"; exit 1; }
    ;;
  interrupt)
    [[ $rc -eq 130 ]] || { show; echo "expected 130 after SIGINT"; exit 1; }
    [[ $took -le 60 ]] || { show; echo "took ${took}s after SIGINT, more than 60"; exit 1; }
    [[ $(grep -c "^\[rank [0-9]*\] waiting" "$work/out") -eq $n ]] ||
      { show; echo "not every rank ran"; exit 1; }
    ;;
esac

# Nothing left behind: the namespaces are empty (backends, QEMU, orted),
# no part of the job runs, the job's temporary directories are gone.
for _ in $(seq 100); do
  left=$(ip netns pids "$nsa"; ip netns pids "$nsb")
  [[ -z $left ]] && break
  sleep 0.1
done
if [[ -n $left ]]; then
  show; echo "left running:"; for p in $left; do ps -o pid=,args= -p "$p" || true; done; exit 1
fi
if pgrep -f "dmlc-qemu host-(part|run) .*$bin" >/dev/null; then
  show; echo "a part of the job still runs"; exit 1
fi
# (A host's part may still be removing its files when mpirun has ended.)
for _ in $(seq 100); do
  [[ -z $(ls -A "$work/tmp") ]] && break
  sleep 0.1
done
if [[ -n $(ls -A "$work/tmp") ]]; then
  show; echo "left in TMPDIR:"; ls -la "$work/tmp"; exit 1
fi
echo "case $case_ (L=$L) passed in ${took}s"

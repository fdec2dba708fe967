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
# shellcheck source=../../vhost-device/tests/netns-hosts.sh
. "$(dirname "$0")/../../vhost-device/tests/netns-hosts.sh"

cleanup() {
  if [[ -n ${job_pid:-} ]]; then kill -9 "$job_pid" 2>/dev/null || true; fi
  netns_hosts_down
  if [[ ${KEEP:-} == 1 ]]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 1' TERM INT

netns_hosts_up "$tag" 2 10.17.0
nsa=${NETNS[0]} nsb=${NETNS[1]}
addr_a=${NETNS_ADDR[0]} addr_b=${NETNS_ADDR[1]}
# mpirun reaches the "hosts" through this agent (in place of ssh).
netns_agent "$work/agent"
netns_mpirun_opts "$work/agent"

printf '# the two namespaces\n%s\n%s  # host 1\n' "$addr_a" "$addr_b" >"$work/hosts"
mkdir "$work/tmp"

# The job's private directories go here, so that the check below sees
# what it leaves.
export TMPDIR=$work/tmp
# The shared options (netns-hosts.sh) through --mpirun-arg, and TCP
# between the namespaces only.
mpi=()
for o in "${NETNS_MPIRUN[@]}" --mca btl tcp,self; do mpi+=("--mpirun-arg=$o"); done

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

#!/usr/bin/env bash
# One group across hosts against Open MPI over the same links, in one run
# (see docs/benchmarks-journal.md, "Across hosts", and docs/multi-host.md).
#
#   bench/multihost.sh [--hosts H] [--members L] [--sizes "1M 4M 16M 64M"]
#                      [--iters I] [--warmup W] [--repeat K] [--wait MODE]
#                      [--piece BYTES] [--backend PATH] [--out FILE]
#
# Makes H "hosts" on this machine as network namespaces joined by veth links
# (vhost-device/tests/netns-hosts.sh; needs root, iproute2 and Open MPI),
# then, for every size, K times interleaved:
#   device  one vhost-device-dmlc --mpi per host (one mpirun, TCP between
#           them) and L host-transport `dmlc-guest bench` members per host:
#           the hierarchical f32 sum allreduce across H x L members
#   flat    Open MPI's MPI_Allreduce across the same H x L ranks (L per
#           host: shared memory within a host, TCP across), bench/mpi_allreduce.c,
#           yielding when idle (more ranks than CPUs here)
#   inter   MPI_Allreduce across H ranks, one per host: the network stage
#           alone, the limit for the device's inter-host step
# and prints the median p50 (rank 0, out of place) of each with the ratios
# flat / device and device / inter. --wait is the members' wait (hybrid,
# the driver's default; poll; or interrupt). --backend runs another
# vhost-device-dmlc --mpi build (an older commit's, say) instead of this
# tree's; --piece is the daemons' --mpi-piece (default theirs). In the
# environment, MH_LOG=debug sets the daemons' --log-level (debug prints
# every collective's phases) and KEEP=1 keeps their logs. --out also writes the table to FILE.
set -euo pipefail

hosts=2 members=2 sizes="1M 4M 16M 64M" iters=20 warmup=5 repeat=3 wait=hybrid backend='' out=''
while [ $# -gt 0 ]; do
    case $1 in
        --hosts) hosts=$2; shift 2 ;;
        --members) members=$2; shift 2 ;;
        --sizes) sizes=$2; shift 2 ;;
        --iters) iters=$2; shift 2 ;;
        --warmup) warmup=$2; shift 2 ;;
        --repeat) repeat=$2; shift 2 ;;
        --wait) wait=$2; shift 2 ;;
        --backend) backend=$2; shift 2 ;;
        --piece) piece=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "multihost.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ $hosts -ge 2 && $members -ge 1 ]] || { echo "multihost.sh: --hosts must be 2 or more, --members 1 or more" >&2; exit 2; }
case $wait in poll|hybrid|interrupt) ;; *) echo "multihost.sh: --wait is poll, hybrid or interrupt" >&2; exit 2 ;; esac
[[ $(id -u) == 0 ]] || { echo "multihost.sh: needs root (network namespaces)" >&2; exit 2; }
for tool in ip mpirun mpicc; do
    command -v "$tool" >/dev/null || { echo "multihost.sh: $tool not found (apt-get install iproute2 openmpi-bin libopenmpi-dev)" >&2; exit 2; }
done

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# A target folder of its own: the mpi build must not replace the default one.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/mpi}
echo "multihost.sh: building the release binaries (vhost-device-dmlc with --features mpi)" >&2
cargo build --release -q -p vhost-device-dmlc --features mpi
cargo build --release -q -p dmlc-guest
bin=$CARGO_TARGET_DIR/release
backend=${backend:-$bin/vhost-device-dmlc}
[[ -x $backend ]] || { echo "multihost.sh: $backend is not an executable" >&2; exit 2; }
mkdir -p "$CARGO_TARGET_DIR/bench-c"
mpicc -O2 -Wall -o "$CARGO_TARGET_DIR/bench-c/mpi_allreduce" bench/mpi_allreduce.c
mpi_bench=$CARGO_TARGET_DIR/bench-c/mpi_allreduce

work=$(mktemp -d /tmp/dmlc-mhb.XXXXXX)
pids=()
# shellcheck source=../vhost-device/tests/netns-hosts.sh
. "$root/vhost-device/tests/netns-hosts.sh"
cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    netns_hosts_down
    if [[ ${KEEP:-} == 1 ]]; then echo "logs kept in $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 1' TERM INT

netns_hosts_up "mhb$$" "$hosts" 10.47.0
netns_agent "$work/agent"
netns_mpirun_opts "$work/agent"
host_list=$(IFS=,; echo "${NETNS_ADDR[*]}")
slots_list=$(for a in "${NETNS_ADDR[@]}"; do printf '%s:%s,' "$a" "$members"; done)
slots_list=${slots_list%,}

cat >"$work/daemon" <<EOF
#!/bin/sh
exec "$backend" --mpi ${piece:+--mpi-piece $piece} --socket-path "$work/h\${OMPI_COMM_WORLD_RANK}.sock" \
  --socket-count $members --log-level ${MH_LOG:-warn} 2>"$work/d\${OMPI_COMM_WORLD_RANK}.log"
EOF
chmod +x "$work/daemon"
mpirun -n "$hosts" --host "$host_list" "${NETNS_MPIRUN[@]}" --mca btl tcp,self \
    "$work/daemon" >"$work/mpirun.log" 2>&1 &
pids+=("$!")
# Killed at cleanup: no job notice from bash then.
disown
for _ in $(seq 600); do
    n=$(find "$work" -maxdepth 1 -name 'h*.sock*' | wc -l)
    [[ $n -ge $((hosts * members)) ]] && break
    sleep 0.1
done
[[ $n -ge $((hosts * members)) ]] || { echo "multihost.sh: the daemons did not listen:"; cat "$work/mpirun.log" "$work"/d*.log; exit 1; }

# p50 of the out-of-place column (6) for SIZE bytes in a bench table.
p50_of() { awk -v s="$2" '$1 == s { print $6; exit }' "$1"; }
bytes_of() { numfmt --from=iec "$1"; }

run_device() {  # SIZE -> the p50 (us) of global rank 0
    local s=$1 h l mp=()
    for ((h = 0; h < hosts; h++)); do
        for ((l = 0; l < members; l++)); do
            ip netns exec "${NETNS[$h]}" timeout 300 "$bin/dmlc-guest" "--$wait" \
                --socket "$work/h$h.sock$l" bench -b "$s" -e "$s" -n "$iters" -w "$warmup" \
                --members-per-host "$members" \
                >"$work/m$h$l.log" 2>&1 &
            mp+=("$!")
        done
    done
    local rc=0 p
    for p in "${mp[@]}"; do wait "$p" || rc=1; done
    [[ $rc == 0 ]] || { echo "multihost.sh: a device member failed at $s B:" >&2; for f in "$work"/m*.log "$work"/d*.log; do echo "== $f"; tail -n 5 "$f"; done >&2; exit 1; }
    grep -q "^# ok" "$work/m00.log" || { echo "multihost.sh: wrong results at $s B" >&2; cat "$work/m00.log" >&2; exit 1; }
    p50_of "$work/m00.log" "$s"
}

run_mpi() {  # RANKS HOSTS SIZE -> rank 0's p50 (us)
    local np=$1 hl=$2 s=$3
    timeout 300 mpirun -n "$np" --host "$hl" "${NETNS_MPIRUN[@]}" --mca btl tcp,vader,self \
        --mca mpi_yield_when_idle 1 \
        --bind-to none "$mpi_bench" -b "$s" -e "$s" -n "$iters" -w "$warmup" >"$work/mpi.log" 2>&1 ||
        { echo "multihost.sh: mpirun failed:" >&2; cat "$work/mpi.log" >&2; exit 1; }
    p50_of "$work/mpi.log" "$s"
}

raw=$work/raw
echo "# bench/multihost.sh: backend $backend; $hosts hosts (network namespaces, veth + bridge) x $members members ($wait wait), f32 sum allreduce, p50 of $iters iterations after $warmup (rank 0, out of place), median of $repeat interleaved repetitions; $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$repeat"); do
    for size in $sizes; do
        s=$(bytes_of "$size")
        d=$(run_device "$s")
        f=$(run_mpi $((hosts * members)) "$slots_list" "$s")
        i=$(run_mpi "$hosts" "$host_list" "$s")
        echo "$s $d $f $i" >>"$raw"
        echo "  rep $rep $size: device $d us, flat MPI $f us, inter-host MPI $i us" >&2
    done
done
table=$(awk '
    function median(a, n,   i, j, t) {
        for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
        return n % 2 ? a[(n+1)/2] : (a[n/2] + a[n/2+1]) / 2
    }
    { if (!($1 in n)) order[++k] = $1; n[$1]++; d[$1, n[$1]] = $2; f[$1, n[$1]] = $3; x[$1, n[$1]] = $4 }
    END {
        printf "| size (B) | device p50 (us) | flat MPI p50 (us) | inter-host MPI p50 (us) | flat / device | device / inter-host |\n"
        printf "|---:|---:|---:|---:|---:|---:|\n"
        for (q = 1; q <= k; q++) {
            s = order[q]
            for (r = 1; r <= n[s]; r++) { ad[r] = d[s, r]; af[r] = f[s, r]; ax[r] = x[s, r] }
            md = median(ad, n[s]); mf = median(af, n[s]); mx = median(ax, n[s])
            printf "| %d | %.1f | %.1f | %.1f | %.2fx | %.2fx |\n", s, md, mf, mx, mf / md, md / mx
        }
    }' "$raw")
echo "$table"
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
if [[ -n $out ]]; then echo "$table" >"$out"; fi

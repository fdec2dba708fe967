#!/usr/bin/env bash
# Fidelity of the backend's timing model (docs/latency-experiments.md): on
# the host transport, runs `dmlc-guest local` with N ranks and an f32 sum
# allreduce `bench` from 4 B to 16 MiB, under the ring model (alpha, beta,
# modelled world size p) and without a model, and prints per size the
# modelled time, the measured medians (rank 0, out of place and in place),
# the error against the model, and whether it is within 5% or 20 us.
#
#   bench/timing-fidelity.sh [--ranks N] [--world P] [--alpha-us A]
#                            [--bandwidth-gbs B] [--iters I] [--max BYTES]
#                            [--repeat K] [--spin-us S] [--rank-arg ARG]
#                            [--overhead-us auto|US] [--vms]
#
# Defaults: 2 ranks, p = 8, alpha 100 us, 1 GB/s, 50 iterations, up to
# 16M, 1 repetition. With --repeat K, the runs with and without the model
# alternate K times and each figure is the median of the K medians.
# --spin-us sets the file's spin_us (the backend busy-waits the last S us
# before each modelled completion); --rank-arg passes an option to every
# rank's bench (e.g. --rank-arg=--interrupt; without any, the ranks
# busy-poll: --rank-arg=--poll, as the published tables were made). --overhead-us sets the file's
# overhead_us, the host's own latency taken off every modelled time: auto
# (the default) measures it first as the median round trip of a 4 B
# allreduce without a model (bench -b 4 -e 4 -n 300), 0 takes nothing off.
# --vms runs the ranks in TCG VMs instead (`dmlc-qemu submit -n N`, each
# VM's `dmlc-guest --pci bench`, the daemon on the host with the same
# file); it needs the release dmlc-qemu and the patched QEMU (as
# `dmlc-qemu submit` does), and every run boots the VMs.
set -euo pipefail

ranks=2 world=8 alpha=100 bw=1 iters=50 max=16M repeat=1 spin=0 rank_args=() overhead=auto vms=0
while [ $# -gt 0 ]; do
    case $1 in
        --ranks) ranks=$2; shift 2 ;;
        --world) world=$2; shift 2 ;;
        --alpha-us) alpha=$2; shift 2 ;;
        --bandwidth-gbs) bw=$2; shift 2 ;;
        --iters) iters=$2; shift 2 ;;
        --max) max=$2; shift 2 ;;
        --repeat) repeat=$2; shift 2 ;;
        --spin-us) spin=$2; shift 2 ;;
        --overhead-us) overhead=$2; shift 2 ;;
        --rank-arg) rank_args+=("$2"); shift 2 ;;
        --rank-arg=*) rank_args+=("${1#--rank-arg=}"); shift ;;
        --vms) vms=1; shift ;;
        -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
        *) echo "timing-fidelity.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ ${#rank_args[@]} -gt 0 ] || rank_args=(--poll)

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --release -q -p dmlc-guest -p vhost-device-dmlc
[ "$vms" = 0 ] || cargo build --release -q -p dmlc-qemu
target=${CARGO_TARGET_DIR:-$root/target}/release
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Runs rank 0's bench with the given launcher options (first) and bench
# options (after --); prints rank 0's output.
ranks_bench() {
    local opts=()
    while [ "$1" != -- ]; do opts+=("$1"); shift; done
    shift
    if [ "$vms" = 1 ]; then
        "$target/dmlc-qemu" submit -n "$ranks" --timeout 1800 "${opts[@]}" \
            --files "$target/dmlc-guest:/usr/bin/dmlc-guest" \
            -- dmlc-guest --pci bench "$@" "${rank_args[@]}" 2>/dev/null |
            sed -n 's/^\[rank 0\] //p'
    else
        "$target/dmlc-guest" local --ranks "$ranks" --backend "$target/vhost-device-dmlc" "${opts[@]}" \
            -- bench "$@" "${rank_args[@]}" 2>/dev/null
    fi
}

if [ "$overhead" = auto ]; then
    # The device floor: rank 0's median round trip of a 4 B allreduce
    # without a model.
    overhead=$(ranks_bench -- -b 4 -e 4 -n 300 -w 50 |
        awk '$1 ~ /^[0-9]+$/ { print $6; exit }')
    [ -n "$overhead" ] || { echo "timing-fidelity.sh: cannot measure the floor" >&2; exit 1; }
fi
cat >"$tmp/ring.toml" <<EOF
spin_us = $spin
overhead_us = $overhead
[model]
kind = "ring"
world = $world
alpha_us = $alpha
bandwidth_gbs = $bw
EOF

# Prints "size oop_median ip_median" per size.
run() {
    ranks_bench "$@" -- -b 4 -e "$max" -n "$iters" -w $((iters / 5 + 1)) |
        awk '$1 ~ /^[0-9]+$/ { print $1, $6, $10 }'
}

where=$([ "$vms" = 1 ] && echo "TCG VMs, virtio-pci" || echo "host transport")
echo "# timing-fidelity.sh: $ranks ranks ($where), ring model p=$world alpha=${alpha}us bandwidth=${bw}GB/s spin_us=$spin overhead_us=$overhead, ranks' extra options: ${rank_args[*]:-none}, f32 sum allreduce, $iters iterations, $repeat repetition(s); $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$repeat"); do
    run --backend-arg=--timing="$tmp/ring.toml" | sed "s/^/model /" >>"$tmp/raw"
    run | sed "s/^/none /" >>"$tmp/raw"
    echo "  repetition $rep done" >&2
done
awk -v p="$world" -v a="$alpha" -v bw="$bw" '
    function median(list,   n, v, i, j, t) {
        n = split(list, v, " ")
        for (i = 2; i <= n; i++) for (j = i; j > 1 && v[j-1] + 0 > v[j] + 0; j--) { t = v[j]; v[j] = v[j-1]; v[j-1] = t }
        return n % 2 ? v[(n+1)/2] : (v[n/2] + v[n/2+1]) / 2
    }
    {
        key = $1 SUBSEP $2
        oop[key] = oop[key] " " $3; ip[key] = ip[key] " " $4
        if (!($2 in seen)) { seen[$2] = 1; sizes[++ns] = $2 }
    }
    END {
        printf "%10s %12s %12s %9s %8s %12s %12s %7s\n", "size(B)", "model(us)", "meas.oop", "err(%)", "ok", "meas.ip", "no-model", "late"
        within = 0
        for (k = 1; k <= ns; k++) {
            n = sizes[k]
            m = (2 * (p - 1) * a * 1e-6 + 2 * ((p - 1) / p) * n / (bw * 1e9)) * 1e6
            mo = median(oop["model" SUBSEP n]); mi = median(ip["model" SUBSEP n]); no = median(oop["none" SUBSEP n])
            err = (mo - m) / m * 100
            tol = m * 0.05; if (tol < 20) tol = 20
            d = mo - m; if (d < 0) d = -d
            ok = d <= tol ? "yes" : "NO"
            if (ok == "yes") within++
            printf "%10d %12.2f %12.2f %9.2f %8s %12.2f %12.2f %7s\n", n, m, mo, err, ok, mi, no, (no > m ? "host" : "-")
        }
        printf "# %d of %d sizes within 5%% or 20 us of the model (out of place); late = host: the run without a model is already slower than the model\n", within, ns
    }' "$tmp/raw"

#!/usr/bin/env bash
# Backend busy-polling (--poll-us) against none, on the host transport, in
# one run (see docs/benchmarks-journal.md, "Backend polling").
#
#   bench/poll-us.sh [--ranks N] [--repeat K] [--iters I] [--polls "0 50 200"]
#                    [--backend PATH]
#
# For each repetition and each poll time (interleaved, so that the
# machine's noise spreads over all of them), runs `dmlc-guest --poll local`
# with N ranks (busy-polling for completions) and a 4 B allreduce `bench`, and keeps rank 0's p50 (out of place
# and in place) and the device's floor that the same run measured (the p50
# of a nop, which the device answers for rank 0 alone). Prints the median
# over the repetitions for each poll time, its ratio to --poll-us 0 from
# the same run, and the allreduce's ratio to the floor. --backend runs another
# vhost-device-dmlc build (an older commit's, say) instead of this tree's.
set -euo pipefail

ranks=2 repeat=5 iters=2000 polls="0 50 200" backend=
while [ $# -gt 0 ]; do
    case $1 in
        --ranks) ranks=$2; shift 2 ;;
        --repeat) repeat=$2; shift 2 ;;
        --iters) iters=$2; shift 2 ;;
        --polls) polls=$2; shift 2 ;;
        --backend) backend=$2; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "poll-us.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case " $polls " in *" 0 "*) ;; *) echo "poll-us.sh: --polls must include 0 (the baseline)" >&2; exit 2 ;; esac

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --release -q -p dmlc-guest -p vhost-device-dmlc
target=${CARGO_TARGET_DIR:-$root/target}/release
backend=${backend:-$target/vhost-device-dmlc}
[ -x "$backend" ] || { echo "poll-us.sh: $backend is not an executable" >&2; exit 2; }
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT

echo "# poll-us.sh: backend $backend; $ranks ranks, 4 B f32 sum allreduce, $iters iterations, $repeat repetitions; $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$repeat"); do
    for p in $polls; do
        line=$("$target/dmlc-guest" --poll local --ranks "$ranks" --backend "$backend" \
            --poll-us "$p" -- bench -b 4 -e 4 -n "$iters" -w $((iters / 10)) 2>&1 |
            awk '$2 == "floor:" { f = $11 } $1 == "4" { r = $6 " " $10 } END { if (f != "" && r != "") print r, f }')
        [ -n "$line" ] || { echo "poll-us.sh: no result (or no floor line) for --poll-us $p (rep $rep)" >&2; exit 1; }
        echo "$p $line" >>"$raw"
        echo "  rep $rep --poll-us $p: p50 oop/ip/floor $line us" >&2
    done
done
awk -v polls="$polls" '
    function median(a, n,   i, j, t) {
        for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
        return n % 2 ? a[(n+1)/2] : (a[n/2] + a[n/2+1]) / 2
    }
    { n[$1]++; o[$1, n[$1]] = $2; i[$1, n[$1]] = $3; f[$1, n[$1]] = $4 }
    END {
        printf "%10s %14s %14s %10s %10s %16s %12s\n", "--poll-us", "p50 oop (us)", "p50 ip (us)", "oop / 0", "ip / 0", "floor p50 (us)", "oop / floor"
        k = split(polls, ps, " ")
        for (x = 1; x <= k; x++) {
            p = ps[x]
            for (r = 1; r <= n[p]; r++) { ao[r] = o[p, r]; ai[r] = i[p, r]; af[r] = f[p, r] }
            mo[p] = median(ao, n[p]); mi[p] = median(ai, n[p]); mf[p] = median(af, n[p])
        }
        for (x = 1; x <= k; x++) {
            p = ps[x]
            printf "%10s %14.2f %14.2f %9.2fx %9.2fx %16.2f %11.2fx\n", p, mo[p], mi[p], mo[p] / mo[0], mi[p] / mi[0], mf[p], mo[p] / mf[p]
        }
    }' "$raw"

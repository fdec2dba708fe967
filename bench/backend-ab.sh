#!/usr/bin/env bash
# Two backend builds under one driver, alternated: is the new backend slower?
# (docs/latency-experiments.md section 11 uses it for the backend without a
# timing model against the backend from before the timing model existed.)
#
#   bench/backend-ab.sh BASE_BACKEND [NEW_BACKEND] [--ranks N] [--repeat K]
#                       [--iters I] [--max BYTES]
#
# NEW_BACKEND defaults to this tree's target/release/vhost-device-dmlc. For
# each of K repetitions it runs, for BASE then NEW, this tree's
# `dmlc-guest --poll local --ranks N --backend B -- bench -b 4 -e MAX -n I`
# and keeps rank 0's out-of-place p50 per size; it prints per size the
# median over the repetitions for each backend and NEW / BASE, then the
# geometric mean of the ratios. Defaults: 2 ranks, 5 repetitions, 200
# iterations, up to 1M.
set -euo pipefail

ranks=2 repeat=5 iters=200 max=1M base= new=
while [ $# -gt 0 ]; do
    case $1 in
        --ranks) ranks=$2; shift 2 ;;
        --repeat) repeat=$2; shift 2 ;;
        --iters) iters=$2; shift 2 ;;
        --max) max=$2; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        -*) echo "backend-ab.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) if [ -z "$base" ]; then base=$1; elif [ -z "$new" ]; then new=$1; else
               echo "backend-ab.sh: too many arguments (see --help)" >&2; exit 2; fi; shift ;;
    esac
done
[ -n "$base" ] || { echo "backend-ab.sh: give the base backend (see --help)" >&2; exit 2; }

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --release -q -p dmlc-guest -p vhost-device-dmlc
target=${CARGO_TARGET_DIR:-$root/target}/release
new=${new:-$target/vhost-device-dmlc}
for b in "$base" "$new"; do
    [ -x "$b" ] || { echo "backend-ab.sh: $b is not an executable" >&2; exit 2; }
done
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT

echo "# backend-ab.sh: base $base, new $new; this tree's dmlc-guest --poll, $ranks ranks, f32 sum allreduce, bench -b 4 -e $max -n $iters, $repeat alternated repetitions; $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq "$repeat"); do
    for which in base new; do
        b=$([ "$which" = base ] && echo "$base" || echo "$new")
        "$target/dmlc-guest" --poll local --ranks "$ranks" --backend "$b" \
            -- bench -b 4 -e "$max" -n "$iters" -w $((iters / 10)) 2>/dev/null |
            awk -v w="$which" '$1 ~ /^[0-9]+$/ { print w, $1, $6 }' >>"$raw"
    done
    echo "  repetition $rep done" >&2
done
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
awk '
    function median(list,   n, v, i, j, t) {
        n = split(list, v, " ")
        for (i = 2; i <= n; i++) for (j = i; j > 1 && v[j-1] + 0 > v[j] + 0; j--) { t = v[j]; v[j] = v[j-1]; v[j-1] = t }
        return n % 2 ? v[(n+1)/2] : (v[n/2] + v[n/2+1]) / 2
    }
    { t[$1, $2] = t[$1, $2] " " $3; if (!($2 in seen)) { seen[$2] = 1; sizes[++ns] = $2 } }
    END {
        printf "%10s %14s %14s %10s\n", "size(B)", "base p50(us)", "new p50(us)", "new/base"
        logsum = 0
        for (k = 1; k <= ns; k++) {
            s = sizes[k]; b = median(t["base", s]); n = median(t["new", s])
            printf "%10s %14.2f %14.2f %10.3f\n", s, b, n, n / b
            logsum += log(n / b)
        }
        printf "# geometric mean of new/base over %d sizes: %.3f\n", ns, exp(logsum / ns)
    }' "$raw"

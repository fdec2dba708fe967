#!/bin/bash
# XGBoost side by side: stock XGBoost over TCP (--communicator rabit,
# --transport tcp) against the patched XGBoost through the virtio-dmlc device
# (--communicator dmlc, --transport device; xgboost-patches/build-xgboost.sh)
# on N TCG VMs, the same training (examples/xgboost/train.py --monitor):
# rank 0's per-round time (median, min, max), the share of the tree updates
# that XGBoost's monitor puts in the histogram exchange (an estimate, an upper
# bound: see docs/xgboost.md), whether every rank ended with the same model,
# and its hash, to compare the two transports' models.
#
# Usage: bench/xgboost-device.sh [--ranks "2 4"] [--rounds R] [--data NAME]
#                                [-- TRAIN_ARGS...]
# The raw output of every job goes to stderr; the table to stdout.
# Needs release builds (cargo build --release -p dmlc-qemu -p
# vhost-device-dmlc -p dmlc-capi), virtiofsd and the test venv.
set -euo pipefail
cd "$(dirname "$0")/.."
ranks="2 4" rounds=10 data=digits extra=()
while [ $# -gt 0 ]; do
    case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "xgboost-device.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    esac
done
for b in dmlc-qemu vhost-device-dmlc libdmlc_guest.so; do
    [ -e "target/release/$b" ] || { echo "build target/release/$b first (see --help)" >&2; exit 1; }
done
# shellcheck source=tests/lib/import-env.sh
. tests/lib/import-env.sh
import_env DMLC_QEMU DMLC_QEMU_FIRMWARE -- qemu-patches/build-qemu.sh --env
import_env DMLC_VIRTIOFSD -- vm-harness/build-virtiofsd.sh --env
import_env DMLC_XGBOOST_PYTHONPATH DMLC_XGBOOST_GTEST -- xgboost-patches/build-xgboost.sh --env
python=$(python/venv.sh)/bin/python
summary=$(
    cat <<'PY'
import json, sys
r = json.load(sys.stdin)
t = r["round_ms"]
share = r["exchange_share_estimate"]
print(f"{r['world']} | {r['communicator']} | {len(t)} | {r['round_median_ms']:.1f} | {min(t):.1f} "
      f"| {max(t):.1f} | {'-' if share is None else f'{share:.0%}'} | {r['accuracy']:.4f}")
PY
)
rows=()
for n in $ranks; do
    for comm in rabit dmlc; do
        echo "# N=$n $comm: $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
        if [ "$comm" = dmlc ]; then
            transport=device
            pp=$DMLC_XGBOOST_PYTHONPATH
        else
            transport=tcp
            pp=""
        fi
        out=$(PYTHONPATH=$pp DMLC_LIBRARY=$PWD/target/release/libdmlc_guest.so \
            target/release/dmlc-qemu submit -n "$n" --tracker rabit --transport "$transport" \
            --host-root --memory 1G --timeout 1500 -- "$python" examples/xgboost/train.py \
            --communicator "$comm" --rounds "$rounds" --data "$data" --monitor --json - \
            "${extra[@]}" 2> >(cat >&2))
        printf '%s\n' "$out" >&2
        hashes=$(printf '%s\n' "$out" | sed -n 's/^\[rank [0-9]*\] rank [0-9]*: model sha256 //p' | sort -u)
        count=$(printf '%s\n' "$out" | grep -c ': model sha256 ' || true)
        if [ "$count" -ne "$n" ]; then
            same="missing ($count of $n)"
        elif [ "$(printf '%s\n' "$hashes" | wc -l)" -eq 1 ]; then
            same="yes"
        else
            same="NO"
        fi
        json=$(printf '%s\n' "$out" | sed -n 's/^\[rank 0\] json: //p')
        row=$(printf '%s' "$json" | "$python" -c "$summary")
        rows+=("| $row | $same | ${hashes:0:16} |")
    done
done
echo "| VMs | communicator | rounds | round median ms | min | max | histogram exchange (estimate) | accuracy | same model on every rank | model sha256 |"
echo "|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"

#!/bin/bash
# Stock XGBoost over TCP between TCG VMs: examples/xgboost/train.py on N
# VMs (dmlc-qemu submit --tracker rabit --host-root), per-round time of
# rank 0 (median, min, max over the rounds), the share of the tree updates
# that XGBoost's monitor puts in the histogram exchange (train.py
# --monitor: an estimate; a few percent on 1 rank, where none runs), and
# whether every rank ended with the same model (the sha256 each rank
# printed of its own model). N = 1 has no peer: its round is the whole
# data set's compute alone.
#
# Usage: bench/xgboost-tcp.sh [--ranks "1 2 4"] [--rounds R] [--data NAME]
#                             [--log-dir DIR] [-- TRAIN_ARGS...]
#   --ranks    the N to run, in this order (default "1 2 4")
#   --rounds   boosting rounds per job (default 10)
#   --data     digits or breast_cancer (default digits)
#   --log-dir  keep each job's logs in DIR/nN
# The raw output of every job goes to stderr; the table to stdout.
# Needs release builds (cargo build --release -p dmlc-qemu -p
# vhost-device-dmlc), virtiofsd (vm-harness/build-virtiofsd.sh) and the
# test venv (python/venv.sh, with xgboost-cpu and scikit-learn).
set -euo pipefail
cd "$(dirname "$0")/.."
ranks="1 2 4" rounds=10 data=digits logs="" extra=()
while [ $# -gt 0 ]; do
    case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --log-dir) logs=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "xgboost-tcp.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
    esac
done
for b in dmlc-qemu vhost-device-dmlc; do
    [ -x "target/release/$b" ] || { echo "build target/release/$b first (see --help)" >&2; exit 1; }
done
# shellcheck source=tests/lib/import-env.sh
. tests/lib/import-env.sh
import_env DMLC_QEMU DMLC_QEMU_FIRMWARE -- qemu-patches/build-qemu.sh --env
import_env DMLC_VIRTIOFSD -- vm-harness/build-virtiofsd.sh --env
python=$(python/venv.sh)/bin/python
# One table row from rank 0's JSON line.
summary=$(
    cat <<'PY'
import json, sys
r = json.load(sys.stdin)
t = r["round_ms"]
print(f"{r['world']} | {len(t)} | {r['round_median_ms']:.1f} | {min(t):.1f} | {max(t):.1f} "
      f"| {r['exchange_share_estimate']:.0%} | {r['setup_s']:.1f} | {r['accuracy']:.4f}")
PY
)
rows=()
for n in $ranks; do
    echo "# N=$n: $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
    log_args=()
    [ -n "$logs" ] && log_args=(--log-dir "$logs/n$n")
    out=$(target/release/dmlc-qemu submit -n "$n" --tracker rabit --host-root --memory 1G \
        --timeout 1200 "${log_args[@]}" -- "$python" examples/xgboost/train.py \
        --rounds "$rounds" --data "$data" --monitor --json - "${extra[@]}" 2> >(cat >&2))
    printf '%s\n' "$out" >&2
    hashes=$(printf '%s\n' "$out" | sed -n 's/^\[rank [0-9]*\] rank [0-9]*: model sha256 //p' | sort -u)
    count=$(printf '%s\n' "$out" | grep -c ': model sha256 ' || true)
    if [ "$count" -ne "$n" ]; then
        same="missing ($count of $n)"
    elif [ "$(printf '%s\n' "$hashes" | wc -l)" -eq 1 ]; then
        same="yes (${hashes:0:12})"
    else
        same="NO"
    fi
    json=$(printf '%s\n' "$out" | sed -n 's/^\[rank 0\] json: //p')
    row=$(printf '%s' "$json" | "$python" -c "$summary")
    rows+=("| $row | $same |")
done
echo "| N | rounds | round median ms | min | max | histogram exchange (estimate) | setup s | accuracy | same model on every rank |"
echo "|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"

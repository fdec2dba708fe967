#!/usr/bin/env bash
# Runs a benchmark command and keeps its raw output, with where it came
# from, as a file under docs/bench/ that the docs can cite.
#
#   bench/record.sh NAME -- COMMAND [ARG...]
#
# Writes docs/bench/NAME.txt: a header (the commit as `git describe
# --always --dirty`, the command line, the date, the machine and its load
# average), then everything COMMAND prints on stdout and stderr, then a
# footer (exit status, wall time, load average after). The output is also
# shown as it comes. COMMAND runs in the repository's root.
#
# A figure in the docs cites the file with a marker on the line before its
# table (docs/check-figures.sh checks it):
#
#   <!-- raw: docs/bench/NAME.txt cmd: COMMAND [ARG...] -->
#
# The check refuses a raw file made from a tree with uncommitted changes
# (a describe ending in -dirty): commit first, then measure.
#
# Environment: DMLC_BENCH_DIR writes elsewhere (default docs/bench).
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }
case ${1:-} in
-h | --help) usage; exit 0 ;;
'' | -*) usage >&2; exit 2 ;;
esac
name=$1
shift
[ "${1:-}" = -- ] || { echo "record.sh: expected -- after NAME (try --help)" >&2; exit 2; }
shift
[ $# -gt 0 ] || { echo "record.sh: no command given (try --help)" >&2; exit 2; }
case $name in
*/* | *.txt) echo "record.sh: NAME is a bare name, without a folder or .txt: $name" >&2; exit 2 ;;
esac

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dir=${DMLC_BENCH_DIR:-docs/bench}
mkdir -p "$dir"
out=$dir/$name.txt
describe=$(git describe --always --dirty --abbrev=12)
case $describe in
*-dirty) echo "record.sh: warning: the tree has uncommitted changes ($describe); docs/check-figures.sh will refuse $out" >&2 ;;
esac
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
started=$SECONDS
{
  echo "# raw output of: $*"
  echo "# commit: $describe"
  echo "# date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "# machine: $(nproc) CPUs, ${cpu:-unknown CPU}, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
} >"$out"
rc=0
"$@" 2>&1 | tee -a "$out" || rc=${PIPESTATUS[0]}
{
  echo
  echo "# exit status: $rc; wall time: $((SECONDS - started)) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
} >>"$out"
echo "record.sh: wrote $out" >&2
exit "$rc"

# shellcheck shell=bash
# The common start of the build scripts (qemu-patches/build-qemu.sh,
# xgboost-patches/build-xgboost.sh, vm-harness/build-virtiofsd.sh,
# kernel-driver/build.sh, tests/image/build-image.sh, python/venv.sh,
# fuzz/run.sh). A script sources it after its header comment and a blank
# line, naming the prefix of its messages (PROG):
#
#   # shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
#   . "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" build-xgboost || exit 1
#
# (an argument rather than a PROG=... line before it: shellcheck without -x
# would call that variable unused). The script gets:
#   set -euo pipefail
#   PROG          the name given
#   CACHE         the cache root, $DMLC_CACHE or ~/.cache/virtio-dmlc (read-only)
#   log MSG...    "PROG: MSG" on stderr
#   die MSG...    "PROG: error: MSG" on stderr, exit 1
#   script_header the script's header comment, line 2 up to the first line
#                 not starting with "#" (a blank one, say), without "# ":
#                 its --help text
#   cache_lock FILE   takes an exclusive flock on FILE (its folder is made)
#                 through fd 9, held until exit or cache_unlock; when another
#                 run holds it, logs "waiting for another SCRIPT run (lock
#                 FILE)" and waits
#   cache_unlock  releases it (closes fd 9)
#
# Package installs are separate: tests/lib/ensure-packages.sh, sourced by the
# scripts that need it, after this file (it uses log and die).

set -euo pipefail

if [[ $# -ne 1 || -z $1 || $1 == -* ]]; then
    echo "prologue.sh: source it with the script's name: . prologue.sh NAME" >&2
    exit 2
fi
PROG=$1
# The sourcing script, with an absolute folder (the scripts may cd).
PROLOGUE_SCRIPT=$(cd "$(dirname "${BASH_SOURCE[1]:-$0}")" && pwd)/$(basename "${BASH_SOURCE[1]:-$0}")

# shellcheck disable=SC2034 # used by the sourcing scripts
readonly CACHE=${DMLC_CACHE:-$HOME/.cache/virtio-dmlc}

log() { echo "$PROG: $*" >&2; }
die() {
    echo "$PROG: error: $*" >&2
    exit 1
}

script_header() {
    sed -n '1d; /^#/!q; s/^# \{0,1\}//; p' "$PROLOGUE_SCRIPT"
}

cache_lock() {
    local file=$1
    mkdir -p "$(dirname "$file")"
    exec 9>"$file"
    if ! flock -n 9; then
        log "waiting for another $(basename "$PROLOGUE_SCRIPT") run (lock $file)"
        flock 9
    fi
}

cache_unlock() { exec 9>&-; }

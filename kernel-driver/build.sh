#!/bin/bash
# Build the virtio_dmlc module against Debian's headers for the guest
# kernel (tests/image/build-image.sh fetches and caches them), and
# tools/dmlc-ktest.
#
# Usage: kernel-driver/build.sh [--check]
#   --check   also run sparse (C=2) and checkpatch.pl --strict, and fail
#             on any finding; W=1 warnings fail every build.
#
# Output: progress on stderr; stdout's last two lines are
#   DMLC_KMOD=/abs/path/virtio_dmlc.ko
#   DMLC_KTEST=/abs/path/tools/dmlc-ktest

# shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" kernel-driver || exit 1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
check=0
case "${1:-}" in
"") ;;
--check) check=1 ;;
-h | --help)
    script_header
    exit 0
    ;;
*)
    echo "build.sh: unknown option $1 (try --help)" >&2
    exit 2
    ;;
esac

need() {
    command -v "$1" >/dev/null 2>&1 && return
    [ "$(id -u)" = 0 ] || die "$1 is missing; install package $2"
    log "installing $2 (for $1)"
    apt-get install -y --no-install-recommends "$2" >&2
}
need make make
need gcc gcc
[ "$check" = 0 ] || need sparse sparse

flags=(--headers)
[ "$check" = 0 ] || flags+=(--checkpatch)
out=$("$here/../tests/image/build-image.sh" "${flags[@]}")
hdr=$(sed -n 's/^DMLC_KERNEL_HEADERS=//p' <<<"$out")
checkpatch=$(sed -n 's/^DMLC_CHECKPATCH=//p' <<<"$out")
[ -d "$hdr" ] || die "no kernel headers from build-image.sh"

log "building virtio_dmlc.ko against $hdr"
sparse_args=()
[ "$check" = 0 ] || sparse_args=(C=2)
make_log=$(mktemp)
trap 'rm -f "$make_log"' EXIT
make -C "$hdr" M="$here" W=1 "${sparse_args[@]}" modules >"$make_log" 2>&1 || {
    cat "$make_log" >&2
    exit 1
}
# Kbuild reports W=1 and sparse findings as warnings: any of them fails.
if grep -E 'warning:|error:' "$make_log" | grep -v 'Skipping BTF' >&2; then
    die "the module build has warnings"
fi
gcc -O2 -Wall -Wextra -Werror -o "$here/tools/dmlc-ktest" "$here/tools/dmlc-ktest.c"
if [ "$check" = 1 ]; then
    log "checkpatch.pl --strict"
    perl "$checkpatch" --no-tree --strict --terse -f \
        "$here/virtio_dmlc.c" "$here/include/uapi/virtio_dmlc.h" "$here/tools/dmlc-ktest.c" >&2
fi
printf 'DMLC_KMOD=%q\n' "$here/virtio_dmlc.ko"
printf 'DMLC_KTEST=%q\n' "$here/tools/dmlc-ktest"

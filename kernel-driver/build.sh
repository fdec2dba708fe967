#!/bin/bash
# Build the virtio_dmlc module against Debian's headers for the guest
# kernel (tests/image/build-image.sh fetches and caches them), and
# tools/dmlc-ktest.
#
# Usage: kernel-driver/build.sh [--check] [--arch ARCH]
#   --check   also run sparse (C=2) and checkpatch.pl --strict (the latter
#             with the host's architecture only: it reads the sources), and
#             fail on any finding; W=1 warnings fail every build.
#   --arch A  the guest's architecture (x86_64, aarch64, riscv64; default
#             x86_64): another one is cross-built (Debian's
#             gcc-ARCH-linux-gnu, installed when missing) into
#             target/kernel-driver/ARCH/, against that image's kernel.
#
# Output: progress on stderr; stdout's last two lines are
#   DMLC_KMOD=/abs/path/virtio_dmlc.ko
#   DMLC_KTEST=/abs/path/tools/dmlc-ktest

# shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" kernel-driver || exit 1

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
check=0
arch=x86_64
while [ $# -gt 0 ]; do
    case "$1" in
    --check) check=1 ;;
    --arch)
        [ $# -ge 2 ] || die "--arch needs an architecture"
        arch=$2
        shift
        ;;
    --arch=*) arch=${1#--arch=} ;;
    -h | --help)
        script_header
        exit 0
        ;;
    *)
        echo "build.sh: unknown option $1 (try --help)" >&2
        exit 2
        ;;
    esac
    shift
done
# The kernel's ARCH, and the cross compiler's prefix and package.
case "$arch" in
x86_64) karch=x86 cross= ;;
aarch64) karch=arm64 cross=aarch64-linux-gnu- ;;
riscv64) karch=riscv cross=riscv64-linux-gnu- ;;
*) die "unknown architecture '$arch' (known: x86_64, aarch64, riscv64)" ;;
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
[ -z "$cross" ] || need "${cross}gcc" "gcc-${cross%-}"

flags=(--arch "$arch" --headers)
# checkpatch reads the sources, whatever the architecture: the host's run
# checks them once.
[ "$check" = 0 ] || [ -n "$cross" ] || flags+=(--checkpatch)
out=$("$here/../tests/image/build-image.sh" "${flags[@]}")
hdr=$(sed -n 's/^DMLC_KERNEL_HEADERS=//p' <<<"$out")
checkpatch=$(sed -n 's/^DMLC_CHECKPATCH=//p' <<<"$out")
[ -d "$hdr" ] || die "no kernel headers from build-image.sh"

# The host's module builds in place; another architecture's in a copy of
# the sources, so that the builds do not overwrite each other.
src=$here
make_args=()
if [ -n "$cross" ]; then
    src=$here/../target/kernel-driver/$arch
    mkdir -p "$src/include/uapi"
    cp "$here/Kbuild" "$here/virtio_dmlc.c" "$src/"
    cp "$here/include/uapi/virtio_dmlc.h" "$src/include/uapi/"
    src=$(cd "$src" && pwd)
    # Debian's headers name the compiler the kernel was built with (trixie:
    # gcc-14); the cross compiler here is the suite's own.
    # No BTF section: it needs pahole, and loading the module needs none.
    make_args=(ARCH="$karch" CROSS_COMPILE="$cross" CC="${cross}gcc" CONFIG_DEBUG_INFO_BTF_MODULES=)
fi
log "building virtio_dmlc.ko for $arch against $hdr"
sparse_args=()
if [ "$check" = 1 ] && [ "$arch" = riscv64 ]; then
    # bookworm's sparse 0.6.4 rejects the -march of trixie's riscv64 kernel
    # (rv64..._zicsr_zifencei) before it reads a line.
    log "no sparse for riscv64: bookworm's sparse cannot parse its kernel's flags"
elif [ "$check" = 1 ]; then
    sparse_args=(C=2)
fi
make_log=$(mktemp)
trap 'rm -f "$make_log"' EXIT
make -C "$hdr" M="$src" W=1 "${make_args[@]}" "${sparse_args[@]}" modules >"$make_log" 2>&1 || {
    cat "$make_log" >&2
    exit 1
}
# Kbuild reports W=1 and sparse findings as warnings: any of them fails.
if grep -E 'warning:|error:' "$make_log" | grep -v 'Skipping BTF' >&2; then
    die "the module build has warnings"
fi
ktest=$here/tools/dmlc-ktest
[ -z "$cross" ] || ktest=$src/dmlc-ktest
"${cross}gcc" -O2 -Wall -Wextra -Werror -o "$ktest" "$here/tools/dmlc-ktest.c"
if [ "$check" = 1 ] && [ -z "$cross" ]; then
    log "checkpatch.pl --strict"
    perl "$checkpatch" --no-tree --strict --terse -f \
        "$here/virtio_dmlc.c" "$here/include/uapi/virtio_dmlc.h" "$here/tools/dmlc-ktest.c" >&2
fi
printf 'DMLC_KMOD=%q\n' "$src/virtio_dmlc.ko"
printf 'DMLC_KTEST=%q\n' "$ktest"

#!/usr/bin/env bash
# Cross-build the programs that run in guests for other architectures:
# dmlc-guest, the digits trainer, pci_probe and libdmlc_guest.so, and copy
# them into target/TRIPLE/release/ (target/TRIPLE/release/examples/ for
# pci_probe), where `dmlc-qemu submit --arch` and the system tests look for
# them. cargo builds in $DMLC_CACHE/cross/target, a folder kept in the
# cache: it rebuilds what changed, so a clean checkout does not compile
# every dependency again (about 4 minutes per architecture when empty, on 2
# cores; seconds after).
#
# Usage: cross-build.sh [--env] ARCH...     (ARCH: aarch64, riscv64)
#   --env   print DMLC_CROSS_TARGET_DIR=DIR (the target folder) on the last
#           line of stdout
#
# Installs, when missing (as root): the rustup target and Debian's cross C
# compiler of each architecture (gcc-aarch64-linux-gnu, gcc-riscv64-linux-gnu;
# .cargo/config.toml names them as the linkers) and its C library
# (libc6-dev-arm64-cross, libc6-dev-riscv64-cross). The programs link against the
# cross toolchain's glibc (bookworm's 2.36), which the guests' runtime (the
# image's libc6, or the Debian rootfs) matches or outdates.
#
# Environment: CARGO_TARGET_DIR, the folder the copies go to (default
# target/); DMLC_CACHE.

# shellcheck source=SCRIPTDIR/../lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/prologue.sh" cross-build || exit 1
# shellcheck source=SCRIPTDIR/../lib/ensure-packages.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/ensure-packages.sh"

usage() {
    script_header >&2
    exit "$1"
}

print_env=0
arches=()
while [ $# -gt 0 ]; do
    case "$1" in
    -h | --help) usage 0 ;;
    --env) print_env=1 ;;
    -*) usage 2 ;;
    *) IFS=, read -r -a more <<<"$1" && arches+=("${more[@]}") ;;
    esac
    shift
done
[ ${#arches[@]} -gt 0 ] || usage 2

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
# Where cargo builds (cached), and where the programs go.
build=$CACHE/cross/target
out=${CARGO_TARGET_DIR:-$repo/target}

for arch in "${arches[@]}"; do
    case "$arch" in
    aarch64) triple=aarch64-unknown-linux-gnu gcc_pkg=gcc-aarch64-linux-gnu libc_pkg=libc6-dev-arm64-cross ;;
    riscv64) triple=riscv64gc-unknown-linux-gnu gcc_pkg=gcc-riscv64-linux-gnu libc_pkg=libc6-dev-riscv64-cross ;;
    x86_64) die "x86_64 is the host: cargo build --release builds its programs" ;;
    *) die "unknown architecture '$arch' (known: aarch64, riscv64)" ;;
    esac
    # The cross linker and the C library it links against (a missing one is
    # installed, or named in the error). The gcc package only recommends the
    # library, and ensure_packages installs no recommends: on a machine where
    # the compiler came first (the kernel module's build needs only it) a link
    # failed for want of Scrt1.o and crti.o.
    ensure_packages "$gcc_pkg" "$libc_pkg"
    if ! rustup target list --installed 2>/dev/null | grep -qx "$triple"; then
        log "rustup target add $triple"
        rustup target add "$triple" >&2 || die "rustup target add $triple failed"
    fi
    log "building the guest programs for $arch ($triple)"
    CARGO_TARGET_DIR=$build cargo build --release --locked --target "$triple" \
        -p dmlc-guest -p dmlc-capi -p dmlc-example-digits --bins --lib >&2 ||
        die "cargo build --target $triple failed"
    CARGO_TARGET_DIR=$build cargo build --release --locked --target "$triple" \
        -p dmlc-driver --example pci_probe >&2 ||
        die "cargo build --target $triple --example pci_probe failed"
    from=$build/$triple/release to=$out/$triple/release
    mkdir -p "$to/examples"
    for f in dmlc-guest dmlc-train-digits libdmlc_guest.so examples/pci_probe; do
        { cp -p "$from/$f" "$to/$f.tmp" && mv "$to/$f.tmp" "$to/$f"; } || die "cannot copy $from/$f to $to"
    done
done
if [ "$print_env" = 1 ]; then
    echo "DMLC_CROSS_TARGET_DIR=$out"
fi

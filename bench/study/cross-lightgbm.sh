#!/usr/bin/env bash
# Cross-compile stock LightGBM for guests of another architecture and print,
# on the last line of stdout, a folder to put on PYTHONPATH in those guests:
# the lightgbm Python package of PyPI's sdist with lib_lightgbm.so built for
# ARCH. Debian has no LightGBM package, and PyPI's wheels are for x86_64 (and
# aarch64 on some versions, riscv64 on none), so the study's LightGBM cells in
# aarch64 and riscv64 VMs run this build, on Debian's python3, numpy and
# scipy of tests/image/build-rootfs.sh's root, with PyPI's narwhals (pure
# Python, which Debian lacks) beside it. It is the version of this
# host's wheel (python/venv.sh), with no patch: the device is reached through
# LightGBM's own network hook (python/src/dmlc/lightgbm.py).
#
# Usage: cross-lightgbm.sh --arch ARCH      (ARCH: aarch64 or riscv64)
#
# Environment:
#   DMLC_CACHE          cache root (default: $HOME/.cache/virtio-dmlc)
#   DMLC_LIGHTGBM_JOBS  parallel compile jobs (default: number of CPUs)
#
# Cached in $DMLC_CACHE/lightgbm/<arch>-<version>-<hash>/ (the hash covers the
# sdist and this script); about 4 minutes per architecture on 2 cores the
# first time. Needs make and Debian's cross g++ (installed with apt-get when
# missing, as root) and CMake 3.28 or later, which bookworm lacks: PyPI's
# cmake package, installed once with python3's pip into the cache.

# shellcheck source=SCRIPTDIR/../../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/lib/prologue.sh" cross-lightgbm || exit 1

readonly LGB_VERSION=4.7.0
readonly LGB_SDIST="lightgbm-$LGB_VERSION.tar.gz"
readonly LGB_URL="https://files.pythonhosted.org/packages/63/8e/4db5e29290d7e619c307fdb8dab0a0514090af2ce3ec483050e024ec6126/$LGB_SDIST"
readonly LGB_SHA256=f8e20f682c9aabd000bcf4a7ed8aa6f473c1adfecccae34ec24e823d156f4af0
readonly JOBS=${DMLC_LIGHTGBM_JOBS:-$(nproc)}
readonly CMAKE_VERSION=3.31.6
# LightGBM's one dependency that Debian's root lacks (pure Python), at the
# version of this host's environment.
readonly NARWHALS_VERSION=2.29.0

arch=""
while [[ $# -gt 0 ]]; do
    case $1 in
    --arch)
        [[ $# -ge 2 ]] || die "--arch needs an architecture (aarch64 or riscv64)"
        arch=$2
        shift
        ;;
    -h | --help)
        script_header
        exit 0
        ;;
    *)
        script_header >&2
        die "unknown argument: $1"
        ;;
    esac
    shift
done
case $arch in
aarch64 | riscv64) ;;
"") die "--arch is required (aarch64 or riscv64; x86_64 guests use this host's wheel)" ;;
*) die "--arch $arch: not one of aarch64, riscv64" ;;
esac
readonly gnu="$arch-linux-gnu"
# What readelf -h calls each architecture.
declare -A ELF_MACHINE=([aarch64]=AArch64 [riscv64]=RISC-V)

# shellcheck source=SCRIPTDIR/../../tests/lib/ensure-packages.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/lib/ensure-packages.sh"
# shellcheck source=SCRIPTDIR/../../tests/lib/fetch-verified.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/lib/fetch-verified.sh"

# Sets CMAKE to a CMake new enough for LightGBM's CMakeLists.txt: the
# system's, or PyPI's (its wheel's binary itself, not pip's Python wrapper).
find_cmake() {
    local have tools="$CACHE/lightgbm/cmake-$CMAKE_VERSION"
    have=$(cmake --version 2>/dev/null | awk 'NR == 1 {print $3}')
    if [[ -n $have ]] && printf '3.28\n%s\n' "$have" | sort -V -C; then
        CMAKE=cmake
        return 0
    fi
    CMAKE="$tools/cmake/data/bin/cmake"
    [[ -x $CMAKE ]] && return 0
    log "installing CMake $CMAKE_VERSION from PyPI into $tools (this system's is ${have:-absent})"
    rm -rf "$tools.tmp"
    python3 -m pip install --disable-pip-version-check -q --root-user-action=ignore \
        --target "$tools.tmp" "cmake==$CMAKE_VERSION" >&2 ||
        die "pip install cmake==$CMAKE_VERSION failed"
    rm -rf "$tools"
    mv "$tools.tmp" "$tools"
    [[ -x $CMAKE ]] || die "PyPI's cmake $CMAKE_VERSION has no $CMAKE"
}

build() {
    local out=$1 work="$1.tmp" sdist start lib machine syms
    find_cmake
    sdist=$(fetch_verified "$LGB_URL" "$LGB_SHA256" "$CACHE/src/$LGB_SDIST")
    rm -rf "$work"
    mkdir -p "$work"
    tar -xzf "$sdist" -C "$work" --no-same-owner
    mv "$work/lightgbm-$LGB_VERSION" "$work/src"
    log "configuring for $arch (log: $work/configure.log)"
    # __BUILD_FOR_PYTHON: the library alone, as the sdist's own build makes it.
    if ! "$CMAKE" -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
        -D__BUILD_FOR_PYTHON=ON -DBUILD_CLI=OFF \
        -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR="$arch" \
        -DCMAKE_C_COMPILER="$gnu-gcc" -DCMAKE_CXX_COMPILER="$gnu-g++" \
        -DCMAKE_FIND_ROOT_PATH="/usr/$gnu" \
        >"$work/configure.log" 2>&1; then
        tail -n 30 "$work/configure.log" >&2
        die "cmake failed; see $work/configure.log"
    fi
    log "compiling lib_lightgbm for $arch with $JOBS jobs (log: $work/build.log)"
    start=$(date +%s)
    if ! make -C "$work/build" -j "$JOBS" _lightgbm >"$work/build.log" 2>&1; then
        grep -B2 -A12 -m3 -E 'error|Error' "$work/build.log" >&2 || tail -n 40 "$work/build.log" >&2
        die "compile failed; see $work/build.log"
    fi
    log "compiled in $(($(date +%s) - start)) s"
    # LIBRARY_OUTPUT_PATH is the source folder.
    lib="$work/src/lib_lightgbm.so"
    [[ -f $lib ]] || die "the build made no $lib"
    # Captured first: `... | grep -q` fails under pipefail when grep exits early.
    machine=$("$gnu-readelf" -h "$lib")
    grep -q "Machine:.*${ELF_MACHINE[$arch]}" <<<"$machine" || die "$lib is not a $arch library"
    syms=$("$gnu-nm" -D --defined-only "$lib")
    grep -q ' LGBM_NetworkInitWithFunctions$' <<<"$syms" ||
        die "$lib lacks LGBM_NetworkInitWithFunctions"

    mkdir -p "$work/python/lightgbm/lib"
    cp -r "$work/src/lightgbm/." "$work/python/lightgbm/"
    cp "$lib" "$work/python/lightgbm/lib/"
    python3 -m pip install --disable-pip-version-check -q --root-user-action=ignore --no-deps \
        --only-binary :all: --target "$work/python" "narwhals==$NARWHALS_VERSION" >&2 ||
        die "pip install narwhals==$NARWHALS_VERSION failed"
    {
        echo "lightgbm $LGB_VERSION for $arch ($LGB_SHA256)"
        echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(($(date +%s) - start)) s"
    } >"$work/BUILD-INFO"
    rm -rf "$work/src" "$work/build"
    rm -rf "$out"
    mv "$work" "$out"
}

key=$({
    echo "lightgbm $LGB_VERSION $LGB_SHA256 $arch"
    sha256sum "${BASH_SOURCE[0]}" | awk '{print $1}'
} | sha256sum | cut -c1-16)
out="$CACHE/lightgbm/$arch-$LGB_VERSION-$key"

cache_lock "$CACHE/.lock-lightgbm"
if [[ -f $out/python/lightgbm/lib/lib_lightgbm.so ]]; then
    log "using cached $out"
else
    ensure_packages make curl "g++-$gnu"
    build "$out"
fi
cache_unlock
echo "$out/python"

#!/usr/bin/env bash
# Build XGBoost with the virtio-dmlc patch series (dmlc_communicator="dmlc") and
# print, on the last line of stdout, a folder to put on PYTHONPATH: it holds the
# xgboost Python package (the sdist's own files) with the patched libxgboost.so.
# Progress goes to stderr.
#
# Usage: build-xgboost.sh [--arch ARCH] [--env | --test | --help]
#
#   (no option)  build (or reuse) XGBoost and print the PYTHONPATH folder
#   --env        build as above, print shell assignments of DMLC_XGBOOST_PYTHONPATH
#                and DMLC_XGBOOST_GTEST (the patch's C++ test)
#   --test       build as above, then run the patch's C++ test over the host
#                transport: a vhost-device-dmlc daemon ($DMLC_BACKEND_BIN) with 2
#                sockets, the C library in $DMLC_LIBRARY
#   --arch ARCH  cross-compile libxgboost alone for guests of ARCH (aarch64 or
#                riscv64) with Debian's cross g++ (installed when missing): the
#                folder holds the same Python files with that library, for
#                Debian's python3 in tests/image/build-rootfs.sh's root of ARCH
#                (no C++ test: --env prints DMLC_XGBOOST_PYTHONPATH only, and
#                --test is refused)
#
# Environment:
#   DMLC_CACHE         cache root (default: $HOME/.cache/virtio-dmlc)
#   DMLC_XGBOOST_JOBS  parallel compile jobs (default: number of CPUs)
#   DMLC_BACKEND_BIN, DMLC_LIBRARY   for --test
#
# The build is cached in $DMLC_CACHE/xgboost/<version>-<hash>/ where the hash
# covers the patch series and this script, so editing either rebuilds. Needs
# cmake, g++, make and libgtest-dev (installed with apt-get when missing, as root).

# shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" build-xgboost || exit 1

readonly XGB_VERSION=3.2.0
readonly XGB_SDIST="xgboost-$XGB_VERSION.tar.gz"
readonly XGB_URL="https://files.pythonhosted.org/packages/91/bb/1eb0242409d22db725d7a88088e6cfd6556829fb0736f9ff69aa9f1e9455/$XGB_SDIST"
readonly XGB_SHA256=99b0e9a2a64896cdaf509c5e46372d336c692406646d20f2af505003c0c5d70d
readonly BUILD_PACKAGES=(cmake g++ make libgtest-dev curl patch)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly HERE
readonly JOBS=${DMLC_XGBOOST_JOBS:-$(nproc)}

usage() { script_header; }

mode=build
arch=""
while [[ $# -gt 0 ]]; do
    case $1 in
    --env) mode="env" ;;
    --test) mode="test" ;;
    --arch)
        [[ $# -ge 2 ]] || die "--arch needs an architecture (aarch64 or riscv64)"
        arch=$2
        shift
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    *)
        usage >&2
        die "unknown option: $1"
        ;;
    esac
    shift
done
case $arch in
"" | aarch64 | riscv64) ;;
*) die "--arch $arch: this script cross-compiles for aarch64 and riscv64 (x86_64 is the native build, without --arch)" ;;
esac
[[ -z $arch || $mode != test ]] ||
    die "--test runs the C++ test on this host: it needs the native build (no --arch)"

# shellcheck source=SCRIPTDIR/../tests/lib/ensure-packages.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/ensure-packages.sh"
# shellcheck source=SCRIPTDIR/../tests/lib/fetch-verified.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/fetch-verified.sh"

cache_key() {
    local patches=("$HERE"/*.patch)
    [[ -e ${patches[0]} ]] || die "no patches in $HERE"
    {
        echo "xgboost $XGB_VERSION $XGB_SHA256"
        sha256sum "${patches[@]}" | awk '{print $1}'
        sha256sum "${BASH_SOURCE[0]}" | awk '{print $1}'
    } | sha256sum | cut -c1-16
}

fetch_source() {
    fetch_verified "$XGB_URL" "$XGB_SHA256" "$CACHE/src/$XGB_SDIST"
}

# CMake's settings for a cross build of libxgboost for $arch, or for the
# native build with the patch's C++ test.
cmake_target_args() {
    if [[ -z $arch ]]; then
        echo "-DXGBOOST_DMLC_TEST=ON"
        return 0
    fi
    local gnu="$arch-linux-gnu"
    echo "-DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=$arch"
    echo "-DCMAKE_C_COMPILER=$gnu-gcc -DCMAKE_CXX_COMPILER=$gnu-g++"
    echo "-DCMAKE_FIND_ROOT_PATH=/usr/$gnu"
}

build_xgboost() {
    local out=$1 work="$1.tmp" sdist start pid rc last now p targets=(xgboost) nm=nm
    [[ -z $arch ]] || nm="$arch-linux-gnu-nm"
    [[ -n $arch ]] || targets+=(testxgboost_dmlc)
    sdist=$(fetch_source)
    rm -rf "$work"
    mkdir -p "$work"
    log "unpacking $XGB_SDIST"
    tar -xzf "$sdist" -C "$work" --no-same-owner
    mv "$work/xgboost-$XGB_VERSION" "$work/src"
    for p in "$HERE"/*.patch; do
        log "applying $(basename "$p")"
        patch -d "$work/src/cpp_src" -p1 --batch --quiet <"$p" >&2 ||
            die "$(basename "$p") does not apply to XGBoost $XGB_VERSION"
    done
    log "configuring (log: $work/configure.log)"
    # shellcheck disable=SC2046 # one CMake argument per word
    if ! cmake -S "$work/src/cpp_src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
        -DKEEP_BUILD_ARTIFACTS_IN_BINARY_DIR=ON $(cmake_target_args) \
        >"$work/configure.log" 2>&1; then
        tail -n 30 "$work/configure.log" >&2
        die "cmake failed; see $work/configure.log"
    fi
    log "compiling ${targets[*]}${arch:+ for $arch} with $JOBS jobs (about 10 minutes on 2 busy cores; log: $work/build.log)"
    start=$(date +%s)
    make -C "$work/build" -j "$JOBS" "${targets[@]}" >"$work/build.log" 2>&1 &
    pid=$!
    last=$start
    while kill -0 "$pid" 2>/dev/null; do
        sleep 5
        now=$(date +%s)
        if ((now - last >= 30)); then
            log "compiling: $(grep -o '^\[ *[0-9]*%\]' "$work/build.log" | tail -n1 || true) after $((now - start)) s"
            last=$now
        fi
    done
    rc=0
    wait "$pid" || rc=$?
    if [[ $rc -ne 0 ]]; then
        grep -B2 -A12 -m3 -E 'error|Error' "$work/build.log" >&2 || tail -n 40 "$work/build.log" >&2
        die "compile failed; see $work/build.log"
    fi
    log "compiled in $(($(date +%s) - start)) s"

    local lib="$work/build/lib/libxgboost.so" syms
    [[ -f $lib ]] || die "the build made no $lib"
    # Captured first: `nm | grep -q` fails under pipefail when grep exits early.
    syms=$("$nm" -D --defined-only "$lib")
    grep -q ' XGCommunicatorInit$' <<<"$syms" || die "$lib lacks XGCommunicatorInit"
    syms=$(strings "$lib")
    grep -q 'dmlc_open_env' <<<"$syms" || die "$lib lacks the virtio-dmlc collective"

    mkdir -p "$work/python" "$work/bin"
    cp -r "$work/src/xgboost" "$work/python/"
    mkdir -p "$work/python/xgboost/lib"
    cp "$lib" "$work/python/xgboost/lib/"
    [[ -n $arch ]] || cp "$work/build/testxgboost_dmlc" "$work/bin/"
    cp "$HERE"/*.patch "$work/"
    {
        echo "xgboost $XGB_VERSION${arch:+ for $arch}"
        echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(($(date +%s) - start)) s"
        (cd "$HERE" && sha256sum ./*.patch "$(basename "${BASH_SOURCE[0]}")")
    } >"$work/BUILD-INFO"
    rm -rf "$work/src" "$work/build"
    rm -rf "$out"
    mv "$work" "$out"
}

run_test() {
    local gtest=$1 dir pid rc=0 i
    [[ -x ${DMLC_BACKEND_BIN:-} ]] || die "--test needs DMLC_BACKEND_BIN (vhost-device-dmlc)"
    [[ -f ${DMLC_LIBRARY:-} ]] || die "--test needs DMLC_LIBRARY (libdmlc_guest.so)"
    dir=$(mktemp -d)
    "$DMLC_BACKEND_BIN" --socket-path "$dir/dmlc.sock" --socket-count 2 --timeout-ms 10000 \
        >"$dir/backend.log" 2>&1 &
    pid=$!
    for i in $(seq 100); do
        [[ -S $dir/dmlc.sock0 && -S $dir/dmlc.sock1 ]] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    [[ -S $dir/dmlc.sock1 ]] || {
        cat "$dir/backend.log" >&2
        kill "$pid" 2>/dev/null || true
        rm -rf "$dir"
        die "the backend's sockets did not appear after $i tries"
    }
    XGBOOST_DMLC_TEST_SOCKET="$dir/dmlc.sock" XGBOOST_DMLC_TEST_WORLD=2 \
        timeout 300 "$gtest" || rc=$?
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -rf "$dir"
    return "$rc"
}

cache_lock "$CACHE/.lock-xgboost"

out="$CACHE/xgboost/${arch:+$arch-}$XGB_VERSION-$(cache_key)"
if [[ -f $out/python/xgboost/lib/libxgboost.so && (-n $arch || -x $out/bin/testxgboost_dmlc) ]]; then
    log "using cached $out"
else
    ensure_packages "${BUILD_PACKAGES[@]}"
    [[ -z $arch ]] || ensure_packages "g++-$arch-linux-gnu"
    build_xgboost "$out"
fi
cache_unlock

case $mode in
env)
    printf 'DMLC_XGBOOST_PYTHONPATH=%q\n' "$out/python"
    [[ -n $arch ]] || printf 'DMLC_XGBOOST_GTEST=%q\n' "$out/bin/testxgboost_dmlc"
    ;;
test) run_test "$out/bin/testxgboost_dmlc" ;;
*) echo "$out/python" ;;
esac

#!/usr/bin/env bash
# Runs the unit tests of the crates that hold the byte order of the device's
# wire formats on a big-endian target, s390x-unknown-linux-gnu, under
# qemu-user (qemu-s390x-static). Every guest and host the project supports
# (x86_64, aarch64, riscv64) is little-endian, so a field read in native
# byte order (from_ne_bytes, a cast of a little-endian struct) would pass
# every other test: here it fails.
#
# Usage: tests/cross-endian.sh [--help] [-- TEST_ARGS...]
#   TEST_ARGS   passed to every test binary after the exclusions below
#               (a name filter, --nocapture, --test-threads=N)
#
# The crates, their unit tests only (--lib):
#   virtio-dmlc   the device ABI: request, response, config space and
#                 communicator layouts (zerocopy little-endian fields)
#   dmlc-driver   the guest side: split virtqueue (descriptors, rings),
#                 requests, the fake device, the /dev/dmlcN ioctl ABI
#   dmlc-reduce   the element kernels: spec 5.X.6.5.1 stores every element
#                 little-endian, whatever the CPU
#   dmlc-comm     the TCP communicator's frame headers (little-endian) and
#                 the reductions over them
# Left out: the crates' integration tests (driver/tests/*.rs and the like)
# start the vhost-device-dmlc daemon and dmlc-guest processes, which would
# have to be built for s390x and run under qemu-user too; the wire formats
# they cross are the ones the unit tests cover. Single tests that cannot run
# under qemu-user are skipped by name in SKIPS below, each with its reason.
#
# Needs: the rustup target s390x-unknown-linux-gnu, and the Debian packages
# gcc-s390x-linux-gnu, libc6-dev-s390x-cross (the linker and the target's
# libc) and qemu-user-static; the ones missing are installed (apt-get as
# root, rustup target add), or the script says which one it cannot get.
# Builds into $DMLC_CACHE/cross-endian/target (a folder of its own, kept in
# the cache: cargo rebuilds what changed, so a clean checkout does not
# compile every dependency for s390x again; about 7 minutes when empty).
# Exits non-zero if a build or any test fails, or if no test ran.

# shellcheck source=SCRIPTDIR/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh" cross-endian || exit 1
# shellcheck source=SCRIPTDIR/lib/ensure-packages.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/ensure-packages.sh"

TARGET=s390x-unknown-linux-gnu
CRATES=(virtio-dmlc dmlc-driver dmlc-reduce dmlc-comm)
# Tests that cannot run under qemu-user: full names (crate-relative paths,
# matched exactly), each with its reason.
SKIPS=(
    # These start the vhost-device-dmlc daemon (dmlc-test-support's
    # Backend): an s390x build of it would have to be run under qemu-user
    # too, and the test process execs it directly. The device path's wire
    # format is covered by dmlc-driver's unit tests (fake device, split
    # ring) and the element order by dmlc-reduce's.
    rabit::tests::init_from_the_environment_with_the_host_transport
    tests::device_and_tcp_agree_bitwise
    tests::device_comm_cuts_large_data_and_runs_every_collective
    tests::device_sendrecv_of_different_lengths_is_an_error
    tests::reduce_and_reduce_scatter_match_the_reference_on_device_and_tcp
    tests::sendrecv_shifts_a_ring_and_alltoall_transposes_blocks
)

test_args=()
while [[ $# -gt 0 ]]; do
    case $1 in
    -h | --help)
        script_header
        exit 0
        ;;
    --)
        shift
        test_args=("$@")
        break
        ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || die "cannot cd to $root"

# The toolchain pieces, installed where they can be.
command -v cargo >/dev/null || die "no cargo on PATH"
if ! rustup target list --installed 2>/dev/null | grep -qx "$TARGET"; then
    command -v rustup >/dev/null ||
        die "the Rust target $TARGET is not installed and there is no rustup to add it"
    log "rustup target add $TARGET"
    rustup target add "$TARGET" >&2 || die "rustup target add $TARGET failed"
fi
ensure_packages gcc-s390x-linux-gnu libc6-dev-s390x-cross qemu-user-static
for tool in s390x-linux-gnu-gcc qemu-s390x-static; do
    command -v "$tool" >/dev/null || die "$tool is not on PATH (its package is installed?)"
done
[[ -d /usr/s390x-linux-gnu/lib ]] || die "no s390x libc in /usr/s390x-linux-gnu (libc6-dev-s390x-cross)"

export CARGO_TARGET_S390X_UNKNOWN_LINUX_GNU_LINKER=s390x-linux-gnu-gcc
export CARGO_TARGET_S390X_UNKNOWN_LINUX_GNU_RUNNER="qemu-s390x-static -L /usr/s390x-linux-gnu"
export CARGO_TARGET_DIR=$CACHE/cross-endian/target
# Optimised a little: the kernels' tests run for minutes under emulation
# at opt-level 0. Debug assertions and overflow checks stay on (the dev
# profile's), and the separate target folder keeps target/ as it was.
export CARGO_PROFILE_DEV_OPT_LEVEL=${CARGO_PROFILE_DEV_OPT_LEVEL:-1}

pkgs=()
for c in "${CRATES[@]}"; do pkgs+=(-p "$c"); done
skip_args=()
for s in "${SKIPS[@]}"; do skip_args+=(--skip "$s"); done
if [[ ${#skip_args[@]} -gt 0 ]]; then
    skip_args+=(--exact)
fi

log "cargo test --locked --target $TARGET --lib ${pkgs[*]} (tests under qemu-s390x-static)"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
status=0
cargo test --locked --no-fail-fast --target "$TARGET" --lib "${pkgs[@]}" -- \
    "${skip_args[@]}" "${test_args[@]}" 2>&1 | tee "$out" || status=$?

# One "test result:" line per test binary; their sums, so that a run that
# built nothing or ran no test does not pass quietly.
read -r passed failed ignored binaries < <(awk '
    /^test result:/ { b++; p += $4; f += $6; i += $8 }
    END { printf "%d %d %d %d\n", p, f, i, b }' "$out")
log "$binaries test binaries on $TARGET: $passed passed, $failed failed, $ignored ignored"
[[ $status -eq 0 ]] || die "cargo test failed (exit $status)"
[[ $failed -eq 0 ]] || die "$failed tests failed"
[[ $binaries -eq ${#CRATES[@]} ]] ||
    die "expected ${#CRATES[@]} test binaries, saw $binaries"
[[ $passed -gt 0 ]] || die "no test ran"

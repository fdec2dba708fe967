#!/usr/bin/env bash
# The project's test command (README: "Run the tests").
#
# Installs what it needs, then runs, in order: rustfmt and clippy checks, the
# unit and integration tests of every crate (backend, driver, C ABI, hostile
# frontends, faults) over real vhost-user sockets, the unit tests of the
# ABI, driver and reductions on big-endian s390x under qemu-user, the
# Python package and its torch backend (pytest, with torch in a cached
# venv), the multi-host
# tests (two network namespaces, MPI between the daemons), a short soak, a short
# fuzzing run, the Debian packages installed and used in a clean Debian 12
# root with the service unit (packaging/test-debs.sh), two libvirt domains
# with the device (packaging/test-libvirt.sh), the kernel driver's
# build for the x86_64, aarch64 and riscv64 guest kernels
# (kernel-driver/build.sh --check), the patched XGBoost's cached build and
# its C++ test (xgboost-patches/), and last the system tests, which boot
# QEMU VMs with the virtio-dmlc device (tests/system/, launcher/tests/), the
# kernel driver's and the other architectures' among them, and the
# launcher's multi-host tests (TCG VMs in two network namespaces).
#
# Every stage prints its duration when it ends, and a summary of all of them
# comes last (also when a stage fails).
#
# Environment:
#   CI=true            a test that cannot run on this machine fails instead of
#                      skipping; as in the tests, any value but empty, "false"
#                      or "0" counts (.ci/run sets CI=true)
#   DMLC_CACHE=DIR     where slow build steps are cached (default ~/.cache/virtio-dmlc)
#   DMLC_ACCEL=kvm     run the system tests' VMs under KVM instead of TCG
#   DMLC_QEMU=PATH     a patched qemu-system-x86_64 to use instead of building one
set -euo pipefail
cd "$(dirname "$0")/.."

# Same rule as the tests' under_ci(): set, and not empty, "false" or "0".
under_ci() {
  case "${CI:-}" in
  '' | false | 0) return 1 ;;
  *) return 0 ;;
  esac
}

stage=""
stage_start=$SECONDS
durations=()
# Ends the running stage: prints its duration and keeps it for the summary.
end_stage() {
  [ -n "$stage" ] || return 0
  local took=$((SECONDS - stage_start))
  printf '<== %s: %d s\n' "$stage" "$took"
  durations+=("$(printf '%6d s  %s' "$took" "$stage")")
  stage=""
}
step() {
  end_stage
  stage="$*"
  stage_start=$SECONDS
  printf '\n==> %s\n' "$*"
}
summary() {
  local rc=$?
  end_stage
  printf '\n== stage durations (%s after %d s)\n' \
    "$([ "$rc" -eq 0 ] && echo passed || echo "FAILED, exit $rc")" "$SECONDS"
  printf '%s\n' "${durations[@]}"
}
trap summary EXIT
# A stopped run is not a passed one (without these the summary said "passed").
trap 'exit 130' INT
trap 'exit 143' TERM

need_cmd() { command -v "$1" >/dev/null 2>&1; }
# shellcheck source=tests/lib/import-env.sh
. tests/lib/import-env.sh

step "checking tools"
for tool in cargo rustc cc; do
  if ! need_cmd "$tool"; then
    echo "error: '$tool' is not installed; the tests need a Rust toolchain and a C compiler" >&2
    exit 1
  fi
done
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  rustup component add rustfmt clippy
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "tests/lib/import-env.sh: a failed build script fails the run"
tests/lib/test-import-env.sh

step "docs: the spec's conformance table (docs/check-conformance.sh)"
docs/check-conformance.sh

step "docs: every figure traced to a raw output from a committed tree (docs/check-figures.sh)"
docs/test-check-figures.sh
docs/check-figures.sh

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo build (debug: the binaries and the C library the tests use)"
cargo build --workspace --locked

step "virtiofsd for guests with the host's userland (built once, then cached)"
# vm-smoke (in the next stage) and the DDP system test boot such guests.
import_env DMLC_VIRTIOFSD -- vm-harness/build-virtiofsd.sh --env

step "cargo test --workspace"
cargo test --workspace --locked --no-fail-fast

step "big-endian: the ABI's, driver's, reductions' and communicators' unit tests on s390x under qemu-user (tests/cross-endian.sh)"
# Every guest here is little-endian, as the device's rings and elements are;
# on a big-endian CPU each of those is a byte swap the code must make (its
# cargo target folder is kept in the cache: about 7 minutes when empty,
# under a minute after; six tests that start the daemon are skipped by
# name).
tests/cross-endian.sh

step "python: the dmlc package and its torch backend (ruff; pytest and torch's distributed suite over the host transport)"
# A cached virtual environment with torch (python/venv.sh: a few minutes the
# first time, for the torch download), the package installed into it as a
# user would (`pip install ./python`), then the suites against the debug
# build of the C library and the backend. pip builds the library and the
# daemon that the wheel bundles with cargo (release): into a target folder
# kept in the cache, so that the first run on a machine builds them (3.5 to
# 7 minutes) and later runs only check them (seconds).
venv=$(python/venv.sh)
py_cargo_target=${DMLC_CACHE:-$HOME/.cache/virtio-dmlc}/python/cargo-target
CARGO_TARGET_DIR=$py_cargo_target \
  "$venv/bin/pip" install --disable-pip-version-check -q --no-deps --force-reinstall ./python
py_files=(python bench/study bench/rsh-agent.py bench/arch-tcg.py bench/torch-ddp.py bench/torch-parallel.py bench/torchjobs.py bench/tcg-cpu.py bench/guest-allreduce.py bench/guest-p2p.py bench/p2p-vms.py
  examples/torch examples/xgboost examples/lightgbm examples/sklearn_data.py
  launcher/src/rabit_tracker.py launcher/tests/test_rabit_tracker.py)
"$venv/bin/ruff" check --config python/pyproject.toml "${py_files[@]}"
"$venv/bin/ruff" format --check --config python/pyproject.toml "${py_files[@]}"
(cd python && DMLC_LIBRARY="$PWD/../target/debug/libdmlc_guest.so" \
  DMLC_BACKEND_BIN="$PWD/../target/debug/vhost-device-dmlc" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests)
# PyTorch's own distributed suite (DistributedTest._DistTestBase of the wheel)
# on "dmlc" next to gloo, subset ci (every op; about 25 s, gloo's results
# cached per torch version): fails on any failure not in its exclusions.toml.
"$venv/bin/pip" install --disable-pip-version-check -q -r python/tests/torch_suite/requirements.txt
DMLC_LIBRARY="$PWD/target/debug/libdmlc_guest.so" DMLC_BACKEND_BIN="$PWD/target/debug/vhost-device-dmlc" \
  "$venv/bin/python" python/tests/torch_suite/run.py --subset ci
# The tracker wrapper of dmlc-qemu --tracker rabit: rank = DMLC_TASK_ID with 12
# workers on the host (about 10 s).
"$venv/bin/python" -m pytest -q -p no:cacheprovider launcher/tests/test_rabit_tracker.py

step "python: pip install './python[torch]' in a new venv, then dmlc-run of a 2-rank job, no DMLC_LIBRARY (tests/python-install.sh)"
# The install as python/README.md gives it, in a new environment that borrows
# the cached one's torch: the wheel's library and daemon, torchrun's
# --max-restarts through dmlc-run, a failed rank's exit status (about 45 s;
# the cargo target folder of the stage above).
CARGO_TARGET_DIR=$py_cargo_target tests/python-install.sh

step "multi-host: 2 hosts as network namespaces, MPI between the daemons (--features mpi)"
# vhost-device/tests/multihost.rs: every opcode against the guest's scalar
# reference (L = 1 and 2), a mismatch, a killed member, a killed daemon
# (docs/multi-host.md). Needs root (namespaces), Open MPI, libclang (the mpi
# crate's bindgen) and iproute2, installed with apt-get when missing. Run
# after the stages that use target/debug/vhost-device-dmlc: this build
# replaces it with the mpi one (a superset).
mh_missing=()
for p in openmpi-bin libopenmpi-dev libclang-dev iproute2; do
  [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == *"ok installed"* ]] || mh_missing+=("$p")
done
if [ ${#mh_missing[@]} -gt 0 ] && [ "$(id -u)" -eq 0 ] && need_cmd apt-get; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${mh_missing[@]}" ||
    { apt-get -qq update &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${mh_missing[@]}"; }
  mh_missing=()
fi
if [ ${#mh_missing[@]} -eq 0 ]; then
  cargo test --locked -p vhost-device-dmlc --features mpi --test multihost -- --test-threads=1
elif under_ci; then
  echo "error: the multi-host tests need ${mh_missing[*]} (install them as root)" >&2
  exit 1
else
  echo "SKIP multi-host tests: missing ${mh_missing[*]} (install them as root)" >&2
fi

step "soak: 2 daemons x 4 host ranks, every completion checked (short run)"
# The full run is dmlc-soak with its defaults: 1,000,000 small and 1,000
# 16 MiB allreduces per group (docs/reliability.md).
cargo build --release --locked -p dmlc-soak -p vhost-device-dmlc
target/release/dmlc-soak --small 100000 --large 100 --progress-secs 0
target/release/dmlc-soak --small 20000 --large 10 --kill-one --progress-secs 0
target/release/dmlc-soak --small 20000 --large 10 --kill-daemon --progress-secs 0

step "fuzzing: lint and the harness's own unit tests (stable, no cargo-fuzz)"
cargo fmt --manifest-path fuzz/Cargo.toml -- --check
cargo clippy --manifest-path fuzz/Cargo.toml --all-targets --locked -- -D warnings
# The seeds' outcomes, the committed reproducers and mutated seeds, without
# libFuzzer's instrumentation (the fuzz targets themselves have test = false).
cargo test --manifest-path fuzz/Cargo.toml --locked --lib

step "fuzzing: 60 s per target (cargo-fuzz, cached after the first install)"
# The long run is fuzz/run.sh 600 (fuzz/README.md, docs/reliability.md).
fuzz/run.sh 60

step "packages: the .debs (packaging/build-debs.sh) installed and used in a clean Debian 12 root, the service unit"
# packaging/test-debs.sh: apt-get install of the five packages in a chroot of
# a cached mmdebstrap root, the daemon's --help, the library through
# pkg-config and a C program, the DKMS module built for the guest kernel's
# headers; inside it packaging/test-service.sh: systemd-analyze verify and
# the daemon run from the unit's ExecStart= and config (docs/packaging.md).
# Before the VM stages, which end the run early when QEMU cannot be built.
# Needs root (chroot, mount and network namespaces).
if [ "$(id -u)" -eq 0 ]; then
  packaging/build-debs.sh --out target/debian >/dev/null
  packaging/test-debs.sh --debs target/debian
elif under_ci; then
  echo "error: the package tests need root (mmdebstrap, chroot, namespaces)" >&2
  exit 1
else
  echo "SKIP package tests: they need root (mmdebstrap, chroot, namespaces)" >&2
fi

step "system tests: patched QEMU (built once, then cached)"
if import_env DMLC_QEMU DMLC_QEMU_FIRMWARE -- qemu-patches/build-qemu.sh --env; then
  echo "QEMU: $DMLC_QEMU"
elif under_ci; then
  echo "error: cannot build the patched QEMU; the system tests cannot run" >&2
  exit 1
else
  echo "SKIP system tests: cannot build the patched QEMU (set DMLC_QEMU to use your own)" >&2
  exit 0
fi

step "system tests: release builds of the guest program and the backend"
# The guests run dmlc-guest (stripped into the image) and pci_probe under
# emulation, where a debug build is many times slower.
cargo build --release --locked -p dmlc-guest -p vhost-device-dmlc -p dmlc-example-digits --bins
cargo build --release --locked -p dmlc-driver --example pci_probe
cargo build --release --locked -p dmlc-capi
# The same programs for aarch64 and riscv64 guests, copied into
# target/TRIPLE/release (Debian's cross linkers, installed when missing;
# cargo builds in a target folder kept in the cache: 2 to 4 minutes per
# architecture when it is empty, seconds after): the launcher's --arch tests
# and the cross-built kernel module's find them beside the host's.
tests/image/cross-build.sh aarch64 riscv64
export DMLC_GUEST_BIN=$PWD/target/release/dmlc-guest
export DMLC_TRAINER_BIN=$PWD/target/release/dmlc-train-digits
export DMLC_PCI_PROBE_BIN=$PWD/target/release/examples/pci_probe
export DMLC_BACKEND_BIN=$PWD/target/release/vhost-device-dmlc
# The DDP test (launcher/tests/system.rs) runs the venv's Python in VMs on
# the host's userland, with the release C library.
export DMLC_LIBRARY=$PWD/target/release/libdmlc_guest.so
export DMLC_PYTHON=$venv/bin/python

step "libvirt: 2 domains of packaging/libvirt/dmlc-domain.xml pass the self-test against one daemon"
# packaging/test-libvirt.sh: Debian's libvirt (installed with apt-get when
# missing), virtlogd, virtlockd and libvirtd started by hand in a private
# mount namespace, virt-xml-validate, virsh define and start of 2 domains with
# the patched QEMU as emulator, run as libvirt-qemu (docs/qemu.md, "libvirt";
# about 20 s, plus the install the first time). Needs root.
if [ "$(id -u)" -eq 0 ]; then
  packaging/test-libvirt.sh
elif under_ci; then
  echo "error: the libvirt test needs root (apt-get, libvirtd, mount namespaces)" >&2
  exit 1
else
  echo "SKIP libvirt test: it needs root (apt-get, libvirtd, mount namespaces)" >&2
fi

step "kernel driver: virtio_dmlc.ko against Debian's headers for the x86_64, aarch64 and riscv64 guest kernels (cached), W=1, sparse, checkpatch"
# kernel-driver/build.sh fetches the headers (and checkpatch.pl from the
# kernel's source package) once through tests/image/build-image.sh.
import_env DMLC_KMOD DMLC_KTEST -- kernel-driver/build.sh --check
# The same module cross-built for the aarch64 (6.1, sparse too) and riscv64
# (6.12) guest kernels, into target/kernel-driver/ARCH/ (their headers
# cached like the host's; the system test loads them in VMs).
kernel-driver/build.sh --check --arch aarch64 >/dev/null
kernel-driver/build.sh --check --arch riscv64 >/dev/null

step "XGBoost with the virtio-dmlc collective: patched build (cached) and its C++ test over the host transport"
# xgboost-patches/build-xgboost.sh: XGBoost 3.2.0 from PyPI's sdist with the
# patch series, cached by the series' and the script's hash (a cold build is
# about 10 minutes on 2 busy cores; cached, a second). The GTest runs against
# a daemon with 2 sockets and the release C library; the VM test of the
# device path (next stages but one) puts DMLC_XGBOOST_PYTHONPATH on PYTHONPATH.
import_env DMLC_XGBOOST_PYTHONPATH DMLC_XGBOOST_GTEST -- xgboost-patches/build-xgboost.sh --env
xgboost-patches/build-xgboost.sh --test

step "study: the report from its committed JSON, in headless Chromium; dmlc-qemu study on host processes end to end"
# bench/study (docs/study.md): its Python environment is the torch one plus
# matplotlib (bench/study/venv.sh, cached; about 20 s the first time), and
# the page test needs Debian's chromium (installed when missing, about a
# minute). The study proper, in VMs, takes 10 minutes: CI runs its host
# cells only (about a minute), measured afresh into a temporary folder.
if ! command -v chromium >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null ||
    { apt-get -qq update && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
fi
study_venv=$(bench/study/venv.sh)
PYTHONPATH=bench "$study_venv/bin/python" -m pytest -q -p no:cacheprovider bench/study/tests
study_out=$(mktemp -d)
cargo build --release --locked -p dmlc-qemu
target/release/dmlc-qemu study --quick --only 'ddp-mlp/host/*' 'projection/*' --places host \
  --fresh --out "$study_out"
for f in index.html report.md study.json log.txt; do
  [ -s "$study_out/$f" ] || { echo "error: dmlc-qemu study wrote no $f" >&2; exit 1; }
done
# A second run measures nothing: every cell comes from the cache (as an
# interrupted study resumes).
target/release/dmlc-qemu study --quick --only 'ddp-mlp/host/*' 'projection/*' --places host \
  --out "$study_out" 2>&1 | tee "$study_out/again.txt"
[ "$(grep -c ': cached (' "$study_out/again.txt")" -eq 3 ] ||
  { echo "error: a second dmlc-qemu study did not take its 3 cells from the cache" >&2; exit 1; }
rm -rf "$study_out"

step "system tests: VMs (${DMLC_ACCEL:-tcg}), one test at a time"
cargo test --locked -p dmlc-system-tests --test system -- --test-threads=1

step "Debian trixie roots of x86_64, aarch64 and riscv64 (tests/image/build-rootfs.sh: cached; cold, tens of minutes each for aarch64 and riscv64)"
# The launcher's DDP across three instruction sets (next stage) boots each
# VM on its architecture's root; built here so that its cost shows apart.
for arch in x86_64 aarch64 riscv64; do
  tests/image/build-rootfs.sh --arch "$arch" >/dev/null
done

step "system tests: dmlc-qemu submit with the digits example, DDP (userspace and kernel driver) and XGBoost (TCP, and the device with the patched build) on 2 VMs; the self-test on aarch64, riscv64 and mixed groups, DDP across the three"
cargo test --locked -p dmlc-qemu --test system -- --test-threads=1

step "multi-host with the launcher: dmlc-qemu submit --hosts, 2 namespaces of TCG VMs"
# launcher/tests/multihost.rs: 2 hosts x 2 VMs run the self-test from a
# hostfile; a failed worker on one host stops the other; Ctrl-C stops both (docs/multi-host.md,
# "With the launcher"). Needs what the multi-host stage needs and the mpi
# build of the backend in release, which replaces the default one at
# target/release/vhost-device-dmlc (a superset; no later stage uses it).
if [ ${#mh_missing[@]} -eq 0 ]; then
  cargo build --release --locked -p vhost-device-dmlc --features mpi
  cargo test --locked -p dmlc-qemu --test multihost -- --test-threads=1
elif under_ci; then
  echo "error: the launcher's multi-host tests need ${mh_missing[*]} (install them as root)" >&2
  exit 1
else
  echo "SKIP launcher multi-host tests: missing ${mh_missing[*]} (install them as root)" >&2
fi

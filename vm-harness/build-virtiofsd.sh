#!/usr/bin/env bash
# Build virtiofsd (the rust-vmm vhost-user virtio-fs daemon, crate
# `virtiofsd` on crates.io; not a Debian bookworm package) once, and print
# the binary's path on the last line of stdout. Progress goes to stderr.
#
# Usage: build-virtiofsd.sh [--env | --help]
#
#   (no option)  build (or reuse) virtiofsd, print the binary's path
#   --env        the same, but print the shell assignment DMLC_VIRTIOFSD=PATH
#
# Environment:
#   DMLC_VIRTIOFSD   a virtiofsd of your own: printed as it is, nothing is built
#   DMLC_CACHE       cache root (default: $HOME/.cache/virtio-dmlc); the
#                    binary goes to $DMLC_CACHE/virtiofsd/VERSION/bin/virtiofsd
#   CARGO            cargo to build with (default: cargo on PATH)
#
# The build runs `cargo install --locked virtiofsd --version VERSION` (the
# crate's own Cargo.lock) and needs Debian's libcap-ng-dev and
# libseccomp-dev, installed with apt-get when missing (as root). A lock
# ($DMLC_CACHE/virtiofsd/.lock) serialises concurrent runs. About 3 to 6
# minutes on 2 cores the first time; then instant.

# shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" build-virtiofsd || exit 1

readonly VERSION=1.14.0
readonly BUILD_PACKAGES=(gcc libcap-ng-dev libseccomp-dev)
readonly DIR="$CACHE/virtiofsd"
readonly OUT="$DIR/$VERSION"
readonly BIN="$OUT/bin/virtiofsd"

usage() { script_header; }

mode=build
case "${1:-}" in
"") ;;
--env) mode="env" ;;
-h | --help)
    usage
    exit 0
    ;;
*)
    usage >&2
    die "unknown option: $1"
    ;;
esac
[[ $# -le 1 ]] || die "expected at most one option"

report() {
    if [[ $mode == env ]]; then
        printf 'DMLC_VIRTIOFSD=%q\n' "$1"
    else
        echo "$1"
    fi
}

# A binary that runs and names the version we build.
works() {
    [[ -x $1 && -f $1 ]] && "$1" --version 2>/dev/null | grep -q "$VERSION"
}

if [[ -n ${DMLC_VIRTIOFSD:-} ]]; then
    [[ -x $DMLC_VIRTIOFSD && -f $DMLC_VIRTIOFSD ]] ||
        die "DMLC_VIRTIOFSD=$DMLC_VIRTIOFSD is not an executable file"
    report "$DMLC_VIRTIOFSD"
    exit 0
fi

if works "$BIN"; then
    log "using cached $BIN"
    report "$BIN"
    exit 0
fi

cache_lock "$DIR/.lock"
# Another run may have built it meanwhile.
if works "$BIN"; then
    log "using cached $BIN"
    report "$BIN"
    exit 0
fi

# shellcheck source=SCRIPTDIR/../tests/lib/ensure-packages.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/ensure-packages.sh"
ensure_packages "${BUILD_PACKAGES[@]}"

cargo=${CARGO:-cargo}
command -v "$cargo" >/dev/null || die "cargo not found (install Rust, or set CARGO)"

work="$OUT.tmp"
rm -rf "$work"
mkdir -p "$work"
log "building virtiofsd $VERSION with $("$cargo" --version) (log: $work/build.log)"
start=$(date +%s)
# A target dir of our own so the build neither touches nor waits on a
# workspace's target/; removed after a successful build.
"$cargo" install --locked virtiofsd --version "$VERSION" --root "$work" \
    --target-dir "$DIR/target" >"$work/build.log" 2>&1 &
pid=$!
last=$start
while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    now=$(date +%s)
    if ((now - last >= 30)); then
        log "compiling: $(grep -cE '^ +Compiling ' "$work/build.log" || true) crates after $((now - start)) s"
        last=$now
    fi
done
rc=0
wait "$pid" || rc=$?
if [[ $rc -ne 0 ]]; then
    tail -n 40 "$work/build.log" >&2
    die "cargo install virtiofsd $VERSION failed; see $work/build.log"
fi
works "$work/bin/virtiofsd" || die "the built $work/bin/virtiofsd does not run or is not $VERSION"
log "built in $(($(date +%s) - start)) s"
rm -f "$work/.crates.toml" "$work/.crates2.json"
rm -rf "$OUT" "$DIR/target"
mv "$work" "$OUT"
report "$BIN"

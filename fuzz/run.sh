#!/usr/bin/env bash
# Builds the fuzz targets with cargo-fuzz (libFuzzer), replays the
# committed crash reproducers, then fuzzes each target for a bounded time
# and prints executions, exec/s, coverage and crashes per target.
#
# Usage: fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]
#   SECONDS_PER_TARGET  default 60 (the CI run); 600 for the documented long run
#   TARGET              default: every target (request_header descriptor_chain
#                       comm_header)
# Environment:
#   DMLC_CACHE            cache root (default ~/.cache/virtio-dmlc); cargo-fuzz is
#                         installed into $DMLC_CACHE/cargo-fuzz-<version>
#   DMLC_FUZZ_SANITIZER   address (default) or none
#   DMLC_FUZZ_JOBS        libFuzzer workers per target (default 1)
# Exits non-zero, loudly, on a build failure, a failing reproducer or a crash.
#
# Only stable Rust is needed: cargo-fuzz's unstable compiler flags are
# allowed with RUSTC_BOOTSTRAP=1, and the sanitizer runtimes ship with the
# stable toolchain.

# shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" fuzz || exit 1

CARGO_FUZZ_VERSION=0.13.2
ALL_TARGETS=(request_header descriptor_chain comm_header)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
secs=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${ALL_TARGETS[@]}")
sanitizer=${DMLC_FUZZ_SANITIZER:-address}
jobs=${DMLC_FUZZ_JOBS:-1}
tooldir=$CACHE/cargo-fuzz-$CARGO_FUZZ_VERSION

# Louder than the prologue's die: a fuzzing failure must stand out in CI logs.
die() {
    echo >&2
    echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" >&2
    echo "!!! FUZZ FAILURE: $*" >&2
    echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!" >&2
    exit 1
}

case $secs in
'' | *[!0-9]* | 0) die "seconds per target must be a positive number, not '$secs'" ;;
esac
for t in "${targets[@]}"; do
    [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || die "unknown target '$t' (targets: ${ALL_TARGETS[*]})"
done

# cargo-fuzz, keyed by version so that a CI cache keeps it.
if [ ! -x "$tooldir/bin/cargo-fuzz" ]; then
    echo "== installing cargo-fuzz $CARGO_FUZZ_VERSION into $tooldir"
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked --root "$tooldir" ||
        die "cargo install cargo-fuzz $CARGO_FUZZ_VERSION failed"
fi
export PATH="$tooldir/bin:$PATH"
export RUSTC_BOOTSTRAP=1

cd "$root" || exit
triple=$(rustc -vV | sed -n 's/^host: //p')
bindir=${CARGO_TARGET_DIR:-$here/target}/$triple/release

mkdir -p "$here/logs"
echo "== building fuzz targets (sanitizer: $sanitizer)"
t0=$(date +%s)
if [ ${#targets[@]} -eq ${#ALL_TARGETS[@]} ]; then
    # One cargo invocation builds every target.
    cargo fuzz build --fuzz-dir "$here" -s "$sanitizer" || die "cargo fuzz build failed"
else
    for t in "${targets[@]}"; do
        cargo fuzz build --fuzz-dir "$here" -s "$sanitizer" "$t" || die "cargo fuzz build $t failed"
    done
fi
echo "== built in $(($(date +%s) - t0)) s"

# Reproducers of crashes found earlier must pass now.
for t in "${targets[@]}"; do
    mapfile -t repro < <(find "$here/regressions/$t" -type f ! -name '.*' 2>/dev/null | sort)
    [ ${#repro[@]} -gt 0 ] || continue
    echo "== replaying ${#repro[@]} regression input(s) of $t"
    if ! "$bindir/$t" "${repro[@]}" >"$here/logs/$t-regressions.log" 2>&1; then
        grep -A4 -m1 'panicked at' "$here/logs/$t-regressions.log" >&2 ||
            tail -40 "$here/logs/$t-regressions.log" >&2
        die "$t: a regression input fails again (log: fuzz/logs/$t-regressions.log)"
    fi
done

summary=()
crashed=()
for t in "${targets[@]}"; do
    corpus=$here/corpus/$t
    artifacts=$here/artifacts/$t
    log=$here/logs/$t.log
    mkdir -p "$corpus" "$artifacts"
    marker=$(mktemp)
    echo "== fuzzing $t for $secs s (corpus fuzz/corpus/$t, log fuzz/logs/$t.log)"
    rc=0
    extra=()
    [ "$jobs" -le 1 ] || extra=(-fork="$jobs")
    # The target writes its seeds into the corpus before libFuzzer reads it.
    DMLC_FUZZ_SEED_DIR=$corpus "$bindir/$t" \
        -artifact_prefix="$artifacts/" -max_total_time="$secs" -timeout=10 \
        -print_final_stats=1 "${extra[@]}" "$corpus" >"$log" 2>&1 || rc=$?
    stat() { sed -n "s/^stat::$1: *//p" "$log" | tail -1; }
    execs=$(stat number_of_executed_units)
    rate=$(stat average_exec_per_sec)
    last=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -1 || true)
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
    ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
    corp=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$last")
    if [ -z "$execs" ]; then
        execs=$(sed -n 's/^#\([0-9]*\).*/\1/p' <<<"$last")
        rate=$(sed -n 's/.* exec\/s: \([0-9]*\).*/\1/p' <<<"$last")
    fi
    new=$(find "$artifacts" -type f -newer "$marker" | sort)
    rm -f "$marker"
    ncrash=$(grep -c . <<<"$new" || true)
    line=$(printf '%-18s executions %10s  exec/s %7s  coverage %5s edges, %5s features  corpus %5s  crashes %s' \
        "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$ncrash")
    echo "$line"
    summary+=("$line")
    if [ "$rc" -ne 0 ] || [ "$ncrash" -ne 0 ]; then
        # The panic message says which invariant broke; else the sanitizer report.
        grep -A4 -m1 'panicked at' "$log" >&2 || grep -A30 -m1 'ERROR: ' "$log" >&2 || tail -40 "$log" >&2
        crashed+=("$t (exit $rc): ${new:-no artifact written}")
    fi
done

echo
echo "== fuzz summary ($secs s per target, sanitizer $sanitizer)"
printf '%s\n' "${summary[@]}"
if [ ${#crashed[@]} -gt 0 ]; then
    for c in "${crashed[@]}"; do echo "crash: $c" >&2; done
    echo "Reproduce with: $bindir/TARGET ARTIFACT; keep the (minimised: -minimize_crash=1) input in fuzz/regressions/TARGET/." >&2
    die "the fuzzer found ${#crashed[@]} crashing target(s)"
fi

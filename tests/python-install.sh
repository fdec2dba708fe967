#!/usr/bin/env bash
# Checks the Python package as a user installs and runs it (python/README.md,
# "Install"): in a new virtual environment, `pip install './python[torch]'`
# (pip builds the C library and the daemon with cargo and bundles both in the
# wheel), then the one command, `dmlc-run --nproc-per-node 2 SCRIPT`, from
# the environment's bin/ with DMLC_LIBRARY and DMLC_BACKEND_BIN unset, on
# python/tests/install_job.py: each rank checks an allreduce against its
# formula and that the library it loaded is the one inside the new
# environment. Then the same job with a rank that fails in the first attempt
# and --max-restarts 1 (must pass: torchrun's flags pass through and the
# restarted ranks reconnect to the daemon), and with a rank that always exits
# 3 (dmlc-run must exit 3).
#
# torch: by default the new environment borrows python/venv.sh's (a .pth file
# naming a folder of links to that environment's packages, the dmlc package
# left out), so that pip finds torch installed and downloads nothing;
# --fresh-torch lets pip install it from PyPI as on a new machine (a 539 MB
# wheel and its CUDA dependencies, 5.4 GB installed: minutes).
#
# Cargo builds into $CARGO_TARGET_DIR, by default the cache's
# python/cargo-target, kept between runs: the first run builds the library
# and the daemon in release (3.5 to 7 minutes on 2 shared cores), later ones
# only what changed (the whole check then takes about 45 s).
#
# Usage: tests/python-install.sh [--fresh-torch] [--keep]
#   --keep   leave the new environment (its path is printed) for a look

# shellcheck source=SCRIPTDIR/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh" python-install || exit 1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

fresh=0
keep=0
for arg; do
  case $arg in
  --fresh-torch) fresh=1 ;;
  --keep) keep=1 ;;
  -h | --help)
    script_header
    exit 0
    ;;
  *) die "unknown argument $arg (see --help)" ;;
  esac
done

python=${PYTHON:-python3}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$CACHE/python/cargo-target}
# Nothing may point the job at a library or daemon outside the environment.
unset DMLC_LIBRARY DMLC_BACKEND_BIN DMLC_SOCKET DMLC_SOCKET_PREFIX DMLC_DEVICE VIRTUAL_ENV PYTHONPATH

work=$(mktemp -d "${TMPDIR:-/tmp}/dmlc-install.XXXXXX")
if [ "$keep" = 1 ]; then
  trap 'log "kept: $work/venv"' EXIT
else
  trap 'rm -rf "$work"' EXIT
fi
venv=$work/venv
start=$SECONDS
"$python" -m venv "$venv" >&2
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')

if [ "$fresh" = 0 ]; then
  lender=$("$repo/python/venv.sh")
  lender_site=$("$lender/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  mkdir "$work/borrowed"
  for p in "$lender_site"/*; do
    case $(basename "$p") in
    dmlc | dmlc-* | dmlc.* | __editable__* | pip | pip-* | setuptools | setuptools-* | \
      _distutils_hack | *.pth | __pycache__) ;;
    *) ln -s "$p" "$work/borrowed/" ;;
    esac
  done
  echo "$work/borrowed" >"$site/borrowed-from-venv-sh.pth"
  log "torch (and numpy) borrowed from $lender"
fi

# The documented commands, from the checkout's root.
cd "$repo" || exit 1
t=$SECONDS
log "pip install './python[torch]' (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
"$venv/bin/pip" install --disable-pip-version-check --progress-bar off -q './python[torch]'
log "installed in $((SECONDS - t)) s"

# What the wheel put where: the library in the package, the daemon in bin/,
# a wheel for any Python 3.
grep -qx 'Tag: py3-none-linux_[a-z0-9_]*' "$site"/dmlc-*.dist-info/WHEEL ||
  die "the wheel is not tagged py3-none-PLATFORM: $(grep Tag: "$site"/dmlc-*.dist-info/WHEEL)"
[ -f "$site/dmlc/libdmlc_guest.so" ] || die "no $site/dmlc/libdmlc_guest.so"
[ -x "$venv/bin/vhost-device-dmlc" ] || die "no $venv/bin/vhost-device-dmlc"
[ -x "$venv/bin/dmlc-run" ] || die "no $venv/bin/dmlc-run"

export PATH=$venv/bin:$PATH
job=python/tests/install_job.py

# run_job EXPECTED_STATUS [dmlc-run's arguments...]: runs dmlc-run, shows
# its output, and fails unless it exits with EXPECTED_STATUS; the output is
# left in $out.
out=$work/out.txt
run_job() {
  local want=$1 rc=0
  shift
  log "dmlc-run $*"
  (cd "$work" && dmlc-run "$@") >"$out" 2>&1 || rc=$?
  sed 's/^/    /' "$out" >&2
  [ "$rc" = "$want" ] || die "dmlc-run $* exited with $rc, not $want"
}
# passed N ATTEMPT: N rank lines of a successful allreduce in attempt ATTEMPT.
passed() {
  local n
  # -o counts occurrences, not lines: robust even if two ranks' lines meet.
  n=$(grep -o "equals the formula (attempt $2, library $site/dmlc/libdmlc_guest.so)" "$out" | wc -l || true)
  [ "$n" = "$1" ] || die "$n ranks, not $1, passed in attempt $2"
  grep -q "^dmlc-run: $venv/bin/vhost-device-dmlc serves" "$out" ||
    die "the daemon was not the one installed in $venv/bin"
}

t=$SECONDS
run_job 0 --nproc-per-node 2 "$repo/$job"
passed 2 0
run_job 0 --nproc-per-node 2 --max-restarts 1 "$repo/$job" --fail-once-rank 1
passed 2 1
run_job 3 --nproc-per-node 2 "$repo/$job" --fail-rank 1
log "3 jobs in $((SECONDS - t)) s; all passed in $((SECONDS - start)) s"

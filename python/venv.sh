#!/usr/bin/env bash
# Prints the path of a virtual environment with python/requirements-test.txt
# installed (torch included), creating it on first use. It is cached under
# $DMLC_CACHE/python/KEY (default ~/.cache/virtio-dmlc), KEY a hash of the
# requirements and the Python version, so a change to either makes a new
# one. The first run downloads torch (a 539 MB wheel and its CUDA
# dependencies, about 5.4 GB installed): a few minutes.
#
# Usage: python/venv.sh            (progress on stderr, the path on stdout)

# shellcheck source=SCRIPTDIR/../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../tests/lib/prologue.sh" venv || exit 1
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}

command -v "$python" >/dev/null 2>&1 || die "$python is not installed"
version=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
key=$( (cat "$here/requirements-test.txt"; echo "$version") | sha256sum | cut -c1-16)
venv=$CACHE/python/$key/venv
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
  log "cached: $venv"
  echo "$venv"
  exit 0
fi
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
if ! "$python" -m venv "$venv" >&2; then
  log "python3 -m venv failed; installing python3-venv"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
  "$python" -m venv "$venv" >&2
fi
log "installing $(grep -vc '^#' "$here/requirements-test.txt") packages (torch takes a few minutes the first time)"
start=$SECONDS
"$venv/bin/pip" install --disable-pip-version-check --progress-bar off -q \
  -r "$here/requirements-test.txt" >&2
touch "$venv/.complete"
log "ready in $((SECONDS - start)) s: $venv"
echo "$venv"

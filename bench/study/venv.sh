#!/usr/bin/env bash
# Prints the path of the study's Python environment, creating it on first
# use: a small virtual environment with bench/study/requirements.txt
# (matplotlib) that also sees the packages of python/venv.sh's environment
# (torch, numpy) through a .pth file, so torch is not installed twice. It
# is cached under $DMLC_CACHE/study/venv-KEY, KEY a hash of both
# requirement files and the Python version.
#
# Usage: bench/study/venv.sh     (progress on stderr, the path on stdout)

# shellcheck source=SCRIPTDIR/../../tests/lib/prologue.sh
. "$(dirname "${BASH_SOURCE[0]}")/../../tests/lib/prologue.sh" study-venv || exit 1
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
base=$("$root/python/venv.sh")
python=$base/bin/python
version=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
key=$( (cat "$here/requirements.txt" "$root/python/requirements-test.txt"; echo "$version") |
  sha256sum | cut -c1-16)
venv=$CACHE/study/venv-$key
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
  echo "$venv"
  exit 0
fi
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"$python" -m venv --without-pip "$venv" >&2
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))' >"$site/base-venv.pth"
log "installing $(grep -vc '^#' "$here/requirements.txt") package(s) over $base"
# The base environment's pip installs into this one's site-packages; the
# .pth makes torch and numpy visible, so pip does not fetch them again.
"$python" -m pip install --disable-pip-version-check --progress-bar off -q \
  --prefix "$venv" -r "$here/requirements.txt" >&2
touch "$venv/.complete"
echo "$venv"

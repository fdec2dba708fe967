#!/usr/bin/env bash
# Fetches the handwritten-digits data that scikit-learn ships
# (sklearn/datasets/data/digits.csv.gz, from the UCI "Optical Recognition of
# Handwritten Digits" data set) out of a pinned scikit-learn wheel on PyPI,
# checks its sha256, caches it, and prints its path on stdout (and nothing
# else there). Later runs print the cached file's path without fetching.
#
# Cache: ${DMLC_CACHE:-$HOME/.cache/virtio-dmlc}/data/digits.csv.gz, with
# scikit-learn's licence (scikit-learn-COPYING) and data description
# (digits.rst) beside it. Needs python3 with pip; the wheel is chosen by
# explicit platform tags, so any local Python version gets the same file.
set -euo pipefail

SKLEARN_VERSION=1.5.2
# sha256 of sklearn/datasets/data/digits.csv.gz in that wheel.
CSV_SHA256=09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22

cache="${DMLC_CACHE:-$HOME/.cache/virtio-dmlc}/data"
out="$cache/digits.csv.gz"

matches() {
    [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$CSV_SHA256" ]
}

if matches "$out"; then
    echo "$out"
    exit 0
fi

mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "fetch-data.sh: downloading scikit-learn $SKLEARN_VERSION from PyPI for its digits data" >&2
python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --platform manylinux_2_17_x86_64 --python-version 3.12 \
    --implementation cp --dest "$tmp" "scikit-learn==$SKLEARN_VERSION" >&2

wheels=("$tmp"/scikit_learn-"$SKLEARN_VERSION"-*.whl)
if [ ! -f "${wheels[0]}" ]; then
    echo "fetch-data.sh: pip downloaded no scikit-learn $SKLEARN_VERSION wheel" >&2
    exit 1
fi

python3 - "${wheels[0]}" "$tmp" "$SKLEARN_VERSION" <<'PY'
import sys, zipfile
wheel, dest, version = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for member, name in [
        ("sklearn/datasets/data/digits.csv.gz", "digits.csv.gz"),
        ("sklearn/datasets/descr/digits.rst", "digits.rst"),
        (f"scikit_learn-{version}.dist-info/COPYING", "scikit-learn-COPYING"),
    ]:
        with open(f"{dest}/{name}", "wb") as f:
            f.write(z.read(member))
PY

if ! matches "$tmp/digits.csv.gz"; then
    echo "fetch-data.sh: digits.csv.gz from the wheel does not have the pinned sha256 $CSV_SHA256" >&2
    exit 1
fi

# Renames within one folder are atomic: concurrent runs never see half a file.
mv -f "$tmp/digits.rst" "$cache/digits.rst"
mv -f "$tmp/scikit-learn-COPYING" "$cache/scikit-learn-COPYING"
mv -f "$tmp/digits.csv.gz" "$out"
echo "$out"

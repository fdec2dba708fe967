#!/usr/bin/env bash
# Fails when a figure in the docs cannot be traced to the raw output that
# made it (docs/benchmarks.md, "How figures are traced").
#
#   docs/check-figures.sh [--list]
#
# What counts as a figure:
#   - a Markdown table any of whose body cells holds a measured quantity: a
#     number with a decimal point and a unit of time or rate (12.5 ms,
#     1.51 GB/s), a ratio (2.68x) or a percentage (17.5%), or a cell that
#     is a bare decimal number whose unit is in the header (144.24);
#   - in README.md, also a line of prose with such a quantity (the
#     headline figures).
# Each needs, in its section above it (after the previous heading or
# table), one or more markers naming the raw output and the command:
#
#   <!-- raw: docs/bench/NAME.txt cmd: COMMAND -->
#
# and each raw file must exist, begin with the header bench/record.sh
# writes, name the same command (`# raw output of: COMMAND`), and name a
# commit of this repository (`# commit: DESCRIBE`) that is not `-dirty`
# (in a shallow clone a commit it cannot see is a warning, not a failure).
#
# Checked: every Markdown file git tracks, except docs/bench/ (the raw
# files) and docs/benchmarks-journal.md (the dated history, whose figures
# describe older trees and are not claims about this one).
#
# --list prints every figure found with its markers, also when all pass.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import re
import subprocess
import sys
from pathlib import Path

EXEMPT = ("docs/bench/", "docs/benchmarks-journal.md")
UNIT = r"(?:ns|us|µs|ms|s|min|h|[KMGT]i?B/s|[KMGT]?B/s|x|%)"
MEASURE = re.compile(r"(?<![\w.])\d+\.\d+\s?" + UNIT + r"(?![\w/])")
# A cell that is a bare decimal number (its unit in the header), e.g. 144.24.
BARE = re.compile(r"^-?\d+\.\d+$")
MARKER = re.compile(r"<!--\s*raw:\s*(\S+)\s+cmd:\s*(.*?)\s*-->")
HEADING = re.compile(r"^#{1,6}\s")

PROSE_ALL = False  # prose is checked in README.md only (its headline figures)
listing = sys.argv[1:] == ["--list"]
if sys.argv[1:] and not listing:
    sys.exit("usage: docs/check-figures.sh [--list]")

files = subprocess.run(
    ["git", "ls-files", "*.md"], capture_output=True, text=True, check=True
).stdout.split()
files = [f for f in files if not f.startswith(EXEMPT)]
commits: dict[str, bool] = {}
warnings: set[str] = set()
SHALLOW = (
    subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], capture_output=True, text=True
    ).stdout.strip()
    == "true"
)


def is_commit(rev: str) -> bool:
    if rev not in commits:
        r = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", rev + "^{commit}"],
            capture_output=True,
        )
        commits[rev] = r.returncode == 0
    return commits[rev]


def raw_problem(path: str, cmd: str) -> str | None:
    p = Path(path)
    if not p.is_file():
        return f"raw file {path} does not exist"
    head = p.read_text(errors="replace").splitlines()[:8]
    fields = dict(
        line[2:].split(": ", 1) for line in head if line.startswith("# ") and ": " in line
    )
    if "raw output of" not in fields or "commit" not in fields:
        return f"{path} lacks bench/record.sh's header (# raw output of:, # commit:)"
    if fields["raw output of"] != cmd:
        return f"{path} was made by `{fields['raw output of']}`, the marker says `{cmd}`"
    describe = fields["commit"]
    if describe.endswith("-dirty"):
        return f"{path} was made from a tree with uncommitted changes ({describe})"
    rev = describe.rsplit("-g", 1)[-1] if "-g" in describe else describe
    if not is_commit(rev):
        if SHALLOW:
            warnings.add(f"{path}: commit {describe} not in this shallow clone; not confirmed")
            return None
        return f"{path} names commit {describe}, which this repository does not have"
    return None


failures: list[str] = []
found = 0
for name in files:
    lines = Path(name).read_text(errors="replace").splitlines()
    markers: list[tuple[int, str, str]] = []  # since the last heading or table
    section: list[tuple[int, str, str]] = []  # since the last heading
    fenced = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
            i += 1
            continue
        if fenced:
            i += 1
            continue
        if HEADING.match(line):
            markers, section = [], []
            i += 1
            continue
        for m in MARKER.finditer(line):
            markers.append((i + 1, m.group(1), m.group(2)))
            section.append(markers[-1])
        if line.startswith("|"):
            start = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            body = lines[start + 2 : i]
            cells = [c.strip() for row in body for c in row.strip().strip("|").split("|")]
            hits = [m.group(0) for row in body for m in MEASURE.finditer(row)]
            hits += [c for c in cells if BARE.match(c)]
            if hits:
                found += 1
                what = f"{name}:{start + 1}: a table with {hits[0]}"
                problems = (
                    [f"{what}: no <!-- raw: ... cmd: ... --> marker above it"]
                    if not markers
                    else [f"{what}: {p}" for _, path, cmd in markers if (p := raw_problem(path, cmd))]
                )
                failures += problems
                if listing:
                    print(what, "<-", ", ".join(path for _, path, _ in markers) or "(none)")
            markers = []
            continue
        if (name == "README.md" or PROSE_ALL) and not line.lstrip().startswith("<!--"):
            hit = MEASURE.search(line)
            if hit:
                found += 1
                what = f"{name}:{i + 1}: a headline figure {hit.group(0)}"
                if not section:
                    failures.append(f"{what}: no <!-- raw: ... cmd: ... --> marker in its section")
                else:
                    failures += [
                        f"{what}: {p}" for _, path, cmd in section if (p := raw_problem(path, cmd))
                    ]
                if listing:
                    print(what, "<-", ", ".join(path for _, path, _ in section) or "(none)")
        i += 1

for w in sorted(warnings):
    print(f"warning: {w}", file=sys.stderr)
for f in failures:
    print(f, file=sys.stderr)
if failures:
    print(
        f"check-figures: {len(failures)} of {found} figures cannot be traced; make each with "
        "bench/record.sh NAME -- COMMAND from a committed tree and put "
        "<!-- raw: docs/bench/NAME.txt cmd: COMMAND --> above it",
        file=sys.stderr,
    )
    sys.exit(1)
print(f"check-figures: {found} figures, each traced to a raw file from a committed tree")
PY

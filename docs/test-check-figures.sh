#!/usr/bin/env bash
# Checks docs/check-figures.sh on a throwaway repository: a figure table
# without a marker, with a raw file that is missing, made by another
# command, made from a dirty tree or naming an unknown commit each fail it;
# a traced table, a table without measured quantities and the journal
# pass. Run by tests/run.sh; prints one line per case.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
git init -q .
git config user.email t@example.invalid
git config user.name test
mkdir -p docs/bench
cp "$here/check-figures.sh" docs/
echo "seed" >seed.txt
git add -A
git commit -qm seed
commit=$(git rev-parse --short=12 HEAD)

raw() { # raw NAME COMMIT COMMAND
  printf '# raw output of: %s\n# commit: %s\n# date: x\n\nstep 1.5 ms\n' "$3" "$2" >"docs/bench/$1.txt"
}
doc() { # doc MARKER-LINE (may be empty)
  printf '# Doc\n\nText.\n\n%s\n| what | time |\n|---|---|\n| step | 12.5 ms |\n' "$1" >docs/figures.md
  git add -A >/dev/null
}
fails=0
expect() { # expect pass|fail DESCRIPTION
  local got=pass
  docs/check-figures.sh >/dev/null 2>&1 || got=fail
  if [ "$got" = "$1" ]; then
    echo "ok: $2"
  else
    echo "FAILED: $2: check-figures ${got}ed, expected $1" >&2
    docs/check-figures.sh --list >&2 || true
    fails=$((fails + 1))
  fi
}

raw good "$commit" "bench/x.sh --n 2"
doc '<!-- raw: docs/bench/good.txt cmd: bench/x.sh --n 2 -->'
expect pass "a table traced to a raw file from a commit"
doc ''
expect fail "a table of figures without a marker"
doc '<!-- raw: docs/bench/none.txt cmd: bench/x.sh --n 2 -->'
expect fail "a marker naming a raw file that does not exist"
doc '<!-- raw: docs/bench/good.txt cmd: bench/x.sh --n 4 -->'
expect fail "a marker whose command is not the raw file's"
raw dirty "$commit-dirty" "bench/x.sh --n 2"
doc '<!-- raw: docs/bench/dirty.txt cmd: bench/x.sh --n 2 -->'
expect fail "a raw file made from a dirty tree"
raw unknown 0123456789ab "bench/x.sh --n 2"
doc '<!-- raw: docs/bench/unknown.txt cmd: bench/x.sh --n 2 -->'
expect fail "a raw file naming a commit the repository lacks"
printf '# Doc\n\n| option | default |\n|---|---|\n| --timeout | 30 s |\n' >docs/figures.md
git add -A
expect pass "a table without a measured quantity"
printf '# Journal\n\n| step | 12.5 ms |\n|---|---|\n| a | 1.5x |\n' >docs/benchmarks-journal.md
git add -A
expect pass "the journal, which is not checked"
printf '# Readme\n\nThe step is 3.06x shorter.\n' >README.md
git add -A
expect fail "a headline figure in README.md without a marker"
[ "$fails" -eq 0 ] || { echo "$fails case(s) of check-figures failed" >&2; exit 1; }

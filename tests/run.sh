#!/usr/bin/env bash
# The project's test command (README: "Run the tests").
#
# Installs what it needs, then runs, in order: rustfmt and clippy checks, the
# unit and integration tests of every crate (backend, driver, C ABI) over
# real vhost-user sockets.
#
# Environment:
#   CI=true            a test that cannot run on this machine fails instead of skipping
#   DMLC_CACHE=DIR     where slow build steps are cached (default ~/.cache/virtio-dmlc)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

need_cmd() { command -v "$1" >/dev/null 2>&1; }

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

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo build (debug, all targets the tests spawn)"
cargo build --workspace --locked --bins

step "cargo test --workspace"
cargo test --workspace --locked

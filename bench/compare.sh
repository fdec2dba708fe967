#!/usr/bin/env bash
# Device vs Open MPI on this host, in one run (see docs/benchmarks-journal.md,
# section "Device vs Open MPI (host transport)").
#
#   bench/compare.sh [--opcode allreduce|sendrecv|alltoall] [--ranks 2,4]
#                    [--maxbytes 64M] [--iters 20] [--warmup 5]
#                    [--repeat K] [--poll-us U] [--out DIR]
#
# Builds the release binaries and the C baselines, installs Open MPI with
# apt-get if mpicc is missing, then runs bench/compare.py: for every N, the
# device through `dmlc-guest local` in poll and in interrupt mode, Open MPI's
# MPI_Allreduce (shared memory), and memcpy bandwidth probes (glibc and
# non-temporal stores, bench/memcpy_bw.c -m libc / -m nt); with
# --repeat K it runs all of them K times, interleaved, and reports per-size
# medians. It writes device-vs-mpi[-OPCODE].{md,json,svg} into DIR (default
# docs/bench).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if ! command -v mpicc >/dev/null 2>&1; then
    echo "compare.sh: mpicc not found, installing Open MPI (openmpi-bin libopenmpi-dev)" >&2
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin libopenmpi-dev
fi

cargo build --release -q -p dmlc-guest -p vhost-device-dmlc
target=${CARGO_TARGET_DIR:-$root/target}
build="$target/bench-c"
mkdir -p "$build"
mpicc -O2 -Wall -o "$build/mpi_allreduce" bench/mpi_allreduce.c
cc -O2 -Wall -pthread -o "$build/memcpy_bw" bench/memcpy_bw.c

exec python3 bench/compare.py \
    --guest "$target/release/dmlc-guest" \
    --mpi "$build/mpi_allreduce" \
    --memcpy "$build/memcpy_bw" \
    "$@"

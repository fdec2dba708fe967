"""The study's matrix: what a cell is, which cells a study runs, and where
a finished cell is kept so that an interrupted study resumes.

A cell is one workload, in one place (host processes, or VMs of one
accelerator and guest architecture), over one transport, at one N. Its
result is cached under OUT/cells/ by a key of its spec and of the inputs
that can change its numbers (the programs it runs), so a rerun skips it
until one of them changes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "target" / "release"
# Where tests/image/cross-build.sh puts the guest programs of each other
# architecture (the launcher maps target/release/X there by itself).
TRIPLES = {"aarch64": "aarch64-unknown-linux-gnu", "riscv64": "riscv64gc-unknown-linux-gnu"}
# The programs a guest runs, built for its architecture.
GUEST_PROGRAMS = ("libdmlc_guest.so", "dmlc-train-digits", "dmlc-guest")


def mpi_bench(arch: str) -> Path:
    """bench/mpi_allreduce.c built for `arch` by the study's setup: with
    this host's mpicc, or for another architecture with its cross compiler
    against Open MPI in Debian's root of that architecture."""
    study = ROOT / "target" / "study"
    # x86_64's keeps the path it had before other architectures had one:
    # its sweep cells' cache keys name it.
    return study / "mpi_allreduce" if arch == "x86_64" else study / arch / "mpi_allreduce"


# What each workload runs, for the cache key: a change to any of these
# files makes the cells of that workload run again.
INPUTS = {
    "ddp": [
        "examples/torch/train.py",
        "examples/torch/common.py",
        "python/src/dmlc/torch_backend.py",
        "python/src/dmlc/device.py",
        "target/release/libdmlc_guest.so",
        "target/release/vhost-device-dmlc",
        "target/release/dmlc-qemu",
    ],
    "digits": [
        "target/release/dmlc-train-digits",
        "target/release/vhost-device-dmlc",
        "target/release/dmlc-qemu",
    ],
    "xgboost": [
        "examples/xgboost/train.py",
        "examples/sklearn_data.py",
        "target/release/libdmlc_guest.so",
        "target/release/vhost-device-dmlc",
        "target/release/dmlc-qemu",
        "xgboost-patches/build-xgboost.sh",
        "xgboost-patches/0001-coll-Collectives-through-a-virtio-dmlc-device-dmlc_c.patch",
    ],
    "lightgbm": [
        "examples/lightgbm/train.py",
        "examples/sklearn_data.py",
        "python/src/dmlc/lightgbm.py",
        "python/src/dmlc/device.py",
        "target/release/libdmlc_guest.so",
        "target/release/vhost-device-dmlc",
        "target/release/dmlc-qemu",
    ],
    "sweep": [
        "bench/guest-p2p.py",
        "bench/rsh-agent.py",
        "target/study/mpi_allreduce",
        "target/release/dmlc-guest",
        "target/release/vhost-device-dmlc",
        "target/release/dmlc-qemu",
    ],
}


@dataclass(frozen=True)
class Cell:
    """One measurement of the study.

    workload:  "ddp-mlp" (train.py's 1.1M-parameter MLP), "ddp-wide" (the
               same MLP 2048 wide: 4.3M parameters, a 17 MB gradient),
               "digits" (the digits trainer's MLP of 1.1M parameters over
               the rabit-style API, examples/digits),
               "xgboost" (examples/xgboost/train.py, hist: the patched
               build through the device, stock over TCP),
               "lightgbm" (examples/lightgbm/train.py, data-parallel trees:
               LightGBM's network hook through the device, its own socket
               network over TCP),
               "sweep" (allreduce over message sizes, every path in one job:
               the device, gloo, our TCP communicator, Open MPI)
               or "projection" (ddp-mlp on the host with the backend's
               timing model, checked against the study's own projection)
    place:     "host" (processes, no emulation) or ACCEL-ARCH, e.g.
               "tcg-x86_64" (one VM per rank on this host's userland) or
               "tcg-aarch64" (on Debian's root of that architecture)
    transport: "dmlc" (the device), or TCP (loopback on the host,
               virtio-net between VMs): "gloo" for DDP, "tcp" (the
               project's TCP communicator) for digits, stock XGBoost's
               rabit and LightGBM's socket network ("tcp"); "all" for a sweep
    n:         ranks
    """

    workload: str
    place: str
    transport: str
    n: int

    @property
    def id(self) -> str:
        return f"{self.workload}/{self.place}/{self.transport}/n{self.n}"

    @property
    def family(self) -> str:
        own = ("sweep", "digits", "xgboost", "lightgbm")
        return self.workload if self.workload in own else "ddp"

    @property
    def in_vms(self) -> bool:
        return self.place != "host"

    @property
    def accel(self) -> str:
        return self.place.partition("-")[0] if self.in_vms else "none"

    @property
    def arch(self) -> str:
        return self.place.partition("-")[2] if self.in_vms else "x86_64"


@dataclass(frozen=True)
class Settings:
    """What the whole study shares: repetitions and sizes. Part of every
    cell's key, so a --quick cell is never taken for a full one."""

    reps_host: int
    reps_vm: int
    steps: int
    batch: int
    eval_every: int
    # Samples held out for the accuracy: an evaluation costs a forward pass
    # of them, under TCG as much as holdout / (3 x batch) training steps.
    holdout: int
    sweep_max: int
    # XGBoost's and LightGBM's boosting rounds.
    rounds: int


QUICK = Settings(
    reps_host=3,
    reps_vm=1,
    steps=60,
    batch=8,
    eval_every=10,
    holdout=150,
    sweep_max=4 << 20,
    rounds=10,
)
# Not yet run end to end: its cost is estimated in docs/study.md. One
# repetition in VMs, as --quick: a second would double an hour's study.
FULL = Settings(
    reps_host=5,
    reps_vm=1,
    steps=80,
    batch=8,
    eval_every=10,
    holdout=150,
    sweep_max=16 << 20,
    rounds=20,
)


def tcp_of(workload: str) -> str:
    """The TCP transport a workload is compared with."""
    return "gloo" if workload.startswith("ddp") or workload == "projection" else "tcp"


def matrix(quick: bool, places: list[str]) -> list[Cell]:
    """The cells of a study over `places`, in the order they run: N = 2 on
    this host and its x86_64 VMs; with --full then N = 4 there (the wide
    model only at N = 2: under TCG it costs four times the other), then
    the other architectures at N = 2 and 4 (the slowest, last, so that an
    interrupted full study has the rest)."""
    x86 = [p for p in places if p == "host" or p.endswith("x86_64")]
    other = [p for p in places if p not in x86]
    plan = [(2, x86, not quick)]
    if not quick:
        plan.append((4, x86, False))
    plan.append((2, other, False))
    if not quick:
        plan.append((4, other, False))
    cells = []
    for n, where, wide in plan:
        for place in where:
            for w in ["ddp-mlp", *(["ddp-wide"] * wide), "digits"]:
                cells += [Cell(w, place, t, n) for t in ("dmlc", tcp_of(w))]
            # --quick keeps to three workloads (its 10 minutes): LightGBM
            # is --full's.
            for w in ("xgboost", *(["lightgbm"] * (not quick))):
                cells += [Cell(w, place, t, n) for t in ("dmlc", "tcp")]
            if place != "host":
                cells.append(Cell("sweep", place, "all", n))
    cells.append(Cell("projection", "host", "dmlc", 2))
    return cells


def select(cells: list[Cell], only: list[str]) -> list[Cell]:
    """The cells whose id matches one of the shell patterns in `only`
    (all of them when it is empty)."""
    if not only:
        return cells
    picked = [c for c in cells if any(fnmatch.fnmatchcase(c.id, p) for p in only)]
    if not picked:
        known = "\n  ".join(c.id for c in cells)
        raise SystemExit(f"--only {' '.join(only)} matches no cell; the cells are:\n  {known}")
    return picked


def _file_digest(rel: str) -> str:
    path = ROOT / rel
    if not path.exists():
        return "missing"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def inputs(cell: Cell) -> list[str]:
    """The files a cell runs: INPUTS, where a guest of another architecture
    runs its own builds of the guest programs and of the MPI benchmark, on
    Debian's root that tests/image/build-rootfs.sh (its key) builds, for
    a sweep with Open MPI's launcher added by bench/study/mpi-root.sh, and
    for LightGBM with the build of bench/study/cross-lightgbm.sh (XGBoost's
    build script is in INPUTS already)."""
    files = INPUTS[cell.family]
    if cell.arch == "x86_64":
        return files
    guest = f"target/{TRIPLES[cell.arch]}/release/"
    moved = {f"target/release/{p}": guest + p for p in GUEST_PROGRAMS}
    moved["target/study/mpi_allreduce"] = str(mpi_bench(cell.arch).relative_to(ROOT))
    roots = ["tests/image/build-rootfs.sh"]
    if cell.family == "sweep":
        roots.append("bench/study/mpi-root.sh")
    if cell.family == "lightgbm":
        roots.append("bench/study/cross-lightgbm.sh")
    return [moved.get(f, f) for f in files] + roots


def key(cell: Cell, settings: Settings) -> str:
    """A digest of the cell, the study's settings and the files it runs."""
    doc = {
        "cell": asdict(cell),
        "settings": asdict(settings),
        "inputs": {f: _file_digest(f) for f in inputs(cell)},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(out: Path, cell: Cell, settings: Settings) -> Path:
    name = cell.id.replace("/", "_")
    return out / "cells" / f"{name}-{key(cell, settings)}.json"

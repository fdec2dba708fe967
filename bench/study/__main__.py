"""dmlc-qemu study: what emulation costs a distributed training job, and
what the device buys over the network path, measured on this machine and
written as one report (study/index.html, study/report.md, study/study.json).

The matrix: PyTorch DDP (train.py's MLP; --full adds a 4.3M-parameter one)
and the digits trainer (rabit-style API) as host processes and in x86_64
TCG VMs (--full: also aarch64 and riscv64 TCG VMs on Debian's roots, and
KVM VMs where a probe shows /dev/kvm works), over the device and over TCP
(loopback on the host, virtio-net between VMs); XGBoost in the x86_64 VMs
(the patched build through the device, stock over TCP); LightGBM as host
processes and in the x86_64 VMs (its network hook through the device, its
own socket network over TCP); N = 2 (--full: 2 and 4); an allreduce
sweep over message sizes in the VMs (the device, gloo, the project's TCP
communicator, Open MPI: this host's in x86_64 VMs, Debian's root's in the
others); and a projection of the
step to a target cluster, checked against one configuration measured
with the backend's timing model.

Each cell is cached by its inputs (the settings and the programs it runs)
under $DMLC_CACHE/study/cells, so a study that was interrupted resumes
where it stopped, and a rerun measures only what changed (--fresh: all).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import tomllib

from . import analysis, prepare, report, runners
from . import cells as cl
from .runners import log

CACHE = Path(os.environ.get("DMLC_CACHE", Path.home() / ".cache" / "virtio-dmlc")) / "study"
DEFAULT_CLUSTER = cl.ROOT / "bench" / "study" / "cluster.toml"
KNOWN_PLACES = ("host", "tcg-x86_64", "kvm-x86_64", "tcg-aarch64", "tcg-riscv64")
# Rough seconds per repetition, for the first estimate of the time left
# (replaced by what the study measures as it goes).
GUESS_S = {"host": 15.0, "vm": 120.0, "sweep": 150.0}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="dmlc-qemu study",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help="host and TCG VMs, N = 2, one DDP model, fewer repetitions "
        "(about 10 minutes on 2 cores once built) [the default]",
    )
    mode.add_argument(
        "--full",
        action="store_true",
        help="also N = 4, the 4.3M-parameter DDP model (N = 2), LightGBM, aarch64 and "
        "riscv64 TCG VMs and KVM where it works; more host repetitions and steps, "
        "sweeps up to 16 MiB (about 2.5 hours on 2 cores, docs/study.md)",
    )
    p.add_argument(
        "--out", type=Path, default=Path("study"), help="where the report goes [default: ./study]"
    )
    p.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="only the cells whose id matches a shell pattern, e.g. 'ddp-mlp/host/*' (see --list)",
    )
    p.add_argument(
        "--list", action="store_true", help="print the cells and whether each is cached, then exit"
    )
    p.add_argument("--fresh", action="store_true", help="measure every cell again")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the report from OUT/study.json, measuring nothing",
    )
    p.add_argument(
        "--benchmarks-md",
        type=Path,
        metavar="FILE",
        help="also rewrite the study's block (the answers) in this Markdown file, e.g. "
        "docs/benchmarks.md",
    )
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=0.8,
        help="the held-out accuracy "
        "whose time to reach is reported [default: 0.8, which train.py's MLP reaches "
        "in about 50 steps at N = 2]",
    )
    p.add_argument(
        "--cluster",
        type=Path,
        default=DEFAULT_CLUSTER,
        help="the target cluster, "
        "a timing-model file (docs/latency-experiments.md) with a ring model "
        f"[default: {DEFAULT_CLUSTER.relative_to(cl.ROOT)}]",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="the target's compute speed relative to this host's (2: twice as fast) [default: 1]",
    )
    p.add_argument(
        "--places",
        default="auto",
        help="comma-separated: host, tcg-x86_64, kvm-x86_64, tcg-aarch64, tcg-riscv64 "
        "[default: host and tcg-x86_64; --full adds tcg-aarch64, tcg-riscv64 and, where "
        "/dev/kvm works, kvm-x86_64]",
    )
    a = p.parse_args()
    if not 0 < a.target_accuracy <= 1:
        p.error("--target-accuracy must be in (0, 1]")
    if a.speed <= 0:
        p.error("--speed must be positive")
    return a


def cached(path: Path) -> dict[str, Any] | None:
    """A finished cell's record, or None (none, or unreadable: measured
    again)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("runs") else None


def shown(path: Path) -> str:
    """A path as the report names it: from the repository's root when it
    is inside it, else as it is."""
    return str(path.relative_to(cl.ROOT)) if path.is_relative_to(cl.ROOT) else str(path)


def cluster_model(path: Path) -> dict[str, Any]:
    """The [model] table of a timing file (TOML, or JSON by its name), for
    the report's description of the target."""
    try:
        text = path.read_text()
        doc = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        return dict(doc["model"])
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"--cluster {path}: not a timing file with a [model]: {e}") from None


def projected_buckets(results: list[dict[str, Any]]) -> dict[int, set[int]]:
    """The DDP bucket sizes that the report projects, by N: those of the
    host's DDP cells through the device and of the projection cell."""
    sizes: dict[int, set[int]] = {}
    for c in results:
        s = c["spec"]
        ddp = s["workload"].startswith("ddp") or s["workload"] == "projection"
        if ddp and s["place"] == "host" and s["transport"] == "dmlc":
            sizes.setdefault(s["n"], set()).update(analysis.buckets(c))
    return sizes


def add_model_times(doc: dict[str, Any], doc_path: Path) -> None:
    """A study.json written before the study recorded its target model's
    times (meta.projection.allreduce_us) gets them, from the timing file it
    names and the bucket sizes of its own cells: a function of committed
    inputs, not a measurement, so no cell is measured again."""
    target = doc["meta"].get("projection")
    if not target or "allreduce_us" in target:
        return
    if not (cl.TARGET / "dmlc-timing").exists():
        raise SystemExit(
            f"{doc_path} has no model times; build dmlc-timing to add them: "
            "cargo build --release -p vhost-device-dmlc"
        )
    cluster = cl.ROOT / target["file"]
    target.update(prepare.model_times(cluster, projected_buckets(doc["cells"])))
    doc_path.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"added the model times of {target['file']} to {doc_path} (dmlc-timing)")


class Progress:
    """Cells done and the time left, estimated from what ran so far."""

    def __init__(self, todo: list[tuple[cl.Cell, int]]) -> None:
        self.todo = todo
        self.spent: dict[str, list[float]] = {}
        self.start = time.monotonic()

    @staticmethod
    def kind(cell: cl.Cell) -> str:
        return "sweep" if cell.workload == "sweep" else ("vm" if cell.in_vms else "host")

    def per_rep(self, cell: cl.Cell) -> float:
        seen = self.spent.get(self.kind(cell))
        return sum(seen) / len(seen) if seen else GUESS_S[self.kind(cell)]

    def left(self, done: int) -> float:
        return sum(self.per_rep(c) * reps for c, reps in self.todo[done:])

    def record(self, cell: cl.Cell, seconds: float) -> None:
        self.spent.setdefault(self.kind(cell), []).append(seconds)


def main() -> None:
    a = parse()
    out: Path = a.out.resolve()
    command = "dmlc-qemu study " + shlex.join(sys.argv[1:])
    doc_path = out / "study.json"
    if a.report_only:
        doc = json.loads(doc_path.read_text())
        add_model_times(doc, doc_path)
        for f in report.write(doc, out):
            log(f"wrote {f}")
        if a.benchmarks_md:
            report.update_block(a.benchmarks_md, doc)
            log(f"updated {a.benchmarks_md}")
        return
    quick = not a.full
    settings = cl.QUICK if quick else cl.FULL
    if a.places == "auto":
        places = ["host", "tcg-x86_64"] + ([] if quick else ["tcg-aarch64", "tcg-riscv64"])
    else:
        places = [x for x in a.places.split(",") if x]
        unknown = [x for x in places if x not in KNOWN_PLACES]
        if unknown:
            raise SystemExit(f"--places: unknown {unknown}; known: {', '.join(KNOWN_PLACES)}")
    foreign = sorted({p.partition("-")[2] for p in places if p.startswith("tcg-")} - {"x86_64"})
    if a.list:
        # Before any build or file: the cells as the matrix has them (KVM's
        # only once its probe passed, XGBoost's even if its build would fail).
        for c in cl.select(cl.matrix(quick, places), a.only):
            hit = cached(cl.cache_path(CACHE, c, settings)) is not None
            reps = runners.repetitions(c, settings)
            print(f"{c.id:40} {reps} rep(s)  {'cached' if hit else 'to measure'}")
        return
    out.mkdir(parents=True, exist_ok=True)
    raw_log = out / "log.txt"
    raw_file = shown(raw_log)
    started = time.monotonic()
    load_before = prepare.loadavg()
    commit = prepare.describe(out, *([a.benchmarks_md] if a.benchmarks_md else []))
    with raw_log.open("w") as f:
        # bench/record.sh's header: docs/check-figures.sh traces the
        # report's tables to this file.
        f.write(f"# raw output of: {command}\n# commit: {commit}\n")
        f.write(f"# date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
        m = prepare.machine()
        f.write(f"# machine: {m['cpus']} CPUs, {m['cpu']}, {m['memory_gib']} GiB\n")
        f.write(f"# load average before: {load_before}\n\n")

    def note(msg: str) -> None:
        log(msg)
        with raw_log.open("a") as f:
            f.write(msg + "\n")

    prepare.build()
    absent = [
        "DDP over MPI (torch's wheels have no MPI backend: MPI appears in the allreduce "
        "sweeps) is not part of the study.",
    ]
    mpi_missing = prepare.build_mpi_bench()
    if mpi_missing:
        absent.append(mpi_missing)
    if foreign:
        prepare.build_foreign(foreign)
    if a.places == "auto" and not quick:
        ok, why = prepare.kvm_usable()
        if ok:
            places.insert(2, "kvm-x86_64")
        else:
            absent.append(why + "; the KVM column is empty.")
    elif a.places == "auto":
        absent.append(
            "KVM and guests of other architectures: a --quick study runs x86_64 TCG VMs only "
            "(--full adds them)."
        )
    model = cluster_model(a.cluster)
    # Checked now, as the backend checks it, rather than after the cells.
    prepare.model_times(a.cluster, {2: {0}})
    chosen = cl.select(cl.matrix(quick, places), a.only)
    built, build_missing = prepare.build_packages(chosen)
    absent += build_missing
    # Without the build it runs (the setup said why), a cell is left out.
    chosen = [c for c in chosen if runners.package_build(c) in (None, *built)]
    build_s = time.monotonic() - started
    note(
        f"setup: builds, data and the KVM probe took {build_s:.0f} s "
        "(not counted in the study's time)"
    )
    todo = [(c, runners.repetitions(c, settings)) for c in chosen]
    progress = Progress(todo)
    measured_s = 0.0
    results = []
    for i, (cell, reps) in enumerate(todo):
        path = cl.cache_path(CACHE, cell, settings)
        rec = None if a.fresh else cached(path)
        if rec is not None:
            rec["cached"] = True
            when = rec.get("measured", {})
            note(
                f"[{i + 1}/{len(todo)}] {cell.id}: cached ({path.name}, measured at commit "
                f"{when.get('commit', 'unrecorded')} on {when.get('date', 'an unrecorded date')})"
            )
            # The cached runs' raw lines too, so that this log holds every
            # number of the report.
            with raw_log.open("a") as f:
                for run in rec["runs"]:
                    f.write("raw: " + json.dumps({"cell": cell.id, "run": run}) + "\n")
            results.append(rec)
            continue
        runs = []
        t_cell = time.monotonic()
        for r in range(reps):
            left = progress.left(i) - progress.per_rep(cell) * r
            note(
                f"[{i + 1}/{len(todo)}] {cell.id}: repetition {r + 1}/{reps} "
                f"(about {left / 60:.1f} min left)"
            )
            t = time.monotonic()
            try:
                run = runners.run_once(cell, settings, runners.free_port(), a.cluster, built)
            except runners.CellFailedError as e:
                note(f"FAILED: {e}")
                raise SystemExit(
                    f"study: cell {cell.id} failed; the cells before it are "
                    "cached, so a rerun resumes here"
                ) from None
            progress.record(cell, time.monotonic() - t)
            runs.append(run)
            with raw_log.open("a") as f:
                f.write("raw: " + json.dumps({"cell": cell.id, "run": run}) + "\n")
        rec = {
            "id": cell.id,
            "spec": asdict(cell),
            "key": cl.key(cell, settings),
            "seconds": round(time.monotonic() - t_cell, 1),
            # Where and when, for a later study that takes it from the cache.
            "measured": {"commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime())},
            "runs": runs,
        }
        measured_s += rec["seconds"]
        path.parent.mkdir(parents=True, exist_ok=True)
        # Whole or not at all: a study killed while writing leaves no half
        # file for the next one to trip on.
        part = path.with_suffix(".part")
        part.write_text(json.dumps(rec))
        part.replace(path)
        results.append(dict(rec, cached=False))
    wall = time.monotonic() - started - build_s
    import torch  # noqa: PLC0415 (only for its version)

    doc = {
        "meta": {
            "command": command,
            "commit": commit,
            "raw_file": raw_file,
            "quick": quick,
            "machine": prepare.machine(),
            "load_before": load_before,
            "load_after": prepare.loadavg(),
            "qemu": prepare.qemu_version(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "settings": asdict(settings),
            "target_accuracy": a.target_accuracy,
            "projection": {
                "file": shown(a.cluster.resolve()),
                "model": model,
                "speed": a.speed,
                **prepare.model_times(a.cluster, projected_buckets(results)),
            },
            "places": places,
            "absent": absent,
            "wall_s": round(wall, 1),
            "measured_s": round(measured_s, 1),
            "build_s": round(build_s, 1),
        },
        "cells": results,
    }
    doc_path.write_text(json.dumps(doc, indent=1) + "\n")
    for f in report.write(doc, out):
        log(f"wrote {f}")
    if a.benchmarks_md:
        report.update_block(a.benchmarks_md, doc)
        log(f"updated {a.benchmarks_md}")
    note(
        f"{len(todo)} cells in {wall / 60:.1f} min ({measured_s / 60:.1f} min measuring; "
        f"{sum(1 for r in results if r['cached'])} from the cache); report: {out / 'index.html'}"
    )
    with raw_log.open("a") as f:
        f.write(
            f"\n# exit status: 0; wall time: {wall + build_s:.0f} s; "
            f"load average after: {prepare.loadavg()}\n"
        )


if __name__ == "__main__":
    main()

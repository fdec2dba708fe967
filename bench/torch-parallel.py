"""FSDP2, pipeline and 2-D parallel training with backend "dmlc" against
"gloo", in one run: host processes, or VMs.

    python3 bench/torch-parallel.py [--program fsdp2 pipeline ddp2d] [--ranks 2 4] [--repeat 3]
        [--schedule gpipe 1f1b] [--tp 2] [--steps 20] [--hidden 256] [--batch B] [--json OUT]
    python3 bench/torch-parallel.py --vms [the same]

Runs examples/torch/fsdp2.py, pipeline.py (once per --schedule) and
ddp2d.py (once per --tp that divides N: 4 ranks as 2 x 2, 2 ranks as 1 x 2,
or 2 x 1 with --tp 1) on N ranks with each backend, interleaved repetition
by repetition so that the machine's noise spreads over both. Every run
passes --reference: each rank must end within its program's tolerance of a
single-process replay of the same steps that uses no collective (the job
fails otherwise), and for fsdp2 and ddp2d every rank must print the same
sha256 of the whole model (a pipeline's ranks hold different stages).
Keeps rank 0's median step, compute, update and exchange (the rest of the
step; for the pipeline, its bubble included; see each program), and prints
per program, N and backend the median over repetitions, the exchange's
share of the step, the largest difference from the reference over every
run and rank, and the step's ratio gloo / dmlc.

Without --vms the ranks are local processes (the device over the host
transport, gloo over loopback TCP). With --vms each rank is a TCG VM on the
host's userland (`dmlc-qemu submit --host-root`): "dmlc" through the
device, "gloo" over virtio-net between the same kind of VMs. Needs torch
and numpy (python/venv.sh); builds the release binaries and C library and
fetches the digits data (examples/digits/fetch-data.sh) first.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torchjobs

BACKENDS = ["dmlc", "gloo"]
ERROR = re.compile(r"^rank (\d+): max \|params - single process\| (\S+) \(tolerance \S+: (\w+)\)$")
SHA = re.compile(r"^rank (\d+): params sha256 ([0-9a-f]{64})$")
TIMES = ("step_ms", "compute_ms", "update_ms", "exchange_ms")


@dataclass(frozen=True)
class Job:
    """One program with its own options (a pipeline's schedule, ddp2d's
    mesh) on `ranks` ranks."""

    program: str
    ranks: int
    options: tuple[str, ...] = ()
    label: str = ""

    @property
    def name(self) -> str:
        return f"{self.program}{' ' + self.label if self.label else ''}"


def jobs(a: argparse.Namespace) -> list[Job]:
    out = []
    for n in a.ranks:
        for program in a.program:
            if program == "fsdp2":
                out.append(Job(program, n))
            elif program == "pipeline":
                for s in a.schedule:
                    shape = ("--chunks", str(a.chunks), "--layers", str(max(4, n)))
                    out.append(Job(program, n, ("--schedule", s, *shape), s))
            else:
                for tp in (tp for tp in a.tp if n % tp == 0):
                    out.append(Job(program, n, ("--tp", str(tp)), f"{n // tp}x{tp}"))
    return out


def check(job: Job, backend: str, status: str, lines: dict[int, list[str]]) -> dict[str, Any]:
    """Rank 0's results (``{}`` if it printed none), `reference_error` the
    largest difference over the ranks, and `failed`: None, or why the run
    failed: `status` (the job's failed exit status, or ""), a rank without
    its results, a rank farther from the reference than its tolerance, or
    (but for the pipeline, whose ranks hold different stages) ranks that
    ended with different models. A failed run is reported on stderr with
    the end of its output."""
    errors, digests = {}, {}
    for r, rank_out in lines.items():
        for line in rank_out:
            if m := ERROR.match(line):
                errors[r] = (float(m.group(2)), m.group(3))
            if m := SHA.match(line):
                digests[r] = m.group(2)
    result: dict[str, Any] = next(
        (
            json.loads(ln.removeprefix("json: "))
            for ln in lines.get(0, [])
            if ln.startswith("json: ")
        ),
        {},
    )
    problems = [status] if status else []
    if not result or len(errors) != job.ranks or len(digests) != job.ranks:
        problems.append("not every rank printed its results")
    far = sorted(r for r, (_, verdict) in errors.items() if verdict != "ok")
    if far:
        problems.append(f"ranks {far} farther from the reference than the tolerance")
    if job.program != "pipeline" and len(set(digests.values())) > 1:
        problems.append("the ranks ended with different models")
    if errors:
        result["reference_error"] = max(e for e, _ in errors.values())
    result["failed"] = "; ".join(problems) or None
    if problems:
        tail = "\n".join(f"[rank {r}] {ln}" for r, out in sorted(lines.items()) for ln in out[-8:])
        sys.stderr.write(f"{tail}\n# FAILED: {job.name} with {backend} on {job.ranks} ranks: ")
        sys.stderr.write(f"{result['failed']}\n")
    return result


def arguments(a: argparse.Namespace, job: Job, backend: str) -> list[str]:
    argv = [str(torchjobs.EXAMPLES / f"{job.program}.py"), "--backend", backend, "--reference"]
    argv += ["--steps", str(a.steps), "--hidden", str(a.hidden), "--batch", str(a.batch)]
    return argv + list(job.options)


def run_host(a: argparse.Namespace, job: Job, backend: str, port: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dmlc-parallel-") as tmp:
        argv = arguments(a, job, backend)
        codes, outputs = torchjobs.run_host(argv, backend, job.ranks, port, tmp)
    status = f"exit codes {codes}" if any(codes) else ""
    return check(job, backend, status, {r: out.splitlines() for r, out in enumerate(outputs)})


def run_vms(a: argparse.Namespace, job: Job, backend: str) -> dict[str, Any]:
    log_dir = None
    if a.log_dir:
        stem = f"{job.program}-{job.label or 'x'}-{backend}-{job.ranks}"
        log_dir = a.log_dir / f"{stem}-{len(list(a.log_dir.glob(stem + '-*')))}"
    p, took = torchjobs.submit(
        job.ranks,
        arguments(a, job, backend),
        transport="tcp" if backend == "gloo" else "device",
        timeout=a.timeout,
        log_dir=log_dir,
    )
    status = f"exit status {p.returncode}" if p.returncode else ""
    lines = torchjobs.rank_lines(p.stdout)
    if not lines:
        lines = {0: (p.stdout + p.stderr).splitlines()}  # the launcher's own words
    result = check(job, backend, status, lines)
    step = f"step {result['step_ms']:.1f} ms" if "step_ms" in result else "no step"
    diff = result.get("reference_error")
    print(
        f"#   {job.name} {backend} on {job.ranks} VMs: {step}, job {took:.0f} s, max diff "
        f"{'-' if diff is None else f'{diff:.1e}'}{' FAILED' if result['failed'] else ''}",
        flush=True,
    )
    return result


def summary(job: Job, runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per backend: the medians over its runs that passed, the
    largest reference difference over all of them, the ratio gloo / dmlc
    of the step (on dmlc's row)."""
    med: dict[str, dict[str, float] | None] = {}
    for b, rs in runs.items():
        ok = [r for r in rs if not r["failed"]]
        med[b] = {k: statistics.median(r[k] for r in ok) for k in TIMES} if ok else None
    rows = []
    for b, rs in runs.items():
        m, dmlc, gloo = med[b], med["dmlc"], med["gloo"]
        diffs = [r["reference_error"] for r in rs if r.get("reference_error") is not None]
        row: dict[str, Any] = {"program": job.name, "ranks": job.ranks, "backend": b}
        row |= {k: round(m[k], 3) if m else None for k in TIMES}
        row |= {
            "exchange_share": round(m["exchange_ms"] / m["step_ms"], 3) if m else None,
            "max_reference_error": max(diffs) if diffs else None,
            "failed_runs": sum(1 for r in rs if r["failed"]),
            "gloo_over_dmlc": round(gloo["step_ms"] / dmlc["step_ms"], 3)
            if b == "dmlc" and dmlc and gloo
            else None,
            "runs": rs,
        }
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    p.add_argument(
        "--program",
        nargs="+",
        choices=["fsdp2", "pipeline", "ddp2d"],
        default=["fsdp2", "pipeline", "ddp2d"],
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--schedule", nargs="+", choices=["gpipe", "1f1b"], default=["gpipe", "1f1b"])
    p.add_argument("--tp", type=int, nargs="+", default=[2], help="ddp2d's ranks per row")
    p.add_argument("--chunks", type=int, default=4, help="the pipeline's micro-batches per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="samples per step (per rank for fsdp2, per row for ddp2d, in all for the "
        "pipeline) [default: 64 on the host, 8 in VMs, where TCG computes about 1000x slower]",
    )
    p.add_argument("--vms", action="store_true", help="ranks in TCG VMs (dmlc-qemu submit)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per VM job")
    p.add_argument("--log-dir", type=Path, help="with --vms: keep each job's logs here")
    p.add_argument("--json", type=Path, help="also write every row and run here ('-': print)")
    a = p.parse_args()
    if a.batch is None:
        a.batch = 8 if a.vms else 64
    todo = jobs(a)
    if not todo:
        p.error("no job: does any --tp divide any --ranks?")
    torchjobs.build(a.vms)
    where = "TCG VMs (1 vCPU, 2 GiB each)" if a.vms else "host processes"
    print(
        f"# torch-parallel.py: hidden {a.hidden}, batch {a.batch}, {a.steps} steps, "
        f"{a.repeat} repetitions, in {where}; {torchjobs.machine()}",
        flush=True,
    )
    got: dict[Job, dict[str, list[dict[str, Any]]]] = {j: {b: [] for b in BACKENDS} for j in todo}
    port = 29600
    for job in todo:
        for _ in range(a.repeat):
            for backend in BACKENDS:
                port += 1
                run = run_vms(a, job, backend) if a.vms else run_host(a, job, backend, port)
                got[job][backend].append(run)
    rows = [row for job, runs in got.items() for row in summary(job, runs)]
    print(
        f"{'program':<16} {'N':>3} {'backend':>7} {'step ms':>9} {'exchange ms':>12} "
        f"{'share':>6} {'max diff':>9} {'gloo/dmlc':>9}"
    )
    for r in rows:
        ratio = f"{r['gloo_over_dmlc']:.2f}x" if r["gloo_over_dmlc"] else "-"
        diff = r["max_reference_error"]
        line = f"{r['program']:<16} {r['ranks']:>3} {r['backend']:>7} "
        if r["step_ms"] is None:
            line += f"{'-':>9} {'-':>12} {'-':>6} "
        else:
            line += f"{r['step_ms']:>9.2f} {r['exchange_ms']:>12.2f} {r['exchange_share']:>6.0%} "
        line += f"{'-' if diff is None else f'{diff:.1e}':>9} {ratio:>9}"
        if r["failed_runs"]:
            line += f"  FAILED {r['failed_runs']} of {len(r['runs'])} runs"
        print(line)
    if a.json == Path("-"):
        print("json:", json.dumps(rows))
    elif a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    if any(r["failed_runs"] for r in rows):
        raise SystemExit("some runs failed (see above)")


if __name__ == "__main__":
    main()

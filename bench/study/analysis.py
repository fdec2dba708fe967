"""Every number of the report, computed from the study's raw JSON and
nothing else: medians and spreads over repetitions, the emulation and
communication factors, the device's speedup over TCP, time to accuracy,
the message-size sweep and the projection. report.py lays them out;
tests regenerate the report from a JSON file and compare.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from .cells import tcp_of

Doc = dict[str, Any]
Run = dict[str, Any]

WORKLOAD_NAMES = {
    "ddp-mlp": "DDP, MLP of 1.1M parameters (4.5 MB gradient)",
    "ddp-wide": "DDP, MLP of 4.3M parameters (17 MB gradient)",
    "digits": "The digits trainer (rabit-style API), MLP of 1.1M parameters",
}
TRANSPORT_NAMES = {
    "dmlc": "device",
    "gloo": "TCP (gloo)",
    "tcp": "TCP (our communicator)",
    "mpi": "Open MPI (TCP)",
}
# The sweep's paths, the device first (the others are compared with it).
SWEEP_PATHS = ("device", "gloo", "tcp", "mpi")


@dataclass(frozen=True)
class Spread:
    """The median of some repetitions and their range."""

    median: float
    low: float
    high: float
    count: int

    @staticmethod
    def of(values: list[float]) -> Spread:
        return Spread(statistics.median(values), min(values), max(values), len(values))


def cells(doc: Doc, workload: str | None = None) -> list[Doc]:
    return [c for c in doc["cells"] if workload is None or c["spec"]["workload"] == workload]


def find(doc: Doc, workload: str, place: str, transport: str, n: int) -> Doc | None:
    for c in doc["cells"]:
        s = c["spec"]
        if (s["workload"], s["place"], s["transport"], s["n"]) == (workload, place, transport, n):
            return c
    return None


def spread(cell: Doc, field: str) -> Spread:
    return Spread.of([float(r[field]) for r in cell["runs"]])


def places(doc: Doc) -> list[str]:
    """The places measured, the host first."""
    found = {c["spec"]["place"] for c in doc["cells"]}
    return sorted(found, key=lambda p: (p != "host", p))


def sizes_n(doc: Doc, workload: str) -> list[int]:
    return sorted({c["spec"]["n"] for c in cells(doc, workload)})


def ddp_workloads(doc: Doc) -> list[str]:
    return [w for w in WORKLOAD_NAMES if cells(doc, w)]


def time_to_accuracy(run: Run, target: float) -> float | None:
    """Seconds of training until the held-out accuracy first reached
    `target` (evaluations not counted); None if it never did."""
    for _step, seconds, acc in run.get("curve", []):
        if acc >= target:
            return float(seconds)
    return None


def tta(cell: Doc, target: float) -> Spread | None:
    times = [time_to_accuracy(r, target) for r in cell["runs"]]
    got = [t for t in times if t is not None]
    return Spread.of(got) if len(got) == len(times) and got else None


def exchange_share(cell: Doc) -> float:
    """Exchange over step, medians of both."""
    return spread(cell, "exchange_ms").median / spread(cell, "step_ms").median


def emulation_factor(doc: Doc, workload: str, place: str, n: int) -> float | None:
    """VM compute over host compute, same workload and N (the compute part
    of a step does not depend on the transport: both cells pooled, where
    both measured it; LightGBM's is measured around the device's
    collectives only)."""

    def compute(where: str) -> list[float]:
        return [
            float(r["compute_ms"])
            for t in ("dmlc", tcp_of(workload))
            if (c := find(doc, workload, where, t, n))
            for r in c["runs"]
            if r.get("compute_ms") is not None
        ]

    vm, host = compute(place), compute("host")
    if not vm or not host:
        return None
    return statistics.median(vm) / statistics.median(host)


def speedup(doc: Doc, workload: str, place: str, n: int, field: str) -> float | None:
    """TCP's median `field` over the device's: how much longer TCP takes."""
    dev = find(doc, workload, place, "dmlc", n)
    tcp = find(doc, workload, place, tcp_of(workload), n)
    if not dev or not tcp:
        return None
    d = spread(dev, field).median
    return spread(tcp, field).median / d if d > 0 else None


@dataclass(frozen=True)
class SweepRow:
    size: int
    times: dict[str, Spread]  # path -> time in us over repetitions


def sweep(cell: Doc) -> list[SweepRow]:
    """The allreduce sweep of a cell: per size, each path's median time
    over the repetitions (each repetition's own median of its iterations)."""
    runs = cell["runs"][0]["runs"]
    by_size: dict[int, dict[str, list[float]]] = {}
    for path, reps in runs.items():
        for rows in reps:
            for r in rows:
                by_size.setdefault(r["size"], {}).setdefault(path, []).append(r["time_us"])
    return [
        SweepRow(size, {p: Spread.of(v) for p, v in paths.items()})
        for size, paths in sorted(by_size.items())
    ]


def buckets(cell: Doc) -> list[int]:
    """The bytes of each DDP bucket of a cell's model (one bucket of every
    parameter where the run did not record them)."""
    run0 = cell["runs"][0]
    return run0.get("bucket_bytes") or [4 * int(run0["params"])]


def modelled_exchange_ms(doc: Doc, n: int, sizes: list[int]) -> float:
    """The target model's time for one allreduce of each size among n
    members, summed: from the table the study recorded with dmlc-timing
    (the backend's own formulas, docs/latency-experiments.md)."""
    table = doc["meta"]["projection"]["allreduce_us"][str(n)]
    return sum(table[str(b)] for b in sizes) / 1e3


@dataclass(frozen=True)
class Projection:
    workload: str
    n: int
    compute_ms: float  # host compute and update, scaled by the speed
    exchange_ms: float  # modelled: one ring allreduce per DDP bucket
    buckets: list[int]

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.exchange_ms


def project(doc: Doc, workload: str, n: int) -> Projection | None:
    """The step this workload would take on the target cluster: the host's
    compute and update divided by the target's relative speed, plus the
    model's allreduce of each DDP bucket (no overlap with backward
    assumed: an upper bound where DDP hides some of it)."""
    host = find(doc, workload, "host", "dmlc", n)
    target = doc["meta"].get("projection")
    if not host or not target:
        return None
    speed = float(target["speed"])
    compute = spread(host, "compute_ms").median + spread(host, "update_ms").median
    sizes = buckets(host)
    return Projection(workload, n, compute / speed, modelled_exchange_ms(doc, n, sizes), sizes)


def projection_error(doc: Doc) -> tuple[Projection, Spread, float] | None:
    """The projection of the one configuration the study measured with the
    backend's timing model (the host's own speed, so speed 1 there): the
    projection, the measured step, and (measured - projected) / measured."""
    cell = next(iter(cells(doc, "projection")), None)
    target = doc["meta"].get("projection")
    if not cell or not target:
        return None
    n = cell["spec"]["n"]
    compute = spread(cell, "compute_ms").median + spread(cell, "update_ms").median
    sizes = buckets(cell)
    projected = Projection("projection", n, compute, modelled_exchange_ms(doc, n, sizes), sizes)
    measured = spread(cell, "step_ms")
    return projected, measured, (measured.median - projected.step_ms) / measured.median

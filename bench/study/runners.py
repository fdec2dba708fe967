"""How each kind of cell runs: the programs it starts, the checks on what
they print, and the raw record it keeps (one dict per repetition).

Every DDP run must end with the same parameters on every rank (each rank
prints its own sha256); on the host, every run is also replayed in one
process without any collective (train.py --reference), which the device's
result must match: a check not computed by the thing it checks. The digits
trainer checks its ranks against each other and against a one-process run
itself (its PASS lines are required); XGBoost's and LightGBM's ranks must
end with one model (python/tests/test_lightgbm.py checks that the device's
trees equal LightGBM's own socket network's); the sweep checks every value
it receives (bench/guest-p2p.py, dmlc-guest bench, bench/mpi_allreduce.c).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torchjobs

from . import cells as cl
from .cells import ROOT, TARGET, Cell, Settings

TRAIN = ROOT / "examples" / "torch" / "train.py"
P2P = ROOT / "bench" / "guest-p2p.py"
# Largest |DDP parameters - one-process replay| accepted on the host: both
# sum the same float32 gradients, in orders that may differ.
MAX_REFERENCE_ERROR = 1e-5


# The Python packages built for the study, by (workload, architecture):
# the patched XGBoost of each architecture, LightGBM of the others
# (prepare.build_packages). Paths for PYTHONPATH.
Builds = dict[tuple[str, str], str]


class CellFailedError(Exception):
    """A run of a cell failed; the message says which and why."""


def hidden_of(cell: Cell) -> int:
    return 2048 if cell.workload == "ddp-wide" else 1024


def train_argv(cell: Cell, s: Settings) -> list[str]:
    argv = [str(TRAIN), "--backend", cell.transport, "--steps", str(s.steps)]
    argv += ["--hidden", str(hidden_of(cell)), "--batch", str(s.batch)]
    argv += ["--eval-every", str(s.eval_every), "--holdout", str(s.holdout), "--json", "-"]
    return argv


def _json_lines(outputs: list[str]) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix("json: "))
        for out in outputs
        for line in out.splitlines()
        if line.startswith("json: ")
    ]


def _same_model(cell: Cell, results: list[dict[str, Any]]) -> None:
    if len(results) != cell.n:
        raise CellFailedError(f"{cell.id}: {len(results)} of {cell.n} ranks printed results")
    digests = {r["params_sha256"] for r in results}
    if len(digests) != 1:
        raise CellFailedError(
            f"{cell.id}: the ranks ended with different models: {sorted(digests)}"
        )


def ddp_host(cell: Cell, s: Settings, port: int, backend_args: list[str]) -> dict[str, Any]:
    """One run of train.py as local processes; rank 0's results."""
    argv = [*train_argv(cell, s), "--reference"]
    with tempfile.TemporaryDirectory(prefix="dmlc-study-") as tmp:
        t = time.monotonic()
        codes, outputs = torchjobs.run_host(
            argv, cell.transport, cell.n, port, tmp, backend_args=backend_args
        )
        took = time.monotonic() - t
    if any(codes):
        tail = "".join(o[-1500:] for o in outputs)
        raise CellFailedError(f"{cell.id}: exit statuses {codes}\n{tail}")
    results = _json_lines(outputs)
    _same_model(cell, results)
    worst = max(r["reference_error"] for r in results)
    if worst > MAX_REFERENCE_ERROR:
        raise CellFailedError(
            f"{cell.id}: parameters {worst:.3e} from the one-process replay "
            f"(at most {MAX_REFERENCE_ERROR} allowed)"
        )
    rank0 = next(r for r in results if r["rank"] == 0)
    return dict(rank0, job_s=round(took, 3))


DATA = Path.home() / ".cache" / "virtio-dmlc" / "data" / "digits.csv.gz"


def foreign(cell: Cell) -> bool:
    """VMs of another instruction set than this host's."""
    return cell.in_vms and cell.arch != "x86_64"


def vm_flags(cell: Cell, rootfs: str = "debian") -> list[str]:
    flags = ["--accel", cell.accel]
    if foreign(cell):
        # Debian's root of that architecture (its python3 and torch 2.6),
        # the repository and the data at their own paths. Under TCG the
        # ranks finish `import torch` minutes apart: the backend waits for
        # the first collective longer than its default 30 s.
        flags += ["--arch", cell.arch, "--rootfs", rootfs, "--bind", str(ROOT)]
        flags += ["--bind", str(DATA.parent), "--backend-arg=--timeout-ms=900000"]
    return flags


def python_job(cell: Cell, argv: list[str]) -> tuple[list[str], bool]:
    """A Python script's command in the VMs: this host's interpreter (the
    VMs share its userland), or the foreign root's own python3; and
    whether torchjobs.submit is to put this host's interpreter first."""
    return (["python3", *argv], False) if foreign(cell) else (argv, True)


def ddp_vms(cell: Cell, s: Settings, timeout: int) -> dict[str, Any]:
    """One job of train.py in cell.n VMs; rank 0's results."""
    transport = "device" if cell.transport == "dmlc" else "tcp"
    argv, python = python_job(cell, train_argv(cell, s))
    p, took = torchjobs.submit(
        cell.n, argv, transport=transport, timeout=timeout, flags=vm_flags(cell), python=python
    )
    results = [
        json.loads(line.removeprefix("json: "))
        for lines in torchjobs.rank_lines(p.stdout).values()
        for line in lines
        if line.startswith("json: ")
    ]
    if p.returncode:
        raise CellFailedError(
            f"{cell.id}: the launcher's exit status {p.returncode}\n"
            f"{p.stdout[-2000:]}{p.stderr[-2000:]}"
        )
    _same_model(cell, results)
    boot = _boot_seconds(p.stderr)
    rank0 = next(r for r in results if r["rank"] == 0)
    return dict(rank0, job_s=round(took, 3), boot_s=boot)


def _boot_seconds(stderr: str) -> float | None:
    """The launcher's "booted in X s" (or "X to Y s": the last)."""
    for line in stderr.splitlines():
        if "booted in " in line:
            words = line.split("booted in ", 1)[1].replace(")", " ").split()
            numbers = [float(w) for w in words if w.replace(".", "", 1).isdigit()]
            if numbers:
                return numbers[-1]
    return None


def mpi_rootfs(arch: str) -> Path:
    """Debian's root of `arch` with Open MPI's launcher and headers
    (bench/study/mpi-root.sh: cached; about a minute the first time)."""
    r = subprocess.run(
        [str(ROOT / "bench" / "study" / "mpi-root.sh"), "--arch", arch],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return Path(r.stdout.strip().splitlines()[-1].removeprefix("DMLC_MPI_ROOTFS="))


def sweep_vms(cell: Cell, s: Settings, timeout: int) -> dict[str, Any]:
    """Allreduce over sizes in cell.n VMs, the device, gloo, the project's
    TCP communicator and (where it was built) Open MPI, in one boot
    (bench/guest-p2p.py)."""
    # dmlc-guest bench holds two pools of the largest message and its
    # rotation span (2 x LLC / N, tens of MiB): the DMA window must fit them.
    dma_mib = (2 * max(s.sweep_max, 64 << 20) + (16 << 20)) >> 20
    dma_mib += dma_mib % 2
    guest = TARGET / "dmlc-guest"
    if foreign(cell):
        guest = ROOT / "target" / cl.TRIPLES[cell.arch] / "release" / "dmlc-guest"
        flags = vm_flags(cell, rootfs=str(mpi_rootfs(cell.arch)))
        # Their Open MPI is 5, which launches through PRRTE: its own names
        # for the remote-shell agent (guest-p2p.py's --mca plm_rsh_agent is
        # Open MPI 4's), and one rank per VM, unbound. Without OVERSUBSCRIBE,
        # PRRTE 3 refuses 2 ranks on 2 VMs given one slot each ("not enough
        # slots"), which Open MPI 4 accepts.
        for name, value in (
            ("plm_ssh_agent", ROOT / "bench" / "rsh-agent.py"),
            ("rmaps_default_mapping_policy", "node:OVERSUBSCRIBE"),
            ("hwloc_default_binding_policy", "none"),
        ):
            flags += ["--env", f"PRTE_MCA_{name}={value}"]
    else:
        flags = vm_flags(cell)
    flags += ["--dma", f"{dma_mib}M", "--env", f"DMLC_GUEST_BIN={guest}"]
    paths = "device,gloo,tcp"
    # Open MPI: this host's in x86_64 VMs (they run its userland), the
    # root's in the others.
    bench = cl.mpi_bench(cell.arch)
    if bench.exists():
        flags += ["--env", f"DMLC_MPI_BENCH={bench}"]
        paths += ",mpi"
    argv = [str(P2P), "--opcode", "allreduce", "--maxbytes", str(s.sweep_max), "--paths", paths]
    argv += ["--repeat", str(s.reps_vm), "--iters", "10", "--warmup", "2"]
    argv, python = python_job(cell, argv)
    p, took = torchjobs.submit(
        cell.n, argv, transport="tcp", timeout=timeout, flags=flags, python=python
    )
    lines = torchjobs.rank_lines(p.stdout).get(0, [])
    docs = [json.loads(x.removeprefix("p2p-json: ")) for x in lines if x.startswith("p2p-json: ")]
    if p.returncode or not docs:
        raise CellFailedError(
            f"{cell.id}: the launcher's exit status {p.returncode}\n"
            f"{p.stdout[-2000:]}{p.stderr[-2000:]}"
        )
    wrong = sum(r["wrong"] for runs in docs[0]["runs"].values() for rows in runs for r in rows)
    if wrong:
        raise CellFailedError(f"{cell.id}: {wrong} wrong values")
    return dict(docs[0], job_s=round(took, 3))


DIGITS = TARGET / "dmlc-train-digits"
# The trainer's closing lines (examples/digits/src/main.rs).
DIGITS_TIMES = re.compile(
    r"median_step_compute_ms ([\d.]+) median_step_exchange_ms ([\d.]+) "
    r"median_step_update_ms ([\d.]+)"
)
DIGITS_ACCURACY = re.compile(r"^test accuracy ([\d.]+)", re.M)
DIGITS_TRAIN = re.compile(r"^time total_ms ([\d.]+)", re.M)


def digits_argv(s: Settings, ranks: int) -> list[str]:
    """The digits trainer's MLP (the same 1.1M parameters as train.py's),
    through the rabit-style API; it checks every rank's weights against
    each other and against a one-process run itself."""
    # --batch counts the samples of all ranks together.
    return [
        str(DIGITS),
        "--data",
        str(DATA),
        "--model",
        "mlp",
        "--steps",
        str(s.steps),
        "--batch",
        str(s.batch * ranks),
    ]


def digits_result(what: str, out: str, ranks: int) -> dict[str, Any]:
    """The first rank's times and accuracy in `out`; fails unless `ranks`
    ranks printed both PASS lines there."""
    passes = out.count("PASS identical weights") + out.count("PASS matches single-process")
    times, acc, total = DIGITS_TIMES.search(out), DIGITS_ACCURACY.search(out), None
    if passes < 2 * ranks or not times or not acc:
        raise CellFailedError(f"{what}: the trainer did not pass its checks\n{out[-2500:]}")
    total = DIGITS_TRAIN.search(out)
    compute, exchange, update = (float(x) for x in times.groups())
    return {
        "step_ms": round(compute + exchange + update, 3),
        "compute_ms": compute,
        "exchange_ms": exchange,
        "update_ms": update,
        "accuracy": float(acc.group(1)),
        "train_s": float(total.group(1)) / 1e3 if total else None,
    }


def digits_host(cell: Cell, s: Settings, port: int) -> dict[str, Any]:
    """The trainer as cell.n local processes: over a daemon of its own
    (device), or over loopback TCP (`DMLC_TRANSPORT=tcp`)."""
    env = {}
    if cell.transport != "dmlc":
        peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(cell.n))
        env = {"DMLC_TRANSPORT": "tcp", "DMLC_TCP_PEERS": peers}
    with tempfile.TemporaryDirectory(prefix="dmlc-study-") as tmp:
        t = time.monotonic()
        codes, outs = torchjobs.run_host(
            digits_argv(s, cell.n), cell.transport, cell.n, port, tmp, python=False, extra_env=env
        )
        took = time.monotonic() - t
    if any(codes):
        raise CellFailedError(f"{cell.id}: exit statuses {codes}")
    digits_result(cell.id, "".join(outs), cell.n)
    return dict(digits_result(cell.id, outs[0], 1), job_s=round(took, 3))


def digits_vms(cell: Cell, s: Settings, timeout: int) -> dict[str, Any]:
    """The trainer in cell.n VMs on the host's userland."""
    transport = "device" if cell.transport == "dmlc" else "tcp"
    p, took = torchjobs.submit(
        cell.n,
        digits_argv(s, cell.n),
        transport=transport,
        timeout=timeout,
        flags=vm_flags(cell),
        python=False,
    )
    if p.returncode:
        raise CellFailedError(
            f"{cell.id}: the launcher's exit status {p.returncode}\n"
            f"{p.stdout[-2000:]}{p.stderr[-2000:]}"
        )
    lines = torchjobs.rank_lines(p.stdout)
    digits_result(cell.id, "\n".join(x for r in sorted(lines) for x in lines[r]), cell.n)
    result = digits_result(cell.id, "\n".join(lines.get(0, [])), 1)
    return dict(result, job_s=round(took, 3), boot_s=_boot_seconds(p.stderr))


XGBOOST = ROOT / "examples" / "xgboost" / "train.py"


def xgboost_argv(cell: Cell, s: Settings) -> list[str]:
    comm = "dmlc" if cell.transport == "dmlc" else "rabit"
    argv = [str(XGBOOST), "--communicator", comm, "--rounds", str(s.rounds)]
    return [*argv, "--monitor", "--json", "-"]


def package_build(cell: Cell) -> tuple[str, str] | None:
    """The build (workload, architecture) that an XGBoost or LightGBM cell
    runs, or None where this host's wheels serve. On this host's userland:
    the patched XGBoost for the device. In VMs of another architecture:
    that architecture's build of XGBoost (the patched one, for both
    transports: it is the version of the host's wheel, which Debian's root
    lacks) or of stock LightGBM."""
    if cell.workload not in ("xgboost", "lightgbm"):
        return None
    if not foreign(cell) and (cell.workload == "lightgbm" or cell.transport != "dmlc"):
        return None
    return (cell.workload, cell.arch)


def package_pythonpath(cell: Cell, built: Builds) -> str:
    """The ranks' PYTHONPATH for an XGBoost or LightGBM cell: its build
    (package_build) first, if it has one."""
    base = torchjobs.job_env()["PYTHONPATH"]
    need = package_build(cell)
    if need is None:
        return base
    if need not in built:
        raise CellFailedError(f"{cell.id}: its {cell.workload} build for {cell.arch} is missing")
    return f"{built[need]}:{base}"


def xgboost_result(cell: Cell, lines: dict[int, list[str]]) -> dict[str, Any]:
    """Rank 0's results; fails unless every rank ended with one model."""
    models = {
        x.split("model sha256 ", 1)[1] for r in lines.values() for x in r if "model sha256 " in x
    }
    docs = [
        json.loads(x.removeprefix("json: ")) for x in lines.get(0, []) if x.startswith("json: ")
    ]
    if len(models) != 1 or sum("model sha256 " in x for r in lines.values() for x in r) != cell.n:
        raise CellFailedError(f"{cell.id}: the ranks did not all end with one model: {models}")
    if not docs:
        raise CellFailedError(f"{cell.id}: rank 0 printed no results")
    d = docs[0]
    share = d.get("exchange_share_estimate")
    return {
        "round_ms": d["round_median_ms"],
        "exchange_share_estimate": share,
        # XGBoost's monitor's estimate of the rest of a round (the
        # estimate's exchange is an upper bound, so this a lower one).
        "compute_ms": None if share is None else round(d["round_median_ms"] * (1 - share), 3),
        "accuracy": d["accuracy"],
        "model_sha256": models.pop(),
    }


def xgboost_vms(cell: Cell, s: Settings, timeout: int, built: Builds) -> dict[str, Any]:
    """examples/xgboost/train.py (hist, the digits data set) in cell.n VMs
    at the launcher's RabitTracker: over TCP ("tcp"), or the patched build
    through the device ("dmlc"); package_pythonpath says which XGBoost."""
    flags = [*vm_flags(cell), "--tracker", "rabit"]
    transport = "device" if cell.transport == "dmlc" else "tcp"
    env = dict(torchjobs.job_env(), PYTHONPATH=package_pythonpath(cell, built))
    argv, python = python_job(cell, xgboost_argv(cell, s))
    p, took = torchjobs.submit(
        cell.n, argv, transport=transport, timeout=timeout, flags=flags, env=env, python=python
    )
    if p.returncode:
        raise CellFailedError(
            f"{cell.id}: the launcher's exit status {p.returncode}\n"
            f"{p.stdout[-2000:]}{p.stderr[-2000:]}"
        )
    result = xgboost_result(cell, torchjobs.rank_lines(p.stdout))
    return dict(result, job_s=round(took, 3), boot_s=_boot_seconds(p.stderr))


def xgboost_host(cell: Cell, s: Settings, port: int, built: Builds) -> dict[str, Any]:
    """The same as cell.n local processes at a RabitTracker of this
    process's (stock XGBoost's own): over a daemon of its own for the
    patched build, over loopback TCP for stock XGBoost."""
    from xgboost.tracker import RabitTracker  # noqa: PLC0415 (only these cells need it)

    tracker = RabitTracker(n_workers=cell.n, host_ip="127.0.0.1", sortby="task")
    tracker.start()
    args = tracker.worker_args()
    env = {
        "PYTHONPATH": package_pythonpath(cell, built),
        "DMLC_TRACKER_URI": str(args["dmlc_tracker_uri"]),
        "DMLC_TRACKER_PORT": str(args["dmlc_tracker_port"]),
    }
    with tempfile.TemporaryDirectory(prefix="dmlc-study-") as tmp:
        t = time.monotonic()
        codes, outs = torchjobs.run_host(
            xgboost_argv(cell, s), cell.transport, cell.n, port, tmp, extra_env=env
        )
        took = time.monotonic() - t
    try:
        # Done once every worker has said goodbye; failed workers may not.
        tracker.wait_for(timeout=5 if any(codes) else 60)
    except Exception as e:  # xgboost raises its own error type
        if not any(codes):
            raise CellFailedError(f"{cell.id}: the RabitTracker did not finish: {e}") from e
    if any(codes):
        tail = "".join(o[-1500:] for o in outs)
        raise CellFailedError(f"{cell.id}: exit statuses {codes}\n{tail}")
    lines = {r: out.splitlines() for r, out in enumerate(outs)}
    return dict(xgboost_result(cell, lines), job_s=round(took, 3))


LIGHTGBM = ROOT / "examples" / "lightgbm" / "train.py"


def lightgbm_argv(cell: Cell, s: Settings) -> list[str]:
    network = "dmlc" if cell.transport == "dmlc" else "socket"
    return [str(LIGHTGBM), "--network", network, "--rounds", str(s.rounds), "--json", "-"]


def lightgbm_result(cell: Cell, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's round times, and what the device's collectives took; fails
    unless every rank ended with the same trees."""
    if len(results) != cell.n or len({r["model_sha256"] for r in results}) != 1:
        raise CellFailedError(f"{cell.id}: the ranks did not all end with one model: {results}")
    r = next(x for x in results if x["rank"] == 0)
    out = {
        "round_ms": r["round_median_ms"],
        "accuracy": r["accuracy"],
        "model_sha256": r["model_sha256"],
        "train_s": r["train_s"],
    }
    if r.get("exchange_s") is not None:
        # Measured around the device's collectives: per round, and the rest.
        out["exchange_ms"] = round(1e3 * r["exchange_s"] / _rounds(r), 3)
        out["compute_ms"] = round(1e3 * (r["train_s"] - r["exchange_s"]) / _rounds(r), 3)
        out["exchange_calls"] = r["exchange_calls"]
    return out


def _rounds(r: dict[str, Any]) -> int:
    return max(1, len(r["round_ms"]))


def lightgbm_host(cell: Cell, s: Settings, port: int) -> dict[str, Any]:
    """examples/lightgbm/train.py as cell.n local processes: through a
    daemon of its own, or LightGBM's socket network on loopback."""
    env = {}
    if cell.transport != "dmlc":
        env = {"DMLC_TCP_PEERS": ",".join(f"127.0.0.1:{free_port()}" for _ in range(cell.n))}
    with tempfile.TemporaryDirectory(prefix="dmlc-study-") as tmp:
        t = time.monotonic()
        codes, outs = torchjobs.run_host(
            lightgbm_argv(cell, s), cell.transport, cell.n, port, tmp, extra_env=env
        )
        took = time.monotonic() - t
    if any(codes):
        tail = "".join(o[-1500:] for o in outs)
        raise CellFailedError(f"{cell.id}: exit statuses {codes}\n{tail}")
    return dict(lightgbm_result(cell, _json_lines(outs)), job_s=round(took, 3))


def lightgbm_vms(cell: Cell, s: Settings, timeout: int, built: Builds) -> dict[str, Any]:
    """examples/lightgbm/train.py in cell.n VMs: on the host's userland
    with its wheel, or on Debian's root of another architecture with
    LightGBM built for it (package_pythonpath)."""
    transport = "device" if cell.transport == "dmlc" else "tcp"
    env = dict(torchjobs.job_env(), PYTHONPATH=package_pythonpath(cell, built))
    argv, python = python_job(cell, lightgbm_argv(cell, s))
    flags = vm_flags(cell)
    p, took = torchjobs.submit(
        cell.n, argv, transport=transport, timeout=timeout, flags=flags, env=env, python=python
    )
    if p.returncode:
        raise CellFailedError(
            f"{cell.id}: the launcher's exit status {p.returncode}\n"
            f"{p.stdout[-2000:]}{p.stderr[-2000:]}"
        )
    lines = torchjobs.rank_lines(p.stdout)
    results = _json_lines(["\n".join(x) for x in lines.values()])
    result = lightgbm_result(cell, results)
    return dict(result, job_s=round(took, 3), boot_s=_boot_seconds(p.stderr))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_once(cell: Cell, s: Settings, port: int, cluster: Path, built: Builds) -> dict[str, Any]:
    """One repetition of `cell`; `built` holds the XGBoost and LightGBM
    builds that the setup made (prepare.build_packages)."""
    vms = cell.in_vms
    runs: dict[str, Any] = {
        "projection": lambda: ddp_host(cell, s, port, [f"--timing={cluster}"]),
        "sweep": lambda: sweep_vms(cell, s, timeout=1800),
        "xgboost": lambda: (
            xgboost_vms(cell, s, 1800, built) if vms else xgboost_host(cell, s, port, built)
        ),
        "lightgbm": lambda: (
            lightgbm_vms(cell, s, 1800, built) if vms else lightgbm_host(cell, s, port)
        ),
        "digits": lambda: digits_vms(cell, s, 1800) if vms else digits_host(cell, s, port),
    }
    if cell.workload in runs:
        return dict(runs[cell.workload]())
    return ddp_vms(cell, s, timeout=1800) if vms else ddp_host(cell, s, port, [])


def repetitions(cell: Cell, s: Settings) -> int:
    if cell.workload == "sweep":
        return 1  # the script repeats inside one boot
    return s.reps_vm if cell.in_vms else s.reps_host


def log(msg: str) -> None:
    print(f"study: {msg}", file=sys.stderr, flush=True)

"""What bench/torch-ddp.py and bench/torch-parallel.py share: the build and
the digits data, a job's ranks as host processes (the device over the host
transport, a daemon per job) or as TCG VMs (`dmlc-qemu submit
--host-root`), and each rank's lines of output.

The scripts import it as ``torchjobs`` (a script's folder is first on
sys.path).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "target" / "release"
EXAMPLES = ROOT / "examples" / "torch"
# A line of the launcher's output: the rank that printed it, and the line.
RANK_LINE = re.compile(r"^\[rank (\d+)\] (.*)$")


def build(vms: bool) -> None:
    """The release binaries and C library (and the launcher for VMs), and
    the examples' default data file (scikit-learn's digits), fetched once."""
    crates = ["-p", "dmlc-capi", "-p", "vhost-device-dmlc"] + (["-p", "dmlc-qemu"] * vms)
    subprocess.run(["cargo", "build", "--release", "-q", *crates], cwd=ROOT, check=True)
    fetch = ROOT / "examples" / "digits" / "fetch-data.sh"
    subprocess.run([str(fetch)], check=True, stdout=subprocess.DEVNULL)


def machine() -> str:
    """The CPUs and load average, for a report's header."""
    load = Path("/proc/loadavg").read_text().split()[:3]
    return f"{os.cpu_count()} CPUs, load average {' '.join(load)}"


def job_env() -> dict[str, str]:
    """The environment of a rank: the release C library and the package
    from the source tree."""
    return dict(
        os.environ,
        DMLC_LIBRARY=str(TARGET / "libdmlc_guest.so"),
        PYTHONPATH=str(ROOT / "python" / "src"),
    )


@contextmanager
def daemon(tmp: str, ranks: int, args: Sequence[str] = ()) -> Iterator[None]:
    """The backend daemon with `ranks` sockets tmp/d.sock0.. (and `args`,
    e.g. a timing model), for the duration of the block."""
    proc = subprocess.Popen(
        [
            str(TARGET / "vhost-device-dmlc"),
            "--socket-path",
            f"{tmp}/d.sock",
            "--socket-count",
            str(ranks),
            "--log-level",
            "warn",
            *args,
        ]
    )
    try:
        deadline = time.monotonic() + 20
        while not all(Path(f"{tmp}/d.sock{r}").exists() for r in range(ranks)):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the backend did not start")
            time.sleep(0.01)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def run_host(
    argv: Sequence[str],
    backend: str,
    ranks: int,
    port: int,
    tmp: str,
    *,
    capture: bool = True,
    timeout: float = 600,
    backend_args: Sequence[str] = (),
    python: bool = True,
    extra_env: Mapping[str, str] | None = None,
) -> tuple[list[int], list[str]]:
    """`python3 argv` (with `python` false, `argv` itself) in `ranks` local
    processes (RANK, WORLD_SIZE, DMLC_SOCKET=tmp/d.sockR, MASTER_PORT=port
    for gloo, and `extra_env`), over a daemon of its own (with
    `backend_args`) for backend "dmlc"; each rank's exit status and, with
    `capture`, its output (stdout and stderr)."""
    env = dict(job_env(), MASTER_PORT=str(port), **(extra_env or {}))
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    err = subprocess.STDOUT if capture else None

    def start() -> tuple[list[int], list[str]]:
        procs = [
            subprocess.Popen(
                [*([sys.executable] * python), *argv],
                env=dict(env, RANK=str(r), WORLD_SIZE=str(ranks), DMLC_SOCKET=f"{tmp}/d.sock{r}"),
                stdout=out,
                stderr=err,
                text=True,
            )
            for r in range(ranks)
        ]
        try:
            outputs = [p.communicate(timeout=timeout)[0] or "" for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            raise SystemExit(f"{argv[0]} with {ranks} ranks did not end in {timeout} s") from None
        return [p.returncode for p in procs], outputs

    if backend != "dmlc":
        return start()
    with daemon(tmp, ranks, backend_args):
        return start()


def submit(
    ranks: int,
    argv: Sequence[str],
    *,
    transport: str,
    timeout: int,
    log_dir: Path | None = None,
    flags: Sequence[str] = (),
    python: bool = True,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], float]:
    """One job of `ranks` TCG VMs (1 vCPU, 2 GiB each) on the host's
    userland: `python3 argv` in each (with `python` false, `argv` itself),
    through the device or over TCP (`transport`), in `env` (default:
    job_env()); the launcher's result and how long the job took."""
    cmd = [str(TARGET / "dmlc-qemu"), "submit", "-n", str(ranks), "--host-root"]
    cmd += ["--memory", "2G", "--timeout", str(timeout)]
    if log_dir:
        cmd += ["--log-dir", str(log_dir)]
    cmd += [*flags, "--transport", transport, "--", *([sys.executable] * python), *argv]
    with tempfile.TemporaryDirectory(prefix="dmlc-torch-") as tmp:
        t = time.monotonic()
        p = subprocess.run(
            cmd, env=env or job_env(), cwd=tmp, capture_output=True, text=True, check=False
        )
        return p, time.monotonic() - t


def rank_lines(stdout: str) -> dict[int, list[str]]:
    """The launcher's output by rank: each rank's lines, unprefixed."""
    lines: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        m = RANK_LINE.match(line)
        if m:
            lines.setdefault(int(m.group(1)), []).append(m.group(2))
    return lines

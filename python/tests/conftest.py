"""Fixtures: the backend daemon, and N rank processes that run a scenario.

Each rank is its own Python process (python/tests/ranks.py) that opens its
device over the host transport, runs the scenario and checks every result
against numpy itself, then prints how many checks passed: the test reads
each rank's own count, never a number summed through the device.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
RANKS = Path(__file__).resolve().parent / "ranks.py"


def under_ci() -> bool:
    """As tests/run.sh's under_ci: CI set, and not empty, "false" or "0"."""
    return os.environ.get("CI", "") not in ("", "false", "0")


def need(module: str) -> Any:
    """Imports `module` (torch, for the tests that use it): a skip when it
    is missing on a developer's machine, a failure under CI, where
    tests/run.sh installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if under_ci():
            pytest.fail(f"{module} cannot be imported under CI: {e}")
        pytest.skip(f"{module} is not installed ({e})")


def _binary(env: str, name: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env])
    for profile in ("release", "debug"):
        p = REPO / "target" / profile / name
        if p.is_file():
            return p
    pytest.fail(f"{name} not found: run `cargo build -p vhost-device-dmlc` or set {env}")


@dataclass
class Backend:
    base: Path
    ranks: int
    proc: subprocess.Popen[bytes]

    def socket(self, rank: int) -> Path:
        return Path(f"{self.base}{rank}")

    def run(
        self,
        scenario: str,
        *,
        timeout: float = 120,
        args: tuple[str, ...] = (),
        argv: list[str] | None = None,
    ) -> list[subprocess.CompletedProcess[str]]:
        """Runs `scenario` of ranks.py on every rank at once, or with `argv`
        that command line after the interpreter (`scenario` then only names
        it in messages); returns each rank's result."""
        env = dict(os.environ)
        env.setdefault("DMLC_LIBRARY", str(_binary("DMLC_LIBRARY", "libdmlc_guest.so")))
        procs = [
            subprocess.Popen(
                [sys.executable, *argv]
                if argv is not None
                else [sys.executable, str(RANKS), scenario, str(self.socket(r)), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={
                    **env,
                    "RANK": str(r),
                    "WORLD_SIZE": str(self.ranks),
                    "DMLC_SOCKET": str(self.socket(r)),
                },
            )
            for r in range(self.ranks)
        ]
        results = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, err = p.communicate()
                pytest.fail(f"{scenario}: a rank did not finish in {timeout} s:\n{out}{err}")
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return results


def start_backend(tmp: Path, ranks: int, *extra: str) -> Backend:
    base = tmp / "d.sock"
    proc = subprocess.Popen(
        [
            str(_binary("DMLC_BACKEND_BIN", "vhost-device-dmlc")),
            "--socket-path",
            str(base),
            "--socket-count",
            str(ranks),
            "--log-level",
            "warn",
            *extra,
        ],
    )
    deadline = time.monotonic() + 20
    while not all(Path(f"{base}{r}").exists() for r in range(ranks)):
        if proc.poll() is not None:
            pytest.fail(f"the backend exited with {proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the backend's sockets did not appear")
        time.sleep(0.01)
    return Backend(base, ranks, proc)


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    b = start_backend(tmp_path, request.param, "--timeout-ms", "20000")
    yield b
    b.proc.terminate()
    b.proc.wait(10)


@pytest.fixture
def backend2(tmp_path: Path) -> Iterator[Backend]:
    b = start_backend(tmp_path, 2, "--timeout-ms", "5000")
    yield b
    b.proc.terminate()
    b.proc.wait(10)


def checks_passed(results: list[subprocess.CompletedProcess[str]]) -> list[int]:
    """Each rank's own count of passed checks (a failing rank fails the test)."""
    counts = []
    for r, res in enumerate(results):
        assert res.returncode == 0, f"rank {r} failed ({res.returncode}):\n{res.stdout}{res.stderr}"
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("checks passed: ")]
        assert line, f"rank {r} printed no count:\n{res.stdout}{res.stderr}"
        counts.append(int(line[-1].split(": ")[1]))
    return counts


def run_ranks(tmp: Path, ranks: int, argv: list[str], timeout: float = 120) -> list[str]:
    """`argv` (after the Python interpreter) in `ranks` processes over a
    fresh backend; each rank's output, after checking its exit status."""
    b = start_backend(tmp, ranks, "--timeout-ms", "20000")
    try:
        results = b.run(" ".join(argv), timeout=timeout, argv=argv)
    finally:
        b.proc.terminate()
        b.proc.wait(10)
    for r, res in enumerate(results):
        assert res.returncode == 0, (
            f"{argv}: rank {r} exited {res.returncode}:\n{res.stdout}{res.stderr}"
        )
    return [res.stdout for res in results]

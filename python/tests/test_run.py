"""``dmlc-run`` (dmlc/run.py): the daemon, torchrun, the job's exit status.

The install itself (the wheel's library and daemon, found with no
DMLC_LIBRARY, and torchrun's --max-restarts) is tests/python-install.sh's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import _binary, need


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        base.pop(k, None)
    base["DMLC_LIBRARY"] = str(_binary("DMLC_LIBRARY", "libdmlc_guest.so"))
    base["DMLC_BACKEND_BIN"] = str(_binary("DMLC_BACKEND_BIN", "vhost-device-dmlc"))
    return subprocess.run(
        [sys.executable, "-m", "dmlc.run", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_it_runs_a_job_over_its_daemon_and_removes_the_sockets() -> None:
    need("torch")
    # python -m dmlc in each rank: it opens the device that
    # DMLC_SOCKET_PREFIX and RANK name; a DMLC_SOCKET of the caller's is
    # dropped with a word.
    r = _run("--nproc-per-node", "2", "-m", "dmlc", DMLC_SOCKET="/nonexistent")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "device        rank 0 of 2" in r.stdout
    assert "device        rank 1 of 2" in r.stdout
    assert "dmlc-run: DMLC_SOCKET ignored" in r.stderr
    m = re.search(r"serves 2 ranks at (\S+)/dmlc\.sock0\.\.1", r.stderr)
    assert m, r.stderr
    assert f"DMLC_SOCKET_PREFIX={m[1]}/dmlc.sock" in r.stdout
    assert not Path(m[1]).exists(), "the socket folder is left"


def test_it_exits_with_the_status_of_the_rank_that_failed() -> None:
    need("torch")
    script = '[ "$RANK" = 1 ] && exit 7; exit 0'
    r = _run("--nproc-per-node", "2", "--no-python", "sh", "-c", script)
    assert r.returncode == 7, r.stdout + r.stderr
    assert "exitcode  : 7" in r.stderr


def test_what_cannot_work_is_refused_with_the_reason() -> None:
    need("torch")
    r = _run("--nnodes", "2", "--nproc-per-node", "2", "job.py")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--nnodes must be 1" in r.stderr
    r = _run("--daemon", "/nonexistent/vhost-device-dmlc", "job.py")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "the daemon /nonexistent/vhost-device-dmlc is not an executable file" in r.stderr
    r = _run("--daemon", "/bin/false", "job.py")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "the daemon exited with status 1: /bin/false --socket-path" in r.stderr


def test_without_torch_it_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; from dmlc.run import main; sys.exit(main(['x']))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "pip install 'dmlc[torch]'" in r.stderr

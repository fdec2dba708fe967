"""dmlc-qemu's tracker wrapper (launcher/src/rabit_tracker.py) on the host:
12 workers on 127.0.0.1 meet XGBoost's RabitTracker and every one gets the
rank DMLC_TASK_ID (XGBoost's tracker sorts task ids as strings, so without
the wrapper's zero-padding task 10 would get rank 2). Needs xgboost.

    python -m pytest -q launcher/tests/test_rabit_tracker.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

WRAPPER = Path(__file__).resolve().parents[1] / "src" / "rabit_tracker.py"
WORKER = """
import os, sys
sys.modules["sklearn"] = None
from xgboost import collective
env = os.environ
collective.init(dmlc_tracker_uri=env["DMLC_TRACKER_URI"],
                dmlc_tracker_port=int(env["DMLC_TRACKER_PORT"]),
                dmlc_task_id=env["DMLC_TASK_ID"])
print(f"task {int(env['DMLC_TASK_ID'])} rank {collective.get_rank()}", flush=True)
collective.finalize()
"""


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the tracker and its ready port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as t:
                t.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")


def test_rank_is_the_task_id_with_12_workers() -> None:
    n = 12
    port = free_port_pair()
    procs = []
    for task in range(n):
        env = dict(os.environ)
        env |= {
            "DMLC_TASK_ID": str(task),
            "DMLC_NUM_WORKER": str(n),
            "DMLC_TRACKER_URI": "127.0.0.1",
            "DMLC_TRACKER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WRAPPER.read_text(), sys.executable, "-c", WORKER],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for task, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, out
        assert f"task {task} rank {task}" in out, out

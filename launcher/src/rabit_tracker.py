"""dmlc-qemu's wrapper around every worker of a job with `--tracker rabit`.

    python3 -c "$(cat rabit_tracker.py)" PROGRAM [ARGS...]

Rank 0 (DMLC_TASK_ID=0) forks a process that runs XGBoost's RabitTracker
(`xgboost.tracker`) on DMLC_TRACKER_URI:DMLC_TRACKER_PORT for
DMLC_NUM_WORKER workers, ranks sorted by task (so rank = DMLC_TASK_ID, which
this wrapper zero-pads to one width: the tracker compares task ids as
strings), and
that answers on the next port once the tracker listens. Every rank waits for
that answer, then execs PROGRAM. (A worker gives up on the tracker after a
few seconds of retries, and the VMs boot at different times; a probe on the
tracker's own port would count as a broken worker there.)

Exit status 125 when the tracker cannot start or cannot be reached.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

WAIT_S = 600.0


def fail(msg: str) -> None:
    sys.stderr.write(f"dmlc-qemu tracker: error: {msg}\n")
    sys.stderr.flush()
    sys.exit(125)


def first_lines(err: BaseException) -> str:
    """An XGBoost error without its stack trace."""
    text = str(err).split("Stack trace:")[0].strip()
    return f"{type(err).__name__}: {text}"


def serve(n: int, host: str, port: int, ready_port: int, report: int) -> None:
    """The tracker's process: starts it, reports on `report`, serves it."""
    try:
        # xgboost imports scikit-learn when it is installed, for its sklearn
        # wrapper; the tracker needs none of it, and under TCG the import
        # costs a minute.
        sys.modules["sklearn"] = None  # type: ignore[assignment]
        from xgboost.tracker import RabitTracker  # noqa: PLC0415

        tracker = RabitTracker(n_workers=n, host_ip=host, port=port, sortby="task")
        tracker.start()
        ready = socket.create_server((host, ready_port))
    except (ImportError, OSError, ValueError) as e:
        # XGBoostError is a ValueError.
        os.write(report, first_lines(e).encode())
        os._exit(1)
    os.write(report, b"ok")
    os.close(report)

    def answer() -> None:
        while True:
            conn, _ = ready.accept()
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    sys.stdout.write(f"dmlc-qemu tracker: RabitTracker for {n} workers on {host}:{port}\n")
    sys.stdout.flush()
    try:
        tracker.wait_for()
    except ValueError as e:
        sys.stderr.write(f"dmlc-qemu tracker: {first_lines(e)}\n")
        os._exit(1)
    os._exit(0)


def start_tracker(n: int, host: str, port: int, ready_port: int) -> None:
    """Forks the tracker's process and waits until it listens (or failed)."""
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        serve(n, host, port, ready_port, w)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    msg = b"".join(chunks).decode(errors="replace")
    if msg != "ok":
        fail(
            f"cannot start XGBoost's RabitTracker on {host}:{port} with {sys.executable}: "
            f"{msg or 'its process died'}"
        )


def wait_for_tracker(host: str, port: int, ready_port: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            socket.create_connection((host, ready_port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                fail(
                    f"no RabitTracker at {host}:{port} after {WAIT_S:.0f} s "
                    "(rank 0 starts it: see its output)"
                )
            time.sleep(0.25)


def main() -> None:
    if len(sys.argv) < 2:
        fail("usage: rabit_tracker.py PROGRAM [ARGS...]")
    env = os.environ
    try:
        rank = int(env["DMLC_TASK_ID"])
        n = int(env["DMLC_NUM_WORKER"])
        host = env["DMLC_TRACKER_URI"]
        port = int(env["DMLC_TRACKER_PORT"])
    except (KeyError, ValueError) as e:
        fail(f"the DMLC tracker environment is incomplete: {e!r}")
    # The tracker sorts the workers by their task ids as strings ("10" before
    # "2"): zero-padded to one width, string order is numeric order, so that
    # rank = DMLC_TASK_ID with more than 10 workers too (int() still reads it).
    env["DMLC_TASK_ID"] = f"{rank:0{len(str(max(n - 1, 0)))}d}"
    if rank == 0:
        start_tracker(n, host, port, port + 1)
    else:
        wait_for_tracker(host, port, port + 1)
    sys.stdout.flush()
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    except OSError as e:
        sys.stderr.write(f"dmlc-qemu tracker: cannot run {sys.argv[1]}: {e}\n")
        sys.exit(127)


if __name__ == "__main__":
    main()

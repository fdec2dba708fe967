"""``dmlc-run`` (or ``python -m dmlc.run``): a torchrun job on this host over
the device, the daemon included.

Starts the backend daemon (vhost-device-dmlc) with one socket per rank,
waits until it serves them all, runs the job with torchrun
(torch.distributed.run) with DMLC_SOCKET_PREFIX set so that rank r opens
socket r (init_process_group("dmlc"), dmlc.init()), stops the
daemon, and exits with the job's status: 0, or the exit status of the
first rank that failed.

Every option of torchrun passes through unchanged (--nproc-per-node,
--max-restarts, --module, --no-python, ...); the job runs on this host
only (--nnodes 1).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

DAEMON = "vhost-device-dmlc"
DAEMON_ENV = "DMLC_BACKEND_BIN"
PREFIX_ENV = "DMLC_SOCKET_PREFIX"
# Settings that name another device; the ranks of this job use the daemon's.
OTHER_DEVICE_ENV = ("DMLC_SOCKET", "DMLC_DEVICE")
SOCKETS_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
EXAMPLE = """example:
  dmlc-run --nproc-per-node 2 train.py --epochs 3
  dmlc-run --nproc-per-node 4 --max-restarts 3 --daemon-args='--timeout-ms 5000' train.py"""


class LaunchError(Exception):
    """The job could not be started: said on one line."""


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: returns the exit status (the job's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        import torch.distributed.run as torchrun  # noqa: PLC0415 (torch is optional)
        from torch.distributed.elastic.multiprocessing.api import (  # noqa: PLC0415
            SignalException,
        )
        from torch.distributed.elastic.multiprocessing.errors import (  # noqa: PLC0415
            ChildFailedError,
        )
    except ImportError as e:
        print(
            f"dmlc-run: needs PyTorch's torchrun ({e}); install it with "
            "`pip install 'dmlc[torch]'` (or `pip install torch`)",
            file=sys.stderr,
        )
        return 1

    ns = _parser(torchrun.get_args_parser()).parse_args(args)
    try:
        world = _local_world_size(torchrun, ns)
        extra = shlex.split(ns.daemon_args)
    except (LaunchError, ValueError) as e:
        print(f"dmlc-run: error: {e}", file=sys.stderr)
        return 2
    for name in OTHER_DEVICE_ENV:
        if os.environ.pop(name, None) is not None:
            print(
                f"dmlc-run: {name} ignored: the ranks use the daemon this command starts",
                file=sys.stderr,
            )

    made_dir = ns.socket_dir is None
    sockets = Path(tempfile.mkdtemp(prefix="dmlc-run-") if made_dir else ns.socket_dir)
    proc: subprocess.Popen[bytes] | None = None
    try:
        daemon = _daemon_binary(ns.daemon)
        sockets.mkdir(parents=True, exist_ok=True)
        base = sockets / "dmlc.sock"
        proc = _start_daemon(daemon, base, world, extra)
        os.environ[PREFIX_ENV] = str(base)
        print(f"dmlc-run: {daemon} serves {world} ranks at {base}0..{world - 1}", file=sys.stderr)
        try:
            torchrun.run(ns)
        except ChildFailedError as e:
            print(e.format_msg(), file=sys.stderr)
            _, failure = e.get_first_failure()
            return _exit_status(failure.exitcode)
        except SignalException as e:
            print(f"dmlc-run: stopped by {e.sigval.name}", file=sys.stderr)
            return 128 + int(e.sigval)
        return 0
    except LaunchError as e:
        print(f"dmlc-run: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            _stop_daemon(proc)
        if made_dir:
            shutil.rmtree(sockets, ignore_errors=True)


def _parser(torchrun_parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """torchrun's own parser, with this command's name, text and options."""
    p = torchrun_parser
    p.prog = "dmlc-run"
    p.usage = (
        "%(prog)s [--daemon PATH] [--daemon-args ARGS] [--socket-dir DIR]\n"
        "                [torchrun's options] training_script [training_script_args ...]"
    )
    p.description = __doc__.split("\n\n", 1)[1] if __doc__ else None
    p.epilog = EXAMPLE
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    g = p.add_argument_group("the daemon (options of dmlc-run; all the others are torchrun's)")
    g.add_argument(
        "--daemon",
        metavar="PATH",
        help=f"the daemon's binary (default: ${DAEMON_ENV}, else the {DAEMON} installed "
        "with this package, else the one on PATH, else a source checkout's target/)",
    )
    g.add_argument(
        "--daemon-args",
        metavar="ARGS",
        default="",
        help="more options for the daemon, one string, such as --daemon-args='--timeout-ms "
        f"5000' (see {DAEMON} --help; it gets --socket-path, --socket-count and, unless "
        "given here, --log-level warn)",
    )
    g.add_argument(
        "--socket-dir",
        metavar="DIR",
        help="where the daemon's sockets go (default: a new temporary folder, removed at the end)",
    )
    return p


def _local_world_size(torchrun: ModuleType, ns: argparse.Namespace) -> int:
    """The number of ranks, one socket each; one host only."""
    lo, hi = torchrun.parse_min_max_nnodes(ns.nnodes)
    if (lo, hi) != (1, 1):
        raise LaunchError(
            f"--nnodes {ns.nnodes}: the daemon serves the ranks of this host only, so "
            "--nnodes must be 1 (a group across hosts: docs/multi-host.md)"
        )
    world = int(torchrun.determine_local_world_size(ns.nproc_per_node))
    if world < 1:
        raise LaunchError(f"--nproc-per-node {ns.nproc_per_node}: at least one rank is needed")
    ns.nproc_per_node = str(world)
    return world


def _daemon_binary(explicit: str | None) -> Path:
    """The daemon to start: the first of --daemon, $DMLC_BACKEND_BIN, the
    one this package installed, PATH, a source checkout's target/."""
    for given in (explicit, os.environ.get(DAEMON_ENV)):
        if given:
            if not os.access(given, os.X_OK):
                raise LaunchError(f"the daemon {given} is not an executable file")
            return Path(given)
    tried: list[str] = []
    try:
        dist = importlib.metadata.distribution("dmlc")
        for f in dist.files or ():
            if f.name == DAEMON:
                p = Path(str(dist.locate_file(f))).resolve()
                if os.access(p, os.X_OK):
                    return p
                tried.append(str(p))
    except importlib.metadata.PackageNotFoundError:
        pass
    on_path = shutil.which(DAEMON)
    if on_path:
        return Path(on_path)
    tried.append(f"PATH ({DAEMON})")
    here = Path(__file__).resolve().parent
    for parent in here.parents:
        if (parent / "Cargo.toml").is_file() and (parent / "vhost-device").is_dir():
            for profile in ("release", "debug"):
                p = parent / "target" / profile / DAEMON
                if os.access(p, os.X_OK):
                    return p
                tried.append(str(p))
            break
    raise LaunchError(
        f"cannot find the daemon {DAEMON} (looked at {', '.join(tried)}): install this "
        f"package with `pip install ./python`, or give --daemon PATH or ${DAEMON_ENV}"
    )


def _socket_id(p: Path) -> tuple[int, int] | None:
    """A socket file's inode and change time: a new socket differs from a
    stale one left by a killed daemon even where the inode is reused."""
    try:
        st = p.lstat()
    except OSError:
        return None
    return (st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


def _die_with_parent() -> None:
    """In the daemon's child: SIGTERM when this launcher dies (Linux's
    PR_SET_PDEATHSIG), so that a killed launcher leaves no daemon behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _start_daemon(
    daemon: Path, base: Path, world: int, extra: list[str]
) -> subprocess.Popen[bytes]:
    """Starts the daemon and waits until it serves every rank's socket."""
    paths = [Path(f"{base}{r}") for r in range(world)]
    stale = [_socket_id(p) for p in paths]
    level = [] if any(a.startswith("--log-level") for a in extra) else ["--log-level", "warn"]
    cmd = [str(daemon), "--socket-path", str(base), "--socket-count", str(world), *level, *extra]
    try:
        # Its own session: a Ctrl-C reaches torchrun, which stops the ranks;
        # the daemon is stopped after them.
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509
    except OSError as e:
        raise LaunchError(f"cannot start the daemon {daemon}: {e}") from e
    deadline = time.monotonic() + SOCKETS_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise LaunchError(f"the daemon exited with status {proc.returncode}: {shlex.join(cmd)}")
        if all(_socket_id(p) not in (None, s) for p, s in zip(paths, stale)):
            return proc
        if time.monotonic() > deadline:
            _stop_daemon(proc)
            raise LaunchError(
                f"the daemon did not serve its {world} sockets within {SOCKETS_TIMEOUT_S:.0f} s: "
                f"{shlex.join(cmd)}"
            )
        time.sleep(0.01)


def _stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the daemon removes its sockets), SIGKILL if it lingers."""
    if proc.poll() is not None:
        if proc.returncode != 0:
            print(f"dmlc-run: the daemon had exited with status {proc.returncode}", file=sys.stderr)
        return
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _exit_status(code: int) -> int:
    """A failed rank's exit code as a shell gives it: 128 + N for signal N."""
    if code < 0:
        return 128 - code
    return code if code > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

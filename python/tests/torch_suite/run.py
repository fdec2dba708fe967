"""PyTorch's own distributed test suite on backend "dmlc", next to gloo.

Drives ``DistributedTest._DistTestBase`` of the installed torch wheel
(torch/testing/_internal/distributed/distributed_test.py) as torch's
test/distributed/test_distributed_spawn.py does for gloo and nccl, for
backend "dmlc" over the host transport: every test starts a fresh
``vhost-device-dmlc`` daemon with one socket per rank, forks world-size
processes, and rank i opens socket i (``DMLC_SOCKET``, read by
``dmlc.Device.from_env`` when torch creates the group).

Backend-name gates: the suite lists what each backend has in
``DistTestCases`` (common_distributed.py); "dmlc" is added to every set
that lists gloo before the suite is imported. Tests gated by a literal
name check (``BACKEND != "gloo"``, ``require_backend_is_available({"gloo"})``)
are found by importing the suite a second time as gloo and comparing each
test's skip mark; helpers that branch on the name at run time are listed
in RUNTIME_GATES. With ``--name-gates lift`` (the default) the runner lifts
those gates, so the tests run on dmlc as on gloo; with ``keep`` they stay
skipped. Either way they are listed apart ("name-gated"), with their
results. The suite's lists of backends with profiler events
(PROFILING_SUPPORTED_BACKENDS, ...) are left alone: they say which
backends emit gloo's "gloo:all_reduce" events, which a Python backend
does not (DMLC_SUITE_CLAIM_PROFILING=1 adds dmlc to them).

Tests in exclusions.toml (next to this file) are not run on dmlc unless
--run-excluded; each has its reason there. The daemon's --timeout-ms is
DMLC_SUITE_DEVICE_TIMEOUT_MS (15000). Needs Python 3.11 (tomllib) and
expecttest (requirements.txt here), which torch's test helpers import.
gloo runs the same tests in the same invocation, or its
results come from a cache per torch version and world size
(~/.cache/virtio-dmlc/torch-suite/TORCH_VERSION/gloo-wN.json; DMLC_CACHE
moves it; --refresh-gloo reruns them).

Exit status: 0 when every test that was run on dmlc and is not excluded
passed or skipped, 1 otherwise (so tests/run.sh fails on a failure in the
subset it runs).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import unittest
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tomllib

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
EXCLUSIONS = HERE / "exclusions.toml"
SUBSETS = HERE / "subsets.toml"
SKIP_FILE = "skip-reason"


# ---- the driver: which tests, both backends, the counts ----------------------


def cache_file(torch_version: str, world: int) -> Path:
    base = Path(os.environ.get("DMLC_CACHE") or Path.home() / ".cache" / "virtio-dmlc")
    return base / "torch-suite" / torch_version / f"gloo-w{world}.json"


def load_exclusions() -> dict[str, str]:
    with EXCLUSIONS.open("rb") as f:
        data = tomllib.load(f)
    return {name: str(reason) for name, reason in data.get("dmlc", {}).items()}


def load_subset(name: str) -> tuple[list[str] | None, list[str]]:
    """The tests of subset `name` (None: all) and the backends it lifts as."""
    if name == "all":
        return None, []
    with SUBSETS.open("rb") as f:
        data = tomllib.load(f)
    if name not in data:
        raise SystemExit(f"no subset {name!r} in {SUBSETS} (have: all, {', '.join(data)})")
    return list(data[name]["tests"]), list(data[name].get("lift_as", []))


def run_worker(
    backend: str, tests: list[str], args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """Runs `tests` on `backend` in a fresh Python process (the suite reads
    its backend when it is imported); returns its results."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(tests))
        listing = f.name
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--backend",
        backend,
        "--world-size",
        str(args.world_size),
        "--name-gates",
        args.name_gates,
        "--timeout",
        str(args.timeout),
        "--tests-from",
        listing,
        "--json",
        str(out),
        *(f"--lift-as={b}" for b in args.lift_as),
    ]
    if args.verbose:
        cmd.append("--verbose")
    try:
        rc = subprocess.call(cmd)
    finally:
        os.unlink(listing)
    if not out.exists():
        raise SystemExit(f"the {backend} worker exited with {rc} and wrote no results")
    return json.loads(out.read_text())


def list_tests(args: argparse.Namespace) -> dict[str, Any]:
    """The suite's tests and their name gates, from a worker that only lists."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "list.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "--list",
            "--backend",
            "dmlc",
            "--world-size",
            str(args.world_size),
            "--json",
            str(out),
            *(f"--lift-as={b}" for b in args.lift_as),
        ]
        subprocess.check_call(cmd)
        return json.loads(out.read_text())


def counts(results: dict[str, dict[str, Any]], names: list[str]) -> dict[str, int]:
    c = {"pass": 0, "fail": 0, "skip": 0, "excluded": 0}
    for n in names:
        if n in results:
            c[results[n]["outcome"]] += 1
    return c


def driver(args: argparse.Namespace) -> int:
    start = time.monotonic()
    subset, subset_lift = load_subset(args.subset)
    args.lift_as = sorted(set(args.lift_as) | set(subset_lift))
    listing = list_tests(args)
    names: list[str] = listing["tests"]
    if subset is not None:
        unknown = sorted(set(subset) - set(names))
        if unknown:
            raise SystemExit(f"subset {args.subset} names tests the suite lacks: {unknown}")
        names = [n for n in names if n in set(subset)]
    if args.k:
        pattern = re.compile(args.k)
        names = [n for n in names if pattern.search(n)]
    exclusions = load_exclusions()
    stale = sorted(set(exclusions) - set(listing["tests"]))
    if stale:
        print(f"exclusions.toml names tests this torch lacks: {stale}", flush=True)
    torch_version = listing["torch"]
    print(
        f"torch {torch_version}, world size {args.world_size}, subset {args.subset}"
        f"{', -k ' + args.k if args.k else ''}: {len(names)} tests",
        flush=True,
    )

    with tempfile.TemporaryDirectory() as d:
        gloo: dict[str, dict[str, Any]] = {}
        if "gloo" in args.backend:
            cache = cache_file(torch_version, args.world_size)
            cached: dict[str, dict[str, Any]] = {}
            if cache.exists() and not args.refresh_gloo:
                cached = json.loads(cache.read_text())["results"]
            todo = [n for n in names if n not in cached]
            print(
                f"gloo: {len(names) - len(todo)} results from {cache}, running {len(todo)}",
                flush=True,
            )
            if todo:
                got = run_worker("gloo", todo, args, Path(d) / "gloo.json")["results"]
                cached.update(got)
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps({"torch": torch_version, "results": cached}, indent=1))
            gloo = {n: cached[n] for n in names if n in cached}
        dmlc: dict[str, dict[str, Any]] = {}
        if "dmlc" in args.backend:
            run = [n for n in names if args.run_excluded or n not in exclusions]
            print(f"dmlc: running {len(run)}, {len(names) - len(run)} excluded", flush=True)
            if run:
                dmlc = run_worker("dmlc", run, args, Path(d) / "dmlc.json")["results"]
            for n in names:
                if n in exclusions and not args.run_excluded:
                    dmlc[n] = {"outcome": "excluded", "detail": exclusions[n], "seconds": 0.0}

    gated: dict[str, str] = listing["name_gated"]
    report(names, gloo, dmlc, gated, exclusions, args)
    extra = {n: listing["extra"][n] for n in names if n in listing["extra"]}
    if extra:
        passed = sum(1 for n in extra if dmlc.get(n, {}).get("outcome") == "pass")
        print(
            f"\n== lifted as {', '.join(args.lift_as)}: {len(extra)} tests gloo skips "
            f"(counted above); dmlc passes {passed} =="
        )
        for n, why in extra.items():
            print(f"  {dmlc.get(n, {}).get('outcome', '-'):8} {n}  (gate: {why})")
    wall = time.monotonic() - start
    print(f"wall time: {wall:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "torch": torch_version,
                    "world_size": args.world_size,
                    "subset": args.subset,
                    "k": args.k,
                    "name_gates": args.name_gates,
                    "wall_s": round(wall, 1),
                    "tests": names,
                    "name_gated": {n: gated[n] for n in names if n in gated},
                    "lift_as": args.lift_as,
                    "lifted_as": {n: listing["extra"][n] for n in names if n in listing["extra"]},
                    "gloo": gloo,
                    "dmlc": dmlc,
                },
                indent=1,
            )
        )
    failed = [n for n in names if dmlc.get(n, {}).get("outcome") == "fail"]
    return 1 if failed else 0


def first_line(text: str, width: int = 160) -> str:
    """The last line of a traceback that says something (its exception)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    useful = [
        ln
        for ln in lines
        if re.match(r"^[\w.]+(Error|Exception|Failure|Skip\w*|Interrupt)\b", ln)
        or ln.startswith("Process ")
    ]
    line = (useful[-1] if useful else lines[-1]) if lines else ""
    return line[:width]


def report(
    names: list[str],
    gloo: dict[str, dict[str, Any]],
    dmlc: dict[str, dict[str, Any]],
    gated: dict[str, str],
    exclusions: dict[str, str],
    args: argparse.Namespace,
) -> None:
    print("\n== per test (gloo, dmlc) ==")
    for n in names:
        g = gloo.get(n, {}).get("outcome", "-")
        m = dmlc.get(n, {})
        why = ""
        if m.get("outcome") in ("fail", "skip") or (
            g == "pass" and m.get("outcome") not in ("pass", None)
        ):
            why = "  " + first_line(m.get("detail", ""))
        mark = " [name-gated]" if n in gated else ""
        print(f"{g:8} {m.get('outcome', '-'):8} {m.get('seconds', 0):6.1f}s {n}{mark}{why}")

    print("\n== counts ==")
    gc, mc = counts(gloo, names), counts(dmlc, names)
    print(f"{'':10} {'pass':>6} {'fail':>6} {'skip':>6} {'excluded':>9}")
    if gloo:
        print(f"{'gloo':10} {gc['pass']:6} {gc['fail']:6} {gc['skip']:6} {'':>9}")
    if dmlc:
        print(f"{'dmlc':10} {mc['pass']:6} {mc['fail']:6} {mc['skip']:6} {mc['excluded']:9}")
    if gloo and dmlc:
        both = [n for n in names if gloo.get(n, {}).get("outcome") == "pass"]
        lost = [n for n in both if dmlc.get(n, {}).get("outcome") != "pass"]
        print(
            f"gloo passes {len(both)}; of those dmlc fails or skips {len(lost)} "
            f"({sum(1 for n in lost if n in exclusions)} excluded)"
        )
        not_excl = [n for n in lost if n not in exclusions]
        if not_excl:
            print("  passing on gloo, not on dmlc, not excluded:")
            for n in not_excl:
                m = dmlc.get(n, {})
                print(f"    {m.get('outcome', '-'):5} {n}  {first_line(m.get('detail', ''))}")

    in_run = {n: gated[n] for n in names if n in gated}
    only_name = [
        n
        for n in in_run
        if dmlc.get(n, {}).get("outcome") == "skip" and gloo.get(n, {}).get("outcome") != "skip"
    ]
    print(
        f"\n== name-gated: {len(in_run)} tests are gated by a literal backend name; "
        f"skipped on dmlc only by it: {len(only_name)} =="
    )
    if args.name_gates == "lift":
        print("(gates lifted: they ran on dmlc as on gloo; --name-gates keep skips them)")
    by: dict[str, int] = {}
    for n, why in in_run.items():
        out = dmlc.get(n, {}).get("outcome", "-")
        by[out] = by.get(out, 0) + 1
        print(f"  {out:8} {n}  (gate: {why})")
    if in_run:
        print("  " + ", ".join(f"{k} {v}" for k, v in sorted(by.items())))
    runtime_gated = [
        n
        for n in names
        if dmlc.get(n, {}).get("outcome") == "skip"
        and gloo.get(n, {}).get("outcome") == "pass"
        and n not in in_run
    ]
    print(f"\n== skipped on dmlc at run time while gloo passes: {len(runtime_gated)} ==")
    for n in runtime_gated:
        print(f"  {n}  {first_line(dmlc[n].get('detail', ''))}")


# ---- the worker: imports the suite for one backend and runs tests ---------------


def import_suite(backend: str, world: int) -> tuple[Any, dict[str, str], str]:
    """Imports distributed_test for `backend`; returns its _DistTestBase's
    module, the name-gated tests (name -> the gate's reason) and torch's
    version. For dmlc, DistTestCases lists dmlc wherever it lists gloo."""
    os.environ["BACKEND"] = backend
    os.environ["WORLD_SIZE"] = str(world)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="torch-suite-"))
    # file:// as torch's CI runs gloo (the suite gates some tests on it);
    # each test gets its own file (Case.setUp).
    os.environ["INIT_METHOD"] = "file://" + os.path.join(os.environ["TEMP_DIR"], "init")
    Path(os.environ["TEMP_DIR"], "barrier").mkdir(exist_ok=True)
    import torch
    from torch.testing._internal import common_distributed as cd

    if backend == "dmlc":
        import dmlc.torch_backend  # noqa: F401 (registers the backend)

        for features in (cd.DistTestCases.backend_feature, cd.DistTestCases.skip_collective):
            for backends in features.values():
                if "gloo" in backends:
                    backends.add("dmlc")
        # A plugin backend is "available" to require_backend_is_available.
        cd.DistTestCases.backend_feature["plugin"].add("dmlc")

    from torch.testing._internal.distributed import distributed_test as dt

    if backend == "dmlc" and os.environ.get("DMLC_SUITE_CLAIM_PROFILING") == "1":
        # The suite then expects gloo's profiler events ("dmlc:all_reduce",
        # async, with the tensors' shapes), which a Python backend does not
        # emit; without this, dmlc is checked as a backend without them.
        for name in (
            "PROFILING_SUPPORTED_BACKENDS",
            "CUDA_PROFILING_SUPPORTED_BACKENDS",
            "SEND_RECV_PROFILING_SUPPORTED_BACKENDS",
        ):
            lst = getattr(dt, name)
            if "gloo" in lst and "dmlc" not in lst:
                lst.append("dmlc")
    gated: dict[str, str] = {}
    if backend == "dmlc":
        gated = {**name_gates(dt), **runtime_gated(dt)}
    return dt, gated, torch.__version__


def name_gates(dt: Any, other: str = "gloo") -> dict[str, str]:
    """Tests whose skip mark is set in the dmlc import and not in a second
    import of the suite as `other`: gated only by a literal backend name."""
    path = dt.__file__
    spec = importlib.util.spec_from_file_location(f"_distributed_test_as_{other}", path)
    assert spec is not None and spec.loader is not None
    as_other = importlib.util.module_from_spec(spec)
    os.environ["BACKEND"] = other
    try:
        spec.loader.exec_module(as_other)
    finally:
        os.environ["BACKEND"] = "dmlc"
    mine, theirs = dt.DistributedTest._DistTestBase, as_other.DistributedTest._DistTestBase
    gated = {}
    for name in dir(mine):
        if not name.startswith("test"):
            continue
        a, b = getattr(mine, name), getattr(theirs, name, None)
        if getattr(a, "__unittest_skip__", False) and not getattr(b, "__unittest_skip__", False):
            gated[name] = str(getattr(a, "__unittest_skip_why__", ""))
    return gated


# Helpers of the suite that branch on the backend's name at run time and
# have no branch for another backend: with --name-gates lift, they see
# BACKEND == "gloo" (their own globals only; the process group stays dmlc).
# Each was read: its BACKEND check picks what to test, never which backend
# runs it.
RUNTIME_GATES = {
    "_test_accumulate_gradients_no_sync": (
        'builds its CPU model only when BACKEND is "mpi" or "gloo"'
    ),
}


def runtime_gated(dt: Any) -> dict[str, str]:
    """The tests that call a helper of RUNTIME_GATES, and its reason."""
    base = dt.DistributedTest._DistTestBase
    found = {}
    for name in dir(base):
        if not name.startswith("test"):
            continue
        try:
            src = inspect.getsource(getattr(base, name))
        except (OSError, TypeError):
            continue
        for helper, why in RUNTIME_GATES.items():
            if f"self.{helper}(" in src:
                found[name] = f"run time, {helper}: {why}"
    return found


def lift(dt: Any, gated: dict[str, str]) -> None:
    base = dt.DistributedTest._DistTestBase
    for name in gated:
        getattr(base, name).__unittest_skip__ = False
    for helper in RUNTIME_GATES:
        f = getattr(base, helper)
        g = types.FunctionType(
            f.__code__,
            {**f.__globals__, "BACKEND": "gloo"},
            f.__name__,
            f.__defaults__,
            f.__closure__,
        )
        g.__kwdefaults__ = f.__kwdefaults__
        g.__dict__.update(f.__dict__)
        setattr(base, helper, g)


def default_library() -> None:
    """DMLC_LIBRARY, when unset: the workspace's debug build, else its release build."""
    if os.environ.get("DMLC_LIBRARY"):
        return
    for profile in ("debug", "release"):
        lib = REPO / "target" / profile / "libdmlc_guest.so"
        if lib.is_file():
            os.environ["DMLC_LIBRARY"] = str(lib)
            return


def daemon_binary() -> Path:
    if os.environ.get("DMLC_BACKEND_BIN"):
        return Path(os.environ["DMLC_BACKEND_BIN"])
    for profile in ("debug", "release"):
        p = REPO / "target" / profile / "vhost-device-dmlc"
        if p.is_file():
            return p
    raise SystemExit("vhost-device-dmlc not found: cargo build -p vhost-device-dmlc")


@contextlib.contextmanager
def daemon(base: Path, world: int) -> Iterator[subprocess.Popen[bytes]]:
    """A fresh backend daemon with sockets `base`0 .. `base`{world-1}."""
    proc = subprocess.Popen(
        [
            str(daemon_binary()),
            "--socket-path",
            str(base),
            "--socket-count",
            str(world),
            "--log-level",
            "error",
            "--timeout-ms",
            os.environ.get("DMLC_SUITE_DEVICE_TIMEOUT_MS", "15000"),
        ]
    )
    try:
        deadline = time.monotonic() + 20
        while not all(Path(f"{base}{r}").exists() for r in range(world)):
            if proc.poll() is not None:
                raise RuntimeError(f"the backend daemon exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("the backend daemon's sockets did not appear in 20 s")
            time.sleep(0.005)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Ranks:
    """Mixin for a torch MultiProcessTestCase: each test gets a fresh
    temporary folder, with ``with_daemon`` a fresh backend daemon there with
    one socket per rank, forked ranks, rank i's ``DMLC_SOCKET`` (socket i) and
    ``RANK``, and the skip reason a rank logged instead of torch's "look at
    subprocess log". Put it before torch's classes; a test calls
    ``_fork_ranks()`` where torch's would start its processes."""

    with_daemon: bool = False
    _sockets: str = ""
    _skips: str = ""

    def _before_fork(self, folder: str) -> None:
        """Called with the test's folder before the ranks start."""

    def _fork_ranks(self) -> None:
        import torch.multiprocessing as tmp

        self._stack = contextlib.ExitStack()
        d = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="dmlc-suite-"))
        type(self)._skips = d
        self._before_fork(d)
        if self.with_daemon:
            base = Path(d) / "d.sock"
            self._stack.enter_context(daemon(base, int(self.world_size)))
            type(self)._sockets = str(base)
        self._start_processes(tmp.get_context("fork").Process)

    def tearDown(self) -> None:
        try:
            super().tearDown()
        finally:
            stack = getattr(self, "_stack", None)
            if stack is not None:
                stack.close()

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kw: Any) -> None:
        from torch.testing._internal import common_distributed as cd

        if cls._sockets:
            os.environ["DMLC_SOCKET"] = f"{cls._sockets}{rank}"
            os.environ["RANK"] = str(rank)
        skips = Path(cls._skips) / f"{SKIP_FILE}.{rank}"

        class Skips(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "skipping test" in record.msg:
                    skips.write_text(str(record.args[-1]) if record.args else record.msg)

        cd.logger.addHandler(Skips(logging.INFO))
        cd.logger.setLevel(logging.INFO)
        super()._run(rank, test_name, file_name, pipe, **kw)

    def _check_return_codes(self, fn: Any, elapsed_time: float) -> None:
        try:
            super()._check_return_codes(fn, elapsed_time)
        except unittest.SkipTest as e:
            reasons = sorted({p.read_text() for p in Path(self._skips).glob(f"{SKIP_FILE}.*")})
            raise unittest.SkipTest("; ".join(reasons) or str(e)) from None


def make_case(dt: Any, backend: str) -> type:
    class Case(Ranks, dt.TestDistBackend, dt.DistributedTest._DistTestBase):  # type: ignore[misc,name-defined]
        """One test: a daemon (dmlc), then world-size forked ranks."""

        with_daemon = backend == "dmlc"

        def setUp(self) -> None:
            super().setUp()
            self._fork_ranks()

        def _before_fork(self, folder: str) -> None:
            dt.INIT_METHOD = "file://" + os.path.join(folder, "init")

    Case.__name__ = Case.__qualname__ = f"TestDistBackend{backend.upper()}"
    return Case


class Result(unittest.TestResult):
    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose
        self.results: dict[str, dict[str, Any]] = {}
        self._t0 = 0.0

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802 (unittest's name)
        super().startTest(test)
        self._t0 = time.monotonic()

    def _put(self, test: unittest.TestCase, outcome: str, detail: str) -> None:
        name = test.id().split(".")[-1]
        secs = time.monotonic() - self._t0
        self.results[name] = {"outcome": outcome, "detail": detail, "seconds": round(secs, 2)}
        tail = f"  {first_line(detail)}" if outcome != "pass" else ""
        print(f"[{len(self.results)}] {outcome:4} {secs:6.1f}s {name}{tail}", flush=True)
        if self.verbose and outcome == "fail":
            print(detail, flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self._put(test, "pass", "")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._put(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._put(test, "fail", self._exc_info_to_string(err, test))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        self._put(test, "skip", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._put(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self._put(test, "fail", "unexpected success")


def worker(args: argparse.Namespace) -> int:
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.timeout)
    if args.backend == "dmlc":
        default_library()
    dt, gated, version = import_suite(args.backend, args.world_size)
    from torch.testing._internal import common_distributed as cd

    cd.logger.setLevel(logging.WARNING)
    names = sorted(n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test"))
    extra: dict[str, str] = {}
    if args.backend == "dmlc":
        for other in args.lift_as:
            for name, why in name_gates(dt, other).items():
                if name not in gated:
                    extra.setdefault(name, f"{other}: {why}")
    if args.list:
        Path(args.json).write_text(
            json.dumps({"torch": version, "tests": names, "name_gated": gated, "extra": extra})
        )
        return 0
    for name in extra:
        getattr(dt.DistributedTest._DistTestBase, name).__unittest_skip__ = False
    if args.backend == "dmlc" and args.name_gates == "lift":
        lift(dt, gated)
    elif args.backend == "dmlc":
        # keep: the literal gates skip as they are; a test that reaches a
        # run-time gate is skipped here, as it would have nothing to test.
        for name, why in gated.items():
            if why.startswith("run time"):
                fn = getattr(dt.DistributedTest._DistTestBase, name)
                fn.__unittest_skip__ = True
                fn.__unittest_skip_why__ = why
    wanted = Path(args.tests_from).read_text().split()
    case = make_case(dt, args.backend)
    suite = unittest.TestSuite(case(n) for n in wanted)
    result = Result(args.verbose)
    suite.run(result)
    Path(args.json).write_text(json.dumps({"torch": version, "results": result.results}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog='Example: "$venv/bin/python" python/tests/torch_suite/run.py --subset ci',
    )
    p.add_argument("--world-size", type=int, default=2, help="ranks per test (default 2)")
    p.add_argument(
        "--subset",
        default="all",
        help="'all' or a subset of subsets.toml ('ci': every op, a few minutes)",
    )
    p.add_argument(
        "--backend",
        choices=["dmlc", "gloo", "both"],
        default="both",
        help="run dmlc, gloo, or both (default; gloo's results cached per torch version)",
    )
    p.add_argument("-k", metavar="PATTERN", help="only tests whose name matches this regex")
    p.add_argument("--json", metavar="OUT", help="write every result here")
    p.add_argument(
        "--name-gates",
        choices=["lift", "keep"],
        default="lift",
        help="tests gated by a literal backend name: run them on dmlc (lift) or skip (keep)",
    )
    p.add_argument("--timeout", type=int, default=120, help="seconds a test may run (default 120)")
    p.add_argument(
        "--lift-as",
        action="append",
        default=[],
        metavar="BACKEND",
        help="also run on dmlc the tests the suite runs only for BACKEND (mpi: its CPU "
        "all_to_all tests); subsets.toml may name some",
    )
    p.add_argument(
        "--run-excluded",
        action="store_true",
        help="run the tests of exclusions.toml too (their failures then count)",
    )
    p.add_argument("--refresh-gloo", action="store_true", help="rerun gloo, ignore the cache")
    p.add_argument("-v", "--verbose", action="store_true", help="print each failure in full")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--list", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tests-from", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    args.backend = ["dmlc", "gloo"] if args.backend == "both" else [args.backend]
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())

"""torch's backend-agnostic c10d tests on backend "dmlc", next to gloo.

torch's test/distributed/test_c10d_common.py holds abstract test classes
(AbstractCommTest, CommonDistributedDataParallelTest, AbstractLargeCommTest,
AbstractTimeoutTest, ProcessGroupWithDispatchedCollectivesTests) whose
helpers take a backend's name; each backend's own file (test_c10d_gloo.py,
test_c10d_nccl.py) instantiates them. test_c10d_pypg.py tests the Python
bindings of ProcessGroup, Backend and Work that a Python backend such as
"dmlc" is built on. Neither file is in the torch wheel: copy both from a
pytorch checkout of about the installed torch's version into a folder
outside this repository (their code is torch's and is not kept here) and
name it with --tests-dir.

This runner
  (a) runs the test classes of test_c10d_pypg.py as they are;
  (b) instantiates the abstract classes of test_c10d_common.py here, for
      "gloo" and for "dmlc" with the same test names: each test calls one
      of the file's helpers with the backend's name, as test_c10d_gloo.py
      does for gloo. Ranks are forked; for dmlc every test first starts a
      fresh daemon with one socket per rank and rank i opens socket i
      (run.py's Ranks, daemon and default_library). Each backend runs in a
      Python process of its own, so the gloo run never imports dmlc;
  (c) with --concrete, runs the concrete classes of test_c10d_common.py as
      they are (they take no backend; most spawn their ranks, which import
      torch each, so this part takes several minutes);
and prints, per class, each test's outcome on gloo and on dmlc, the counts,
and every dmlc failure with its reason.

A test whose helper needs an accelerator (it moves tensors to cuda:RANK or
calls torch.accelerator.set_device_index) is gated by skip_if_lt_x_gpu, so
it skips on both backends where there is none, as in test_c10d_gloo.py;
tests of the file that are gloo's own (create_device(interface=...),
_broadcast_coalesced over gloo's devices) or nccl's are not instantiated.
The file computes device_type from torch.accelerator.current_accelerator(),
which is "cuda" for a CUDA wheel on a machine without a GPU; when
torch.accelerator.is_available() is False the runner sets it to "cpu" (what
a CPU wheel computes) and says so.

Exit status: 1 when a test passes on gloo and fails on dmlc, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any
from unittest import mock

import run as suite

COMMON = "test_c10d_common.py"
PYPG = "test_c10d_pypg.py"

# Concrete classes of test_c10d_common.py that (c) does not run, and why.
NOT_RUN = {
    "ThreadLocalSafetyLintTest": (
        "lints torch's C++ sources (torch/csrc/distributed/c10d beside the test "
        "folder), which a copy of the test files does not have"
    ),
    "ProcessGroupWithDispatchedCollectivesTests": (
        "its own tests run in (b), inherited by the instantiation for each backend"
    ),
}


# ---- the worker: one Python process per part --------------------------------


def import_tests(tests_dir: Path) -> tuple[Any, list[str]]:
    """Imports test_c10d_common from `tests_dir`; returns it and the
    adjustments made to it, in words."""
    sys.path.insert(0, str(tests_dir))
    import test_c10d_common as common
    import torch

    notes = []
    if not torch.accelerator.is_available() and common.device_type != "cpu":
        notes.append(
            f"test_c10d_common.device_type set to 'cpu' at run time (the file computes "
            f"{common.device_type!r}: torch.accelerator.current_accelerator() names the "
            "wheel's accelerator although none is available)"
        )
        common.device_type = "cpu"
    return common, notes


def instantiate(common: Any, backend: str) -> dict[str, tuple[type, int]]:
    """The abstract classes of test_c10d_common, instantiated for `backend`:
    the key is the abstract class, the value the test class and its world size."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.common_distributed import (
        MultiProcessTestCase,
        skip_if_lt_x_gpu,
    )
    from torch.testing._internal.common_utils import TestCase, retry_on_connect_failures

    dmlc = backend == "dmlc"

    class Forked(suite.Ranks):
        """torch starts ranks with _spawn_processes: fork them here instead
        (the classes are made at run time), with the daemon for dmlc."""

        with_daemon = dmlc

        def _spawn_processes(self) -> None:
            self._fork_ranks()

    class CommTest(Forked, common.AbstractCommTest, MultiProcessTestCase):
        device = "cpu"

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

        def test_sequence_num_set_default_pg(self) -> None:
            self._test_sequence_num_set_default_pg(backend)

        def test_sequence_num_set_new_group(self) -> None:
            self._test_sequence_num_set_new_group(backend)

        @skip_if_lt_x_gpu(2)  # the helper calls torch.accelerator.set_device_index
        def test_sequence_num_incremented_default(self) -> None:
            self._test_sequence_num_incremented_default_group(backend)

        @skip_if_lt_x_gpu(4)  # as above, and its subgroup is ranks [0, 1, 2]
        def test_sequence_num_incremented_subgroup(self) -> None:
            self._test_sequence_num_incremented_subgroup(backend)

        @skip_if_lt_x_gpu(2)  # the helper moves its tensors to cuda:RANK
        def test_warn_not_in_group(self) -> None:
            self._test_warn_not_in_group(backend)

        def test_rank_membership(self) -> None:
            self._test_rank_membership(backend)

        def test_tensor_dtype_mismatch(self) -> None:
            self._test_tensor_dtype_mismatch(backend)

        def test_tensor_dtype_complex(self) -> None:
            self._test_tensor_dtype_complex(backend)

        def test_bool_tensors(self) -> None:
            self._test_bool_tensors(backend)

    class DdpTest(Forked, common.CommonDistributedDataParallelTest, MultiProcessTestCase):
        """The class's own tests (most need two GPUs), and its CPU helpers."""

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

        def _get_process_group(self) -> Any:
            dist.init_process_group(
                backend, store=self._get_store(), rank=self.rank, world_size=self.world_size
            )
            return dist.distributed_c10d._get_default_group()

        def test_ddp_cpu_module(self) -> None:
            pg = self._get_process_group()
            self._test_ddp_with_process_group(pg, [torch.device("cpu")], None)

        def test_ddp_cpu_module_grad_is_view(self) -> None:
            pg = self._get_process_group()
            self._test_ddp_with_process_group(
                pg, [torch.device("cpu")], None, gradient_as_bucket_view=True
            )

        def test_ddp_comm_hook_future_passing_cpu(self) -> None:
            pg = self._get_process_group()
            model = DistributedDataParallel(common.ModuleForDdpCommHook(), process_group=pg)
            model.register_comm_hook(None, self._simple_hook)
            self._run_and_verify_hook(model, 8, 2 * torch.ones(2, 2))

    class LargeCommTest(Forked, common.AbstractLargeCommTest, MultiProcessTestCase):
        device = torch.device("cpu")

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

        def test_new_group_local_sync(self) -> None:
            self._test_new_group_local_sync(backend)

        def test_new_group_local_sync_sanity_check(self) -> None:
            self._test_new_group_local_sync_sanity_check(backend)

        def test_new_group_local_sync_duplicate_pg(self) -> None:
            self._test_new_group_local_sync_duplicate_pg(backend)

        def test_new_group_ordered(self) -> None:
            self._test_new_group_ordered(backend)

    class DispatchedTest(Forked, common.ProcessGroupWithDispatchedCollectivesTests):
        """World size 1. The helper skips reduce_scatter and all_to_all for
        the name "gloo" only: dmlc runs them."""

        def test_collectives(self) -> None:
            self._test_collectives(backend)

        def test_allreduce_coalesced(self) -> None:
            self._test_allreduce_coalesced(backend)

        def test_all_to_all_single(self) -> None:
            self._test_all_to_all_single(backend)

    class TimeoutTest(common.AbstractTimeoutTest, TestCase):
        """World size 1 in this process (the helper's thread): for dmlc a
        daemon with one socket, named by DMLC_SOCKET while the test runs."""

        def setUp(self) -> None:
            super().setUp()
            self._stack = contextlib.ExitStack()
            if dmlc:
                d = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="dmlc-c10d-"))
                base = Path(d) / "d.sock"
                self._stack.enter_context(suite.daemon(base, 1))
                env = {"DMLC_SOCKET": f"{base}0", "RANK": "0"}
                self._stack.enter_context(mock.patch.dict(os.environ, env))

        def tearDown(self) -> None:
            try:
                self._stack.close()
            finally:
                super().tearDown()

        @retry_on_connect_failures
        def test_default_store_timeout(self) -> None:
            self._test_default_store_timeout(backend)

    classes: dict[str, tuple[type, int]] = {
        "ProcessGroupWithDispatchedCollectivesTests": (DispatchedTest, 1),
        "AbstractCommTest": (CommTest, 2),
        "CommonDistributedDataParallelTest": (DdpTest, 2),
        "AbstractLargeCommTest": (LargeCommTest, 4),
        # Last: it opens the device in this process, the others in forks.
        "AbstractTimeoutTest": (TimeoutTest, 1),
    }
    for key, (cls, _) in classes.items():
        cls.__name__ = cls.__qualname__ = f"{key}_{backend}"
    return classes


def defined_in(module: Any) -> dict[str, type]:
    """The unittest classes that `module` defines and that have tests."""
    loader = unittest.TestLoader()
    return {
        name: obj
        for name, obj in vars(module).items()
        if isinstance(obj, type)
        and issubclass(obj, unittest.TestCase)
        and obj.__module__ == module.__name__
        and loader.getTestCaseNames(obj)
    }


def run_classes(classes: dict[str, type], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Runs the tests of each class (those matching -k), a class at a time;
    per class, its results (test -> outcome, detail, seconds)."""
    loader = unittest.TestLoader()
    pattern = re.compile(args.k or "")
    out: dict[str, dict[str, Any]] = {}
    for key, cls in classes.items():
        names = [n for n in loader.getTestCaseNames(cls) if pattern.search(f"{key}.{n}")]
        if not names:
            continue
        print(f"-- {key}", flush=True)
        result = suite.Result(args.verbose)
        unittest.TestSuite(cls(n) for n in names).run(result)
        out[key] = result.results
    return out


def worker(args: argparse.Namespace) -> int:
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.timeout)
    common, notes = import_tests(args.tests_dir)
    import torch
    from torch.testing._internal import common_distributed as cd

    cd.logger.setLevel(logging.WARNING)

    world: dict[str, int] = {}
    if args.worker in ("gloo", "dmlc"):
        if args.worker == "dmlc":
            suite.default_library()
            import dmlc.torch_backend  # noqa: F401 (registers the backend)
        made = instantiate(common, args.worker)
        world = {k: w for k, (_, w) in made.items()}
        results = run_classes({k: c for k, (c, _) in made.items()}, args)
    elif args.worker == "pypg":
        import test_c10d_pypg

        results = run_classes(defined_in(test_c10d_pypg), args)
    else:
        todo = {k: c for k, c in defined_in(common).items() if k not in NOT_RUN}
        results = run_classes(todo, args)
    Path(args.json).write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "git": torch.version.git_version,
                "notes": notes,
                "world": world,
                "results": results,
            }
        )
    )
    return 0


# ---- the driver: the parts, then the tables -----------------------------------


def run_worker(part: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Runs `part` (pypg, gloo, dmlc or concrete) in a fresh Python process."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        part,
        "--tests-dir",
        str(args.tests_dir),
        "--timeout",
        str(args.timeout),
        "--json",
        str(out),
    ]
    if args.verbose:
        cmd.append("--verbose")
    if args.k:
        cmd += ["-k", args.k]
    print(f"\n==== running {part} ====", flush=True)
    start = time.monotonic()
    rc = subprocess.call(cmd)
    print(f"==== {part}: {time.monotonic() - start:.0f} s ====", flush=True)
    if not out.exists():
        raise SystemExit(f"the {part} worker exited with {rc} and wrote no results")
    return json.loads(out.read_text())


def outcome(results: dict[str, Any], test: str) -> str:
    return results.get(test, {}).get("outcome", "-")


def reason(results: dict[str, Any], test: str) -> str:
    r = results.get(test, {})
    return suite.first_line(r.get("detail", ""), 120) if r.get("outcome") != "pass" else ""


def tally(results: dict[str, Any]) -> str:
    c = {"pass": 0, "fail": 0, "skip": 0}
    for r in results.values():
        c[r["outcome"]] += 1
    return f"pass {c['pass']:3}  fail {c['fail']:3}  skip {c['skip']:3}"


def table_one(part: dict[str, Any]) -> None:
    """A part run once (no backend of ours): per class, each test."""
    for cls, results in part["results"].items():
        print(f"\n-- {cls}: {tally(results)}")
        for test in sorted(results):
            print(f"  {outcome(results, test):5} {test}  {reason(results, test)}".rstrip())


def table_both(gloo: dict[str, Any], dmlc: dict[str, Any], verbose: bool) -> list[str]:
    """Per abstract class, each test on both backends; returns the tests
    that pass on gloo and fail on dmlc."""
    lost: list[str] = []
    for cls in dmlc["results"]:
        g, m = gloo["results"].get(cls, {}), dmlc["results"][cls]
        print(f"\n-- {cls} (world size {dmlc['world'].get(cls, '?')})")
        print(f"  {'gloo':5} {'dmlc':5} test")
        for test in sorted(set(g) | set(m)):
            why = reason(m, test) or reason(g, test)
            print(f"  {outcome(g, test):5} {outcome(m, test):5} {test}  {why}".rstrip())
        print(f"  gloo: {tally(g)}")
        print(f"  dmlc: {tally(m)}")
        failed = [t for t in sorted(m) if outcome(m, t) == "fail"]
        for test in failed:
            print(f"  dmlc failure: {test} (gloo: {outcome(g, test)}): {reason(m, test)}")
            if verbose:
                print(m[test]["detail"])
            if outcome(g, test) == "pass":
                lost.append(f"{cls}.{test}")
    return lost


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def driver(args: argparse.Namespace) -> int:
    start = time.monotonic()
    for name in (COMMON, PYPG):
        if not (args.tests_dir / name).is_file():
            raise SystemExit(f"{args.tests_dir / name} not found (see --help)")
    with tempfile.TemporaryDirectory() as d:
        parts = ["pypg", "gloo", "dmlc"] + (["concrete"] if args.concrete else [])
        got = {p: run_worker(p, args, Path(d) / f"{p}.json") for p in parts}
    first = got["dmlc"]
    print(f"\n==== torch {first['torch']} (git {first['git']}), tests from {args.tests_dir} ====")
    for name in (COMMON, PYPG):
        print(f"  {name}: sha256 {digest(args.tests_dir / name)}")
    for note in first["notes"]:
        print(f"  adjustment: {note}")

    print("\n==== (a) test_c10d_pypg.py, as it is ====")
    table_one(got["pypg"])

    print("\n==== (b) the abstract classes of test_c10d_common.py, for gloo and dmlc ====")
    lost = table_both(got["gloo"], got["dmlc"], args.verbose)

    if "concrete" in got:
        print("\n==== (c) the concrete classes of test_c10d_common.py, as they are ====")
        for cls, why in NOT_RUN.items():
            print(f"  not run: {cls}: {why}")
        table_one(got["concrete"])

    print("\n==== counts ====")
    rows: list[tuple[str, str]] = []
    for cls, results in got["pypg"]["results"].items():
        rows.append((f"(a) {cls}", tally(results)))
    for cls, results in got["dmlc"]["results"].items():
        rows.append((f"(b) {cls} gloo", tally(got["gloo"]["results"].get(cls, {}))))
        rows.append((f"(b) {cls} dmlc", tally(results)))
    for cls, results in got.get("concrete", {}).get("results", {}).items():
        rows.append((f"(c) {cls}", tally(results)))
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        print(f"  {label:{width}}  {text}")
    print(f"passing on gloo, failing on dmlc: {len(lost)}")
    for test in lost:
        print(f"  {test}")
    print(f"wall time: {time.monotonic() - start:.0f} s", flush=True)
    return 1 if lost else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog='Example: "$venv/bin/python" python/tests/torch_suite/c10d.py '
        "--tests-dir /tmp/pytorch-c10d",
    )
    p.add_argument(
        "--tests-dir",
        type=Path,
        required=True,
        help=f"folder with torch's {COMMON} and {PYPG} (not in this repository)",
    )
    p.add_argument("--timeout", type=int, default=120, help="seconds a test may run (default 120)")
    p.add_argument("-k", metavar="PATTERN", help="only tests whose CLASS.TEST matches this regex")
    p.add_argument(
        "--concrete", action="store_true", help="also run part (c): the file's concrete classes"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="print each failure in full")
    p.add_argument("--worker", choices=["pypg", "gloo", "dmlc", "concrete"], help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tests_dir = args.tests_dir.resolve()
    if args.worker:
        return worker(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())

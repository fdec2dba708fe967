"""The package over the host transport: every collective on numpy arrays
and torch tensors, errors as exceptions, the environment."""

from __future__ import annotations

import inspect
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import dmlc
from conftest import Backend, checks_passed, need, start_backend
from dmlc import flight_recorder
from dmlc.device import allreduce_order, memory, reduce_op


def test_numpy_collectives_match_the_rank_order_reference(backend: Backend) -> None:
    counts = checks_passed(backend.run("numpy"))
    assert len(set(counts)) == 1 and counts[0] > 100, counts


def test_torch_tensors_in_place_out_of_place_and_async(backend: Backend) -> None:
    need("torch")
    counts = checks_passed(backend.run("torch"))
    assert len(set(counts)) == 1 and counts[0] >= 20, counts


def test_direct_and_staged_members_cut_large_collectives_alike(backend2: Backend) -> None:
    assert checks_passed(backend2.run("mixed_cuts")) == [7, 7]


def test_a_mismatch_names_the_field_and_the_peer(backend2: Backend) -> None:
    assert checks_passed(backend2.run("mismatch")) == [6, 6]


def test_a_lost_member_raises_peer_lost_on_the_others(backend2: Backend) -> None:
    results = backend2.run("lost")
    assert results[1].returncode == 0, results[1].stderr
    assert checks_passed(results[:1]) == [1]


def test_the_environment_opens_the_device(backend2: Backend) -> None:
    assert checks_passed(backend2.run("env")) == [10, 10]


def test_collectives_take_data_out_op_root_and_the_old_allreduce_order_warns() -> None:
    for name in ("allreduce", "reduce", "allgather", "reduce_scatter", "broadcast"):
        params = list(inspect.signature(getattr(dmlc.Device, name)).parameters)
        order = [p for p in ("data", "out", "op", "root") if p in params]
        assert params[1 : 1 + len(order)] == order, (name, params)
    marker = object()
    assert allreduce_order(marker, "max", stacklevel=2) == (marker, "max")
    with pytest.warns(DeprecationWarning, match=r"allreduce\(data, out, op\)"):
        assert allreduce_order("max", dmlc.ReduceOp.SUM, stacklevel=2) == (None, "max")
    with pytest.warns(DeprecationWarning):
        assert allreduce_order(dmlc.ReduceOp.MIN, "sum", stacklevel=2) == (None, dmlc.ReduceOp.MIN)


def test_arguments_are_checked_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="unknown reduce op"):
        reduce_op("median")
    assert reduce_op("avg") is dmlc.ReduceOp.AVG
    with pytest.raises(TypeError, match="no element type"):
        memory(np.zeros(3, dtype=np.complex64))
    with pytest.raises(ValueError, match="C-contiguous"):
        memory(np.zeros((4, 4), dtype=np.float32).T)
    with pytest.raises(ValueError, match="'poll', 'interrupt' or 'hybrid'"):
        dmlc.Device._options("sometimes", None)  # type: ignore[arg-type]
    a = np.zeros(3, dtype=np.int32)
    assert memory(a) == (a.ctypes.data, 12, dmlc.Dtype.I32)
    with pytest.raises(ValueError, match="read-only"):
        a.flags.writeable = False
        memory(a)


def _field(res: object, key: str) -> str:
    out = res.stdout  # type: ignore[attr-defined]
    return next(ln.split(": ", 1)[1] for ln in out.splitlines() if ln.startswith(key + ": "))


@pytest.mark.parametrize("world", [2])
def test_ddp_unmodified_gives_every_rank_the_same_parameters(tmp_path: Path, world: int) -> None:
    need("torch")
    from conftest import start_backend

    b = start_backend(tmp_path, world, "--timeout-ms", "20000")
    try:
        dmlc_runs = b.run("ddp", args=("dmlc", str(tmp_path / "store-dmlc")))
        gloo_runs = b.run("ddp", args=("gloo", str(tmp_path / "store-gloo")))
    finally:
        b.proc.terminate()
        b.proc.wait(10)
    checks_passed(dmlc_runs)
    checks_passed(gloo_runs)
    if os.environ.get("CI", "") not in ("", "false", "0"):
        # tests/run.sh installs the package: torch must find it by itself.
        assert _field(dmlc_runs[0], "loaded by") == "entry point"
    # Each rank printed its own digest: all equal within a backend.
    assert len({_field(r, "params sha256") for r in dmlc_runs}) == 1
    assert len({_field(r, "params sha256") for r in gloo_runs}) == 1
    # dmlc and gloo agree up to summation order.
    a, g = float(_field(dmlc_runs[0], "params sum")), float(_field(gloo_runs[0], "params sum"))
    assert abs(a - g) <= 1e-6 * max(1.0, abs(g)), (a, g)


def test_a_missing_kernel_driver_node_is_named_in_the_error() -> None:
    with pytest.raises(dmlc.DmlcError, match=r"/nonexistent/dmlc9.*is the module loaded"):
        dmlc.Device.open_kernel("/nonexistent/dmlc9")
    with pytest.raises(dmlc.DmlcError, match="/nonexistent/dmlc8"):
        dmlc.Device.from_env({"DMLC_DEVICE": "kernel:/nonexistent/dmlc8"})


def test_the_flight_recorder_dump_loads_in_torchs_analyser(tmp_path: Path) -> None:
    fr_trace = need("torch.distributed.flight_recorder.fr_trace")
    trace = tmp_path / "trace.json"
    b = start_backend(tmp_path, 2, "--timeout-ms", "5000", "--trace-out", str(trace))
    try:
        counts = checks_passed(b.run("numpy"))
    finally:
        b.proc.terminate()  # writes the trace
        b.proc.wait(10)
    assert len(set(counts)) == 1, counts
    paths = flight_recorder.write(trace, tmp_path / "fr")
    assert [p.name for p in paths] == ["dmlc_fr_rank0", "dmlc_fr_rank1"]
    db_path = tmp_path / "fr.db"
    fr_trace.main([str(tmp_path / "fr"), "--prefix", "dmlc_fr_rank", "-o", str(db_path)])
    with db_path.open("rb") as f:
        _, db = pickle.load(f)
    records = int(json.loads(trace.read_text())["otherData"]["records"])
    assert len(db.collectives) == records > 0
    failed = [c for c in db.collectives if not c.pass_check]
    assert not failed, failed
    assert len(db.ncclcalls) == 2 * records

"""The torch.distributed backend "dmlc" over the host transport: failed
collectives reach torch as errors, the dtypes the device lacks are carried
with gloo's results or refused at the call, and the backend is registered
as torch expects of a third-party one."""

from __future__ import annotations

from pathlib import Path

from conftest import Backend, checks_passed, need


def test_dtypes_the_device_lacks_are_carried_or_refused(backend: Backend, tmp_path: Path) -> None:
    need("torch")
    counts = checks_passed(backend.run("torch_values", args=(str(tmp_path / "store"),)))
    assert counts == [counts[0]] * backend.ranks and counts[0] == 20, counts


def test_failed_collectives_fail_the_work_its_future_and_ddp_backward(
    backend2: Backend, tmp_path: Path
) -> None:
    need("torch")
    counts = checks_passed(backend2.run("torch_failures", args=(str(tmp_path / "store"),)))
    assert counts == [17, 13], counts


def test_a_member_that_exits_fails_the_others_collective_and_backward(
    backend2: Backend, tmp_path: Path
) -> None:
    need("torch")
    results = backend2.run("torch_peer_lost", args=(str(tmp_path / "store"),))
    assert results[1].returncode == 0, results[1].stderr
    assert checks_passed(results[:1]) == [2]

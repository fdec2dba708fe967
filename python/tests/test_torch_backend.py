"""The torch.distributed backend "dmlc" over the host transport: failed
collectives reach torch as errors, the dtypes the device lacks are carried
with gloo's results or refused at the call, and the backend is registered
as torch expects of a third-party one."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Backend, checks_passed, need, start_backend


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


@pytest.mark.parametrize("ranks", [2, 3])
def test_send_recv_all_to_all_gather_and_scatter(ranks: int, tmp_path: Path) -> None:
    need("torch")
    # max_bytes 65540: the large message goes as three, cut by both ends.
    b = start_backend(tmp_path, ranks, "--timeout-ms", "20000", "--max-bytes", "65540")
    try:
        counts = checks_passed(b.run("torch_p2p_blocks", args=(str(tmp_path / "store"),)))
    finally:
        b.proc.terminate()
        b.proc.wait(10)
    # Rank 0 checks one message more from each other rank, and the
    # messages from any source; the last rank, the gather.
    others = 16
    assert counts == [2 * ranks + 17] + [others] * (ranks - 2) + [others + 1], counts


@pytest.mark.parametrize("ranks", [3, 4])
def test_subgroups_run_on_communicators_of_their_own(ranks: int, tmp_path: Path) -> None:
    need("torch")
    # At most 4 communicators (the group's included): the groups destroyed
    # must have freed theirs for the later ones to fit.
    b = start_backend(tmp_path, ranks, "--timeout-ms", "20000", "--max-comms", "4")
    try:
        counts = checks_passed(b.run("torch_groups", args=(str(tmp_path / "store"),)))
    finally:
        b.proc.terminate()
        b.proc.wait(10)
    # Each rank's own count: the checks of the groups it is in, one for
    # each it is not in.
    assert counts == {3: [16, 17, 20], 4: [16, 17, 13, 16]}[ranks], counts


@pytest.mark.parametrize("ranks", [2, 3])
def test_all_to_all_single_refuses_a_non_contiguous_input_as_gloo_does(
    ranks: int, tmp_path: Path
) -> None:
    need("torch")
    b = start_backend(tmp_path, ranks, "--timeout-ms", "20000")
    try:
        store = str(tmp_path / "store")
        counts = checks_passed(b.run("torch_all_to_all_single_contiguity", args=(store,)))
    finally:
        b.proc.terminate()
        b.proc.wait(10)
    assert counts == [4] * ranks, counts

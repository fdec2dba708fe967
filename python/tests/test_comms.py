"""Communicators, send and receive, all-to-all, gather and scatter (spec
5.X.6.13) through the package, on 4 ranks over the host transport: numpy
arrays in device memory and staged (tensors: the "torch" scenario of
test_device.py), each rank checking its results against values it computes
itself."""

from __future__ import annotations

from pathlib import Path

import pytest

import dmlc
from conftest import checks_passed, start_backend


def test_communicators_messages_and_block_collectives_on_four_ranks(tmp_path: Path) -> None:
    # max_bytes 65540 (no multiple of 8): messages and blocks go as several
    # requests, cut alike by the members that stage and those that do not.
    b = start_backend(tmp_path, 4, "--timeout-ms", "20000", "--max-bytes", "65540")
    try:
        counts = checks_passed(b.run("comms"))
    finally:
        b.proc.terminate()
        b.proc.wait(10)
    # Each rank's own count: they differ by the checks only some ranks make
    # (the truncated message on ranks 0 and 1, a root's result, the
    # communicator the odd ranks create).
    assert counts == [31, 32, 29, 30], counts


def test_truncated_error_keeps_both_sizes_and_the_mask_names_the_table() -> None:
    with pytest.raises(dmlc.TruncatedError) as e:
        raise dmlc.TruncatedError(8, "m", 0, 1, length=16, room=8)
    assert (e.value.length, e.value.room, e.value.peer) == (16, 8, 1)
    assert isinstance(dmlc.errors.error_for(8, "x"), dmlc.TruncatedError)
    assert dmlc.errors.MismatchError(2, "x", 0x40 | 0x8).fields == ["count", "table"]
    assert dmlc.Comm(3, 1, 2) == dmlc.Comm(3, 1, 2)

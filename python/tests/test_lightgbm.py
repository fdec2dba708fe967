"""dmlc.lightgbm: LightGBM's network hook through the device.

- examples/lightgbm/train.py over the device and over LightGBM's own socket
  network (the reference, which never touches the device) on the same data:
  every rank ends with the same trees, and at two ranks the device's trees
  equal the socket network's bit for bit (each histogram bin is one
  addition of two values, the same in either order); at three they must
  reach the same test accuracy.
- The two functions LightGBM calls, called here through their C signatures
  with uneven blocks, gaps between them and a reducer of our own (int32
  maximum), against results this file computes from every rank's inputs.
- A call LightGBM could not have made right (blocks for another group size)
  ends the process naming the cause.

Run as a script, this file is the rank program of the last two.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, Backend, checks_passed, need, run_ranks

TRAIN = REPO / "examples" / "lightgbm" / "train.py"


def _free_port_base(count: int) -> int:
    """A port p with p .. p + count - 1 free on 127.0.0.1 now."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for p in range(base, base + count):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
        except OSError:
            continue
        return int(base)
    pytest.fail("no run of free ports on 127.0.0.1")


def _results(outs: list[str]) -> list[dict]:
    docs = []
    for r, out in enumerate(outs):
        line = next((ln for ln in out.splitlines() if ln.startswith("json: ")), None)
        assert line, f"rank {r} printed no results:\n{out}"
        docs.append(json.loads(line[6:]))
    return docs


def _socket_run(ranks: int, args: list[str]) -> list[dict]:
    port = _free_port_base(ranks)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    procs = [
        subprocess.Popen(
            [sys.executable, str(TRAIN), "--network", "socket", "--port", str(port), *args],
            env={**env, "RANK": str(r), "WORLD_SIZE": str(ranks)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(ranks)
    ]
    outs = []
    for r, p in enumerate(procs):
        try:
            out = p.communicate(timeout=300)[0]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"LightGBM's socket network: rank {r} did not finish in 300 s")
        assert p.returncode == 0, f"socket rank {r} exited {p.returncode}:\n{out}"
        outs.append(out)
    return _results(outs)


@pytest.mark.parametrize("ranks", [2, 3])
def test_lightgbm_through_the_device_matches_its_socket_network(ranks: int, tmp_path: Path) -> None:
    need("lightgbm")
    need("sklearn")
    args = ["--rounds", "4", "--json", "-"]
    device = _results(run_ranks(tmp_path, ranks, [str(TRAIN), "--network", "dmlc", *args], 300))
    socket = _socket_run(ranks, args)
    for name, docs in (("device", device), ("socket", socket)):
        assert [d["rank"] for d in docs] == list(range(ranks)), docs
        assert len({d["model_sha256"] for d in docs}) == 1, f"{name}: ranks differ: {docs}"
        assert docs[0]["accuracy"] > 0.8, docs[0]
    # Every collective of the training went through the device.
    assert device[0]["exchange_calls"] > 4 * ranks and device[0]["exchange_s"] > 0
    if ranks == 2:
        assert device[0]["model_sha256"] == socket[0]["model_sha256"]
    else:
        assert device[0]["accuracy"] == socket[0]["accuracy"]


def test_reduce_scatter_and_allgather_through_their_c_signatures(backend: Backend) -> None:
    results = backend.run("lightgbm functions", argv=[__file__, "functions"])
    assert checks_passed(results) == [2] * backend.ranks


def test_blocks_for_another_group_size_end_the_process_naming_it(backend2: Backend) -> None:
    results = backend2.run("lightgbm wrong size", argv=[__file__, "wrong-size"])
    for r, res in enumerate(results):
        assert res.returncode == 1, f"rank {r}: {res.returncode}\n{res.stdout}{res.stderr}"
        assert "num_machines must be the group's size" in res.stderr, res.stderr
        assert "checks passed" not in res.stdout


# The rank program.

_REDUCER = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int32)


@_REDUCER
def _int32_max(src: int, dst: int, type_size: int, nbytes: int) -> None:
    n = nbytes // 4
    a = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(src))
    b = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(dst))
    np.maximum(a, b, out=b)


def _int32s(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int32 * len(values))(*values)


def _rank_input(r: int, lens: list[int], gap: int) -> np.ndarray:
    """Rank r's reduce-scatter input: block j has lens[j] int32s, `gap` int32s of
    filler after each; values that make a different rank the maximum per element."""
    out = []
    for j, k in enumerate(lens):
        out.append((np.arange(k, dtype=np.int32) * 7 + 13 * r * (1 + j)) % 50 - 25)
        out.append(np.full(gap, 10_000 + r, dtype=np.int32))  # never in a result
    return np.concatenate(out)


def _functions(dev: object, wrong_size: bool = False) -> None:
    from dmlc.lightgbm import Exchange

    ex = Exchange(dev)  # type: ignore[arg-type]
    rank, world = dev.rank, dev.world_size  # type: ignore[attr-defined]
    passed = 0
    # Reduce-scatter: blocks of 2, 5, 1 ... int32s with 3 filler int32s after each.
    lens = [[2, 5, 1, 4][j % 4] for j in range(world)]
    gap = 3
    starts = [sum(lens[:j]) * 4 + j * gap * 4 for j in range(world)]
    data = _rank_input(rank, lens, gap)
    out = np.full(lens[rank] + 2, -99, dtype=np.int32)
    fold = ctypes.c_void_p(ctypes.cast(_int32_max, ctypes.c_void_p).value)
    n = world + 1 if wrong_size else world
    ex.reduce_scatter(
        data.ctypes.data,
        data.nbytes,
        4,
        _int32s([s for s in starts] + [0] * (n - world)),
        _int32s([k * 4 for k in lens] + [0] * (n - world)),
        n,
        out.ctypes.data,
        out.nbytes,
        ctypes.byref(fold),
    )
    every = [_rank_input(r, lens, gap) for r in range(world)]
    s0 = starts[rank] // 4
    want = np.max([e[s0 : s0 + lens[rank]] for e in every], axis=0)
    if not (np.array_equal(out[: lens[rank]], want) and (out[lens[rank] :] == -99).all()):
        raise SystemExit(f"rank {rank}: reduce-scatter gave {out}, expected {want}")
    passed += 1
    # Allgather: rank r's block holds r + 1 bytes ... at a gap of 2 bytes.
    sizes = [r * 3 + 1 for r in range(world)]
    where = [sum(sizes[:r]) + 2 * r for r in range(world)]
    mine = np.arange(sizes[rank], dtype=np.uint8) + 40 * rank
    got = np.full(where[-1] + sizes[-1] + 2, 255, dtype=np.uint8)
    ex.allgather(
        mine.ctypes.data,
        mine.nbytes,
        _int32s(where),
        _int32s(sizes),
        world,
        got.ctypes.data,
        got.nbytes,
    )
    want_g = np.full_like(got, 255)
    for r in range(world):
        want_g[where[r] : where[r] + sizes[r]] = np.arange(sizes[r], dtype=np.uint8) + 40 * r
    if not np.array_equal(got, want_g):
        raise SystemExit(f"rank {rank}: allgather gave {got}, expected {want_g}")
    passed += 1
    if ex.calls != 2:
        raise SystemExit(f"rank {rank}: {ex.calls} calls counted, 2 made")
    print(f"checks passed: {passed}", flush=True)


if __name__ == "__main__":
    from dmlc import Device

    with Device.from_env() as device:
        _functions(device, wrong_size=sys.argv[1] == "wrong-size")

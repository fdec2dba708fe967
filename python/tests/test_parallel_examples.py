"""The parallel examples (examples/torch/fsdp2.py, pipeline.py, ddp2d.py) on
2 ranks over the host transport with backend "dmlc", a few small steps
each: every rank's parameters must be within the program's tolerance of a
single-process replay of the same steps that uses no collective (each
program's --reference), not merely equal between the ranks.

And the backend's coalesced tensor forms, which torch's functional
collectives (so DTensor and FSDP2's ``full_tensor()``) call: each rank
checks its results against values it computes itself. Run as a script,
this file is that rank program.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, checks_passed, need, run_ranks, under_ci

EXAMPLES = REPO / "examples" / "torch"
ERROR = re.compile(r"^rank (\d+): max \|params - single process\| (\S+) \(tolerance (\S+): ok\)$")
SHA = re.compile(r"^rank (\d+): params sha256 ([0-9a-f]{64})$")


@pytest.fixture(scope="module")
def digits() -> Path:
    """The digits data (examples/digits/fetch-data.sh: cached after the
    first fetch)."""
    got = subprocess.run(
        [str(REPO / "examples" / "digits" / "fetch-data.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    if got.returncode:
        if under_ci():
            pytest.fail(f"fetch-data.sh failed under CI:\n{got.stderr}")
        pytest.skip(f"the digits data could not be fetched:\n{got.stderr}")
    return Path(got.stdout.strip())


@pytest.mark.parametrize(
    ("program", "extra", "same_params"),
    [
        ("fsdp2.py", [], True),
        ("pipeline.py", ["--schedule", "1f1b", "--layers", "3"], False),
        ("pipeline.py", ["--schedule", "gpipe"], False),
        ("ddp2d.py", ["--tp", "2"], True),
    ],
    ids=["fsdp2", "pipeline-1f1b", "pipeline-gpipe", "ddp2d-1x2"],
)
def test_parallel_example_matches_the_single_process(
    program: str, extra: list[str], same_params: bool, digits: Path, tmp_path: Path
) -> None:
    need("torch")
    argv = [str(EXAMPLES / program), "--backend", "dmlc", "--data", str(digits), "--reference"]
    argv += ["--steps", "3", "--hidden", "32", "--batch", "16", *extra]
    outs = run_ranks(tmp_path, 2, argv)
    digests = []
    for r, out in enumerate(outs):
        lines = out.splitlines()
        errors = [m for m in map(ERROR.match, lines) if m]
        assert errors and errors[0][1] == str(r), f"rank {r}: no reference check:\n{out}"
        assert float(errors[0][2]) <= float(errors[0][3]), out
        digests += [m[2] for m in map(SHA.match, lines) if m]
    assert len(digests) == 2, outs
    if same_params:
        assert digests[0] == digests[1], outs
    result = json.loads(next(ln for ln in outs[0].splitlines() if ln.startswith("json: "))[6:])
    assert result["world"] == 2 and result["step_ms"] > 0 and result["reference_error"] <= 1e-5


def test_functional_collectives_coalesced_forms(tmp_path: Path) -> None:
    """all_gather_single_coalesced and reduce_scatter_single_coalesced
    (torch's functional collectives go through them even for one tensor:
    before the backend had them, ``funcol.reduce_scatter_single`` and
    DTensor's ``full_tensor()`` failed with "Backend dmlc does not
    support ...")."""
    need("torch")
    outs = run_ranks(tmp_path, 2, [__file__, str(tmp_path / "store")])
    assert checks_passed([subprocess.CompletedProcess([], 0, o, "") for o in outs]) == [8, 8]


def _functional_rank(store_path: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    import dmlc.torch_backend  # noqa: F401 (registers "dmlc" from a source tree)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "dmlc", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    g = dist.group.WORLD
    passed = 0

    def check(ok: bool, what: str) -> None:
        nonlocal passed
        if not ok:
            raise SystemExit(f"rank {rank}: {what}")
        passed += 1

    def mine(r: int, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32) + 100 * r

    every = [mine(r, 5) for r in range(world)]
    got = funcol.all_gather_single(mine(rank, 5), 0, g)
    check(torch.equal(got, torch.cat(every)), f"all_gather_single: {got}")
    a, b, empty = mine(rank, 3), mine(rank, 2).to(torch.int64), torch.empty(0)
    got2 = funcol.all_gather_single_coalesced([a, b, empty], g)
    want = [torch.cat([mine(r, 3) for r in range(world)])]
    want.append(torch.cat([mine(r, 2).to(torch.int64) for r in range(world)]))
    check(torch.equal(got2[0], want[0]) and torch.equal(got2[1], want[1]), f"coalesced: {got2}")
    check(got2[2].numel() == 0, f"coalesced, no elements: {got2[2]}")
    total = sum(mine(r, 2 * world) * (r + 1) for r in range(world))
    block = slice(2 * rank, 2 * rank + 2)
    got = funcol.reduce_scatter_single(mine(rank, 2 * world) * (rank + 1), "sum", 0, g)
    check(torch.equal(got, total[block]), f"reduce_scatter_single: {got}")
    ins = [mine(rank, 2 * world) * (rank + 1), mine(rank, 4 * world)]
    got2 = funcol.reduce_scatter_single_coalesced(ins, "avg", [0, 0], g)
    avg2 = sum(mine(r, 4 * world) for r in range(world)) / world
    check(torch.allclose(got2[0], (total / world)[block]), f"coalesced avg: {got2[0]}")
    check(torch.allclose(got2[1], avg2[4 * rank : 4 * rank + 4]), f"coalesced avg: {got2[1]}")
    mesh = init_device_mesh("cpu", (world,))
    whole = torch.arange(8.0 * world).reshape(4 * world, 2)
    full = distribute_tensor(whole, mesh, [Shard(0)]).full_tensor()
    check(torch.equal(full, whole), f"full_tensor: {full}")
    part = DTensor.from_local(torch.full((2 * world,), rank + 1.0), mesh, [Partial()])
    shard = part.redistribute(mesh, [Shard(0)]).to_local()
    check(torch.equal(shard, torch.full((2,), world * (world + 1) / 2)), f"Partial: {shard}")
    dist.destroy_process_group()
    print(f"checks passed: {passed}", flush=True)


if __name__ == "__main__":
    _functional_rank(sys.argv[1])

"""FSDP2 (``fully_shard``) training of train.py's MLP on the digits, on CPU,
over backend "dmlc" (the device) or "gloo" (TCP).

    python3 examples/torch/fsdp2.py --backend dmlc --reference   # in each rank

Rank and world size come from the environment as in train.py. Each Linear
layer is an FSDP2 unit of its own and the model the root one, on a 1-D
mesh of every rank: each rank keeps 1/N of every parameter; the forward
all-gathers each layer and frees it after, the backward all-gathers it
again and reduce-scatters its gradient (averaged over the ranks), and SGD
updates the shards. Each rank reads its own --batch samples per step
(train.py's batches).

Prints on rank 0 the median step (zero_grad, forward, backward, SGD step)
split into compute (forward and backward of an unsharded copy of the model
on the same batch, with no collective, timed just before each step),
update (the SGD step on the shards) and exchange (the rest: FSDP's
all-gathers and reduce-scatters and its copies around them), the last
loss, and a ``json:`` line; on every rank the sha256 of the full
parameters (gathered with ``DTensor.full_tensor()``), equal on every rank.

--reference replays the steps in one process with no collective (SGD on
the mean of every rank's loss, whose gradient the averaged reduce-scatter
gives) and compares the full parameters. Tolerance: 1e-5 (the two sum the
gradients in another order, so they differ by float32 rounding; with one
rank's gradient lost the defaults end 5e-3 away after 3 steps, 1e-2 after
20). Exits 1 above it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from common import (
    arguments,
    batch,
    flat,
    init,
    load,
    median_ms,
    model,
    rank_and_world,
    replay,
    report,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

TOLERANCE = 1e-5


def main() -> int:
    a = arguments(__doc__, hidden=256, batch=64, steps=20).parse_args()
    rank, world = rank_and_world()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    init(a.backend, rank, world)
    x, y = load(a.data)
    mesh = init_device_mesh("cpu", (world,))
    net = model(a.hidden)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=a.lr)
    alone = model(a.hidden)  # the compute without FSDP: same shapes, whole
    setup_s = time.perf_counter() - t0

    def loss_of(m: torch.nn.Module, step: int, of: int) -> torch.Tensor:
        bx, by = batch(x, y, step, of, world, a.batch)
        return torch.nn.functional.cross_entropy(m(bx), by)

    steps, compute, updates = [], [], []
    for s in range(a.steps):
        t = time.perf_counter()
        loss_of(alone, s, rank).backward()
        compute.append(time.perf_counter() - t)
        alone.zero_grad()
        t = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(net, s, rank)
        loss.backward()
        u = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t)
        updates.append(time.perf_counter() - u)

    full = flat(p.full_tensor() if isinstance(p, DTensor) else p for p in net.parameters())
    reference = None
    if a.reference:

        def mean_loss(m: torch.nn.Module, step: int) -> torch.Tensor:
            return torch.stack([loss_of(m, step, r) for r in range(world)]).mean()

        reference = flat(replay(model(a.hidden), a.lr, a.steps, mean_loss).parameters())
    dist.destroy_process_group()
    result = {
        "program": "fsdp2",
        "backend": a.backend,
        "rank": rank,
        "world": world,
        "params": full.numel(),
        "setup_s": round(setup_s, 3),
        "step_ms": median_ms(steps),
        "compute_ms": median_ms(compute),
        "update_ms": median_ms(updates),
        "final_loss": round(loss.item(), 6),
    }
    return report(result, full, reference, TOLERANCE, a.json)


if __name__ == "__main__":
    raise SystemExit(main())

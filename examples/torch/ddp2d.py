"""2-D parallel training of train.py's MLP on the digits: tensor parallel
inside groups of --tp ranks, DDP across them, on CPU, over backend "dmlc"
(the device) or "gloo" (TCP).

    python3 examples/torch/ddp2d.py --backend dmlc --tp 2 --reference   # in each rank

Rank and world size come from the environment as in train.py. The ranks
form a DeviceMesh of (world / tp) x tp (``init_device_mesh("cpu", (dp,
tp))``; 4 ranks: 2 x 2, 2 ranks: 1 x 2 or, with --tp 1, 2 x 1), whose rows
("tp") and columns ("dp") are process groups of their own. Inside a row,
each rank holds 1/tp of the two hidden layers (Megatron's MLP): the first
layer's rows (its output units), the second's columns, and an allreduce
over the row sums the second layer's partial outputs before its bias (the
backward needs no exchange: every rank of the row holds the same gradient
after it); the last layer is whole on every rank. Across rows,
``DistributedDataParallel(process_group=dp)`` averages each rank's
gradients with the ranks that hold the same shard. Each row reads its own
--batch samples per step (train.py's batches, one reader per row).

Prints on rank 0 the median step (zero_grad, forward, backward, SGD step)
split into compute (the same forward and backward with both exchanges off:
no allreduce in the row, DDP's no_sync; timed just before each step),
update (SGD) and exchange (the rest: the row's allreduces, DDP's and its
copies), the last loss, and a ``json:`` line; on every rank the sha256 of
the whole model (the shards gathered over the row), equal on every rank.

--reference replays the steps in one process with no collective (SGD on
the whole model, the loss the mean of every row's loss; the hidden layers
computed in the row's pieces, see Pieces) and compares the whole model.
Tolerance: 1e-5 (with --tp 2 the host gives exactly 0 with both backends,
20 and 100 steps alike; with one row's gradient lost the defaults end
5e-3 away after 3 steps, 1e-2 after 20). Exits 1 above it.
"""

from __future__ import annotations

import time
from typing import Any

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
from torch.nn.parallel import DistributedDataParallel

TOLERANCE = 1e-5


class SumOverRow(torch.autograd.Function):
    """Forward: the sum of every row member's `x`; backward: the gradient
    as it is (each member of the row already holds all of it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class RowMLP(torch.nn.Module):
    """train.py's MLP `whole` with its hidden layers split over `group`,
    whose member `t` of `tp` this process is."""

    def __init__(self, whole: torch.nn.Module, t: int, tp: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        l1, l2, self.l3 = whole[0], whole[2], whole[4]  # type: ignore[index]
        part = l1.out_features // tp
        mine = slice(t * part, (t + 1) * part)
        self.l1 = torch.nn.Linear(l1.in_features, part)
        self.l2 = torch.nn.Linear(part, l2.out_features, bias=False)
        with torch.no_grad():
            self.l1.weight.copy_(l1.weight[mine])
            self.l1.bias.copy_(l1.bias[mine])
            self.l2.weight.copy_(l2.weight[:, mine])
        self.b2 = l2.bias
        self.group, self.tp = group, tp
        self.exchange = True  # off: the compute alone (results then wrong)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.l2(torch.relu(self.l1(x)))
        if self.exchange and self.tp > 1:
            z = SumOverRow.apply(z, self.group)
        return self.l3(torch.relu(z + self.b2))

    def whole(self) -> torch.Tensor:
        """The whole model's parameters, in train.py's order, gathered
        over the row."""

        def gather(p: torch.Tensor, dim: int) -> torch.Tensor:
            parts = [torch.empty_like(p) for _ in range(self.tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=self.group)
            return torch.cat(parts, dim)

        w1, b1 = gather(self.l1.weight, 0), gather(self.l1.bias, 0)
        w2 = gather(self.l2.weight, 1)
        return flat([w1, b1, w2, self.b2, self.l3.weight, self.l3.bias])


class Pieces(torch.nn.Module):
    """The whole model `whole` as the reference runs it: its hidden layers
    computed in the row's pieces (each member's product, summed in member
    order), so that float32 rounds as it does in the row. With whole
    products the two drift apart where a ReLU near zero goes one way in
    one and the other in the other: 4e-5 after 20 steps at the defaults
    (2 x 2), 3e-4 after 100, though in float64 they agree to 1e-16."""

    def __init__(self, whole: torch.nn.Module, tp: int) -> None:
        super().__init__()
        self.whole, self.tp = whole, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        l1, l2, l3 = self.whole[0], self.whole[2], self.whole[4]  # type: ignore[index]
        pieces = zip(l1.weight.chunk(self.tp), l1.bias.chunk(self.tp), l2.weight.chunk(self.tp, 1))
        f = torch.nn.functional
        parts = [f.linear(torch.relu(f.linear(x, w, b)), v.contiguous()) for w, b, v in pieces]
        z = parts[0]
        for part in parts[1:]:
            z = z + part
        return l3(torch.relu(z + l2.bias))


def main() -> int:
    p = arguments(__doc__, hidden=256, batch=64, steps=20)
    p.add_argument("--tp", type=int, default=2, help="ranks per tensor-parallel row")
    a = p.parse_args()
    rank, world = rank_and_world()
    if world % a.tp or a.hidden % a.tp:
        p.error(f"--tp {a.tp} must divide the ranks ({world}) and --hidden ({a.hidden})")
    dp = world // a.tp
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    init(a.backend, rank, world)
    x, y = load(a.data)
    mesh = init_device_mesh("cpu", (dp, a.tp), mesh_dim_names=("dp", "tp"))
    row, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    local = RowMLP(model(a.hidden), t, a.tp, mesh.get_group("tp"))
    net = DistributedDataParallel(local, process_group=mesh.get_group("dp"))
    opt = torch.optim.SGD(net.parameters(), lr=a.lr)
    setup_s = time.perf_counter() - t0

    def loss_of(m: torch.nn.Module, step: int, of: int) -> torch.Tensor:
        bx, by = batch(x, y, step, of, dp, a.batch)
        return torch.nn.functional.cross_entropy(m(bx), by)

    steps, compute, updates = [], [], []
    for s in range(a.steps):
        local.exchange = False
        t1 = time.perf_counter()
        with net.no_sync():
            loss_of(net, s, row).backward()
        compute.append(time.perf_counter() - t1)
        local.exchange = True
        t1 = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(net, s, row)
        loss.backward()
        u = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t1)
        updates.append(time.perf_counter() - u)

    params = local.whole()
    reference = None
    if a.reference:

        def mean_loss(m: torch.nn.Module, step: int) -> torch.Tensor:
            return torch.stack([loss_of(m, step, r) for r in range(dp)]).mean()

        whole = replay(Pieces(model(a.hidden), a.tp), a.lr, a.steps, mean_loss)
        reference = flat(whole.parameters())
    dist.destroy_process_group()
    result = {
        "program": "ddp2d",
        "backend": a.backend,
        "mesh": [dp, a.tp],
        "rank": rank,
        "world": world,
        "params": params.numel(),
        "setup_s": round(setup_s, 3),
        "step_ms": median_ms(steps),
        "compute_ms": median_ms(compute),
        "update_ms": median_ms(updates),
        "final_loss": round(loss.item(), 6),
    }
    return report(result, params, reference, TOLERANCE, a.json)


if __name__ == "__main__":
    raise SystemExit(main())

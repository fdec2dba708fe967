"""Pipeline-parallel training of an MLP on the digits with
``torch.distributed.pipelining``, on CPU, over backend "dmlc" (the device)
or "gloo" (TCP).

    python3 examples/torch/pipeline.py --backend dmlc --schedule 1f1b --reference

Rank and world size come from the environment as in train.py; there are
as many stages as ranks. The model has --layers Linear layers (64 in,
--hidden wide, 10 out, a ReLU before each but the first), built alike on
every rank from seed 0; rank r keeps stage r, a run of consecutive layers
(a ``PipelineStage`` whose shapes the first step finds out). Each step
feeds --batch samples (rank 0 reads them, the last rank their labels) as
--chunks micro-batches through the schedule of --schedule, GPipe or 1F1B;
each micro-batch's activations go forward, and their gradients back, by
send and receive between neighbouring stages; the loss is the mean
cross-entropy of each micro-batch, and the schedule averages the
gradients over the micro-batches (``scale_grads``). SGD then updates each
stage on its own rank.

Prints on rank 0 the median step (zero_grad, the schedule's step, SGD)
split into compute (stage 0's forward and backward of every micro-batch
with no send or receive, timed just before each step), update (SGD) and
exchange (the rest: the sends and receives and the time stage 0 waits for
the later stages, the pipeline's bubble included), the last step's loss
(sent by the last stage), and a ``json:`` line; on every rank the sha256
of its stage's parameters.

--reference replays the steps in one process with no collective (SGD on
the whole model, the loss the mean over the micro-batches of each one's
mean cross-entropy) and compares each rank's stage with the same layers
there. Tolerance: 1e-5 (the two add the micro-batches' gradients in
another order: float32 rounding apart; with one micro-batch of four lost
the defaults end 5e-3 away after 3 steps, 2e-2 after 20). Exits 1 above
it.
"""

from __future__ import annotations

import copy
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
    mlp,
    rank_and_world,
    replay,
    report,
)
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

TOLERANCE = 1e-5
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_of(net: torch.nn.Sequential, layers: int, stage: int, stages: int) -> torch.nn.Sequential:
    """Stage `stage` of `stages`: its share of the `layers` Linear layers
    (the first ones one more where they do not divide), each with the ReLU
    before it."""
    per, extra = divmod(layers, stages)
    first = stage * per + min(stage, extra)
    count = per + (stage < extra)
    # net is Linear, then ReLU and Linear for each later layer.
    lo = 0 if first == 0 else 2 * first - 1
    return net[lo : 2 * (first + count) - 1]  # type: ignore[return-value]


def main() -> int:
    p = arguments(__doc__, hidden=256, batch=64, steps=20)
    p.add_argument("--layers", type=int, default=4, help="Linear layers (at least one per rank)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    a = p.parse_args()
    rank, world = rank_and_world()
    if a.layers < world or a.batch % a.chunks or (a.schedule == "1f1b" and a.chunks < world):
        p.error("need --layers >= ranks, --chunks dividing --batch, and for 1f1b --chunks >= ranks")
    widths = [64] + [a.hidden] * (a.layers - 1) + [10]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    init(a.backend, rank, world)
    x, y = load(a.data)
    first, last = rank == 0, rank == world - 1
    module = stage_of(mlp(widths), a.layers, rank, world)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, target)

    schedule = SCHEDULES[a.schedule](stage, a.chunks, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=a.lr)
    alone = copy.deepcopy(module)  # the compute without the pipeline
    setup_s = time.perf_counter() - t0

    def compute_alone(bx: torch.Tensor, by: torch.Tensor) -> float:
        t = time.perf_counter()
        for cx, cy in zip(bx.chunk(a.chunks), by.chunk(a.chunks)):
            inp = cx if first else torch.randn(len(cx), a.hidden, requires_grad=True)
            out = alone(inp)
            (loss_fn(out, cy) if last else out.sum()).backward()
        alone.zero_grad()
        return time.perf_counter() - t

    steps, compute, updates = [], [], []
    losses: list[torch.Tensor] = []
    for s in range(a.steps):
        bx, by = batch(x, y, s, 0, 1, a.batch)
        compute.append(compute_alone(bx, by))
        t = time.perf_counter()
        opt.zero_grad()
        losses = []
        if first and last:
            schedule.step(bx, target=by, losses=losses)
        elif first:
            schedule.step(bx)
        elif last:
            schedule.step(target=by, losses=losses)
        else:
            schedule.step()
        u = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t)
        updates.append(time.perf_counter() - u)
    loss = torch.stack(losses).mean().detach() if last else torch.zeros(())
    dist.broadcast(loss, world - 1)

    params = flat(module.parameters())
    reference = None
    if a.reference:

        def mean_loss(m: torch.nn.Module, step: int) -> torch.Tensor:
            bx, by = batch(x, y, step, 0, 1, a.batch)
            chunks = zip(bx.chunk(a.chunks), by.chunk(a.chunks))
            return torch.stack([loss_fn(m(cx), cy) for cx, cy in chunks]).mean()

        whole = replay(mlp(widths), a.lr, a.steps, mean_loss)
        reference = flat(stage_of(whole, a.layers, rank, world).parameters())
    dist.destroy_process_group()
    result = {
        "program": "pipeline",
        "backend": a.backend,
        "schedule": a.schedule,
        "chunks": a.chunks,
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

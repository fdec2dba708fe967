"""Data-parallel training of an MLP on the handwritten digits with DDP,
unmodified, over backend "dmlc" (the device) or "gloo" (TCP).

    python3 examples/torch/train.py --backend dmlc   # in each rank

Rank and world size come from the environment (RANK and WORLD_SIZE, or the
launcher's DMLC_TASK_ID and DMLC_NUM_WORKER). With "gloo" the ranks meet
at MASTER_ADDR:MASTER_PORT (default: rank 0 of DMLC_TCP_PEERS, else
127.0.0.1:29500); "dmlc" needs no rendezvous: the device is the group. "nocomm" is a
baseline, not a backend: its collectives complete at once and move
nothing, so a step costs what DDP and the model cost with a free exchange,
the floor under any backend (the ranks' parameters then differ).

Prints, on rank 0, the median step time split into compute (forward and
backward without the exchange, measured first under no_sync, or with
--interleave before every step), the
optimizer's update, and exchange (the rest: DDP's bucket copies and
scaling, and the collectives that the backward did not hide), and on
every rank the sha256 of its parameters, so that a caller can check that
every rank holds the same model. Ranks that agree can all be wrong alike:
--reference also replays the same steps in this one process, without any
collective (the mean loss over every rank's batch, which is what DDP's
averaged gradient computes), and prints the largest difference between the
two sets of parameters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import DEFAULT_DATA, flat, init, load, model, rank_and_world, replay, sha256
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend",
        choices=["dmlc", "gloo", "nocomm"],
        default="dmlc",
        help='"nocomm": a baseline whose collectives do nothing (see above)',
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="digits.csv.gz")
    p.add_argument("--hidden", type=int, default=1024, help="width of the two hidden layers")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--eval-samples",
        type=int,
        default=0,
        help="measure the accuracy on the first N samples (0: all; under TCG the whole "
        "set costs a minute at --hidden 1024)",
    )
    p.add_argument(
        "--bucket-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True): gradients live in DDP's buckets, so the "
        "copies into and out of the buckets go away (a DDP option; DDP itself unchanged)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="measure the compute before every step instead of before all of them, so "
        "that compute and step come from the same stretch of time on a noisy machine "
        "(the parameters end the same either way)",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="replay the steps in one process, with no collective, and print the largest "
        "difference from DDP's parameters (a check that does not trust the backend)",
    )
    p.add_argument(
        "--resync-every",
        type=int,
        default=0,
        metavar="K",
        help="every K steps (at least 10), print how far this rank's parameters drifted from "
        "rank 0's, then copy rank 0's; and print the drift after the last step. Ranks of "
        "different CPU architectures may round the same update differently "
        "(docs/architectures.md). 0: never",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="K",
        help="hold out the last --holdout samples from training and, every K steps, measure "
        "the accuracy on them; the JSON's 'curve' lists (step, training seconds so far, "
        "accuracy), from which a time to a given accuracy follows (bench/study). 0: never",
    )
    p.add_argument("--holdout", type=int, default=297, help="samples held out with --eval-every")
    p.add_argument("--json", type=Path, help="also write the results here ('-': print them)")
    a = p.parse_args()
    if a.eval_every < 0 or (a.eval_every and a.holdout < 1):
        p.error("--eval-every needs K >= 0 and --holdout >= 1")
    if a.resync_every and (a.resync_every < 10 or a.backend == "nocomm"):
        p.error("--resync-every needs K >= 10 and a backend that communicates")

    rank, world = rank_and_world()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    init(a.backend, rank, world)
    x, y = load(a.data)
    if a.eval_every:
        if a.holdout >= len(x) - a.batch:
            raise SystemExit(f"--holdout {a.holdout} leaves too few of {len(x)} samples to train")
        tx, ty = x[-a.holdout :], y[-a.holdout :]
        x, y = x[: -a.holdout], y[: -a.holdout]
    net = DistributedDataParallel(model(a.hidden), gradient_as_bucket_view=a.bucket_view)
    params = sum(q.numel() for q in net.parameters())
    opt = torch.optim.SGD(net.parameters(), lr=a.lr)
    setup_s = time.perf_counter() - t0

    def batch(step: int, of: int = rank) -> tuple[torch.Tensor, torch.Tensor]:
        lo = ((step * world + of) * a.batch) % (len(x) - a.batch)
        return x[lo : lo + a.batch], y[lo : lo + a.batch]

    def single_process() -> torch.Tensor:
        """The same steps in this process alone: the mean of every rank's
        loss, whose gradient DDP's averaged gradients must equal."""

        def loss(ref: torch.nn.Module, s: int) -> torch.Tensor:
            losses = [
                torch.nn.functional.cross_entropy(ref(bx), by)
                for bx, by in (batch(s, r) for r in range(world))
            ]
            return sum(losses) / world  # type: ignore[return-value]

        return flat(replay(model(a.hidden), a.lr, a.steps, loss).parameters())

    compute: list[float] = []

    def compute_alone(step: int) -> None:
        """Forward and backward with DDP's exchange off; the gradients go."""
        bx, by = batch(step)
        t = time.perf_counter()
        with net.no_sync():
            torch.nn.functional.cross_entropy(net(bx), by).backward()
        compute.append(time.perf_counter() - t)
        opt.zero_grad()

    def drift_from_rank0(step: int, resync: bool) -> None:
        """Prints the largest |parameter - rank 0's| on this rank; with
        `resync`, then takes rank 0's parameters."""
        worst = 0.0
        with torch.no_grad():
            for q in net.parameters():
                first = q.detach().clone()
                dist.broadcast(first, src=0)
                worst = max(worst, (q - first).abs().max().item())
                if resync:
                    q.copy_(first)
        done = "; took rank 0's" if resync else ""
        print(f"rank {rank}: step {step}: drift from rank 0 {worst:.3e}{done}", flush=True)

    for s in range(5):
        compute_alone(s)
    if a.interleave:
        compute.clear()  # those were the warm-up
    steps, updates = [], []
    # (step, seconds of training so far, held-out accuracy): the evaluation
    # itself is not counted as training time.
    curve: list[tuple[int, float, float]] = []

    def evaluate(step: int) -> None:
        with torch.no_grad():
            held = (net(tx).argmax(1) == ty).float().mean().item()
        curve.append((step, round(sum(steps), 6), round(held, 4)))

    if a.eval_every:
        evaluate(0)
    for s in range(a.steps):
        if a.interleave:
            compute_alone(s)
        bx, by = batch(s)
        t = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(bx), by)
        loss.backward()
        u = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - t)
        updates.append(time.perf_counter() - u)
        if a.eval_every and ((s + 1) % a.eval_every == 0 or s + 1 == a.steps):
            evaluate(s + 1)
        if a.resync_every and (s + 1) % a.resync_every == 0 and s + 1 < a.steps:
            drift_from_rank0(s + 1, resync=True)
    if a.resync_every:
        drift_from_rank0(a.steps, resync=False)
    ex, ey = (x[: a.eval_samples], y[: a.eval_samples]) if a.eval_samples else (x, y)
    with torch.no_grad():
        acc = (net(ex).argmax(1) == ey).float().mean().item()
    final = flat(net.parameters())
    digest = sha256(final)
    reference_error = (final - single_process()).abs().max().item() if a.reference else None
    staged = None
    if a.backend == "dmlc":
        from dmlc.torch_backend import device  # noqa: PLC0415

        dev = device()
        staged = dev.staged_bytes if dev is not None else None
    dist.destroy_process_group()

    step_ms = statistics.median(steps) * 1e3
    compute_ms = statistics.median(compute) * 1e3
    update_ms = statistics.median(updates) * 1e3
    result = {
        "backend": a.backend,
        "rank": rank,
        "world": world,
        "params": params,
        "setup_s": round(setup_s, 3),
        "step_ms": round(step_ms, 3),
        "compute_ms": round(compute_ms, 3),
        "update_ms": round(update_ms, 3),
        "exchange_ms": round(max(0.0, step_ms - compute_ms - update_ms), 3),
        "final_loss": round(loss.item(), 6),
        "accuracy": round(acc, 4),
        "params_sha256": digest,
        "reference_error": reference_error,
        "staged_bytes": staged,
    }
    if a.eval_every:
        result["curve"] = curve
    # DDP's buckets as they ended (after its rebuild in the first step): one
    # allreduce each per step, which a projection of the step needs.
    buckets = net._get_ddp_logging_data().get("bucket_sizes")
    if isinstance(buckets, str) and buckets:
        result["bucket_bytes"] = [int(b) for b in buckets.split(",")]
    print(f"rank {rank}: params sha256 {digest}")
    if reference_error is not None:
        print(f"rank {rank}: max |params - single process| {reference_error:.3e}")
    if staged is not None:
        # Over the kernel driver nothing is staged; over the others, every bucket.
        print(f"rank {rank}: dmlc staged {staged} bytes")
    if rank == 0:
        print(
            f"{a.backend}: {world} ranks, {params} parameters, step {step_ms:.2f} ms "
            f"(compute {compute_ms:.2f}, exchange {result['exchange_ms']:.2f}, "
            f"update {update_ms:.2f}), "
            f"loss {loss.item():.4f}, accuracy {acc:.3f}"
        )
    if a.json == Path("-"):
        print("json:", json.dumps(result), flush=True)
    elif a.json:
        a.json.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

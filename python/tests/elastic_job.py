"""The processes of test_elastic.py: a training job that loses a rank.

    elastic_job.py train CKPT_DIR STEPS DIE_AT   # under torchrun
    elastic_job.py survivor|victim|newcomer STORE_DIR

`train` is a DDP job (float64 linear regression) that checkpoints after
every step on rank 0 and resumes from the checkpoint; in torchrun's first
attempt (TORCHELASTIC_RESTART_COUNT 0) rank 1 dies before step DIE_AT, so
the job finishes only if torchrun's restart forms a new "dmlc" group on the
same daemon. Each rank writes its final weights to CKPT_DIR/finalRANK.json.

The three roles are the same sequence by hand, without torchrun: the
victim joins and dies; the survivor must get PeerLostError naming rank 1,
destroy its group, and form a new one with the newcomer (a restarted rank
1) in the same process, whose allreduce must then be right.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dmlc
import dmlc.torch_backend  # registers "dmlc" from a source tree

FEATURES = 8
BATCH = 16
LR = 0.05


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s data at `step`: the same on every attempt."""
    gen = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(BATCH, 1, generator=gen, dtype=torch.float64)
    return x, y


def initial_weights() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, FEATURES, dtype=torch.float64).reshape(1, FEATURES)


def train(ckpt_dir: str, steps: int, die_at: int) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("dmlc")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(ckpt_dir) / "ckpt.pt"
    model = torch.nn.Linear(FEATURES, 1, bias=False, dtype=torch.float64)
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.weight.data.copy_(state["weight"])
        start = state["step"]
    else:
        model.weight.data.copy_(initial_weights())
    net = DistributedDataParallel(model)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    print(f"rank {rank} attempt {attempt} resumes at step {start}", flush=True)
    for step in range(start, steps):
        if attempt == 0 and rank == 1 and step == die_at:
            os._exit(9)  # no goodbye: the daemon sees the socket close
        opt.zero_grad()
        x, y = batch(step, rank, world)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if rank == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"weight": model.weight.detach().clone(), "step": step + 1}, tmp)
            tmp.replace(ckpt)
        dist.barrier()  # every rank resumes from the step rank 0 saved
    # A file each: torchrun's ranks share one stdout, whose lines can mix.
    final = json.dumps(model.weight.detach().flatten().tolist())
    (Path(ckpt_dir) / f"final{rank}.json").write_text(final)
    dist.destroy_process_group()


def join(store_dir: str, round_: int) -> dist.Store:
    """A group of 2 over a FileStore of its own per round."""
    rank = int(os.environ["RANK"])
    store = dist.FileStore(str(Path(store_dir) / f"round{round_}"), 2)
    dist.init_process_group("dmlc", store=store, rank=rank, world_size=2)
    return store


def by_hand(role: str, store_dir: str) -> None:
    if role == "victim":
        store = join(store_dir, 1)
        dist.all_reduce(torch.ones(4))
        store.wait(["posted"])
        os._exit(9)
    if role == "newcomer":
        join(store_dir, 2)
        t = torch.full((4,), 10.0)
        dist.all_reduce(t)
        print("sum: " + json.dumps(t.tolist()), flush=True)
        dist.destroy_process_group()
        return
    store = join(store_dir, 1)
    dist.all_reduce(torch.ones(4))
    work = dist.all_reduce(torch.ones(4), async_op=True)
    store.set("posted", "1")
    # PEER_LOST if the request reached the device before rank 1 left,
    # TIMEOUT (a member that never came) if after: both name rank 1.
    try:
        work.wait()
        print("lost: none", flush=True)
    except (dmlc.PeerLostError, dmlc.CollectiveTimeoutError) as e:
        print(f"lost: {e.peer} ({type(e).__name__}: {e})", flush=True)
    dist.destroy_process_group()
    join(store_dir, 2)
    t = torch.full((4,), 1.0)
    dist.all_reduce(t)
    print("sum: " + json.dumps(t.tolist()), flush=True)
    dist.destroy_process_group()


def main() -> None:
    if sys.argv[1] == "train":
        train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        by_hand(sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    main()

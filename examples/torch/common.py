"""What the torch examples share: the job's environment, the digits data, the
MLP, the process group ("dmlc", "gloo" or train.py's "nocomm"), the
batches, the single-process replay that checks a run without trusting any
collective, and the lines a run prints (train.py's, which
bench/torch-ddp.py and bench/torch-parallel.py parse).

The examples import it as ``common`` (a script's folder is first on
sys.path), so each runs as ``python3 examples/torch/NAME.py``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

M = TypeVar("M", bound=torch.nn.Module)

DEFAULT_DATA = Path.home() / ".cache/virtio-dmlc/data/digits.csv.gz"


def env_int(*names: str, default: int | None = None) -> int:
    for n in names:
        if n in os.environ:
            return int(os.environ[n])
    if default is None:
        raise SystemExit(f"set one of {', '.join(names)}")
    return default


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: torchrun's RANK and
    WORLD_SIZE, or the launcher's DMLC_TASK_ID and DMLC_NUM_WORKER."""
    return env_int("RANK", "DMLC_TASK_ID"), env_int("WORLD_SIZE", "DMLC_NUM_WORKER")


def load(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits.csv.gz: 64 pixels (0..16) and a label per row."""
    if not path.exists():
        raise SystemExit(f"{path} not found: examples/digits/fetch-data.sh fetches it (or --data)")
    with gzip.open(path, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return torch.from_numpy(rows[:, :64] / 16.0), torch.from_numpy(rows[:, 64]).long()


def mlp(widths: Sequence[int]) -> torch.nn.Sequential:
    """Linear layers of `widths` (64 in, 10 out for the digits) with a ReLU
    between each two, initialized from seed 0: the same in every process."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [torch.nn.ReLU()] * (i > 0) + [torch.nn.Linear(a, b)]
    return torch.nn.Sequential(*layers)


def model(hidden: int) -> torch.nn.Module:
    """train.py's MLP: 64, two hidden layers of `hidden`, 10."""
    return mlp([64, hidden, hidden, 10])


def batch(
    x: torch.Tensor, y: torch.Tensor, step: int, of: int, count: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` samples of step `step` for reader `of` of `count` (a
    rank, or a data-parallel replica): consecutive and disjoint per step."""
    lo = ((step * count + of) * size) % (len(x) - size)
    return x[lo : lo + size], y[lo : lo + size]


def flat(params: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([q.detach().reshape(-1) for q in params])


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def replay(net: M, lr: float, steps: int, loss: Callable[[M, int], torch.Tensor]) -> M:
    """The run's steps in this process alone, with no collective: SGD on
    `loss(net, step)`, the loss whose gradient the parallel run's
    exchanges must reproduce. Returns `net`, trained."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for s in range(steps):
        opt.zero_grad()
        loss(net, s).backward()
        opt.step()
    return net


class NoComm(dist.ProcessGroup):
    """Collectives that complete at once and move nothing (the "nocomm"
    baseline): what DDP's step costs with an exchange of zero."""

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "nocomm"

    def _done(self, value: object) -> dist.Work:
        from torch._C._distributed_c10d import _create_work_from_future  # noqa: PLC0415

        fut: torch.futures.Future[object] = torch.futures.Future()
        fut.set_result(value)
        return _create_work_from_future(fut)

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        return self._done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        return self._done(tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: object = None
    ) -> dist.Work:
        for o in outputs[0]:
            o.copy_(inputs[0])  # every rank "holds" this rank's value
        return self._done(outputs)

    def barrier(self, opts: object = None) -> dist.Work:
        return self._done(None)


def init(backend: str, rank: int, world: int) -> None:
    if backend == "nocomm":
        if "NOCOMM" not in dist.Backend._plugins:
            dist.Backend.register_backend(
                "nocomm", lambda _s, r, n, _t: NoComm(r, n), devices=["cpu"]
            )
        dist.init_process_group("nocomm", store=dist.HashStore(), rank=rank, world_size=world)
        return
    if backend == "dmlc":
        import dmlc.torch_backend  # noqa: F401, PLC0415 (registers "dmlc" on older torch)

        store: dist.Store = dist.HashStore()  # unused by "dmlc": the device is the group
    else:
        peers = os.environ.get("DMLC_TCP_PEERS", "").split(",")
        default_addr = peers[0].rsplit(":", 1)[0] if peers[0] else "127.0.0.1"
        addr = os.environ.get("MASTER_ADDR", default_addr)
        port = int(os.environ.get("MASTER_PORT", "29500"))
        # In the launcher's VMs the host name resolves to 127.0.0.1: tell gloo
        # which interface carries the peers' addresses.
        if peers[0] and "GLOO_SOCKET_IFNAME" not in os.environ:
            if Path("/sys/class/net/eth0").exists():
                os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        # A torch built without libuv (Debian's) refuses the default
        # use_libuv=True; USE_LIBUV=0 (which Debian's roots here set) says so.
        libuv = os.environ.get("USE_LIBUV", "1") != "0"
        store = dist.TCPStore(addr, port, world, rank == 0, use_libuv=libuv)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


# ---- the parallel examples (fsdp2.py, pipeline.py, ddp2d.py) -------------------


def arguments(doc: str, hidden: int, batch: int, steps: int) -> argparse.ArgumentParser:
    """The options every parallel example has, with its defaults."""
    p = argparse.ArgumentParser(description=doc.split("\n\n", maxsplit=1)[0])
    p.add_argument("--backend", choices=["dmlc", "gloo"], default="dmlc")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="digits.csv.gz")
    p.add_argument("--hidden", type=int, default=hidden, help="width of the hidden layers")
    p.add_argument("--batch", type=int, default=batch, help="samples per step (see above)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--reference",
        action="store_true",
        help="replay the steps in one process, with no collective, print the largest "
        "difference from this rank's parameters, and exit 1 above the tolerance",
    )
    p.add_argument("--json", type=Path, help="also write rank 0's results here")
    return p


def median_ms(seconds: Sequence[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def report(
    result: dict[str, Any],
    params: torch.Tensor,
    reference: torch.Tensor | None,
    tolerance: float,
    json_path: Path | None = None,
) -> int:
    """Prints train.py's lines: this rank's parameters' sha256 and, with a
    reference, their largest difference from it; on rank 0 a summary and
    ``json: {...}`` (step, compute, update and exchange in ms, the
    exchange's share of the step, the loss, rank 0's reference error).
    Returns the exit status: 1 if this rank's parameters are farther from
    the reference than `tolerance`."""
    rank = result["rank"]
    digest = sha256(params)
    error = (params - reference).abs().max().item() if reference is not None else None
    step = result["step_ms"]
    exchange = max(0.0, step - result["compute_ms"] - result["update_ms"])
    result |= {
        "exchange_ms": round(exchange, 3),
        "exchange_share": round(exchange / step, 4),
        "params_sha256": digest,
        "reference_error": error,
        "tolerance": tolerance,
    }
    print(f"rank {rank}: params sha256 {digest}")
    failed = error is not None and not error <= tolerance
    if error is not None:
        verdict = "FAILED" if failed else "ok"
        print(
            f"rank {rank}: max |params - single process| {error:.3e} "
            f"(tolerance {tolerance:.0e}: {verdict})"
        )
    if rank == 0:
        print(
            f"{result['program']} {result['backend']}: {result['world']} ranks, step "
            f"{result['step_ms']:.2f} ms (compute {result['compute_ms']:.2f}, exchange "
            f"{result['exchange_ms']:.2f}, update {result['update_ms']:.2f}), loss "
            f"{result['final_loss']:.4f}"
        )
        print("json:", json.dumps(result), flush=True)
        if json_path:
            json_path.write_text(json.dumps(result) + "\n")
    return 1 if failed else 0

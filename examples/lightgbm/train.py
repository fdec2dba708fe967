"""Distributed gradient boosting with LightGBM (data-parallel trees) on a data
set that scikit-learn's wheel ships, one shard per rank, over the device or
over LightGBM's own socket network.

    dmlc-qemu submit -n 2 --transport device --host-root \\
        -- python3 examples/lightgbm/train.py --network dmlc
    dmlc-qemu submit -n 2 --transport tcp --host-root \\
        -- python3 examples/lightgbm/train.py --network socket

--network dmlc hands LightGBM a reduce-scatter and an allgather through the
device (dmlc.lightgbm: LightGBM's LGBM_NetworkInitWithFunctions hook, no
patch). --network socket is LightGBM's own TCP network, at the addresses
and ports of DMLC_TCP_PEERS (the launcher's --transport tcp sets it: the
job's TCP endpoints, which this program's ranks use for nothing else), or
without it at 127.0.0.1, rank r on --port + r. The rank and the number of ranks come from the device
(dmlc), or from DMLC_TASK_ID/DMLC_NUM_WORKER (the launcher's) or
RANK/WORLD_SIZE.

Every rank splits the data the same way (seed), trains on its own rows and
prints the time of every boosting round, the sha256 of its trees (LightGBM's
JSON dump of them, which leaves out the per-rank network parameters) and
its test accuracy, so that a caller can check that every rank holds the
same model and compare the two networks. With --network dmlc it also prints
the time spent in the device's collectives.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# LightGBM imports scikit-learn, when installed, for its sklearn API, which
# this script does not use; under TCG that import takes minutes.
sys.modules.setdefault("sklearn", None)  # type: ignore[arg-type]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightgbm as lgb  # noqa: E402
from sklearn_data import NAMES, load, split  # noqa: E402


def env_int(*names: str, default: int) -> int:
    """The first of `names` set in the environment, as an int."""
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def socket_params(rank: int, world: int, port: int) -> dict[str, Any]:
    """LightGBM's own network: its machine list and this rank's port."""
    peers = os.environ.get("DMLC_TCP_PEERS")
    if peers:
        machines = peers.split(",")
        if len(machines) != world:
            raise SystemExit(f"DMLC_TCP_PEERS names {len(machines)} machines for {world} ranks")
        listen = int(machines[rank].rsplit(":", 1)[1])
    else:
        machines, listen = [f"127.0.0.1:{port + r}" for r in range(world)], port + rank
    # LightGBM finds its rank by matching its addresses and port in the list.
    return {
        "machines": ",".join(machines),
        "local_listen_port": listen,
        "num_machines": world,
        "tree_learner": "data",
        "pre_partition": True,
        "time_out": 10,
    }


class RoundTimer:
    """Wall time of every boosting round (a LightGBM callback pair)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = 0.0

    def callbacks(self) -> list[Any]:
        def before(env: Any) -> None:
            self.last = time.perf_counter()

        def after(env: Any) -> None:
            self.times.append(time.perf_counter() - self.last)

        before.before_iteration = True  # type: ignore[attr-defined]
        return [before, after]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--network",
        choices=["dmlc", "socket"],
        default="dmlc",
        help="dmlc: collectives through the virtio-dmlc device; socket: LightGBM's own TCP network",
    )
    p.add_argument("--data", choices=NAMES, default="digits")
    p.add_argument("--rounds", type=int, default=20, help="boosting rounds")
    p.add_argument("--leaves", type=int, default=31, help="num_leaves of every tree")
    p.add_argument("--bins", type=int, default=255, help="max_bin")
    p.add_argument("--seed", type=int, default=0, help="split and booster seed (every rank)")
    p.add_argument("--threads", type=int, default=1, help="LightGBM's num_threads")
    p.add_argument(
        "--port",
        type=int,
        default=12400,
        help="--network socket without DMLC_TCP_PEERS: rank 0's port on 127.0.0.1",
    )
    p.add_argument("--json", type=Path, help="also write the results here ('-': print them)")
    a = p.parse_args()

    t0 = time.perf_counter()
    if a.network == "dmlc":
        # Only this network needs the package (and its C library).
        import dmlc  # noqa: PLC0415
        from dmlc import lightgbm as dmlc_lgb  # noqa: PLC0415

        dev = dmlc.init()
        rank, world = dev.rank, dev.world_size
        net: dict[str, Any] = dmlc_lgb.params(dev)
    else:
        rank = env_int("DMLC_TASK_ID", "RANK", default=0)
        world = env_int("DMLC_NUM_WORKER", "WORLD_SIZE", default=1)
        net = socket_params(rank, world, a.port) if world > 1 else {}
    x, y, classes = load(a.data)
    test, mine, n_train = split(len(y), a.seed, rank, world)
    params: dict[str, Any] = {
        "num_leaves": a.leaves,
        "max_bin": a.bins,
        "learning_rate": 0.3,
        "seed": a.seed,
        "deterministic": True,
        "num_threads": a.threads,
        "verbose": -1,
        **net,
    }
    if classes > 2:
        params |= {"objective": "multiclass", "num_class": classes}
    else:
        params |= {"objective": "binary"}
    timer = RoundTimer()
    exchange_s, exchange_calls = None, None
    shard = lgb.Dataset(x[mine], label=y[mine], params=params)
    if a.network == "dmlc" and world > 1:
        with dmlc_lgb.network(dev) as ex:
            setup_s = time.perf_counter() - t0
            booster = lgb.train(
                params, shard, num_boost_round=a.rounds, callbacks=timer.callbacks()
            )
        exchange_s, exchange_calls = ex.seconds, ex.calls
    else:
        setup_s = time.perf_counter() - t0
        booster = lgb.train(params, shard, num_boost_round=a.rounds, callbacks=timer.callbacks())
        if world > 1:
            booster.free_network()
    prob = booster.predict(x[test])
    pred = prob.argmax(axis=1) if classes > 2 else (prob > 0.5)
    accuracy = float(np.mean(pred == y[test]))
    trees = json.dumps(booster.dump_model()["tree_info"], sort_keys=True)
    digest = hashlib.sha256(trees.encode()).hexdigest()

    for i, t in enumerate(timer.times):
        print(f"rank {rank}: round {i} {t * 1e3:.1f} ms")
    round_ms = statistics.median(timer.times) * 1e3
    train_s = sum(timer.times)
    print(f"rank {rank}: model sha256 {digest}")
    print(f"rank {rank}: test accuracy {accuracy:.4f}")
    if rank == 0:
        print(
            f"lightgbm {lgb.__version__} {a.network}: {world} ranks, {a.data} "
            f"({n_train} training rows, {len(mine)} on rank 0, {x.shape[1]} features, "
            f"{classes} classes), {a.rounds} rounds, round median {round_ms:.1f} ms, "
            f"setup {setup_s:.1f} s, accuracy {accuracy:.4f}"
            + (
                f", {exchange_s * 1e3:.1f} ms of {train_s * 1e3:.1f} ms training in "
                f"{exchange_calls} collectives through the device"
                if exchange_s is not None
                else ""
            )
        )
    result = {
        "network": a.network,
        "rank": rank,
        "world": world,
        "data": a.data,
        "rounds": a.rounds,
        "round_ms": [round(t * 1e3, 3) for t in timer.times],
        "round_median_ms": round(round_ms, 3),
        "train_s": round(train_s, 4),
        "exchange_s": None if exchange_s is None else round(exchange_s, 4),
        "exchange_calls": exchange_calls,
        "setup_s": round(setup_s, 3),
        "accuracy": round(accuracy, 4),
        "model_sha256": digest,
    }
    if a.json == Path("-"):
        print("json:", json.dumps(result))
    elif a.json:
        a.json.write_text(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Distributed gradient boosting with XGBoost (tree method hist) on a data set
that scikit-learn's wheel ships, one shard per rank.

    dmlc-qemu submit -n 2 --tracker rabit --host-root -- python3 examples/xgboost/train.py
    dmlc-qemu submit -n 2 --tracker rabit --transport device --host-root \
        -- python3 examples/xgboost/train.py --communicator dmlc

The second needs the patched XGBoost of xgboost-patches/ on PYTHONPATH and
DMLC_LIBRARY (docs/xgboost.md): its collectives go through the device.

The ranks meet at a DMLC tracker, the way dmlc-submit starts a job: every
worker reads DMLC_TASK_ID, DMLC_NUM_WORKER, DMLC_TRACKER_URI and
DMLC_TRACKER_PORT and hands them to xgboost.collective.CommunicatorContext
(without the first two, RANK and WORLD_SIZE: processes on one host).
Without DMLC_TRACKER_URI it trains alone. Every rank uses the same seed for
the train/test split and the booster, trains on its own shard of the
training rows (rows rank, rank + N, ...), and XGBoost's collectives (the
quantile sketches, then the gradient histograms of every tree level) make
the model the same everywhere.

Prints the time of every boosting round, the median, and on every rank the
sha256 of its model's raw bytes (UBJSON) and its test accuracy, so that a
caller can check that every rank holds the same model. Stock XGBoost keeps
no account of the time its collectives take. With --monitor the script
trains under XGBoost's own monitor (verbosity 3) and prints an estimate
from its timers: the tree updates' histogram time (BuildHistogram and
InitRoot, which hold the histogram allreduces) less the local histogram
builds (BuildHist), as a share of the tree updates (UpdateTree): an upper
bound, since on one rank, where no collective runs, it came out at 5% on
the host and 21% in a TCG VM (the rest of those timers' work).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import io
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

# xgboost imports scikit-learn, when it is installed, for its sklearn
# wrapper, which this script does not use; under TCG that import (scipy
# and all) takes minutes. So it is hidden from xgboost, and the data set is
# read from the file that scikit-learn's wheel ships.
sys.modules.setdefault("sklearn", None)  # type: ignore[arg-type]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import xgboost as xgb  # noqa: E402
from sklearn_data import NAMES, load, split  # noqa: E402
from xgboost import collective  # noqa: E402


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


@contextlib.contextmanager
def communicator(kind: str, rank: int, world: int) -> Iterator[None]:
    """XGBoost's communicator from the DMLC tracker environment."""
    env = os.environ
    if "DMLC_TRACKER_URI" not in env:
        if world > 1:
            raise SystemExit(
                f"DMLC_NUM_WORKER={world} but no DMLC_TRACKER_URI: start the job with a "
                "tracker (dmlc-qemu submit --tracker rabit, or dmlc-submit)"
            )
        yield
        return
    args: dict[str, int | str] = {
        "dmlc_communicator": kind,
        "dmlc_tracker_uri": env["DMLC_TRACKER_URI"],
        "dmlc_tracker_port": int(env["DMLC_TRACKER_PORT"]),
        # The tracker sorts by task: rank = DMLC_TASK_ID.
        "dmlc_task_id": str(rank),
    }
    with collective.CommunicatorContext(**args):
        yield


MONITOR_LINE = re.compile(r"\] (\w+): ([0-9.e+-]+)s, (\d+) calls")


def monitor_seconds(log: str) -> dict[str, float]:
    """Seconds per timer of XGBoost's monitor output ("Monitor (0): NAME"
    headers, then "TIMER: 0.01s, 5 calls" lines), keyed NAME.TIMER."""
    totals: dict[str, float] = {}
    section = ""
    for line in log.splitlines():
        if "======== Monitor" in line:
            section = line.split(":", 3)[-1].strip(" =")
        elif m := MONITOR_LINE.search(line):
            key = f"{section}.{m.group(1)}"
            totals[key] = totals.get(key, 0.0) + float(m.group(2))
    return totals


@contextlib.contextmanager
def monitored(on: bool, log: io.StringIO) -> Iterator[None]:
    """XGBoost at verbosity 3 (its monitor's timers run), its log into `log`."""
    if not on:
        yield
        return
    with xgb.config_context(verbosity=3), contextlib.redirect_stdout(log):
        yield


class RoundTimer(xgb.callback.TrainingCallback):
    """Wall time of every boosting round."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self.last = 0.0

    def before_iteration(self, model: Any, epoch: int, evals_log: Any) -> bool:
        self.last = time.perf_counter()
        return False

    def after_iteration(self, model: Any, epoch: int, evals_log: Any) -> bool:
        self.times.append(time.perf_counter() - self.last)
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--communicator",
        default="rabit",
        choices=["rabit", "dmlc"],
        help="rabit: stock XGBoost over TCP; dmlc: the collectives through the "
        "virtio-dmlc device, which needs XGBoost built by xgboost-patches/build-xgboost.sh "
        "on PYTHONPATH (the bootstrap still uses the tracker)",
    )
    p.add_argument("--data", choices=NAMES, default="digits")
    p.add_argument("--rounds", type=int, default=20, help="boosting rounds")
    p.add_argument("--depth", type=int, default=6, help="max_depth of every tree")
    p.add_argument("--bins", type=int, default=256, help="max_bin of the hist method")
    p.add_argument("--seed", type=int, default=0, help="split and booster seed (every rank)")
    p.add_argument("--threads", type=int, default=1, help="XGBoost's nthread")
    p.add_argument(
        "--monitor",
        action="store_true",
        help="train under XGBoost's monitor and print the share of the tree updates "
        "that its timers put in the histogram exchange (an estimate)",
    )
    p.add_argument("--model-out", type=Path, help="also save the model here (JSON)")
    p.add_argument("--json", type=Path, help="also write the results here ('-': print them)")
    a = p.parse_args()

    # The launcher's names, or torchrun's.
    rank = env_int("DMLC_TASK_ID", env_int("RANK", 0))
    world = env_int("DMLC_NUM_WORKER", env_int("WORLD_SIZE", 1))
    t0 = time.perf_counter()
    x, y, classes = load(a.data)
    test, mine, n_train = split(len(y), a.seed, rank, world)
    dtrain = xgb.DMatrix(x[mine], label=y[mine])
    dtest = xgb.DMatrix(x[test], label=y[test])
    params: dict[str, Any] = {
        "tree_method": "hist",
        "max_depth": a.depth,
        "max_bin": a.bins,
        "eta": 0.3,
        "seed": a.seed,
        "nthread": a.threads,
    }
    if classes > 2:
        params |= {"objective": "multi:softprob", "num_class": classes}
    else:
        params |= {"objective": "binary:logistic"}
    timer = RoundTimer()
    with communicator(a.communicator, rank, world):
        joined = collective.get_world_size() if "DMLC_TRACKER_URI" in os.environ else 1
        if joined != world:
            raise SystemExit(f"rank {rank}: the tracker made a group of {joined}, not {world}")
        setup_s = time.perf_counter() - t0
        log = io.StringIO()
        with monitored(a.monitor, log):
            booster = xgb.train(params, dtrain, num_boost_round=a.rounds, callbacks=[timer])
    prob = booster.predict(dtest)
    pred = prob.argmax(axis=1) if classes > 2 else (prob > 0.5)
    accuracy = float(np.mean(pred == y[test]))
    raw = bytes(booster.save_raw("ubj"))
    digest = hashlib.sha256(raw).hexdigest()
    if a.model_out:
        booster.save_model(a.model_out)
    exchange_share = None
    if a.monitor:
        # The monitor prints its timers when the booster is freed.
        with monitored(True, log):
            del booster
            gc.collect()
        sec = monitor_seconds(log.getvalue())
        update = sec.get("HistUpdater.UpdateTree", 0.0)
        hist = sec.get("HistUpdater.BuildHistogram", 0.0) + sec.get("HistUpdater.InitRoot", 0.0)
        local = sum(v for k, v in sec.items() if k.endswith(".BuildHist"))
        if update > 0:
            exchange_share = max(0.0, hist - local) / update
            print(
                f"rank {rank}: monitor: tree updates {update * 1e3:.1f} ms, histograms "
                f"{hist * 1e3:.1f} ms of which local builds {local * 1e3:.1f} ms: exchange "
                f"(estimate) {exchange_share:.0%} of the tree updates"
            )
        else:
            print(f"rank {rank}: monitor: no UpdateTree timer in XGBoost's log")

    for i, t in enumerate(timer.times):
        print(f"rank {rank}: round {i} {t * 1e3:.1f} ms")
    round_ms = statistics.median(timer.times) * 1e3
    print(f"rank {rank}: model sha256 {digest}")
    print(f"rank {rank}: test accuracy {accuracy:.4f}")
    if rank == 0:
        print(
            f"xgboost {xgb.__version__} {a.communicator}: {world} ranks, {a.data} "
            f"({n_train} training rows, {len(mine)} on rank 0, {x.shape[1]} features, "
            f"{classes} classes), {a.rounds} rounds, round median {round_ms:.1f} ms "
            f"(min {min(timer.times) * 1e3:.1f}, max {max(timer.times) * 1e3:.1f}), "
            f"setup {setup_s:.1f} s, accuracy {accuracy:.4f}"
            + (
                f", histogram exchange (estimate) {exchange_share:.0%} of the tree updates"
                if exchange_share is not None
                else "; time in collectives: not measured (--monitor estimates it)"
            )
        )
    result = {
        "communicator": a.communicator,
        "rank": rank,
        "world": world,
        "data": a.data,
        "rounds": a.rounds,
        "round_ms": [round(t * 1e3, 3) for t in timer.times],
        "round_median_ms": round(round_ms, 3),
        "setup_s": round(setup_s, 3),
        "accuracy": round(accuracy, 4),
        "exchange_share_estimate": exchange_share,
        "model_sha256": digest,
    }
    if a.json == Path("-"):
        print("json:", json.dumps(result))
    elif a.json:
        a.json.write_text(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

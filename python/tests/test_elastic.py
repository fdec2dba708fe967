"""Fault tolerance as torch users know it (issue 37, item 6): a lost rank
fails the survivors' collective naming it, destroy_process_group works,
and a new "dmlc" group on the same daemon forms with a restarted rank:
by hand, and under `torchrun --max-restarts`, whose job must then end with
the weights of an uninterrupted run computed here without any collective."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import _binary, need, start_backend

JOB = Path(__file__).with_name("elastic_job.py")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env.setdefault("DMLC_LIBRARY", str(_binary("DMLC_LIBRARY", "libdmlc_guest.so")))
    return env


def _uninterrupted(steps: int, world: int) -> list[float]:
    """SGD on the mean of every rank's loss: what DDP's averaged gradient
    computes, replayed in this process."""
    import torch

    sys.path.insert(0, str(JOB.parent))
    from elastic_job import LR, batch, initial_weights

    w = initial_weights().clone().requires_grad_(True)
    for step in range(steps):
        losses = []
        for r in range(world):
            x, y = batch(step, r, world)
            losses.append(torch.nn.functional.mse_loss(x @ w.T, y))
        (sum(losses) / world).backward()
        with torch.no_grad():
            w -= LR * w.grad
            w.grad = None
    return w.detach().flatten().tolist()


def test_torchrun_restarts_a_job_that_lost_a_rank(tmp_path: Path) -> None:
    need("torch")
    steps, die_at = 12, 5
    b = start_backend(tmp_path, 2, "--timeout-ms", "20000")
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "2",
                str(JOB),
                "train",
                str(tmp_path),
                str(steps),
                str(die_at),
            ],
            env=_env(DMLC_SOCKET_PREFIX=str(b.base), OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        b.proc.terminate()
        b.proc.wait(10)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    for r in range(2):
        assert f"rank {r} attempt 0 resumes at step 0" in out, out
        assert f"rank {r} attempt 1 resumes at step {die_at}" in out, out
    want = _uninterrupted(steps, 2)
    for r in range(2):
        got = json.loads((tmp_path / f"final{r}.json").read_text())
        err = max(abs(a - b) for a, b in zip(got, want))
        assert err < 1e-12, f"weights differ from an uninterrupted run by {err}: {got} vs {want}"


def test_survivor_destroys_its_group_and_forms_a_new_one_with_a_restarted_rank(
    tmp_path: Path,
) -> None:
    need("torch")
    b = start_backend(tmp_path, 2, "--timeout-ms", "20000")

    procs: list[subprocess.Popen[str]] = []

    def rank(role: str, r: int) -> subprocess.Popen[str]:
        env = _env(RANK=str(r), WORLD_SIZE="2", DMLC_SOCKET=str(b.socket(r)))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(JOB), role, str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        return procs[-1]

    try:
        survivor, victim = rank("survivor", 0), rank("victim", 1)
        _, err = victim.communicate(timeout=120)
        assert victim.returncode == 9, err
        newcomer = rank("newcomer", 1)
        new_out, new_err = newcomer.communicate(timeout=120)
        out, err = survivor.communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
        b.proc.terminate()
        b.proc.wait(10)
    assert survivor.returncode == 0 and newcomer.returncode == 0, f"{out}{err}{new_out}{new_err}"
    lost = [ln for ln in out.splitlines() if ln.startswith("lost: ")]
    assert lost and lost[0].startswith("lost: 1 ("), out
    want = "sum: " + json.dumps([11.0] * 4)  # 1 from the survivor, 10 from the newcomer
    assert want in out.splitlines() and want in new_out.splitlines(), f"{out}{new_out}"

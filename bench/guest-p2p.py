"""Point-to-point, all-to-all and allreduce inside the guests, three or four ways in one boot:
the device (`dmlc-guest bench`, the driver's default wait), gloo's send/recv
, all_to_all_single and all_reduce over virtio-net (torch.distributed), and the
project's TCP Communicator over the same network (`dmlc-guest bench
--transport tcp`). Started in every VM by bench/p2p-vms.py through
`dmlc-qemu submit --transport tcp` (the VMs have the device and virtio-net).

Each pattern is nccl-tests': sendrecv (every rank sends `size` bytes to the
next rank and receives as many from the previous one, both posted before
either is waited for), alltoall (`size` = a rank's N equal blocks) and
allreduce (a sum of `size` bytes of f32, in place; bench/study uses it).
With path "mpi" (give DMLC_MPI_BENCH, an mpicc build of
bench/mpi_allreduce.c), also Open MPI over the same network: every rank
serves bench/rsh-agent.py, and rank 0 runs mpirun with it as the remote
shell (the VMs have no sshd).
Time is rank 0's median over `iters` after `warmup`, every iteration
started together (a barrier first). gloo's results are checked on every
rank against values the rank computes; the two dmlc-guest benches check
their own. Rank 0 prints one JSON line: `p2p-json: {...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

GUEST = os.environ.get("DMLC_GUEST_BIN", "dmlc-guest")
RSH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rsh-agent.py")


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def pattern_of(opcode: str, size: int, world: int) -> int:
    """Elements (f32) per message or per block; 0: the size has none."""
    return size // 4 // (world if opcode == "alltoall" else 1)


def expected(src: int, dst: int, n: int) -> torch.Tensor:
    """What rank `src` sends rank `dst`: n f32 values naming both."""
    return torch.arange(n, dtype=torch.float32) + float(src * 1000 + dst * 10)


def gloo_sweep(opcode: str, szs: list[int], iters: int, warmup: int) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    rows = []
    for size in szs:
        n = pattern_of(opcode, size, world)
        if n == 0:
            continue
        if opcode == "sendrecv":
            send = expected(rank, nxt, n)
            recv = torch.empty(n)
            want = expected(prv, rank, n)
        elif opcode == "allreduce":
            # Small integers in f32: their sum is exact in any order.
            base = (torch.arange(n) % 4096).float()
            send = base + rank
            recv = torch.empty(n)
            want = base * world + sum(range(world))
        else:
            send = torch.cat([expected(rank, j, n) for j in range(world)])
            recv = torch.empty(n * world)
            want = torch.cat([expected(j, rank, n) for j in range(world)])
        times = []
        wrong = 0
        for i in range(warmup + iters):
            if opcode == "allreduce":
                recv.copy_(send)
            else:
                recv.fill_(-1.0)
            dist.barrier()
            t0 = time.perf_counter()
            if opcode == "allreduce":
                dist.all_reduce(recv)
            elif opcode == "sendrecv":
                ops = [dist.P2POp(dist.irecv, recv, prv), dist.P2POp(dist.isend, send, nxt)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            else:
                dist.all_to_all_single(recv, send)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt * 1e6)
            wrong += int((recv != want).sum())
        rows.append({"size": size, "time_us": statistics.median(times), "wrong": wrong})
    return rows


def bench_sweep(opcode: str, via: str, a: argparse.Namespace) -> list[dict]:
    """One `dmlc-guest bench` run on every rank; rank 0's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "b.json")
        cmd = [GUEST, "bench", "--opcode", opcode, "-b", str(a.minbytes), "-e", str(a.maxbytes)]
        cmd += ["-f", str(a.factor), "-n", str(a.iters), "-w", str(a.warmup), "--json", path]
        if via == "tcp":
            cmd += ["--transport", "tcp"]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
            raise SystemExit(f"{' '.join(cmd)}: exit status {p.returncode}")
        if dist.get_rank() != 0:
            return []
        with open(path) as f:
            doc = json.load(f)
    return [
        {"size": r["size"], "time_us": r["oop"]["time_us"], "wrong": r["oop"]["wrong"]}
        for r in doc["results"]
    ]


def mpi_sweep(opcode: str, a: argparse.Namespace) -> list[dict]:
    """mpirun of bench/mpi_allreduce on every VM, started by rank 0 through
    rsh-agent.py; rank 0's rows (the others only wait)."""
    if dist.get_rank() != 0:
        return []
    peers = [p.rsplit(":", 1)[0] for p in os.environ["DMLC_TCP_PEERS"].split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.json")
        cmd = ["mpirun", "--allow-run-as-root", "-np", str(len(peers))]
        cmd += ["--host", ",".join(f"{ip}:1" for ip in peers), "--mca", "plm_rsh_agent", RSH]
        cmd += ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "eth0"]
        cmd += ["--mca", "oob_tcp_if_include", "eth0"]
        cmd += [os.environ["DMLC_MPI_BENCH"], "-o", opcode, "-b", str(a.minbytes)]
        cmd += ["-e", str(a.maxbytes), "-f", str(a.factor), "-n", str(a.iters)]
        cmd += ["-w", str(a.warmup), "-j", path]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
            raise SystemExit(f"mpirun: exit status {p.returncode}")
        with open(path) as f:
            doc = json.load(f)
    return [
        {"size": r["size"], "time_us": r["oop"]["time_us"], "wrong": r["oop"]["wrong"]}
        for r in doc["results"]
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--opcode", choices=["sendrecv", "alltoall", "allreduce"], default="sendrecv")
    p.add_argument("--minbytes", type=int, default=4)
    p.add_argument("--maxbytes", type=int, default=64 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="interleaved runs of every path")
    p.add_argument("--paths", default="device,gloo,tcp", help="of device, gloo, tcp, mpi")
    a = p.parse_args()
    rank = int(os.environ["DMLC_TASK_ID"])
    world = int(os.environ["DMLC_NUM_WORKER"])
    master = os.environ["DMLC_TCP_PEERS"].split(",")[0].split(":")[0]
    torch.set_num_threads(1)
    paths = [x for x in a.paths.split(",") if x]
    if "mpi" in paths:
        # Open MPI refuses the guests' host name "(none)".
        if socket.gethostname() in ("(none)", ""):
            socket.sethostname(f"dmlc-vm{rank}")
        # Before the group forms, so that every server listens before
        # rank 0's mpirun (after the first barrier) reaches it.
        subprocess.Popen([sys.executable, RSH, "serve"])
    # In the launcher's VMs the host name resolves to 127.0.0.1: gloo must
    # be told which interface carries the peers' addresses.
    if os.path.exists("/sys/class/net/eth0"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:29511",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    szs = sizes(a.minbytes, a.maxbytes, a.factor)
    dist.barrier()
    runs: dict[str, list[list[dict]]] = {x: [] for x in paths}
    for rep in range(a.repeat):
        for path in paths:
            t = time.monotonic()
            if path == "gloo":
                rows = gloo_sweep(a.opcode, szs, a.iters, a.warmup)
            elif path == "mpi":
                rows = mpi_sweep(a.opcode, a)
            else:
                rows = bench_sweep(a.opcode, path, a)
            dist.barrier()
            if rank == 0:
                print(f"# run {rep + 1}: {path} took {time.monotonic() - t:.1f} s", flush=True)
            runs[path].append(rows)
    # Every rank's own gloo check.
    bad = sum(r["wrong"] for rows in runs.get("gloo", []) for r in rows)
    if bad:
        raise SystemExit(f"rank {rank}: {bad} wrong values received through gloo")
    if rank == 0:
        doc = {
            "opcode": a.opcode,
            "world": world,
            "iters": a.iters,
            "warmup": a.warmup,
            "runs": runs,
        }
        print("p2p-json: " + json.dumps(doc), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

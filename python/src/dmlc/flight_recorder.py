"""The daemon's flight recorder (``--trace-out``, Chrome trace JSON) as
PyTorch Flight Recorder dumps, one per rank, for torch's analyser::

    python -m dmlc.flight_recorder trace.json fr/
    python -m torch.distributed.flight_recorder.fr_trace fr/ --prefix dmlc_fr_rank

Each request queue becomes one process group (``pg_config``), each
collective one entry on every rank that took part: its sequence number in
the queue (counted from 1 over the whole trace, so it survives the
device's restart of sequence numbers at a generation change), the
collective's name as torch spells it (``c10d:all_reduce``: ``c10d`` is
what torch's own hook writes for a backend it does not know), the element counts and dtypes of its
input and output, the times the daemon saw (the request taken, made to
count, completed) and its state. A member that never arrived has no entry,
which the analyser reports as a missing rank; a member that arrived but was
not completed is ``started``. The daemon's own status (``ok``, ``timeout``,
``peer_lost``...) is kept in each entry's ``dmlc_status``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import Any

# The Flight Recorder format version this writes (torch 2.15 writes 2.10).
FR_VERSION = "2.10"

_NAMES = {
    "allreduce": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "barrier": "barrier",
}
_DTYPES = {
    "f32": "Float",
    "f64": "Double",
    "f16": "Half",
    "bf16": "BFloat16",
    "i8": "Char",
    "u8": "Byte",
    "i32": "Int",
    "u32": "UInt32",
    "i64": "Long",
    "u64": "UInt64",
}


def _sizes(opcode: str, count: int, world: int) -> tuple[list[list[int]], list[list[int]]]:
    """Element counts of a member's input and output, as torch records them."""
    if opcode == "barrier":
        return [], []
    if opcode == "allgather":
        return [[count]], [[count * world]]
    if opcode == "reduce_scatter":
        return [[count * world]], [[count]]
    return [[count]], [[count]]


def convert(trace: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The Flight Recorder dump of every rank of a flight recorder trace."""
    other = trace.get("otherData", {})
    if other.get("source") != "vhost-device-dmlc flight recorder":
        raise ValueError("not a vhost-device-dmlc flight recorder trace (otherData.source)")
    world = int(other["world_size"])
    base_ns = int(other["start_unix_us"]) * 1000
    slices = [e for e in trace["traceEvents"] if e.get("cat") == "collective"]
    # One collective = one (queue, generation, seq); numbered per queue in
    # the order of their first member's slice.
    first: dict[tuple[int, int, int], float] = {}
    for e in slices:
        a = e["args"]
        key = (a["queue"], a["generation"], a["seq"])
        first[key] = min(first.get(key, e["ts"]), e["ts"])
    numbers: dict[tuple[int, int, int], int] = {}
    per_queue: dict[int, int] = {}
    for key in sorted(first, key=lambda k: (first[k], k)):
        per_queue[key[0]] = per_queue.get(key[0], 0) + 1
        numbers[key] = per_queue[key[0]]
    queues = sorted(per_queue)
    pg_config = {
        str(q): {"name": str(q), "desc": f"dmlc queue {q}", "ranks": str(list(range(world)))}
        for q in queues
    }
    dumps: dict[int, dict[str, Any]] = {
        r: {
            "version": FR_VERSION,
            "pg_config": pg_config,
            "pg_status": {},
            "entries": [],
            "nccl_comm_state": {},
        }
        for r in range(world)
    }
    for e in sorted(slices, key=lambda e: (e["args"]["rank"], e["ts"])):
        a = e["args"]
        rank, opcode = int(a["rank"]), a["opcode"]
        seq = numbers[(a["queue"], a["generation"], a["seq"])]
        dtype = _DTYPES.get(a.get("dtype") or "", "Byte")
        ins, outs = _sizes(opcode, int(a["count"]), world)
        entries = dumps[rank]["entries"]
        start_ns = base_ns + round(e["ts"] * 1000)
        end_ns = start_ns + round(e["dur"] * 1000)
        done = bool(a["completed"])
        entries.append(
            {
                "record_id": len(entries),
                "pg_id": queues.index(a["queue"]),
                "process_group": (str(a["queue"]), f"dmlc queue {a['queue']}"),
                "collective_seq_id": seq,
                "p2p_seq_id": 0,
                "op_id": seq,
                "profiling_name": f"c10d:{_NAMES[opcode]}",
                "time_created_ns": base_ns + round(a["arrived_us"] * 1000),
                "time_discovered_started_ns": start_ns,
                "time_discovered_completed_ns": end_ns if done else None,
                "duration_ms": e["dur"] / 1000 if done else None,
                "input_sizes": ins,
                "input_dtypes": [dtype] * len(ins),
                "output_sizes": outs,
                "output_dtypes": [dtype] * len(outs),
                "state": "completed" if done else "started",
                "timeout_ms": 0,
                "is_p2p": False,
                "retired": done,
                "frames": [],
                "dmlc_status": a["status"],
                "dmlc_injected": list(a.get("injected", [])),
            }
        )
    return dumps


def write(trace_path: Path, out_dir: Path, prefix: str = "dmlc_fr_rank") -> list[Path]:
    """Writes ``out_dir/PREFIX<rank>`` for every rank; returns the paths."""
    dumps = convert(json.loads(trace_path.read_text()))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, dump in dumps.items():
        path = out_dir / f"{prefix}{rank}"
        with path.open("wb") as f:
            pickle.dump(dump, f)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dmlc.flight_recorder",
        description="Convert the daemon's --trace-out file to PyTorch Flight Recorder dumps "
        "(one per rank), for python -m torch.distributed.flight_recorder.fr_trace.",
    )
    p.add_argument("trace", type=Path, help="the daemon's --trace-out JSON file")
    p.add_argument("out_dir", type=Path, help="where to write PREFIX0, PREFIX1, ...")
    p.add_argument(
        "--prefix", default="dmlc_fr_rank", help="file name prefix (default %(default)s)"
    )
    args = p.parse_args(argv)
    try:
        paths = write(args.trace, args.out_dir, args.prefix)
    except (OSError, ValueError, KeyError) as e:
        print(f"dmlc.flight_recorder: {args.trace}: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

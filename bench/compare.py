#!/usr/bin/env python3
"""Device vs Open MPI on this host: runs every configuration in one go and
writes a combined table (Markdown), the raw results (JSON) and a plot (SVG,
written directly, no plotting library needed).

Normally started by bench/compare.sh, which builds the binaries first.

Configurations, for every N in --ranks:
  device poll       dmlc-guest --poll local --ranks N -- bench ...
  device interrupt  dmlc-guest --interrupt local --ranks N -- bench ...
  device hybrid     dmlc-guest --hybrid local --ranks N -- bench ... (the
                    driver's default wait)
  Open MPI          mpirun -np N --oversubscribe ... mpi_allreduce ...
for the collective --opcode names (allreduce, sendrecv: every rank sends to
the next and receives from the previous, MPI_Sendrecv; alltoall:
MPI_Alltoall), out of place,
plus a memcpy bandwidth probe (1 thread and one per CPU; glibc's memcpy
and a copy with non-temporal stores, bench/memcpy_bw.c -m libc / -m nt).
"""

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile

CONFIGS = [
    # key, label, colour
    ("poll", "device, poll", "#1f77b4"),
    ("interrupt", "device, interrupt", "#2ca02c"),
    ("hybrid", "device, hybrid", "#9467bd"),
    ("mpi", "Open MPI (sm)", "#d62728"),
]

# The dmlc-guest flag of each device mode.
WAIT_FLAGS = {"poll": "--poll", "interrupt": "--interrupt", "hybrid": "--hybrid"}


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def show_size(b):
    for shift, suffix in ((30, "G"), (20, "M"), (10, "K")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{suffix}"
    return str(b)


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def show_cmd(cmd, args):
    """The command as the docs show it: binaries by name, no temp files."""
    names = {args.guest: "dmlc-guest", args.mpi: "mpi_allreduce"}
    shown = [names.get(c, c) for c in cmd]
    if len(shown) >= 2 and shown[-2] in ("--json", "-j"):
        shown = shown[:-2]
    return " ".join(shown)


def run(cmd, timeout, env=None):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit(f"compare.py: command failed with status {p.returncode}: {' '.join(cmd)}")
    return p.stdout


def memcpy_probe(exe, threads, stores):
    out = run([exe, "-t", str(threads), "-s", "256", "-n", "10", "-m", stores], 600)
    words = out.split()[1:]  # "memcpy" then name-value pairs
    vals = {words[i]: words[i + 1] for i in range(0, len(words) - 1, 2)}
    return {
        "threads": threads,
        "stores": vals.get("stores", stores),
        "best_gbps": float(vals["best_gbps"]),
        "median_gbps": float(vals["median_gbps"]),
    }


def probe_stores(m):
    """A probe's stores; runs recorded before there were two kinds used glibc's."""
    return m.get("stores", "libc")


def probe_label(m):
    return f"{m['threads']} thread(s), {probe_stores(m)}"


def probe(memcpy, stores, threads):
    """best_gbps of the probe with these stores and threads (the most threads run if
    threads is None), or 0 if there is none."""
    ms = [m for m in memcpy if probe_stores(m) == stores and (threads is None or m["threads"] == threads)]
    if not ms:
        return 0
    return max(ms, key=lambda m: m["threads"])["best_gbps"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--guest", help="dmlc-guest binary (release)")
    ap.add_argument("--mpi", help="mpi_allreduce binary")
    ap.add_argument("--memcpy", help="memcpy_bw binary")
    ap.add_argument("--replot", metavar="JSON",
                    help="only redraw the SVG from a device-vs-mpi.json written earlier")
    ap.add_argument("--ranks", default="2,4", help="comma-separated N values")
    ap.add_argument("--opcode", default="allreduce", choices=list(WHAT),
                    help="what to time (files are named device-vs-mpi[-OPCODE].*)")
    ap.add_argument("--minbytes", default="4")
    ap.add_argument("--maxbytes", default="64M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--modes", default="poll,interrupt,hybrid",
                    help="device modes to run (of poll, interrupt, hybrid)")
    ap.add_argument("--out", default="docs/bench", help="output folder")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every configuration this many times (interleaved); report medians")
    ap.add_argument("--poll-us", type=int, default=None,
                    help="backend --poll-us for the device runs (default: the backend's)")
    args = ap.parse_args()

    if args.replot:
        with open(args.replot) as f:
            doc = json.load(f)
        runs = {(r["config"], r["world"]): r["result"] for r in doc["runs"]}
        ranks = sorted({n for _, n in runs})
        with open(os.path.join(args.out, f"{stem(doc['meta'].get('opcode', 'allreduce'))}.svg"), "w") as f:
            f.write(svg(runs, ranks, doc["meta"]["memcpy"], doc["meta"].get("opcode", "allreduce")))
        return
    if not (args.guest and args.mpi and args.memcpy):
        ap.error("--guest, --mpi and --memcpy are required (bench/compare.sh passes them)")
    ranks = [int(n) for n in args.ranks.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in WAIT_FLAGS]
    if unknown:
        ap.error(f"--modes: unknown mode(s) {', '.join(unknown)} (of {', '.join(WAIT_FLAGS)})")
    minb, maxb = parse_size(args.minbytes), parse_size(args.maxbytes)
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="dmlc-compare-")
    nproc = os.cpu_count() or 1
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = loadavg()

    memcpy = [memcpy_probe(args.memcpy, t, m) for m in ("libc", "nt") for t in sorted({1, nproc})]
    repeats = {}
    tables = {}
    commands = []
    mpi_env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # Every repeat runs every configuration once, so that load from outside
    # (a shared machine) spreads over all configurations alike.
    for rep in range(args.repeat):
        for n in ranks:
            common = ["--opcode", args.opcode, "-b", str(minb), "-e", str(maxb), "-n", str(args.iters),
                      "-w", str(args.warmup)]
            for mode in modes:
                path = os.path.join(tmp, f"dev-{mode}-{n}-{rep}.json")
                backend = ["--poll-us", str(args.poll_us)] if args.poll_us is not None else []
                cmd = [args.guest, WAIT_FLAGS[mode]] + [
                    "local", "--ranks", str(n)] + backend + ["--", "bench"] + common + ["--json", path]
                if rep == 0:
                    commands.append(show_cmd(cmd, args))
                tables[(mode, n, rep)] = run(cmd, args.timeout)
                with open(path) as f:
                    repeats.setdefault((mode, n), []).append(json.load(f))
            path = os.path.join(tmp, f"mpi-{n}-{rep}.json")
            cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
                   "--mca", "btl", "self,vader", args.mpi, "-o", args.opcode, "-b", str(minb), "-e", str(maxb),
                   "-n", str(args.iters), "-w", str(args.warmup), "-j", path]
            if rep == 0:
                commands.append(show_cmd(cmd, args))
            tables[("mpi", n, rep)] = run(cmd, args.timeout, env=mpi_env)
            with open(path) as f:
                repeats.setdefault(("mpi", n), []).append(json.load(f))
    runs = {k: merge(v) for k, v in repeats.items()}

    meta = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "host": f"{nproc} CPUs, {cpu_model()}",
        "load_before": load_before,
        "load_after": loadavg(),
        "iters": args.iters,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "opcode": args.opcode,
        "commands": commands,
        "memcpy": memcpy,
    }
    doc = {
        "meta": meta,
        "runs": [{"config": k[0], "world": k[1], "result": v, "repeats": repeats[k]}
                 for k, v in sorted(runs.items(), key=str)],
    }
    out = os.path.join(args.out, stem(args.opcode))
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(out + ".svg", "w") as f:
        f.write(svg(runs, ranks, memcpy, args.opcode))
    md = markdown(runs, ranks, modes, meta, tables)
    with open(out + ".md", "w") as f:
        f.write(md)
    print(md)


# What each --opcode times, as the tables say it.
WHAT = {
    "allreduce": "f32 sum allreduce",
    "sendrecv": "f32 sendrecv (each rank sends to the next, receives from the previous)",
    "alltoall": "f32 all-to-all (size = a rank's N blocks)",
}


def stem(opcode):
    return "device-vs-mpi" if opcode == "allreduce" else f"device-vs-mpi-{opcode}"


def median(xs):
    xs = sorted(xs)
    k = len(xs)
    return xs[k // 2] if k % 2 else (xs[k // 2 - 1] + xs[k // 2]) / 2


def merge(docs):
    """One result per configuration: per size and field, the median over the
    repeats (#wrong: the sum)."""
    out = dict(docs[0])
    sizes = [r["size"] for r in docs[0]["results"]]
    merged = []
    for i, size in enumerate(sizes):
        rows = [d["results"][i] for d in docs if i < len(d["results"]) and d["results"][i]["size"] == size]
        row = {"size": size, "count": rows[0]["count"]}
        for side in ("oop", "ip"):
            if rows[0].get(side) is None:  # no in-place form
                row[side] = None
                continue
            row[side] = {k: (sum(r[side][k] for r in rows) if k == "wrong"
                             else median([r[side][k] for r in rows]))
                         for k in rows[0][side]}
        merged.append(row)
    out["results"] = merged
    return out


def rows_by_size(run_doc):
    return {r["size"]: r for r in run_doc["results"]}


def ratios(runs, ranks, modes, memcpy):
    """Headline ratios per N: at the largest and the smallest common size. 2·N·S/t is
    divided by the non-temporal probe with every thread (the bound for a data path
    that streams its outputs; in runs without one, the best probe), by glibc's with
    every thread, and by glibc's with one."""
    nt_all = probe(memcpy, "nt", None) or max(m["best_gbps"] for m in memcpy)
    libc_all = probe(memcpy, "libc", None)
    one_memcpy = probe(memcpy, "libc", 1)
    out = {}
    for n in ranks:
        mpi = rows_by_size(runs[("mpi", n)])
        r = {}
        for mode in modes:
            dev = rows_by_size(runs[(mode, n)])
            sizes = sorted(set(dev) & set(mpi))
            if not sizes:
                continue
            big, small = sizes[-1], sizes[0]
            d, m = dev[big]["oop"], mpi[big]["oop"]
            r[mode] = {
                "big": big,
                "small": small,
                "membw": d["membw"],
                "membw_vs_memcpy": d["membw"] / nt_all if nt_all else 0,
                "membw_vs_libc": d["membw"] / libc_all if libc_all else 0,
                "membw_vs_memcpy_1t": d["membw"] / one_memcpy if one_memcpy else 0,
                "algbw": d["algbw"],
                "mpi_algbw": m["algbw"],
                "algbw_vs_mpi": d["algbw"] / m["algbw"] if m["algbw"] else 0,
                "p50_small": dev[small]["oop"]["time_us"],
                "mpi_p50_small": mpi[small]["oop"]["time_us"],
                "p50_vs_mpi": dev[small]["oop"]["time_us"] / mpi[small]["oop"]["time_us"]
                if mpi[small]["oop"]["time_us"] else 0,
            }
        out[n] = r
    return out


def markdown(runs, ranks, modes, meta, tables):
    lines = []
    w = lines.append
    w(f"Measured {meta['date']} on {meta['host']}; load average {meta['load_before']} before, "
      f"{meta['load_after']} after. {WHAT[meta.get('opcode', 'allreduce')]}, out of place: per size the median over "
      f"{meta['repeat']} interleaved run(s) of each configuration of the median of {meta['iters']} "
      f"iterations after {meta['warmup']} warm-up; data rotated through buffers larger than the LLC.")
    w("")
    mc = ", ".join(f"{probe_label(m)} {m['best_gbps']:.1f} GB/s (median {m['median_gbps']:.1f})"
                   for m in meta["memcpy"])
    w(f"memcpy probe (bytes read + written per second, 256 MiB arrays; libc: glibc's memcpy, "
      f"nt: non-temporal stores): {mc}.")
    w("")
    rat = ratios(runs, ranks, modes, meta["memcpy"])
    w("| N | mode | 2·N·S/t at max size vs memcpy (nt, all threads / libc, all threads / libc, 1 thread) | "
      "algbw at max size: device / MPI | p50 at min size: device / MPI |")
    w("|---|---|---|---|---|")
    for n in ranks:
        for mode, r in rat[n].items():
            w(f"| {n} | {mode} | {r['membw']:.2f} GB/s = {100 * r['membw_vs_memcpy']:.0f}% / "
              f"{100 * r.get('membw_vs_libc', 0):.0f}% / "
              f"{100 * r['membw_vs_memcpy_1t']:.0f}% ({show_size(r['big'])}) | {r['algbw']:.2f} / "
              f"{r['mpi_algbw']:.2f} GB/s = {r['algbw_vs_mpi']:.2f}x | {r['p50_small']:.1f} / "
              f"{r['mpi_p50_small']:.1f} us = {r['p50_vs_mpi']:.1f}x |")
    w("")
    for n in ranks:
        w(f"N = {n}:")
        w("")
        cols = [c for c in ["poll", "interrupt", "hybrid", "mpi"] if (c, n) in runs]
        by = {c: rows_by_size(runs[(c, n)]) for c in cols}
        sizes = sorted(set().union(*[set(v) for v in by.values()]))
        head = ["size"] + [f"{c} p50 (us)" for c in cols] + [f"{c} algbw (GB/s)" for c in cols] + \
            [f"{c} 2NS/t (GB/s)" for c in cols] + ["#wrong"]
        w("| " + " | ".join(head) + " |")
        w("|" + "---|" * len(head))
        for s in sizes:
            cells = [show_size(s)]
            for key in ("time_us", "algbw", "membw"):
                for c in cols:
                    r = by[c].get(s)
                    cells.append("" if r is None else (f"{r['oop'][key]:.2f}" if key == "time_us"
                                                       else f"{r['oop'][key]:.3f}"))
            wrong = sum(by[c][s]["oop"]["wrong"] + (by[c][s]["ip"] or {"wrong": 0})["wrong"]
                        for c in cols if s in by[c])
            cells.append(str(wrong))
            w("| " + " | ".join(cells) + " |")
        w("")
    w("Commands (run by bench/compare.sh):")
    w("")
    w("```")
    for c in meta["commands"]:
        w(c)
    w("```")
    w("")
    w("<details><summary>Raw tables</summary>")
    w("")
    for (c, n, rep), t in sorted(tables.items(), key=str):
        w(f"{c}, N = {n}, run {rep + 1}:")
        w("")
        w("```")
        w(t.rstrip())
        w("```")
        w("")
    w("</details>")
    return "\n".join(lines) + "\n"


# ---- SVG ------------------------------------------------------------------

def svg(runs, ranks, memcpy, opcode="allreduce"):
    width, panel_h, left, right, top = 800, 300, 70, 220, 30
    panels = [
        ("latency p50 (us)", "time_us", True),
        ("algbw (GB/s)", "algbw", False),
        ("memory traffic 2·N·S/t (GB/s)", "membw", False),
    ]
    height = top + len(panels) * (panel_h + 60)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="14">virtio-dmlc device vs Open MPI: {WHAT[opcode]}, '
           f'out of place</text>']
    sizes = sorted({r["size"] for v in runs.values() for r in v["results"]})
    if not sizes:
        return "\n".join(out + ["</svg>"])
    xmin, xmax = math.log2(sizes[0]), math.log2(sizes[-1])
    pw = width - left - right
    dashes = {n: d for n, d in zip(ranks, ["", "6,3", "2,2", "8,2,2,2"])}
    for pi, (title, key, _) in enumerate(panels):
        y0 = top + pi * (panel_h + 60) + 20
        vals = [r["oop"][key] for v in runs.values() for r in v["results"] if r["oop"][key] > 0]
        if key == "membw":
            vals += [m["best_gbps"] for m in memcpy]
        if not vals:
            continue
        ymin = 10 ** math.floor(math.log10(min(vals)))
        ymax = 10 ** math.ceil(math.log10(max(vals)))
        ly = lambda v: y0 + panel_h - (math.log10(v) - math.log10(ymin)) / \
            (math.log10(ymax) - math.log10(ymin)) * panel_h
        lx = lambda s: left + (math.log2(s) - xmin) / max(xmax - xmin, 1e-9) * pw
        out.append(f'<text x="{left}" y="{y0 - 6}" font-size="12">{title}</text>')
        out.append(f'<rect x="{left}" y="{y0}" width="{pw}" height="{panel_h}" fill="none" stroke="#888"/>')
        e = math.log10(ymin)
        while e <= math.log10(ymax) + 1e-9:
            y = ly(10 ** e)
            out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>')
            out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{10 ** e:g}</text>')
            e += 1
        for s in sizes[::2]:
            x = lx(s)
            out.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + panel_h}" stroke="#f2f2f2"/>')
            out.append(f'<text x="{x:.1f}" y="{y0 + panel_h + 14}" text-anchor="middle">{show_size(s)}</text>')
        out.append(f'<text x="{left + pw / 2}" y="{y0 + panel_h + 30}" text-anchor="middle">'
                   f'message size (bytes)</text>')
        legend_y = y0 + 10
        for key_c, label, colour in CONFIGS:
            for n in ranks:
                if (key_c, n) not in runs:
                    continue
                pts = [(lx(r["size"]), ly(r["oop"][key])) for r in runs[(key_c, n)]["results"]
                       if r["oop"][key] > 0]
                if not pts:
                    continue
                d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
                dash = f' stroke-dasharray="{dashes[n]}"' if dashes.get(n) else ""
                out.append(f'<polyline points="{d}" fill="none" stroke="{colour}" stroke-width="1.6"{dash}/>')
                lx0 = left + pw + 12
                out.append(f'<line x1="{lx0}" y1="{legend_y}" x2="{lx0 + 24}" y2="{legend_y}" '
                           f'stroke="{colour}" stroke-width="1.6"{dash}/>')
                out.append(f'<text x="{lx0 + 30}" y="{legend_y + 4}">{label}, N={n}</text>')
                legend_y += 16
        if key == "membw":
            for i, m in enumerate(memcpy):
                y = ly(m["best_gbps"])
                out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#777" '
                           f'stroke-dasharray="1,3"/>')
                out.append(f'<text x="{left + 4 + 140 * i}" y="{y + 12:.1f}" fill="#555">memcpy, '
                           f'{probe_label(m)}: {m["best_gbps"]:.1f} GB/s</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()

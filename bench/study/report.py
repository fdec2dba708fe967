"""The study's report from its raw JSON: sections of prose, tables and
plots, written as study/report.md (plots as files beside it) and as
study/index.html (one self-contained page, plots inline). Both come from
the same sections, and every number in them from analysis.py.
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from . import analysis as an
from . import plots
from .analysis import Doc, Spread
from .cells import tcp_of


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Plot:
    name: str  # file name without .svg, and the HTML id
    title: str
    svg: str


@dataclass
class Section:
    """A heading and what follows it, in order: paragraphs (Markdown with
    `code` spans), tables and plots."""

    title: str
    blocks: list[str | Table | Plot] = field(default_factory=list)

    def add(self, block: str | Table | Plot) -> None:
        self.blocks.append(block)

    @property
    def plots(self) -> list[Plot]:
        return [b for b in self.blocks if isinstance(b, Plot)]


def ms(s: Spread | None) -> str:
    if s is None:
        return "-"
    if s.count == 1 or s.low == s.high:
        return f"{s.median:.2f}"
    return f"{s.median:.2f} ({s.low:.2f} to {s.high:.2f})"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


# What VMs of another architecture run a workload with, on their own Debian
# root: not this host's wheels.
FOREIGN_STACK = {
    "ddp": "Debian's torch",
    "digits": "Debian's root",
    "sweep": "Debian's root",
    "xgboost": "XGBoost cross-built",
    "lightgbm": "LightGBM cross-built",
}


def where(place: str, workload: str) -> str:
    """The place's name in a table, with what VMs of another architecture
    run `workload` on instead of this host's wheels."""
    if place == "host":
        return "host processes"
    accel, _, arch = place.partition("-")
    if arch != "x86_64":
        stack = FOREIGN_STACK.get(workload, FOREIGN_STACK["ddp"])
        return f"{arch} VMs ({accel.upper()}, {stack})"
    return f"{arch} VMs ({accel.upper()})"


def size_name(b: int) -> str:
    for shift, suffix in ((20, "MiB"), (10, "KiB")):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {suffix}"
    return f"{b} B"


def setup_section(doc: Doc) -> Section:
    m = doc["meta"]
    ran = sum(1 for c in doc["cells"] if not c.get("cached"))
    sec = Section("How this report was made")
    sec.add(
        f"Command: `{m['command']}`, from commit `{m['commit']}`, "
        f"{'quick' if m['quick'] else 'full'} study, {len(doc['cells'])} cells "
        f"({ran} measured in this run, the others taken from the cache of an earlier one "
        "with the same inputs)."
    )
    earlier = Counter(
        "commit `{commit}` on {date}".format(**c["measured"])
        if "measured" in c
        else "an unrecorded commit"
        for c in doc["cells"]
        if c.get("cached")
    )
    if earlier:
        sec.add(
            "Cells from the cache, by the commit that measured them: "
            + "; ".join(f"{n} at {where}" for where, n in sorted(earlier.items()))
            + "."
        )
    carried = Counter(
        "commit `{at}` ({why})".format(**c["carried"]) for c in doc["cells"] if "carried" in c
    )
    if carried:
        sec.add(
            "Cells whose cache entry was carried over by hand to a rebuilt program's key, "
            "keeping the measurement and its commit (each cell's `carried` in study.json): "
            + "; ".join(f"{n} at {why}" for why, n in sorted(carried.items()))
            + "."
        )
    sec.add(
        f"Machine: {m['machine']['cpus']} CPUs ({m['machine']['cpu']}), "
        f"{m['machine']['memory_gib']} GiB; load average {m['load_before']} before and "
        f"{m['load_after']} after; {m['qemu']}; Python {m['python']}, torch {m['torch']}."
    )
    st = m["settings"]
    sec.add(
        f"Each DDP cell trains `examples/torch/train.py` for {st['steps']} steps, "
        f"{st['batch']} samples per rank per step, measuring the accuracy on "
        f"{st.get('holdout', 297)} held-out samples every {st['eval_every']} steps; the digits "
        "trainer runs as many steps with as many samples. Medians over "
        f"{st['reps_host']} repetitions on the host and {st['reps_vm']} "
        "in VMs, the range in parentheses. A step is split into compute (forward and backward "
        "with the exchange off), update (the optimizer) and exchange (the rest). "
        f"The study took {m['wall_s'] / 60:.1f} min after {m['build_s']:.0f} s of setup "
        "(builds, not counted)."
    )
    for note in m.get("absent", []):
        sec.add(f"Not measured: {note}")
    return sec


def ddp_sections(doc: Doc) -> list[Section]:
    target = float(doc["meta"]["target_accuracy"])
    out = []
    for w in an.ddp_workloads(doc):
        for n in an.sizes_n(doc, w):
            sec = Section(f"{an.WORKLOAD_NAMES[w]}, N = {n}")
            rows, bars, curves = [], [], []
            for place in an.places(doc):
                for t in ("dmlc", tcp_of(w)):
                    c = an.find(doc, w, place, t, n)
                    if not c:
                        continue
                    label = f"{where(place, w)}, {an.TRANSPORT_NAMES[t]}"
                    step = an.spread(c, "step_ms")
                    rows.append(
                        [
                            where(place, w),
                            an.TRANSPORT_NAMES[t],
                            ms(step),
                            ms(an.spread(c, "compute_ms")),
                            ms(an.spread(c, "exchange_ms")),
                            ms(an.spread(c, "update_ms")),
                            f"{100 * an.exchange_share(c):.1f}%",
                            ms(an.tta(c, target)),
                            f"{an.spread(c, 'accuracy').median:.3f}",
                        ]
                    )
                    bars.append(
                        (
                            label,
                            {
                                p: an.spread(c, f"{p}_ms").median
                                for p in ("compute", "exchange", "update")
                            },
                        )
                    )
                    run = c["runs"][0]
                    if run.get("curve"):
                        curves.append((label, [(s, a) for _, s, a in run["curve"]]))
            sec.add(
                Table(
                    [
                        "where",
                        "transport",
                        "step ms",
                        "compute ms",
                        "exchange ms",
                        "update ms",
                        "exchange share",
                        f"time to {target:.0%} accuracy s",
                        "final accuracy",
                    ],
                    rows,
                )
            )
            key = f"{w}-n{n}"
            sec.add(
                Plot(
                    f"breakdown-{key}", "Where a step's time goes", plots.breakdown(sec.title, bars)
                )
            )
            if curves:
                sec.add(
                    Plot(
                        f"accuracy-{key}",
                        "Held-out accuracy against training time (first repetition)",
                        plots.accuracy_curves(sec.title, curves, target),
                    )
                )
            else:
                sec.add(
                    "This trainer measures its test accuracy once, after the last step: no "
                    "time to accuracy."
                )
            out.append(sec)
    return out


def xgboost_collectives(place: str, transport: str) -> str:
    """Which XGBoost a row ran: VMs of another architecture have no stock
    wheel, so they run the patched build's own rabit path over TCP."""
    if transport == "dmlc":
        return "device (patched)"
    return "TCP (stock)" if place == "host" or place.endswith("x86_64") else "TCP (patched, rabit)"


def xgboost_sections(doc: Doc) -> list[Section]:
    out = []
    for n in an.sizes_n(doc, "xgboost"):
        sec = Section(f"XGBoost (hist, the digits data), N = {n}")
        sec.add(
            "`examples/xgboost/train.py` at a RabitTracker: the patched build "
            "(xgboost-patches/) with its collectives through the device, and stock XGBoost "
            "over TCP (virtio-net); VMs of another architecture run the patched build "
            "cross-compiled (`build-xgboost.sh --arch`) for both, its TCP path being stock "
            "XGBoost's rabit. Round: the median boosting round; exchange: XGBoost's own "
            "monitor's estimate of the histogram allreduces' share of the tree updates (an "
            "upper bound, docs/xgboost.md). Every rank must end with the same model."
        )
        rows = []
        for place in an.places(doc):
            for t in ("dmlc", "tcp"):
                c = an.find(doc, "xgboost", place, t, n)
                if not c:
                    continue
                run = c["runs"][0]
                share = run.get("exchange_share_estimate")
                rows.append(
                    [
                        where(place, "xgboost"),
                        xgboost_collectives(place, t),
                        ms(an.spread(c, "round_ms")),
                        "-" if share is None else f"{100 * share:.1f}%",
                        f"{an.spread(c, 'accuracy').median:.4f}",
                        run["model_sha256"][:16],
                    ]
                )
        sec.add(
            Table(
                ["where", "collectives", "round ms", "exchange (estimate)", "accuracy", "model"],
                rows,
            )
        )
        out.append(sec)
    return out


def lightgbm_sections(doc: Doc) -> list[Section]:
    out = []
    for n in an.sizes_n(doc, "lightgbm"):
        sec = Section(f"LightGBM (data-parallel trees, the digits data), N = {n}")
        sec.add(
            "`examples/lightgbm/train.py`: LightGBM's network hook "
            "(`LGBM_NetworkInitWithFunctions`) with its reduce-scatter and allgather through "
            "the device (`dmlc.lightgbm`, no patch to LightGBM), against LightGBM's own socket "
            "network over TCP. Round: the median boosting round. Exchange: the time in the "
            "device's collectives, measured around them (LightGBM keeps no such account of "
            "its socket network). Every rank must end with the same trees; at N = 2 the two "
            "networks give the same trees bit for bit (python/tests/test_lightgbm.py). VMs of "
            "another architecture run the same LightGBM version cross-compiled "
            "(bench/study/cross-lightgbm.sh; Debian has no LightGBM)."
        )
        rows = []
        for place in an.places(doc):
            for t in ("dmlc", "tcp"):
                c = an.find(doc, "lightgbm", place, t, n)
                if not c:
                    continue
                run = c["runs"][0]
                exchange = "-"
                if run.get("exchange_ms") is not None:
                    share = an.spread(c, "exchange_ms").median / an.spread(c, "round_ms").median
                    exchange = f"{ms(an.spread(c, 'exchange_ms'))} ({100 * share:.1f}%)"
                rows.append(
                    [
                        where(place, "lightgbm"),
                        "device (hook)" if t == "dmlc" else "TCP (LightGBM's sockets)",
                        ms(an.spread(c, "round_ms")),
                        exchange,
                        f"{an.spread(c, 'accuracy').median:.4f}",
                        run["model_sha256"][:16],
                    ]
                )
        sec.add(Table(["where", "network", "round ms", "exchange ms", "accuracy", "trees"], rows))
        out.append(sec)
    return out


def summary_section(doc: Doc) -> Section:
    target = float(doc["meta"]["target_accuracy"])
    sec = Section("The answers")
    sec.add(
        "Per workload, place and N. Emulation factor: a VM's compute over the host's "
        "(same workload and N). Speedup: TCP's median over the device's (gloo for DDP, the "
        "project's TCP communicator for digits, stock XGBoost for XGBoost (in VMs of other "
        "architectures: the patched build's own rabit path), LightGBM's own "
        "socket network for LightGBM), for the whole step (a boosting round) and for its "
        "exchange, in the same place. Exchange share: the "
        f"device's exchange over its step. Time to {target:.0%}: seconds of training until "
        "the held-out accuracy reached it (device / TCP)."
    )
    rows = []
    for w in an.ddp_workloads(doc):
        for n in an.sizes_n(doc, w):
            for place in an.places(doc):
                dev = an.find(doc, w, place, "dmlc", n)
                tcp = an.find(doc, w, place, tcp_of(w), n)
                if not dev and not tcp:
                    continue
                emu = an.emulation_factor(doc, w, place, n) if place != "host" else None
                times = [ms(an.tta(c, target)) if c else "-" for c in (dev, tcp)]
                rows.append(
                    [
                        w,
                        str(n),
                        where(place, w),
                        ratio(emu),
                        ratio(an.speedup(doc, w, place, n, "step_ms")),
                        ratio(an.speedup(doc, w, place, n, "exchange_ms")),
                        f"{100 * an.exchange_share(dev):.1f}%" if dev else "-",
                        " / ".join(times),
                    ]
                )
    for n in an.sizes_n(doc, "xgboost"):
        for place in an.places(doc):
            dev = an.find(doc, "xgboost", place, "dmlc", n)
            if dev:
                share = dev["runs"][0].get("exchange_share_estimate")
                emu = an.emulation_factor(doc, "xgboost", place, n) if place != "host" else None
                rows.append(
                    [
                        "xgboost",
                        str(n),
                        where(place, "xgboost"),
                        ratio(emu) + (" (estimate)" if emu else ""),
                        ratio(an.speedup(doc, "xgboost", place, n, "round_ms")),
                        "-",
                        "-" if share is None else f"{100 * share:.1f}% (estimate)",
                        "-",
                    ]
                )
    for n in an.sizes_n(doc, "lightgbm"):
        for place in an.places(doc):
            dev = an.find(doc, "lightgbm", place, "dmlc", n)
            if dev:
                share = an.spread(dev, "exchange_ms").median / an.spread(dev, "round_ms").median
                emu = an.emulation_factor(doc, "lightgbm", place, n) if place != "host" else None
                rows.append(
                    [
                        "lightgbm",
                        str(n),
                        where(place, "lightgbm"),
                        ratio(emu),
                        ratio(an.speedup(doc, "lightgbm", place, n, "round_ms")),
                        "-",
                        f"{100 * share:.1f}%",
                        "-",
                    ]
                )
    sec.add(
        Table(
            [
                "workload",
                "N",
                "where",
                "emulation factor",
                "step speedup over TCP",
                "exchange speedup over TCP",
                "exchange share",
                f"time to {target:.0%} s",
            ],
            rows,
        )
    )
    sweep_rows = []
    for c in an.cells(doc, "sweep"):
        rows_in = an.sweep(c)
        for r in (rows_in[0], rows_in[-1]) if rows_in else ():
            dev = r.times.get("device")
            if not dev:
                continue
            others = [
                ratio(r.times[p].median / dev.median) if p in r.times and dev.median else "-"
                for p in an.SWEEP_PATHS[1:]
            ]
            sweep_rows.append(
                [
                    where(c["spec"]["place"], "sweep"),
                    str(c["spec"]["n"]),
                    size_name(r.size),
                    ms(dev),
                    *others,
                ]
            )
    if sweep_rows:
        sec.add(
            "One allreduce inside the VMs, at the smallest and largest size of the report's "
            "sweeps: the device's time and how many times longer each other path takes."
        )
        sec.add(
            Table(
                ["where", "N", "bytes per rank", "device us"]
                + [f"{an.TRANSPORT_NAMES.get(p, p)} / device" for p in an.SWEEP_PATHS[1:]],
                sweep_rows,
            )
        )
    err = an.projection_error(doc)
    if err:
        sec.add(
            f"The report's projection to a target cluster missed the step it could check by "
            f"{100 * err[2]:.1f}% (measured {err[1].median:.2f} ms, projected "
            f"{err[0].step_ms:.2f} ms)."
        )
    return sec


def sweep_sections(doc: Doc) -> list[Section]:
    out = []
    for c in an.cells(doc, "sweep"):
        spec = c["spec"]
        sec = Section(
            f"Allreduce by message size, {where(spec['place'], 'sweep')}, N = {spec['n']}"
        )
        sec.add(
            "f32 sum, each path in the same boot: the device (`dmlc-guest bench`), gloo over "
            "virtio-net, the project's TCP communicator (`dmlc-guest bench --transport tcp`) "
            "and Open MPI over virtio-net (`bench/mpi_allreduce.c`, started by `mpirun` in the "
            "first VM through `bench/rsh-agent.py`, as the guests have no sshd); rank 0's "
            "median of 10 iterations per repetition, the median over repetitions (range in "
            "parentheses); every received value checked."
        )
        rows_in = an.sweep(c)
        paths = [p for p in an.SWEEP_PATHS if any(p in r.times for r in rows_in)]
        rows = []
        for r in rows_in:
            dev = r.times.get("device")
            cells = [size_name(r.size)] + [ms(r.times.get(p)) for p in paths]
            for p in paths[1:]:
                t = r.times.get(p)
                cells.append(ratio(t.median / dev.median if t and dev and dev.median else None))
            rows.append(cells)
        header = ["bytes per rank"] + [f"{p} us" for p in paths]
        header += [f"{p} / device" for p in paths[1:]]
        sec.add(Table(header, rows))
        sizes = [r.size for r in rows_in]
        series = {p: [r.times.get(p) for r in rows_in] for p in paths}
        key = f"{spec['place']}-n{spec['n']}"
        sec.add(
            Plot(
                f"latency-{key}", "Time per allreduce", plots.sweep(sec.title, sizes, series, False)
            )
        )
        sec.add(
            Plot(
                f"bandwidth-{key}",
                "Algorithm bandwidth",
                plots.sweep(sec.title, sizes, series, True),
            )
        )
        out.append(sec)
    return out


def scaling_section(doc: Doc) -> Section | None:
    lines: dict[str, list[tuple[int, float]]] = {}
    for w in an.ddp_workloads(doc):
        if len(an.sizes_n(doc, w)) < 2:
            continue
        for place in an.places(doc):
            for t in ("dmlc", tcp_of(w)):
                pts = [
                    (n, an.spread(c, "step_ms").median)
                    for n in an.sizes_n(doc, w)
                    if (c := an.find(doc, w, place, t, n))
                ]
                if len(pts) > 1:
                    lines[f"{w}, {where(place, w)}, {an.TRANSPORT_NAMES[t]}"] = pts
    if not lines:
        return None
    sec = Section("Scaling with N")
    sec.add(Plot("scaling", "Step time against N", plots.scaling(sec.title, lines)))
    return sec


def projection_section(doc: Doc) -> Section | None:
    target = doc["meta"].get("projection")
    if not target:
        return None
    m = target["model"]
    fields = ", ".join(f"{k} = {v}" for k, v in m.items() if k not in ("kind", "world"))
    sec = Section("Projection to a target cluster")
    sec.add(
        f"Target: `{target['file']}`, a {m.get('kind', 'ideal')} model of {target['world']} "
        f"ranks ({fields}); its compute {target['speed']} times "
        "this host's (a timing file holds no compute time: the speed is the study's "
        "`--speed`, for example the ratio of the two machines' times for one step of the "
        "model alone). Projected step = (host compute + update) / speed + the model's "
        "allreduce of each DDP bucket (`dmlc-timing`: the backend's own formulas), with no "
        "overlap of backward and exchange assumed."
    )
    rows = []
    for w in an.ddp_workloads(doc):
        for n in an.sizes_n(doc, w):
            p = an.project(doc, w, n) if w.startswith("ddp") else None
            if p:
                rows.append(
                    [w, str(n), f"{p.compute_ms:.2f}", f"{p.exchange_ms:.2f}", f"{p.step_ms:.2f}"]
                )
    sec.add(
        Table(["workload", "measured at N", "compute ms", "modelled exchange ms", "step ms"], rows)
    )
    err = an.projection_error(doc)
    if err:
        p, measured, e = err
        sec.add(
            "Fidelity check: the same projection for a configuration the study can measure, "
            f"train.py (1.1M parameters) by {p.n} host processes whose backend runs this "
            "timing model (`vhost-device-dmlc --timing`), so the device completes each "
            "allreduce at the model's time; speed 1 (it is this host)."
        )
        sec.add(
            Table(
                ["projected step ms", "measured step ms", "error (measured - projected)"],
                [[f"{p.step_ms:.2f}", ms(measured), f"{100 * e:.1f}%"]],
            )
        )
    return sec


def sections(doc: Doc) -> list[Section]:
    out = [
        summary_section(doc),
        setup_section(doc),
        *ddp_sections(doc),
        *xgboost_sections(doc),
        *lightgbm_sections(doc),
    ]
    out += sweep_sections(doc)
    out += [s for s in (scaling_section(doc), projection_section(doc)) if s]
    return out


TITLE = "Should I run distributed ML on QEMU? A feasibility study"


def markdown(secs: list[Section], raw_marker: str) -> str:
    """The report as Markdown; plots as plots/NAME.svg beside it."""
    lines = [f"# {TITLE}", ""]
    for s in secs:
        lines += [f"## {s.title}", ""]
        for b in s.blocks:
            if isinstance(b, Table):
                lines.append(raw_marker)
                lines.append("| " + " | ".join(b.header) + " |")
                lines.append("|" + "---|" * len(b.header))
                lines += ["| " + " | ".join(r) + " |" for r in b.rows]
            elif isinstance(b, Plot):
                lines.append(f"![{b.title}](plots/{b.name}.svg)")
            else:
                lines.append(b)
            lines.append("")
    return "\n".join(lines)


CSS = """
body { font-family: sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.5rem; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
figure.plot { margin: 1rem 0; } figure.plot svg { max-width: 100%; height: auto; }
"""
# Marks the page once the browser laid it out: how many plots have a size.
# The headless test reads this attribute from the DOM it dumps.
CHECK = """
window.addEventListener("load", () => {
  const plots = [...document.querySelectorAll("figure.plot svg")];
  const drawn = plots.filter(s => { const r = s.getBoundingClientRect();
    return r.width > 50 && r.height > 50 && s.querySelectorAll("path").length > 0; });
  document.body.dataset.plots = plots.length;
  document.body.dataset.plotsDrawn = drawn.length;
});
"""


def page(secs: list[Section]) -> str:
    """The report as one self-contained HTML page, plots inline."""
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(TITLE)}</title><style>{CSS}</style>",
        f"<script>{CHECK}</script></head><body>",
        f"<h1>{html.escape(TITLE)}</h1>",
    ]
    for s in secs:
        out.append(f"<h2>{html.escape(s.title)}</h2>")
        for b in s.blocks:
            if isinstance(b, Table):
                out.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in b.header))
                for r in b.rows:
                    out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
                out.append("</table>")
            elif isinstance(b, Plot):
                out.append(f'<figure class="plot" id="{b.name}">{b.svg}')
                out.append(f"<figcaption>{html.escape(b.title)}</figcaption></figure>")
            else:
                out.append(f"<p>{_inline(b)}</p>")
    out.append("</body></html>")
    return "\n".join(out)


def _inline(text: str) -> str:
    """Markdown's `code` spans as <code>, the rest escaped."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


BEGIN = "<!-- study:begin (written by dmlc-qemu study --benchmarks-md; do not edit) -->"
END = "<!-- study:end -->"


def headline(doc: Doc) -> str:
    """The answers section for docs/benchmarks.md, between BEGIN and END."""
    m = doc["meta"]
    marker = f"<!-- raw: {m['raw_file']} cmd: {m['command']} -->"
    body = markdown([summary_section(doc)], marker).split("\n", 2)[2]  # no page title
    body = body.replace("## The answers\n\n", "", 1)
    # The report beside the raw log, as docs/benchmarks.md links it.
    rep = Path(m["raw_file"]).parent / "report.md"
    link = str(rep.relative_to("docs")) if rep.is_relative_to("docs") else str(rep)
    intro = (
        f"From the study's latest report ([{link}]({link})), made by "
        f"`{m['command']}` at commit `{m['commit']}`; how it is made: [study.md](study.md)."
    )
    return f"{BEGIN}\n{intro}\n\n{body.rstrip()}\n{END}"


def update_block(path: Path, doc: Doc) -> None:
    """Replaces the study's block in `path` (a Markdown file that has one)."""
    text = path.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{path} has no study block ({BEGIN} ... {END})")
    path.write_text(text[:start] + headline(doc) + text[end + len(END) :])


def write(doc: Doc, out: Path) -> list[Path]:
    """report.md, plots/*.svg and index.html into `out`; the files written."""
    secs = sections(doc)
    marker = f"<!-- raw: {doc['meta']['raw_file']} cmd: {doc['meta']['command']} -->"
    (out / "plots").mkdir(parents=True, exist_ok=True)
    written = []
    for s in secs:
        for p in s.plots:
            path = out / "plots" / f"{p.name}.svg"
            path.write_text(p.svg)
            written.append(path)
    (out / "report.md").write_text(markdown(secs, marker))
    (out / "index.html").write_text(page(secs))
    return [out / "report.md", out / "index.html", *written]

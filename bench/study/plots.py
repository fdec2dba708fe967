"""The report's pictures, drawn by matplotlib as SVG text (inlined in the
HTML page, and kept as files for the Markdown). Each function takes the
numbers analysis.py computed and returns one SVG document."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt

from .analysis import Spread

# Text stays text (smaller files, selectable); a fixed salt and no date
# make the same numbers give the same file.
plt.rcParams.update(
    {
        "svg.fonttype": "none",
        "svg.hashsalt": "dmlc-study",
        "font.size": 9,
        "figure.dpi": 100,
    }
)
COLOURS = {"compute": "#4c72b0", "exchange": "#dd8452", "update": "#55a868"}
PATH_COLOURS = {"device": "#c44e52", "gloo": "#8172b3", "tcp": "#937860", "mpi": "#64b5cd"}


def _svg(fig: plt.Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def breakdown(title: str, bars: list[tuple[str, dict[str, float]]]) -> str:
    """Stacked bars: per label, the step's compute, exchange and update (ms)."""
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(bars) + 1.2))
    labels = [label for label, _ in bars]
    left = [0.0] * len(bars)
    for part, colour in COLOURS.items():
        widths = [parts[part] for _, parts in bars]
        ax.barh(labels, widths, left=left, color=colour, label=part)
        left = [lo + w for lo, w in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (medians)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    return _svg(fig)


def accuracy_curves(
    title: str, curves: list[tuple[str, list[tuple[float, float]]]], target: float
) -> str:
    """Held-out accuracy against seconds of training, one line per run."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, points in curves:
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
    ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds of training (log scale)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _svg(fig)


def sweep(
    title: str, sizes: list[int], paths: dict[str, list[Spread | None]], bandwidth: bool
) -> str:
    """Latency (us) or algorithm bandwidth (MB/s) against message size, one
    line per path, the range over repetitions shaded."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for path, values in paths.items():
        xs = [s for s, v in zip(sizes, values, strict=True) if v]
        vs = [v for v in values if v]

        def y(t: float, size: int) -> float:
            return size / t if bandwidth else t  # bytes per us = MB/s

        ax.plot(
            xs,
            [y(v.median, s) for s, v in zip(xs, vs, strict=True)],
            marker="o",
            label=path,
            color=PATH_COLOURS.get(path),
        )
        ax.fill_between(
            xs,
            [y(v.high, s) for s, v in zip(xs, vs, strict=True)],
            [y(v.low, s) for s, v in zip(xs, vs, strict=True)],
            alpha=0.2,
            color=PATH_COLOURS.get(path),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("algorithm bandwidth (MB/s)" if bandwidth else "time (us)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _svg(fig)


def scaling(title: str, lines: dict[str, list[tuple[int, float]]]) -> str:
    """Step time (ms) against N, one line per place and transport."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, points in lines.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xlabel("N (ranks)")
    ax.set_ylabel("ms per step (median)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _svg(fig)

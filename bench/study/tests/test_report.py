"""The study's report: every number from the raw JSON (the committed report
is regenerated from its JSON and compared), the formulas against values
worked out by hand, the cache keys, and the page in headless Chromium."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from study import analysis, browser, cells, report, runners

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "docs" / "study"


# Every committed report: the quick one, and the full one (x86_64) where
# it exists.
REPORTS = sorted(d for d in (ROOT / "docs").glob("study*") if (d / "study.json").is_file())


def committed_doc() -> dict:
    return json.loads((COMMITTED / "study.json").read_text())


@pytest.mark.parametrize("folder", REPORTS, ids=lambda d: d.name)
def test_the_committed_report_is_what_its_json_gives(folder: Path) -> None:
    doc = json.loads((folder / "study.json").read_text())
    marker = f"<!-- raw: {doc['meta']['raw_file']} cmd: {doc['meta']['command']} -->"
    again = report.markdown(report.sections(doc), marker)
    assert again == (folder / "report.md").read_text(), (
        f"docs/{folder.name}/report.md differs from what its study.json gives: rewrite it "
        f"with `dmlc-qemu study --out docs/{folder.name} --report-only`"
    )


def test_the_benchmarks_page_shows_the_committed_answers() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    start, end = text.find(report.BEGIN), text.find(report.END)
    assert 0 <= start < end, "docs/benchmarks.md has no study block"
    block = text[start : end + len(report.END)]
    # The block names the report it was written from (its raw marker).
    found = [d for d in REPORTS if f"<!-- raw: docs/{d.name}/log.txt " in block]
    assert len(found) == 1, "docs/benchmarks.md's study block names no committed report"
    doc = json.loads((found[0] / "study.json").read_text())
    assert block == report.headline(doc), (
        f"docs/benchmarks.md's study block differs from what docs/{found[0].name}/study.json "
        f"gives: `dmlc-qemu study --out docs/{found[0].name} --report-only --benchmarks-md "
        "docs/benchmarks.md`"
    )


def test_the_projection_adds_the_model_s_time_of_each_bucket(tmp_path: Path) -> None:
    # The recorded table is dmlc-timing's (its formulas are tested in Rust);
    # here: which entries a projection takes and how it adds them.
    host = {
        "spec": {"workload": "ddp-mlp", "place": "host", "transport": "dmlc", "n": 4},
        "runs": [{"compute_ms": 2.0, "update_ms": 1.0, "bucket_bytes": [100, 300], "params": 1}],
    }
    table = {"4": {"100": 500.0, "300": 1500.0}, "2": {"100": 1.0, "300": 1.0}}
    doc = {
        "meta": {"projection": {"speed": 2.0, "world": 8, "allreduce_us": table}},
        "cells": [host],
    }
    p = analysis.project(doc, "ddp-mlp", 4)
    assert (p.compute_ms, p.exchange_ms, p.step_ms) == (1.5, 2.0, 3.5)
    # A run without bucket sizes is one bucket of every parameter (f32).
    assert analysis.buckets({"runs": [{"params": 25}]}) == [100]


def test_time_to_accuracy_is_the_first_evaluation_that_reaches_it() -> None:
    run = {"curve": [[0, 0.0, 0.1], [10, 1.5, 0.79], [20, 3.0, 0.81], [30, 4.5, 0.78]]}
    assert analysis.time_to_accuracy(run, 0.8) == 3.0
    assert analysis.time_to_accuracy(run, 0.9) is None
    cell = {"runs": [run, dict(run, curve=[[0, 0.0, 0.1], [10, 2.0, 0.85]])]}
    spread = analysis.tta(cell, 0.8)
    assert spread is not None
    assert (spread.median, spread.low, spread.high) == (2.5, 2.0, 3.0)
    # One repetition that never got there: no time for the cell.
    assert analysis.tta({"runs": [run, {"curve": [[0, 0.0, 0.1]]}]}, 0.8) is None


def test_factors_come_from_the_medians_of_both_sides() -> None:
    def cell(place: str, transport: str, step: float, compute: float) -> dict:
        run = {"step_ms": step, "compute_ms": compute, "exchange_ms": step - compute - 1}
        spec = {"workload": "ddp-mlp", "place": place, "transport": transport, "n": 2}
        return {"spec": spec, "runs": [dict(run, update_ms=1.0)]}

    doc = {
        "cells": [
            cell("host", "dmlc", 7.0, 2.0),
            cell("host", "gloo", 9.0, 2.0),
            cell("tcg-x86_64", "dmlc", 150.0, 100.0),
            cell("tcg-x86_64", "gloo", 300.0, 80.0),
        ]
    }
    # VM compute (median of 100 and 80) over host compute (2).
    assert analysis.emulation_factor(doc, "ddp-mlp", "tcg-x86_64", 2) == pytest.approx(45.0)
    assert analysis.speedup(doc, "ddp-mlp", "tcg-x86_64", 2, "step_ms") == pytest.approx(2.0)
    assert analysis.speedup(doc, "ddp-mlp", "host", 4, "step_ms") is None


def test_a_cell_key_changes_with_the_programs_it_runs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cells, "ROOT", tmp_path)
    (tmp_path / "examples" / "torch").mkdir(parents=True)
    train = tmp_path / "examples" / "torch" / "train.py"
    train.write_text("one")
    cell = cells.Cell("ddp-mlp", "host", "dmlc", 2)
    first = cells.key(cell, cells.QUICK)
    assert cells.key(cell, cells.QUICK) == first
    assert cells.key(cell, cells.FULL) != first
    assert cells.key(cells.Cell("ddp-mlp", "host", "gloo", 2), cells.QUICK) != first
    train.write_text("two")
    assert cells.key(cell, cells.QUICK) != first


def test_a_foreign_cell_key_follows_its_own_architecture_s_programs(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(cells, "ROOT", tmp_path)
    files = {
        "host": "target/release/libdmlc_guest.so",
        "guest": "target/aarch64-unknown-linux-gnu/release/libdmlc_guest.so",
        "root": "tests/image/build-rootfs.sh",
    }
    for f in files.values():
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("one")
    vm = cells.Cell("ddp-mlp", "tcg-aarch64", "dmlc", 2)
    x86 = cells.Cell("ddp-mlp", "tcg-x86_64", "dmlc", 2)
    first, first_x86 = cells.key(vm, cells.FULL), cells.key(x86, cells.FULL)
    (tmp_path / files["host"]).write_text("two")
    assert cells.key(vm, cells.FULL) == first
    assert cells.key(x86, cells.FULL) != first_x86
    for name in ("guest", "root"):
        (tmp_path / files[name]).write_text("two")
        assert cells.key(vm, cells.FULL) != first, name
        first = cells.key(vm, cells.FULL)
    assert (
        cells.inputs(cells.Cell("sweep", "tcg-riscv64", "all", 4)).count(
            "target/study/riscv64/mpi_allreduce"
        )
        == 1
    )


def test_boosted_trees_in_foreign_vms_run_their_architecture_s_builds() -> None:
    built = {
        ("xgboost", "x86_64"): "/c/xgboost/patched",
        ("xgboost", "aarch64"): "/c/xgboost/aarch64",
        ("lightgbm", "aarch64"): "/c/lightgbm/aarch64",
    }
    path = runners.package_pythonpath
    # This host's userland: the patched XGBoost for the device alone.
    assert path(cells.Cell("xgboost", "tcg-x86_64", "dmlc", 2), built).startswith("/c/xgboost/p")
    assert not path(cells.Cell("xgboost", "host", "tcp", 2), built).startswith("/c/")
    assert not path(cells.Cell("lightgbm", "tcg-x86_64", "dmlc", 2), built).startswith("/c/")
    # Another architecture: its own build, for both transports.
    for t in ("dmlc", "tcp"):
        for w in ("xgboost", "lightgbm"):
            cell = cells.Cell(w, "tcg-aarch64", t, 2)
            assert path(cell, built).startswith(f"/c/{w}/aarch64:"), cell.id
    with pytest.raises(runners.CellFailedError, match="lightgbm build for riscv64"):
        path(cells.Cell("lightgbm", "tcg-riscv64", "tcp", 2), built)
    lgb = cells.inputs(cells.Cell("lightgbm", "tcg-riscv64", "dmlc", 4))
    assert "bench/study/cross-lightgbm.sh" in lgb
    assert "target/riscv64gc-unknown-linux-gnu/release/libdmlc_guest.so" in lgb
    full = cells.matrix(quick=False, places=["tcg-riscv64"])
    assert {c.id for c in full if c.family in ("xgboost", "lightgbm")} == {
        f"{w}/tcg-riscv64/{t}/n{n}"
        for w in ("xgboost", "lightgbm")
        for t in ("dmlc", "tcp")
        for n in (2, 4)
    }


def test_only_selects_by_pattern_and_names_the_cells_when_none_match() -> None:
    matrix = cells.matrix(quick=True, places=["host", "tcg-x86_64"])
    ids = {c.id for c in cells.select(matrix, ["ddp-mlp/host/*"])}
    assert ids == {"ddp-mlp/host/dmlc/n2", "ddp-mlp/host/gloo/n2"}
    with pytest.raises(SystemExit, match="sweep/tcg-x86_64/all/n2"):
        cells.select(matrix, ["no-such-cell"])


def test_the_page_draws_every_plot_in_headless_chromium(tmp_path: Path) -> None:
    if not shutil.which("chromium"):
        pytest.fail("chromium is not installed: tests/run.sh installs Debian's chromium")
    written = report.write(committed_doc(), tmp_path)
    svgs = [p for p in written if p.suffix == ".svg"]
    assert len(svgs) >= 3
    plots, drawn = browser.plots_drawn(tmp_path / "index.html")
    assert plots == len(svgs), "the page holds another number of plots than were drawn"
    assert drawn == plots, f"only {drawn} of {plots} plots were laid out and drawn"


def test_a_half_written_cell_is_measured_again(tmp_path: Path) -> None:
    from study.__main__ import cached

    path = tmp_path / "cell.json"
    assert cached(path) is None
    path.write_text('{"id": "ddp-mlp/host/dmlc/n2", "runs": [{"step_ms": 1')
    assert cached(path) is None
    path.write_text('{"id": "ddp-mlp/host/dmlc/n2", "runs": [{"step_ms": 1.0}]}')
    assert cached(path) == {"id": "ddp-mlp/host/dmlc/n2", "runs": [{"step_ms": 1.0}]}

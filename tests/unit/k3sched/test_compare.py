"""k3sched.compare on tiny-cpu: every schedule the shape supports, serial baseline, outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from k3sched.compare import (SCHEDULES, best_row, compare, compare_command, render_notes, render_table, variant,
                             write_compare)
from k3sched.config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def rows():
    return compare(load_config(TINY))


def test_rows_complete(rows) -> None:
    assert [r.schedule for r in rows[:-1]] == list(SCHEDULES)
    assert rows[-1].strategy == "serial" and rows[-1].schedule == load_config(TINY).schedule.pipeline
    for r in rows:  # tiny-cpu (pp 2, 4 layers, 4 micro-batches) supports every schedule
        assert r.ok, f"{r.label}: {r.error}"
        assert r.step_us > 0 and r.ratio_to_bound >= 1 - 1e-9
        assert 0 <= r.bubble < 1 and 0 <= r.exposed_ep_ratio < 1 and 0 <= r.exposed_collective_ratio < 1
        assert len(r.peak_device) == 2 and r.peak_device_max == max(r.peak_device) > 0
        assert r.p2p_bytes > 0 and r.plan_s >= 0 and r.num_tasks > 0
    vpp = {r.schedule: r.vpp for r in rows[:-1]}
    assert vpp["1f1b"] == 1 and vpp["zb-v"] == 2 and vpp["dualpipev"] == 2 and vpp["interleaved-1f1b"] >= 2
    # interleaved placements send more P2P than one chunk per rank
    by = {r.label: r for r in rows}
    assert by["interleaved-1f1b-k3"].p2p_bytes > by["1f1b-k3"].p2p_bytes


def test_serial_not_faster_than_best_k3(rows) -> None:
    best = best_row(rows)
    assert rows[-1].step_us >= best.step_us


def test_table_renders(rows) -> None:
    console = Console(width=220, record=True)
    console.print(render_table(rows))
    text = console.export_text()
    for s in SCHEDULES:
        assert s in text


def test_unsupported_shape_gives_error_row() -> None:
    cfg = load_config(TINY, ["parallel.pp=4", "parallel.microbatches=3"])  # 4 layers: no vpp 2 at pp 4
    rows = compare(cfg, ["1f1b", "zb-v", "interleaved-1f1b", "dualpipev"])
    by = {r.schedule: r for r in rows if r.strategy == "k3"}
    assert by["1f1b"].ok
    for name in ("zb-v", "interleaved-1f1b", "dualpipev"):
        assert not by[name].ok and "skipped" in by[name].error
    with pytest.raises(ConfigError, match="chunks"):
        variant(cfg, "zb-v")
    with pytest.raises(ValueError, match="unknown schedule"):
        compare(cfg, ["nope"])


def test_outputs_written(rows, tmp_path) -> None:
    import matplotlib.image

    from k3sched.pipelines import TABLE

    paths = write_compare(rows, None, tmp_path)
    for r in rows:
        doc = json.loads((tmp_path / r.label / "plan.json").read_text())
        assert doc["format"] == "k3sched.plan/1" and doc["strategy"] == r.strategy
        # compare shows a step: pipedream-2bw's plan spans two ([Note: pipedream-2bw])
        assert doc["metrics"]["step_time_us"] / TABLE[r.schedule].steps == pytest.approx(r.step_us)
    summary = json.loads((tmp_path / "compare.json").read_text())
    assert len(summary["rows"]) == len(rows)
    img = matplotlib.image.imread(tmp_path / "compare.png")
    assert img.ndim == 3 and img.shape[0] > 1000
    assert tmp_path / "compare.png" in paths


def test_compare_command(tmp_path) -> None:
    console = Console(width=220, record=True)
    assert compare_command(TINY, ["1f1b", "zb-h1"], tmp_path / "o", ["parallel.microbatches=2"], console) == 0
    assert (tmp_path / "o" / "zb-h1-k3" / "plan.json").exists()
    assert compare_command(TINY, ["bogus"], None, None, console) == 2
    assert compare_command(tmp_path / "missing.yaml", None, None, None, console) == 2
    assert "error" in console.export_text()


def test_default_table_fits_120_columns_and_wide_has_everything(rows) -> None:
    cfg = load_config(TINY, ["parallel.pp=4", "parallel.microbatches=4"])  # vpp-2 schedules skipped
    some = rows + compare(cfg, ["zb-v"])
    console = Console(width=120, record=True)
    console.print(render_table(some))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 120
    for s in SCHEDULES:
        assert s in text
    assert "skipped (1)" in text and "per stage" not in text
    assert render_notes(some) == [f"(1) zb-v: {some[-2].error}"]
    wide = Console(width=240, record=True)
    wide.print(render_table(some, wide=True))
    wtext = wide.export_text()
    assert "peak dev GiB per stage" in wtext and "skipped: zb-v needs" in wtext


def test_compare_command_narrow_prints_notes(tmp_path) -> None:
    console = Console(width=120, record=True)
    assert compare_command(TINY, ["1f1b", "zb-v"], None, ["parallel.pp=4"], console) == 0
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "(1) zb-v: skipped" in text


def test_without_a_spread_rows_have_no_expected_step(rows) -> None:
    assert all(r.expected_us is None for r in rows)
    console = Console(width=120, record=True)
    console.print(render_table(rows))
    assert "expected" not in console.export_text()


def test_a_task_time_spread_ranks_schedules_by_their_expected_step() -> None:
    """[Note: ranking with a task-time spread]: with ``hardware.cpu_runner.task_time_cv`` 0.3 on tiny-cpu,
    chimera plans a shorter step than dualpipev but expects a longer one (its transfers are hidden
    with less room), so the fastest row is dualpipev; the planned ranking would pick chimera."""
    cfg = load_config(TINY, ["hardware.cpu_runner.task_time_cv=0.3"])
    rows = compare(cfg, ["chimera", "dualpipev"])
    by = {r.label: r for r in rows}
    for r in rows:
        assert r.ok and r.expected_us == pytest.approx(r.plan.metrics.expected["step_time_us"])
    k3 = [by["chimera-k3"], by["dualpipev-k3"]]
    assert by["chimera-k3"].step_us < by["dualpipev-k3"].step_us, "the planned ranking no longer differs here"
    assert by["chimera-k3"].expected_us > by["dualpipev-k3"].expected_us
    assert best_row(rows) is by["dualpipev-k3"] is min(k3, key=lambda r: r.expected_us)
    serial = rows[-1]
    assert serial.expected_us > serial.step_us  # its ranks wait for each other at the all-to-alls
    console = Console(width=120, record=True)
    console.print(render_table(rows))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "expected" in text and f"{by['dualpipev-k3'].expected_us / 1e3:.3f}" in text and "dualpipev *" in text
    wide = Console(width=240, record=True)
    wide.print(render_table(rows + compare(load_config(TINY, ["parallel.pp=4", "hardware.cpu_runner.task_time_cv=0.3"]),
                                           ["zb-v"]), wide=True))
    wtext = wide.export_text()
    assert "expected ms" in wtext and "skipped: zb-v" in wtext

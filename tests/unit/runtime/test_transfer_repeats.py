"""[Note: interleaved repeats] in runtime/transfer.py: a calibration target measured in several
rounds is its runs' median, so one run slowed by the machine moves nothing."""

from __future__ import annotations

import pytest

from runtime.transfer import repeated_rows, transfer_check

from conftest import CONFIGS

TARGETS = {"microbatches x2": ["parallel.microbatches=8"], "serial": ["schedule.strategy=serial"]}
PLANS = {"microbatches x2": (3000.0, 3100.0), "serial": (2500.0, None)}


def test_a_slowed_run_of_three_moves_nothing():
    runs = {  # (measured step, (fastest, slowest) compute ratio, source runs beside)
        "microbatches x2": [(3050.0, (1.00, 1.02), 1800.0), (4100.0, (1.25, 1.27), 1810.0), (3010.0, (0.99, 1.01), 1790.0)],
        "serial": [(2600.0, None, None), (2580.0, None, None), (2620.0, None, None)],
    }
    mb, ser = repeated_rows(TARGETS, PLANS, runs, 1700.0)
    assert (mb.name, mb.overrides) == ("microbatches x2", ["parallel.microbatches=8"])
    assert mb.measured_us == 3050.0 and mb.runs_us == [3050.0, 4100.0, 3010.0]  # the run of x1.25 is left out
    assert mb.ratio == pytest.approx(3050.0 / 3000.0) and mb.expected_ratio == pytest.approx(3050.0 / 3100.0)
    assert mb.compute == (1.00, 1.02)
    assert mb.source_around_us == 1800.0 and mb.source_predicted_us == 1700.0
    assert mb.bracketed_ratio == pytest.approx((3050.0 / 1800.0) / (3000.0 / 1700.0))
    # no compute ratios, no source runs beside: None, not a figure made up
    assert ser.measured_us == 2600.0 and ser.compute is None and ser.source_around_us is None
    assert ser.bracketed_ratio is None and ser.expected_ratio is None


def test_one_round_is_the_run_itself():
    runs = {"microbatches x2": [(3050.0, (1.0, 1.1), 1800.0)], "serial": [(2600.0, (0.9, 1.0), 1790.0)]}
    mb, ser = repeated_rows(TARGETS, PLANS, runs, 1700.0)
    assert (mb.measured_us, mb.compute, mb.source_around_us) == (3050.0, (1.0, 1.1), 1800.0)
    assert (ser.measured_us, ser.compute, ser.source_around_us) == (2600.0, (0.9, 1.0), 1790.0)


def test_no_rounds_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="repeats: must be at least 1; got 0"):
        transfer_check(CONFIGS / "tiny-cpu.yaml", [], TARGETS, 4, tmp_path, repeats=0)
    assert list(tmp_path.iterdir()) == []

"""Does a calibration transfer? Fit a profile from one run, predict runs of other configs.

:func:`transfer_check` runs a source config on the shaped-link testbed (``runtime/testbed.py``),
calibrates from its traces (``k3sched calibrate``, [Note: calibration] in traces/calibrate.py),
then, for each target (a list of ``--set`` overrides on top of the source), plans the target with
the fitted profile and runs it: the prediction error is measured on runs the profile was not
fitted to. The residual on the source run is reported separately. Used by
``tests/unit/traces/test_calibrate.py`` and ``benchmarks/bench_overlap.py``.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path


SOURCE_AGAIN = "source again"
"""Name of :func:`transfer_check`'s last row with ``bracket``: the source config's last run."""


@dataclass
class TransferRow:
    name: str
    overrides: list[str]
    predicted_us: float
    measured_us: float
    expected_us: float | None = None
    """The plan's expected step with the fitted task-time spread ([Note: task-time spread] in
    k3sched/variability.py); None without one."""
    compute: tuple[float, float] | None = None
    """The run's compute against the plan's, (fastest, slowest) rank: :func:`compute_ratios`."""
    source_around_us: float | None = None
    """With ``bracket``: the mean measured step of the source runs just before and just after this
    one ([Note: bracketed transfer])."""
    source_predicted_us: float | None = None
    """With ``bracket``: the source config's step as the fitted profile plans it."""
    runs_us: list[float] = field(default_factory=list)
    """Each run's measured step, in run order (``measured_us`` is their median: [Note: interleaved
    repeats])."""

    @property
    def ratio(self) -> float:
        """measured / predicted."""
        return self.measured_us / self.predicted_us

    @property
    def expected_ratio(self) -> float | None:
        """measured / expected (None without a spread)."""
        return self.measured_us / self.expected_us if self.expected_us else None

    @property
    def bracketed_ratio(self) -> float | None:
        """(measured / the source runs beside it) / (predicted / the source's predicted): how well
        the fitted profile predicts this config *against the source*, with the machine's speed of
        the moment cancelled to first order ([Note: bracketed transfer]); None without ``bracket``."""
        if not (self.source_around_us and self.source_predicted_us):
            return None
        return (self.measured_us / self.source_around_us) / (self.predicted_us / self.source_predicted_us)


def compute_ratios(summary: dict, warmup_steps: int = 1) -> tuple[float, float] | None:
    """Each rank's compute-lane busy time (median over the steps after ``warmup_steps``) over its
    stage's planned one, (fastest, slowest) rank; from ``summary.json``'s ``lane_busy_s``. Tells a
    step that missed its prediction because its tasks ran slower than costed (a ratio above 1)
    from one that waited longer than planned (ratios near 1); None without the fields."""
    import statistics

    busy = (summary.get("lane_busy_s") or {}).get("compute")
    planned = (summary.get("lane_busy_planned_s") or {}).get("compute")
    stage_of = summary.get("stage_of_rank") or [0] * len(busy or ())
    if not busy or not planned:
        return None
    ratios = [statistics.median(steps[warmup_steps:] or steps) / planned[stage_of[r]]
              for r, steps in enumerate(busy) if steps and planned[stage_of[r]] > 0]
    return (min(ratios), max(ratios)) if ratios else None


def _run(config: Path, overrides: list[str], steps: int, out: Path, warmup_steps: int = 1) -> dict:
    from runtime.launch import run_command

    rc = run_command(config, overrides, steps, None, out, timeout_s=600, quiet=True, emulate_links=True,
                     warmup_steps=warmup_steps, trace_steps=True)
    if rc != 0:
        raise RuntimeError(f"run {overrides} failed with exit {rc}")
    return json.loads((out / "summary.json").read_text())


def repeated_rows(targets: dict[str, list[str]], plans: dict[str, tuple[float, float | None]],
                  runs: dict[str, list[tuple[float, tuple[float, float] | None, float | None]]],
                  source_predicted_us: float | None) -> list[TransferRow]:
    """One row per target from its runs ([Note: interleaved repeats]): ``plans`` name -> (predicted,
    expected or None) step; ``runs`` name -> per run (measured step, compute ratios or None, mean of
    the source runs beside it or None). Measured step, compute ratios and source runs beside are
    the medians over the runs."""
    rows = []
    for name, extra in targets.items():
        rs = runs[name]
        comp = [c for _, c, _ in rs if c]
        row = TransferRow(name, extra, plans[name][0], statistics.median([m for m, _, _ in rs]), plans[name][1],
                          (statistics.median([c[0] for c in comp]), statistics.median([c[1] for c in comp]))
                          if comp else None)
        arounds = [a for _, _, a in rs if a is not None]
        if arounds and source_predicted_us:
            row.source_around_us, row.source_predicted_us = statistics.median(arounds), source_predicted_us
        row.runs_us = [m for m, _, _ in rs]
        rows.append(row)
    return rows


def transfer_check(config: Path, source: list[str], targets: dict[str, list[str]], steps: int, out: Path,
                   warmup_steps: int = 1, bracket: bool = False,
                   repeats: int = 1) -> tuple[float, list[TransferRow], float | None]:
    """Calibrate from ``source`` (overrides of ``config``), predict and run each target.
    A target's overrides come after the source's; ``schedule.strategy=serial`` runs the serial
    plan. ``warmup_steps``: the first steps of each run left out of its measured step. ``bracket``:
    run the source again after every target and give each row the mean of the source runs beside it
    ([Note: bracketed transfer]); a last row, ``SOURCE_AGAIN``, is the last of them, predicted as the
    source: its ratio over 1 + the residual is the last measurement over the first, how far the
    machine moved while the targets ran. ``repeats``: the targets run that many rounds, each round
    every target once in order ([Note: interleaved repeats]). Returns (the fit's residual on the
    source run, one row per target, the residual against the expected step with the fitted spread
    or None).

    [Note: interleaved repeats] A run of a minute on a shared machine is sometimes slowed as a whole
    while the runs just before and after it are not, so one run per target can put a slowdown of
    the machine into a target's figure. With ``repeats`` R > 1 each target's runs are spread over
    the whole check, one per round, and its measured step is their median (its compute ratios the
    medians of its runs', its source runs beside the median of the rounds'): a slowdown that hits
    one run of three moves nothing.
    The profile is still fitted from the source's one first run; only the measurement of the
    targets is repeated.

    [Note: bracketed transfer] A shared machine changes speed within minutes (the same run can
    take markedly longer or shorter than a few minutes before), so a target's measured / predicted
    carries how far the machine moved after the source was measured. Runs of the source just before
    and just after a target measure the machine of that moment: the target's step over their mean,
    against its predicted step over the source's, is the profile's prediction of the target
    *relative to the source* with a linear drift across the three runs cancelled. It is a second
    figure beside the absolute one (measured / predicted), never a replacement: what it does not
    show is whether the profile predicts absolute time on a machine of the source's speed."""
    from traces.calibrate import calibrate_files
    from k3sched.config import load_config
    from k3sched.planner import plan

    if repeats < 1:
        raise ValueError(f"repeats: must be at least 1; got {repeats}")
    src = out / "source"
    before = float(_run(config, source, steps, src, warmup_steps)["measured_step_time_us"])
    profile = out / "profile.yaml"
    # the measured steps, not the last alone ([Note: traces of the measured steps] in runtime/steplog.py)
    fit = calibrate_files(sorted(str(p) for p in src.glob("trace_steps_rank*.json")), src / "plan.json", profile,
                          summary=src / "summary.json")
    ovs = {name: source + extra + [f"schedule.profile={profile}"] for name, extra in targets.items()}
    plans = {}
    for name, ov in ovs.items():
        m = plan(load_config(config, ov)).metrics
        plans[name] = (float(m.step_time_us), m.expected_step_us)
    runs: dict[str, list[tuple[float, tuple[float, float] | None, float | None]]] = {n: [] for n in targets}
    last = None
    k = 0
    for rnd in range(repeats):
        for name, ov in ovs.items():
            k += 1
            d = name.replace(" ", "_") + (f"_{rnd + 1}" if repeats > 1 else "")
            summary = _run(config, ov, steps, out / d, warmup_steps)
            around = None
            if bracket and fit.predicted_us:
                last = _run(config, source, steps, out / f"source_after_{k}", warmup_steps)
                after = float(last["measured_step_time_us"])
                around, before = (before + after) / 2, after
            runs[name].append((float(summary["measured_step_time_us"]), compute_ratios(summary, warmup_steps), around))
    rows = repeated_rows(targets, plans, runs, fit.predicted_us)
    if last is not None:
        rows.append(TransferRow(SOURCE_AGAIN, [], fit.predicted_us, float(last["measured_step_time_us"]),
                                fit.expected_us, compute_ratios(last, warmup_steps)))
    return fit.residual or 0.0, rows, fit.expected_residual

"""Typed schemas of the JSON files the trace tools read besides the plan (docs/formats.md): a
run's summary (``k3sched.run/1``) and the validation report (``k3sched.validation/1``). The plan's
(``k3sched.plan/1``) and the one-line messages of every check are the core's, ``k3sched.planfile``.

[Note: front doors]
Every file a user hands to ``k3sched validate`` / ``k3sched calibrate`` is checked before anything
reads it (the plan by ``k3sched.planfile.check_plan_doc``, the others here), so a malformed file
is refused with ONE line naming the file, the field path (``stages[0].lanes.compute[3].deps``),
the value found and what is allowed, and never reaches the validator or the fitter
half-understood (``deps: "xyz"`` iterated character by character, a NaN start time compared as
"never late", a bogus kind fitted into a profile). The models are pydantic v2 in strict mode: no
bool or string where a number is expected, no float where an integer is, numbers finite, ids and
names strings, kinds and lanes from ``k3sched.tasks``. Unknown keys are ignored (a newer writer
may add fields; a reader only relies on the ones its model names). What a type
cannot say (an end before its start, a dependency on a task the plan does not have, a task filed
under another lane or stage than it names) is checked after the types, with its own field path.
A check that fails raises :class:`SchemaError` (a ``TraceError``: the CLIs print it and exit 2).

Layering: ``traces`` imports only the plan format (``k3sched.tasks``, ``k3sched.planfile``),
pydantic and numpy.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import Field

from k3sched.planfile import (Finite, Id, KindName, NonNegFloat, NonNegInt, PlanFileError, PosFloat, Strict, fail_at,
                              show, validate_model)
from traces.events import TraceError

RUN_FORMAT = "k3sched.run/1"
REPORT_FORMAT = "k3sched.validation/1"
VIOLATION_TYPES: tuple[str, ...] = ("missing", "unplanned", "wrong_rank", "lane_mapping", "wrong_lane", "order",
                                    "dependency", "onload_before_offload", "collective_order")


class SchemaError(TraceError):
    """A file that does not follow its schema. ``str(err)`` is one line: file, field path, value,
    what is allowed."""


class PlanError(SchemaError, PlanFileError):
    """A plan that cannot be used (one line naming what is wrong): what the trace tools raise for
    a plan file (``k3sched.planfile.check_plan_doc(doc, where, PlanError)``)."""


ViolationType = Literal[VIOLATION_TYPES]  # type: ignore[valid-type]


# ---- summary.json (k3sched.run/1) ------------------------------------------------------

class RunSummary(Strict):
    """``runtime/train.py``'s summary; only ``format`` and ``measured_step_time_us`` are required
    (what calibration reads), every other field is typed when present."""

    format: Literal[RUN_FORMAT]  # type: ignore[valid-type]
    measured_step_time_us: PosFloat
    predicted_step_time_us: Optional[NonNegFloat] = None
    measured_over_predicted: Optional[NonNegFloat] = None
    expected_step_time_us: Optional[NonNegFloat] = None
    measured_over_expected: Optional[NonNegFloat] = None
    config: Optional[str] = None
    overrides: Optional[list[str]] = None
    strategy: Optional[str] = None
    pipeline: Optional[str] = None
    device: Optional[str] = None
    world: Optional[Annotated[int, Field(ge=1)]] = None
    pp: Optional[Annotated[int, Field(ge=1)]] = None
    dp: Optional[Annotated[int, Field(ge=1)]] = None
    ep: Optional[Annotated[int, Field(ge=1)]] = None
    microbatches: Optional[Annotated[int, Field(ge=1)]] = None
    steps: Optional[Annotated[int, Field(ge=1)]] = None
    warmup_steps: Optional[NonNegInt] = None
    seed: Optional[int] = None
    lr: Optional[NonNegFloat] = None
    losses: Optional[list[Annotated[float, Field(allow_inf_nan=True)]]] = None  # a diverged loss is data
    step_time_s: Optional[list[NonNegFloat]] = None
    tokens_per_step: Optional[NonNegInt] = None
    tokens_per_s: Optional[list[NonNegFloat]] = None
    budget_bytes: Optional[NonNegInt] = None
    peak_device_bytes_planned: Optional[list[NonNegInt]] = None
    peak_device_bytes_measured: Optional[list[NonNegInt]] = None
    peak_host_bytes_measured: Optional[list[NonNegInt]] = None
    peak_peer_bytes_measured: Optional[list[NonNegInt]] = None
    stage_of_rank: Optional[list[NonNegInt]] = None
    offloaded_sets: Optional[dict[str, NonNegInt]] = None
    testbed: Optional[dict[str, Any]] = None
    lane_busy_s: Optional[dict[str, list[list[NonNegFloat]]]] = None  # lane -> rank -> step
    lane_busy_planned_s: Optional[dict[str, list[NonNegFloat]]] = None  # lane -> stage
    comm_overlap_ratio: Optional[list[list[Optional[NonNegFloat]]]] = None  # rank -> step


# ---- validation report (k3sched.validation/1) ------------------------------------------

class ReportViolation(Strict):
    type: ViolationType
    task_id: Optional[Id]
    rank: Annotated[int, Field(ge=-1)]
    detail: str
    magnitude_us: Finite


class ReportMetrics(Strict):
    tolerance_us: Optional[NonNegFloat] = None
    planned_tasks: Optional[NonNegInt] = None
    matched_instances: Optional[NonNegInt] = None
    repeated_instances: Optional[NonNegInt] = None
    ranks: Optional[NonNegInt] = None
    cross_rank_deps_skipped: Optional[NonNegInt] = None
    onload_pairs_checked: Optional[NonNegInt] = None
    clock: Optional[Literal["device", "host", "mixed"]] = None
    clock_counts: Optional[dict[Literal["device", "host"], NonNegInt]] = None
    violation_counts: Optional[dict[ViolationType, NonNegInt]] = None
    step_time_us: Optional[dict[Literal["planned", "measured"], Optional[Finite]]] = None
    duration_ratio_by_kind: Optional[dict[KindName, Optional[Finite]]] = None  # from trace data: any sign


class ValidationReport(Strict):
    format: Literal[REPORT_FORMAT]  # type: ignore[valid-type]
    conforms: bool
    clock: Optional[Literal["device", "host", "mixed"]] = None  # absent in reports written before it
    violations: list[ReportViolation]
    metrics: ReportMetrics


# ---- summary and report ----------------------------------------------------------------

def check_summary(doc, where: str = "summary.json") -> RunSummary:
    """Check a run's summary.json document; raises :class:`SchemaError` (one line)."""
    if isinstance(doc, dict) and doc.get("format") != RUN_FORMAT:
        raise SchemaError(f"{where}: format: not a k3sched run summary (expected {RUN_FORMAT!r}); "
                          f"got {show(doc.get('format'))}")
    return validate_model(RunSummary, doc, where, SchemaError)


def check_report(doc, where: str = "validation report") -> ValidationReport:
    """Check a validation report document (what ``validate --json`` writes); raises
    :class:`SchemaError` (one line)."""
    rep = validate_model(ValidationReport, doc, where, SchemaError)
    if rep.conforms != (not rep.violations):
        fail_at(SchemaError, where, "conforms", f"must be {not rep.violations} with {len(rep.violations)} "
              "violation(s)", rep.conforms)
    if rep.clock is not None and rep.metrics.clock is not None and rep.clock != rep.metrics.clock:
        fail_at(SchemaError, where, "clock", f"must be metrics.clock ({rep.metrics.clock!r})", rep.clock)
    return rep


def load_summary(path) -> RunSummary:
    """Read and check a run's summary.json; :class:`SchemaError` / ``TraceError`` (one line)."""
    from traces.chrome import load_json

    return check_summary(load_json(path), str(path))


def load_report(path) -> ValidationReport:
    from traces.chrome import load_json

    return check_report(load_json(path), str(path))

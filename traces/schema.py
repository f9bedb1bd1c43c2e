"""Typed schemas of the JSON files k3sched exchanges (docs/formats.md): the plan
(``k3sched.plan/1``), a run's summary (``k3sched.run/1``) and the validation report
(``k3sched.validation/1``).

[Note: front doors]
Every file a user hands to ``k3sched validate`` / ``k3sched calibrate`` is checked here before
anything reads it, so a malformed file is refused with ONE line naming the file, the field path
(``stages[0].lanes.compute[3].deps``), the value found and what is allowed, and never reaches the
validator or the fitter half-understood (``deps: "xyz"`` iterated character by character, a NaN
start time compared as "never late", a bogus kind fitted into a profile). The models are pydantic
v2 in strict mode: no bool or string where a number is expected, no float where an integer is,
numbers finite, ids and names strings, kinds and lanes from ``k3sched.tasks``. Unknown keys are
ignored (a newer writer may add fields; a reader only relies on the ones below). What a type
cannot say (an end before its start, a dependency on a task the plan does not have, a task filed
under another lane or stage than it names) is checked after the types, with its own field path.
A check that fails raises :class:`SchemaError` (a ``TraceError``: the CLIs print it and exit 2).

Layering: ``traces`` imports only the plan format (``k3sched.tasks``), pydantic and numpy.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from k3sched.tasks import LANE_OF, LANES, Kind, parse_task_id
from traces.events import TraceError

PLAN_FORMAT = "k3sched.plan/1"
RUN_FORMAT = "k3sched.run/1"
REPORT_FORMAT = "k3sched.validation/1"
KIND_VALUES: tuple[str, ...] = tuple(k.value for k in Kind)
_LANE_OF_KIND = {k.value: lane for k, lane in LANE_OF.items()}
VIOLATION_TYPES: tuple[str, ...] = ("missing", "unplanned", "wrong_rank", "lane_mapping", "wrong_lane", "order",
                                    "dependency", "onload_before_offload", "collective_order")


class SchemaError(TraceError):
    """A file that does not follow its schema. ``str(err)`` is one line: file, field path, value,
    what is allowed."""


class PlanError(SchemaError):
    """A plan that cannot be used (one line naming what is wrong)."""


# ---- field types -----------------------------------------------------------------------

KindName = Literal[KIND_VALUES]  # type: ignore[valid-type]
LaneName = Literal[LANES]  # type: ignore[valid-type]
ViolationType = Literal[VIOLATION_TYPES]  # type: ignore[valid-type]
NonNegInt = Annotated[int, Field(ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Id = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


# ---- plan.json (k3sched.plan/1) --------------------------------------------------------

class MemBytes(_Strict):
    device: NonNegInt
    host: NonNegInt
    peer: NonNegInt


class TaskMem(_Strict):
    alloc: MemBytes
    free: MemBytes


class Release(_Strict):
    stage: NonNegInt
    device: NonNegInt


class PlanTask(_Strict):
    id: Id
    kind: KindName
    lane: LaneName
    stage: NonNegInt
    start_us: NonNegFloat
    end_us: NonNegFloat
    deps: list[Id]
    chunk: Optional[NonNegInt] = None
    mb: Optional[NonNegInt] = None
    layer: Optional[NonNegInt] = None
    slice: Optional[NonNegInt] = None
    mem: Optional[TaskMem] = None
    bytes: NonNegInt = 0
    buffer: Optional[Id] = None
    peer_stage: Optional[NonNegInt] = None
    duration_us: Optional[NonNegFloat] = None
    release: Optional[Release] = None


class PlanStage(_Strict):
    stage: NonNegInt
    lanes: dict[LaneName, list[PlanTask]]
    start_deps: Optional[dict[Id, list[Id]]] = None


class PlanMetrics(_Strict):
    """The metrics a reader uses; other keys pass unchecked."""

    step_time_us: Optional[NonNegFloat] = None
    lower_bound_us: Optional[NonNegFloat] = None
    critical_path_us: Optional[NonNegFloat] = None
    max_lane_busy_us: Optional[NonNegFloat] = None
    bubble_ratio: Optional[list[dict[LaneName, Ratio]]] = None
    exposed_comm_ratio: Optional[list[NonNegFloat]] = None
    exposed_comm_us: Optional[list[dict[LaneName, NonNegFloat]]] = None
    exposed_ep_ratio: Optional[NonNegFloat] = None
    peak_device_bytes: Optional[list[NonNegInt]] = None
    peak_host_bytes: Optional[list[NonNegInt]] = None
    peak_peer_bytes: Optional[list[NonNegInt]] = None
    peak_device_bytes_before_offload: Optional[list[NonNegInt]] = None
    num_tasks: Optional[NonNegInt] = None
    budget_bytes: Optional[NonNegInt] = None
    offloaded_sets: Optional[dict[str, NonNegInt]] = None
    expected: Optional[dict[str, Any]] = None  # [Note: task-time spread] in k3sched/variability.py


class Plan(_Strict):
    format: Literal[PLAN_FORMAT]  # type: ignore[valid-type]
    lanes: Annotated[list[LaneName], Field(min_length=1)]
    stages: Annotated[list[PlanStage], Field(min_length=1)]
    config: Optional[dict[str, Any]] = None
    strategy: Optional[str] = None
    pipeline: Optional[str] = None
    shared_links: Optional[list[list[LaneName]]] = None
    backbone: Optional[dict[str, list[Optional[str]]]] = None
    metrics: Optional[PlanMetrics] = None


# ---- summary.json (k3sched.run/1) ------------------------------------------------------

class RunSummary(_Strict):
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

class ReportViolation(_Strict):
    type: ViolationType
    task_id: Optional[Id]
    rank: Annotated[int, Field(ge=-1)]
    detail: str
    magnitude_us: Finite


class ReportMetrics(_Strict):
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


class ValidationReport(_Strict):
    format: Literal[REPORT_FORMAT]  # type: ignore[valid-type]
    conforms: bool
    clock: Optional[Literal["device", "host", "mixed"]] = None  # absent in reports written before it
    violations: list[ReportViolation]
    metrics: ReportMetrics


# ---- messages --------------------------------------------------------------------------

def _path(loc) -> str:
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or "(top level)"


def _show(v) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # nan / inf, as JSON spells them NaN / Infinity
    try:
        s = json.dumps(v, allow_nan=True)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


_ALLOWED = {
    "int_type": "must be an integer", "float_type": "must be a number", "finite_number": "must be a finite number",
    "string_type": "must be a string", "bool_type": "must be true or false", "list_type": "must be a list",
    "dict_type": "must be an object", "model_type": "must be an object", "model_attributes_type": "must be an object",
}


# what a list-typed field holds, for its type error
_LIST_OF = {"deps": "task ids (strings)", "lanes": "lane names", "stages": "stage objects",
            "violations": "violation objects", "losses": "numbers", "step_time_s": "numbers"}


def _first_error(err: ValidationError) -> tuple[str, str, Any, int]:
    errs = err.errors(include_url=False)
    e = errs[0]
    loc = e["loc"]
    if e["type"] == "missing":
        return _path(loc), "missing (required)", None, len(errs)
    if loc and loc[-1] == "[key]":  # a dict key: loc is (..., key, "[key]"), the input the key
        msg = e["msg"].replace("Input should be", "keys must be" + (" one of" if e["type"] == "literal_error" else ""))
        return _path(loc[:-2]), msg, e["input"], len(errs)
    if e["type"] == "list_type" and loc and loc[-1] in _LIST_OF:
        return _path(loc), f"must be a list of {_LIST_OF[loc[-1]]}", e["input"], len(errs)
    msg = _ALLOWED.get(e["type"])
    if msg is None:
        msg = e["msg"].replace("Input should be", "must be")
        if e["type"] == "literal_error":
            msg = msg.replace("must be ", "must be one of ", 1)
    return _path(loc), msg, e["input"], len(errs)


def _fail(cls, where: str, path: str, msg: str, value=None, more: int = 0, show_value: bool = True):
    got = f"; got {_show(value)}" if show_value else ""
    extra = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    raise cls(f"{where}: {path}: {msg}{got}{extra}")


def _validate(model, doc, where: str, cls):
    if not isinstance(doc, dict):
        raise cls(f"{where}: expected a JSON object, got {type(doc).__name__}")
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        path, msg, value, n = _first_error(e)
        _fail(cls, where, path, msg, value, n - 1, show_value=msg != "missing (required)")


# ---- plan ------------------------------------------------------------------------------

def check_plan(doc, where: str = "plan") -> Plan:
    """Check a plan.json document (types, then cross-field rules; [Note: front doors]); return it
    as a typed :class:`Plan`. Raises :class:`PlanError` (one line)."""
    if not isinstance(doc, dict):
        raise PlanError(f"{where}: not a plan (expected a JSON object, got {type(doc).__name__})")
    fmt = doc.get("format")
    if fmt != PLAN_FORMAT:
        raise PlanError(f"{where}: not a k3sched plan (format {fmt!r}, expected {PLAN_FORMAT!r})")
    plan = _validate(Plan, doc, where, PlanError)
    _check_plan_rules(plan, where)
    return plan


def _check_plan_rules(plan: Plan, where: str) -> None:
    def bad(path, msg, value=None, show_value=True):
        _fail(PlanError, where, path, msg, value, show_value=show_value)

    if len(set(plan.lanes)) != len(plan.lanes):
        bad("lanes", "must name each lane once", plan.lanes)
    stage_nums = [st.stage for st in plan.stages]
    for i, st in enumerate(plan.stages):
        if stage_nums.index(st.stage) != i:
            bad(f"stages[{i}].stage", "must differ from every other stage's", st.stage)
    planned = set(plan.lanes)
    seen: dict[str, str] = {}
    for i, st in enumerate(plan.stages):
        for lane, tasks in st.lanes.items():
            if lane not in planned:
                bad(f"stages[{i}].lanes", f"lane {lane!r} is not in the plan's lanes {plan.lanes}", lane)
            for j, t in enumerate(tasks):
                at = f"stages[{i}].lanes.{lane}[{j}]"
                if t.id in seen:
                    bad(f"{at}.id", f"task id appears twice (also at {seen[t.id]})", t.id)
                seen[t.id] = at
                try:
                    key = parse_task_id(t.id)
                except ValueError as e:
                    bad(f"{at}.id", str(e), show_value=False)
                if key.kind.value != t.kind:
                    bad(f"{at}.kind", f"must be the kind the id names ({key.kind.value!r})", t.kind)
                if t.lane != lane:
                    bad(f"{at}.lane", f"must be the lane the task is listed under ({lane!r})", t.lane)
                if _LANE_OF_KIND[t.kind] != lane:
                    bad(f"{at}.lane", f"a {t.kind} task runs on lane {_LANE_OF_KIND[t.kind]!r}", lane)
                if t.stage != st.stage or key.stage != st.stage:
                    bad(f"{at}.stage", f"must be the stage the task is listed under and its id names ({st.stage})",
                        t.stage if t.stage != st.stage else t.id)
                if key.mb is not None and t.mb != key.mb:
                    bad(f"{at}.mb", f"must be the micro-batch the id names ({key.mb})", t.mb)
                if key.layer is not None and t.layer != key.layer:
                    bad(f"{at}.layer", f"must be the layer the id names ({key.layer})", t.layer)
                if t.slice != key.slice:
                    bad(f"{at}.slice", f"must be the sequence slice the id names ({key.slice})", t.slice)
                if t.end_us < t.start_us:
                    bad(f"{at}.end_us", f"must not be before start_us ({t.start_us})", t.end_us)
                for ref, name in ((t.peer_stage, "peer_stage"), (t.release.stage if t.release else None,
                                                                  "release.stage")):
                    if ref is not None and ref not in stage_nums:
                        bad(f"{at}.{name}", f"must be a stage of the plan {sorted(stage_nums)}", ref)
    for i, st in enumerate(plan.stages):
        for lane, tasks in st.lanes.items():
            for j, t in enumerate(tasks):
                for k, d in enumerate(t.deps):
                    if d not in seen:
                        bad(f"stages[{i}].lanes.{lane}[{j}].deps[{k}]", "must be the id of a task of the plan", d)
                    if d == t.id:
                        bad(f"stages[{i}].lanes.{lane}[{j}].deps[{k}]", "a task cannot depend on itself", d)
        for tid, ds in (st.start_deps or {}).items():
            for d in [tid, *ds]:
                if d not in seen:
                    bad(f"stages[{i}].start_deps", "must name tasks of the plan", d)


# ---- summary and report ----------------------------------------------------------------

def check_summary(doc, where: str = "summary.json") -> RunSummary:
    """Check a run's summary.json document; raises :class:`SchemaError` (one line)."""
    if isinstance(doc, dict) and doc.get("format") != RUN_FORMAT:
        raise SchemaError(f"{where}: format: not a k3sched run summary (expected {RUN_FORMAT!r}); "
                          f"got {_show(doc.get('format'))}")
    return _validate(RunSummary, doc, where, SchemaError)


def check_report(doc, where: str = "validation report") -> ValidationReport:
    """Check a validation report document (what ``validate --json`` writes); raises
    :class:`SchemaError` (one line)."""
    rep = _validate(ValidationReport, doc, where, SchemaError)
    if rep.conforms != (not rep.violations):
        _fail(SchemaError, where, "conforms", f"must be {not rep.violations} with {len(rep.violations)} "
              "violation(s)", rep.conforms)
    if rep.clock is not None and rep.metrics.clock is not None and rep.clock != rep.metrics.clock:
        _fail(SchemaError, where, "clock", f"must be metrics.clock ({rep.metrics.clock!r})", rep.clock)
    return rep


def load_summary(path) -> RunSummary:
    """Read and check a run's summary.json; :class:`SchemaError` / ``TraceError`` (one line)."""
    from traces.chrome import load_json

    return check_summary(load_json(path), str(path))


def load_report(path) -> ValidationReport:
    from traces.chrome import load_json

    return check_report(load_json(path), str(path))

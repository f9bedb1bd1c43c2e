"""plan.json (format ``k3sched.plan/1``, docs/formats.md): its types, its writer and its check.

The one module that knows the file: :func:`plan_to_json` / :func:`dumps_plan_bytes` write a
planner :class:`~k3sched.planner.Plan`; :func:`check_plan_doc` checks a document read from one
and returns it as a typed :class:`PlanDoc` ([Note: front doors] in traces/schema.py).
:class:`PlanMetrics` is the plan's summary figures, the same type in memory (``Plan.metrics``)
and in the file; :class:`PlanTask` is one task as the runtime executes it.

Layering: this module imports only ``k3sched.tasks``, pydantic and (to write) orjson, so ``traces``
and ``runtime`` read plans through it without the planner.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .tasks import LANE_OF, LANES, Kind, Task, id_bucket, parse_task_id

if TYPE_CHECKING:  # pragma: no cover
    from .planner import Plan

PLAN_FORMAT = "k3sched.plan/1"
KIND_VALUES: tuple[str, ...] = tuple(k.value for k in Kind)
_LANE_OF_KIND = {k.value: lane for k, lane in LANE_OF.items()}


class PlanFileError(ValueError):
    """A plan file that cannot be used; ``str(err)`` is one line: file, field path, value, what is
    allowed."""


# ---- field types -----------------------------------------------------------------------

KindName = Literal[KIND_VALUES]  # type: ignore[valid-type]
LaneName = Literal[LANES]  # type: ignore[valid-type]
NonNegInt = Annotated[int, Field(ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Id = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
    """A file's record: strict types, finite numbers, unknown keys ignored ([Note: front doors])."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


# ---- metrics ---------------------------------------------------------------------------

class PlanMetrics(Strict):
    """A plan's summary figures (``metrics`` in plan.json). The planner fills every field but
    ``memory_lean`` and ``expected``, which it sets only when they apply (and the file then lacks
    them); a plan file may carry any of them (hand-written and synthetic plans carry few), so each
    is optional. Frozen: the planner builds it once (:func:`k3sched.metrics.compute_metrics`, then
    the planner's memory figures)."""

    model_config = ConfigDict(frozen=True)

    step_time_us: Optional[NonNegFloat] = None
    lower_bound_us: Optional[NonNegFloat] = None
    memory_lower_bound_us: Optional[NonNegFloat] = None
    critical_path_us: Optional[NonNegFloat] = None
    max_lane_busy_us: Optional[NonNegFloat] = None
    bubble_ratio: Optional[list[dict[LaneName, Ratio]]] = None  # per stage
    exposed_comm_ratio: Optional[list[NonNegFloat]] = None
    exposed_comm_us: Optional[list[dict[LaneName, NonNegFloat]]] = None
    exposed_ep_ratio: Optional[NonNegFloat] = None
    peak_device_bytes: Optional[list[NonNegInt]] = None
    peak_host_bytes: Optional[list[NonNegInt]] = None
    peak_peer_bytes: Optional[list[NonNegInt]] = None
    num_tasks: Optional[NonNegInt] = None
    offloaded_sets: Optional[dict[str, NonNegInt]] = None  # local, remote, total
    budget_bytes: Optional[NonNegInt] = None
    # per-stage device peak before the planner offloaded anything (offload auto/remote; else null)
    peak_device_bytes_before_offload: Optional[list[NonNegInt]] = None
    memory_lean: Optional[dict[str, NonNegInt]] = None  # the leaner (lookahead, wgrad_lag) the plan fits with
    expected: Optional[dict[str, Any]] = None  # [Note: task-time spread] in k3sched/variability.py

    @property
    def expected_step_us(self) -> float | None:
        """The expected step with the task-time spread (the mean step of the plan's replays), when
        the plan has one."""
        return self.expected["step_time_us"] if self.expected else None

    @property
    def ranking_step_us(self) -> float | None:
        """What the plan is ranked by (:func:`ranking_step`)."""
        return ranking_step(self.step_time_us, self.expected_step_us)

    def to_json(self) -> dict:
        """The ``metrics`` object of plan.json: the fields in order, ``memory_lean`` and
        ``expected`` only when set."""
        return {k: _jsonable(v) for k, v in self.__dict__.items()
                if v is not None or k not in ("memory_lean", "expected")}


def ranking_step(planned_us: float | None, expected_us: float | None) -> float | None:
    """What a plan is ranked and compared by ([Note: ranking with a task-time spread] in
    k3sched/compare.py): its expected step when it has one, else its planned step."""
    return expected_us if expected_us is not None else planned_us


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item"):
        return x.item()
    return x


# ---- plan.json as read -----------------------------------------------------------------

class MemBytes(Strict):
    device: NonNegInt
    host: NonNegInt
    peer: NonNegInt


class TaskMem(Strict):
    alloc: MemBytes
    free: MemBytes


class Release(Strict):
    stage: NonNegInt
    device: NonNegInt


class TaskDoc(Strict):
    """One task as plan.json lists it (checked; the kind as its name)."""

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


class StageDoc(Strict):
    stage: NonNegInt
    lanes: dict[LaneName, list[TaskDoc]]
    start_deps: Optional[dict[Id, list[Id]]] = None


class PlanDoc(Strict):
    """A checked plan.json (:func:`check_plan_doc`)."""

    format: Literal[PLAN_FORMAT]  # type: ignore[valid-type]
    lanes: Annotated[list[LaneName], Field(min_length=1)]
    stages: Annotated[list[StageDoc], Field(min_length=1)]
    config: Optional[dict[str, Any]] = None
    strategy: Optional[str] = None
    pipeline: Optional[str] = None
    shared_links: Optional[list[list[LaneName]]] = None
    backbone: Optional[dict[str, list[Optional[str]]]] = None
    metrics: Optional[PlanMetrics] = None


@dataclass(frozen=True)
class PlanTask:
    """One task of a rank's stage as the runtime executes it: plan.json's fields it needs, the
    kind as a :class:`~k3sched.tasks.Kind`, and the start dependencies and collective bucket
    it has in the plan."""

    id: str
    kind: Kind
    lane: str
    stage: int
    chunk: int
    mb: int | None
    layer: int | None
    deps: tuple[str, ...] = ()
    start_deps: tuple[str, ...] = ()
    bucket: int | None = None
    bytes: int = 0
    buffer: str | None = None
    peer_stage: int | None = None
    start_us: float = 0.0
    end_us: float = 0.0
    slice: int | None = None
    """The micro-batch's sequence slice (None: the whole sequence; [Note: task id grammar])."""

    @classmethod
    def from_json(cls, t: Mapping, start_deps: tuple[str, ...] = ()) -> PlanTask:
        return cls(id=t["id"], kind=Kind(t["kind"]), lane=t["lane"], stage=int(t["stage"]), chunk=int(t["chunk"]),
                   mb=t.get("mb"), layer=t.get("layer"), deps=tuple(t.get("deps") or ()), start_deps=start_deps,
                   bucket=id_bucket(t["id"]), bytes=int(t.get("bytes") or 0), buffer=t.get("buffer"),
                   peer_stage=t.get("peer_stage"), start_us=float(t.get("start_us") or 0.0),
                   end_us=float(t.get("end_us") or 0.0), slice=t.get("slice"))


# ---- messages (of every file check: [Note: front doors] in traces/schema.py) ---------------

def _path(loc) -> str:
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or "(top level)"


def show(v) -> str:
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


def fail_at(cls, where: str, path: str, msg: str, value=None, more: int = 0, show_value: bool = True):
    got = f"; got {show(value)}" if show_value else ""
    extra = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    raise cls(f"{where}: {path}: {msg}{got}{extra}")


def validate_model(model, doc, where: str, cls):
    if not isinstance(doc, dict):
        raise cls(f"{where}: expected a JSON object, got {type(doc).__name__}")
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        path, msg, value, n = _first_error(e)
        fail_at(cls, where, path, msg, value, n - 1, show_value=msg != "missing (required)")


# ---- plan.json checked -----------------------------------------------------------------

def check_plan_doc(doc, where: str = "plan", error: type[Exception] = PlanFileError) -> PlanDoc:
    """Check a plan.json document (types, then cross-field rules; [Note: front doors] in
    traces/schema.py); return it as a typed :class:`PlanDoc`. Raises ``error`` (one line; a
    :class:`PlanFileError`, or the reader's own subclass of it: ``traces.schema.PlanError``)."""
    if not isinstance(doc, dict):
        raise error(f"{where}: not a plan (expected a JSON object, got {type(doc).__name__})")
    fmt = doc.get("format")
    if fmt != PLAN_FORMAT:
        raise error(f"{where}: not a k3sched plan (format {fmt!r}, expected {PLAN_FORMAT!r})")
    plan = validate_model(PlanDoc, doc, where, error)
    _check_plan_rules(plan, where, error)
    return plan


def _check_plan_rules(plan: PlanDoc, where: str, error: type[Exception]) -> None:
    def bad(path, msg, value=None, show_value=True):
        fail_at(error, where, path, msg, value, show_value=show_value)

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


# ---- plan.json as written --------------------------------------------------------------

def task_json(t: Task, native: bool = False) -> dict:
    """One task of plan.json. ``native``: the values orjson writes as the same JSON without a
    copy (the :class:`~k3sched.tasks.Kind` enum, the :class:`~k3sched.tasks.Mem` dataclasses, the
    deps list itself; [Note: plan.json as written]); else plain JSON types."""
    a, f = t.alloc, t.free
    rel = t.release
    out = {
        "id": t.id, "kind": t.kind if native else t.kind.value, "lane": t.lane, "stage": t.stage,
        "chunk": t.chunk, "mb": t.mb, "layer": t.layer, "start_us": round(t.start_us, 3),
        "end_us": round(t.end_us, 3), "deps": t.deps if native else list(t.deps),
        "mem": {"alloc": a, "free": f} if native else
               {"alloc": {"device": a.device, "host": a.host, "peer": a.peer},
                "free": {"device": f.device, "host": f.host, "peer": f.peer}},
        "bytes": t.bytes, "buffer": t.buffer,
        "peer_stage": t.peer_stage, "duration_us": round(t.duration_us, 3),
        "release": None if rel is None else {"stage": rel[0], "device": rel[1]},
    }
    if t.slice is not None:  # only sliced plans carry the field ([Note: task id grammar])
        out["slice"] = t.slice
    return out


def plan_to_json(plan: "Plan", native: bool = False) -> dict:
    """The plan.json document of a planner :class:`~k3sched.planner.Plan`; ``native``: its tasks
    as :func:`task_json` ``native`` makes them, for :func:`dumps_plan_bytes` only."""
    from .cost import CostModel  # the planner's, as the plan is

    tasks = plan.tasks
    stages = []
    start_deps = sorted(plan.graph.start_deps.items())
    for s in range(plan.cfg.parallel.pp):
        lanes = {lane: [task_json(tasks[tid], native) for tid in plan.lane_orders[(s, lane)]] for lane in LANES}
        stages.append({"stage": s, "lanes": lanes,
                       "start_deps": {tid: d for tid, d in start_deps if tasks[tid].stage == s}})
    return {
        "format": PLAN_FORMAT,
        "config": plan.cfg.to_dict(),
        "strategy": plan.strategy,
        "pipeline": plan.pipeline,
        "lanes": list(LANES),
        "shared_links": [list(g) for g in CostModel(plan.cfg).shared_links()],
        "backbone": {str(r): [None if x is None else str(x) for x in slots] for r, slots in plan.backbone.items()},
        "stages": stages,
        "metrics": plan.metrics.to_json(),
    }


def dumps_json(doc: dict, indent: bool = False) -> bytes:
    """``doc`` as UTF-8 JSON bytes (orjson: numpy arrays and scalars allowed); ``indent``: two spaces
    per level. The same document gives the same bytes, run to run."""
    import orjson

    opt = orjson.OPT_SERIALIZE_NUMPY | (orjson.OPT_INDENT_2 if indent else 0)
    return orjson.dumps(doc, option=opt)


@contextlib.contextmanager
def gc_paused():
    """[Note: no GC while building outputs] The cyclic collector off while a document of
    hundreds of thousands of dicts is built: each collection of the older generations walks the
    whole heap (the plan's tasks included) and finds nothing, the documents being trees; it
    cost a third of the outputs' CPU on K2-like. Restored as it was after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def dumps_plan_bytes(plan: "Plan") -> bytes:
    """plan.json as written: two-space indented JSON (orjson) and a final newline.

    [Note: plan.json as written] orjson writes an Enum as its value, a dataclass as an object of
    its fields in order and a list in place, so the tasks are handed to it as they are (no copy
    of each Kind, Mem and deps list): the same bytes as :func:`plan_to_json`'s plain document
    (tests/unit/k3sched/test_outputs.py compares the two), in half the time."""
    with gc_paused():
        return dumps_json(plan_to_json(plan, native=True), indent=True) + b"\n"


def dumps_plan(plan: "Plan") -> str:
    return dumps_plan_bytes(plan).decode()

"""Check a recorded trace against the plan it was meant to follow.

[Note: validation rules]
Trace range events whose name is a planned task id are the task's measured instances (rank from
the trace, stage from the id; the first instance per (rank, id) counts, repeats are counted in
``metrics.repeated_instances``). A rank's stage is the majority stage of its instances ([Note: trace
join] in traces/join.py). Violation types, each with (type, task_id, rank, detail, magnitude_us), each
reported by its own function in traces/rules.py (``traces.rules.RULES``):

- ``missing``: a task of stage s absent on a rank running stage s (rank -1: no rank ran stage s).
- ``unplanned``: a range named like a task id that the plan does not contain.
- ``wrong_rank``: a planned task found on a rank whose stage is another.
- ``lane_mapping``: every planned lane maps to one tid per rank, the majority tid of its
  instances; two lanes sharing a tid, or an instance on a tid that is no lane's, is reported.
- ``wrong_lane``: an instance on the tid of another lane.
- ``order``: within a (rank, lane), measured start order differs from planned order; the tasks
  outside the longest in-order subsequence are reported.
- ``dependency``: a consumer started before its producer ended (beyond ``tolerance_us``). Only
  comparable clocks are compared: the same rank, or, with ``cross_rank_clocks=True``, the
  replica-matched rank of the producer's stage ([Note: trace join]).
  Receive ends of a transfer are the exception: a P2P receive is posted early and waits for its
  send, so its start may precede the send's end. For a receive-side consumer of its sending
  producer -- ``act.recv`` / ``grad.recv`` of ``act.send`` / ``grad.send``, ``act.rstore`` (the
  peer side) of ``act.roffload``, ``act.ronload`` of ``act.rserve`` (``SEND_OF`` in traces/join.py) --
  the rule compares the receive's END with the send's START: the data cannot arrive before the send began.
- ``onload_before_offload``: act.onload / act.ronload started before the matching act.offload /
  act.roffload ended (same ``buffer``, else same (stage, mb, layer, chunk)); such plan deps are
  checked here, not under ``dependency``.
- ``collective_order``: on the ep and collective lanes, ranks of one stage run their tasks in
  different orders (a deadlock on a real communicator).

[Note: device timeline]
A GPU event (kind kernel, nccl, memcpy, memset) belongs to the instance whose task id is its
``parent`` (the range enclosing its launch, [Note: kernel projection] in traces/nsys.py, Kineto's
correlation in traces/chrome.py) on the same rank; GPU events starting at or after the host start
of that task's next instance (a repeated step) are not the first instance's. An instance's device
span is [first GPU start, last GPU end]. A (rank, lane) whose instances all have GPU events is
checked on the device clock: ``order`` and ``collective_order`` on device starts, the overlap and
busy metrics on device spans; otherwise the whole (rank, lane) falls back to its host ranges. A
``dependency`` / ``onload_before_offload`` pair is compared on device times when both ends are,
else on host times (one clock per comparison). Each (rank, lane) with GPU events maps to one
stream, the stream most of its instances ran on (the majority stream of each instance's events);
two lanes on one stream is ``lane_mapping``, an instance with GPU events on another lane's stream
is ``wrong_lane`` (magnitude: those events' time). NCCL kernels time their task but are not
stream-checked: ProcessGroupNCCL runs them on the communicator's internal stream, not on the
launching lane's (a lane whose tasks only launch NCCL kernels has no stream in the mapping).
Streams that are no lane's are only counted (``metrics.device.unmapped_stream_events``). The report's
``clock`` is ``device`` (every instance on the device clock), ``host`` (none) or ``mixed``, with
``metrics.clock_counts``; ``validate(..., clock="host")`` ignores GPU events.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from k3sched.intervals import overlap_length, union_length
from k3sched.tasks import COMM_LANES, SYNC_KINDS
from traces import rules
from traces.events import EventTable
from traces.rules import PlanIndex, Violation
from k3sched.planfile import PLAN_FORMAT, PlanDoc, check_plan_doc
from traces.schema import PlanError, check_report

DEFAULT_TOLERANCE_US = 5.0
__all__ = ["PLAN_FORMAT", "PlanError", "Report", "Violation", "load_plan", "validate"]
_TYPE_ORDER = ("missing", "wrong_rank", "lane_mapping", "wrong_lane", "dependency", "onload_before_offload",
               "collective_order", "order", "unplanned")


@dataclass
class Report:
    conforms: bool
    violations: list[Violation] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    clock: str = "host"
    """The clock the checks ran on: ``device`` (every matched instance on its GPU events),
    ``host`` (none: no GPU events joined, or ``clock="host"``) or ``mixed``."""

    def by_type(self, type_: str) -> list[Violation]:
        return [v for v in self.violations if v.type == type_]

    def to_json(self) -> dict:
        """The report document (``k3sched.validation/1``), checked against its schema
        (``traces.schema.ValidationReport``): a report that does not follow it is a bug here."""
        doc = {"format": "k3sched.validation/1", "conforms": self.conforms, "clock": self.clock,
               "violations": [_jsonable(asdict(v)) for v in self.violations], "metrics": _jsonable(self.metrics)}
        check_report(doc)
        return doc

    def render(self, max_violations: int = 40) -> str:
        return _render(self, max_violations)


# ---- plan ------------------------------------------------------------------------------

def load_plan(path, *, typed: bool = False):
    """Read a plan.json and check it against its schema (``k3sched.planfile.check_plan_doc``: types,
    then the cross-field rules, [Note: front doors]). Returns the document (a dict), or with
    ``typed=True`` the checked :class:`k3sched.planfile.PlanDoc`. Raises :class:`PlanError` (one line
    naming the file, the field path, the value and what is allowed)."""
    from traces.chrome import load_json
    from traces.events import TraceError

    try:
        doc = load_json(path)
    except TraceError as e:
        raise PlanError(str(e)) from None
    plan = check_plan_doc(doc, str(path), PlanError)
    return plan if typed else doc


# ---- validation ------------------------------------------------------------------------

def validate(plan: "dict | PlanDoc", events, tolerance_us: float = DEFAULT_TOLERANCE_US, *,
             cross_rank_clocks: bool = False,
             only_traced_stages: bool = False, clock: str = "auto") -> Report:
    """Validate ``events`` (an EventTable, or a list of them) against ``plan`` (a plan.json
    dict, checked against its schema here, or an already checked :class:`k3sched.planfile.PlanDoc`);
    see [Note: validation rules]. ``only_traced_stages``: do not report stages no rank
    ran as missing (validating a subset of the ranks). ``clock``: ``"auto"`` checks a task on
    its GPU events where it has some ([Note: device timeline]), ``"host"`` only on its host
    ranges (the GPU events are ignored). The trace is joined to the plan once
    (:func:`traces.rules.join`), then each rule of ``traces.rules.RULES`` reports its findings."""
    if clock not in ("auto", "host"):
        raise ValueError(f"clock must be 'auto' or 'host', not {clock!r}")
    if isinstance(events, (list, tuple)):
        events = EventTable.concat(list(events))
    J = rules.join(plan, events, clock=clock, tolerance_us=tolerance_us, cross_rank_clocks=cross_rank_clocks,
                   only_traced_stages=only_traced_stages)
    V = [v for rule in rules.RULES for v in rule(J)]
    metrics = _metrics(J.P, J.rank, J.task, J.lane, J.start, J.end, J.ranks, J.stages.stage_of, J.P.stages)
    pm = plan.get("metrics") if isinstance(plan, dict) else (plan.metrics.model_dump() if plan.metrics else None)
    exp = ((pm or {}).get("expected") or {}).get("comm_overlap_ratio") or []
    exp_wait = ((pm or {}).get("expected") or {}).get("sync_wait_us") or []
    for s, d in metrics["planned_by_stage"].items():  # the plan's overlap with its task-time spread, if any
        if s < len(exp):
            d["expected_comm_overlap_ratio"] = exp[s]
        if s < len(exp_wait) and exp_wait[s] is not None:
            d["expected_sync_wait_us"] = exp_wait[s]
    waits = _sync_waits(J, plan)
    for r, w in waits.items():
        metrics["measured_by_rank"][r].update(w)
    n_dev = int(J.on_dev.sum())
    metrics.update({"tolerance_us": tolerance_us, "planned_tasks": len(J.P.ids), "matched_instances": int(len(J.task)),
                    "repeated_instances": J.repeats, "ranks": len(J.ranks), "stage_of_rank": J.stages.stage_of,
                    "cross_rank_deps_skipped": J.dep_pairs.skipped, "onload_pairs_checked": len(J.onloads),
                    "clock": J.clock, "clock_counts": {"device": n_dev, "host": int(len(J.task)) - n_dev},
                    "device": _device_metrics(J),
                    "violation_counts": {t: sum(v.type == t for v in V) for t in _TYPE_ORDER
                                         if any(v.type == t for v in V)}})
    V.sort(key=lambda v: (-v.magnitude_us, _TYPE_ORDER.index(v.type), v.rank, v.task_id or ""))
    return Report(conforms=not V, violations=V, metrics=metrics, clock=J.clock)


def _metrics(P: PlanIndex, rank, task, lane, start, end, ranks, stage_of_rank, stages) -> dict:
    comm = [P.lanes.index(ln) for ln in COMM_LANES if ln in P.lanes]
    ci = P.lanes.index("compute") if "compute" in P.lanes else -1

    def lane_stats(l_arr, s_arr, e_arr):
        busy = {P.lanes[li]: union_length(s_arr[l_arr == li], e_arr[l_arr == li]) for li in range(len(P.lanes))}
        cm = np.isin(l_arr, comm)
        comm_len = union_length(s_arr[cm], e_arr[cm])
        ov = overlap_length(s_arr[cm], e_arr[cm], s_arr[l_arr == ci], e_arr[l_arr == ci])
        return busy, comm_len, ov

    planned, measured = {}, {}
    for s in stages:
        m = P.stage == s
        busy, cl, ov = lane_stats(P.lane[m], P.start[m], P.end[m])
        planned[s] = {"span_us": float(P.end[m].max() - P.start[m].min()) if m.any() else 0.0, "busy_us": busy,
                      "comm_us": cl, "comm_overlap_us": ov, "comm_overlap_ratio": ov / cl if cl else None}
    for r in ranks:
        m = rank == r
        busy, cl, ov = lane_stats(lane[m], start[m], end[m])
        measured[r] = {"stage": stage_of_rank[r], "span_us": float(end[m].max() - start[m].min()), "busy_us": busy,
                       "comm_us": cl, "comm_overlap_us": ov, "comm_overlap_ratio": ov / cl if cl else None}
    pdur = P.end[task] - P.start[task] if len(task) else np.empty(0)
    mdur = end - start
    kinds = np.array(P.kind, dtype=object)[task] if len(task) else np.empty(0, object)
    dev = {}
    for k in sorted(set(kinds.tolist())):
        m = (kinds == k) & (pdur > 0)
        if m.any():
            dev[k] = float(np.median(mdur[m] / pdur[m]))
    return {"step_time_us": {"planned": P.step_time_us,
                             "measured": max((v["span_us"] for v in measured.values()), default=None)},
            "planned_by_stage": planned, "measured_by_rank": measured, "duration_ratio_by_kind": dev}


def _sync_waits(J: rules.Joined, plan) -> dict[int, dict]:
    """[Note: waiting for the last rank] A synchronising transfer (an all-to-all, a gradient
    reduction) cannot move its bytes before every rank of its group has posted it, so on a rank that
    posts early its span begins with a wait for the slowest rank of the moment. The plan's ranks of a
    stage are identical and cannot show that wait; a run's ranks drift apart (one is preempted, the
    next all-to-all waits for it). Per rank: ``sync_wait_us``, the time its synchronising transfers
    spent before the last rank of the stage posted them, and ``sync_wait_covered_us``, how much of
    that ran beside its own compute. A covered wait is not exposed, but the compute that covered it
    was placed to cover the transfer's wire time, which then follows uncovered when the transfer's
    consumer is next: the plan's overlap is lost by up to the covered wait.

    Reported only where the numbers mean that: cross-rank clocks declared comparable, and the plan's
    ``dp`` is 1 (every rank of a stage is then one EP group and one reduction group; with ``dp`` > 1
    the stage's ranks form several groups the trace does not name). A task counts only where every
    traced rank of its stage ran it."""
    par = ((plan.get("config") if isinstance(plan, dict) else plan.config) or {}).get("parallel") or {}
    if not J.cross_rank_clocks or par.get("dp") != 1 or not len(J.task):
        return {}
    P = J.P
    kind = np.array(P.kind, dtype=object)[J.task]
    sync = np.isin(kind, [k.value for k in SYNC_KINDS])
    n_stage = np.array([len(J.stages.ranks_of.get(s, [])) for s in range(max(J.stage.max() + 1, 1))])
    last = np.full(len(P.ids), -np.inf)
    cnt = np.zeros(len(P.ids), dtype=np.int64)
    np.maximum.at(last, J.task[sync], J.start[sync])
    np.add.at(cnt, J.task[sync], 1)
    ok = sync & (cnt[J.task] == n_stage[J.stage]) & (n_stage[J.stage] > 1)
    wait_end = np.where(ok, np.minimum(last[J.task], J.end), J.start)
    ci = P.lanes.index("compute") if "compute" in P.lanes else -1
    out = {}
    for r in J.ranks:
        m = J.rank == r
        w = m & ok & (wait_end > J.start)
        if not (m & ok).any():
            continue
        comp = m & (J.lane == ci)
        out[r] = {"sync_wait_us": float(np.sum(wait_end[w] - J.start[w])),
                  "sync_wait_covered_us": overlap_length(J.start[w], wait_end[w], J.start[comp], J.end[comp])}
    return out


def _device_metrics(J: rules.Joined) -> dict:
    """The device timeline's counts and each rank's lane -> stream mapping ({} with clock="host")."""
    D = J.D
    if D is None:
        return {}
    ev_owner, wrong = J.stream_events
    by_rank: dict = {}
    for (r, li), s in sorted(J.streams.unit.items()):
        by_rank.setdefault(r, {})[J.P.lanes[li]] = s
    return {"gpu_events": D.n_gpu, "joined_events": int(len(D.ev_inst)), "unjoined_events": D.n_unjoined,
            "instances_with_gpu_events": int(D.has.sum()), "lane_stream": by_rank,
            "wrong_stream_events": int(wrong.sum()), "unmapped_stream_events": int(((ev_owner < 0) & ~D.ev_nccl).sum()),
            "nccl_events_not_stream_checked": int(D.ev_nccl.sum())}


# ---- output ----------------------------------------------------------------------------

def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    return x


def _fmt(x, unit=""):
    return "-" if x is None else f"{x:,.1f}{unit}"


def _render(rep: Report, max_violations: int) -> str:
    m = rep.metrics
    counts = m.get("violation_counts", {})
    head = "CONFORMS" if rep.conforms else "DOES NOT CONFORM"
    lines = [f"k3sched trace validation: {head}"
             + ("" if rep.conforms else " (" + ", ".join(f"{n} {t}" for t, n in counts.items()) + ")"),
             f"plan: {m.get('planned_tasks')} tasks; trace: {m.get('ranks')} ranks, {m.get('matched_instances')} "
             f"task instances matched (tolerance {m.get('tolerance_us')} us)"]
    cc = m.get("clock_counts") or {}
    if m.get("clock"):
        lines.append(f"clock: {m['clock']} ({cc.get('device', 0)} task instances checked on their GPU events, "
                     f"{cc.get('host', 0)} on host ranges)")
    if m.get("cross_rank_deps_skipped"):
        lines.append(f"note: {m['cross_rank_deps_skipped']} cross-rank dependencies not compared (clocks of "
                     f"different ranks not declared comparable)")
    if rep.violations:
        lines.append("")
        lines.append("violations, worst first (magnitude in us):")
        w_t = max(len(v.type) for v in rep.violations)
        w_id = max(len(v.task_id or "-") for v in rep.violations[:max_violations])
        for v in rep.violations[:max_violations]:
            lines.append(f"  {v.type:<{w_t}}  rank {v.rank:>2}  {v.task_id or '-':<{w_id}}  "
                         f"{v.magnitude_us:>9.1f}  {v.detail}")
        if len(rep.violations) > max_violations:
            lines.append(f"  ... and {len(rep.violations) - max_violations} more (see --json)")
    lines.append("")
    st = m.get("step_time_us", {})
    lines.append(f"step time: planned {_fmt(st.get('planned'), ' us')}, measured {_fmt(st.get('measured'), ' us')}")
    pl = m.get("planned_by_stage", {})
    for r, mr in sorted(m.get("measured_by_rank", {}).items()):
        p = pl.get(mr["stage"], {})
        lines.append(f"rank {r} (stage {mr['stage']}): span {_fmt(mr['span_us'])} us (plan {_fmt(p.get('span_us'))}); "
                     f"comm/compute overlap {_ratio(mr['comm_overlap_ratio'])} (plan {_ratio(p.get('comm_overlap_ratio'))}"
                     + (f", expected {_ratio(p['expected_comm_overlap_ratio'])} with its task-time spread"
                        if p.get("expected_comm_overlap_ratio") is not None else "") + ")")
        busy = "  ".join(f"{ln} {_fmt(mr['busy_us'][ln])}/{_fmt(p.get('busy_us', {}).get(ln))}"
                         for ln in mr["busy_us"] if mr["busy_us"][ln] or p.get("busy_us", {}).get(ln))
        lines.append(f"    busy us measured/planned: {busy}")
        if mr.get("sync_wait_us"):
            lines.append(f"    waited {_fmt(mr['sync_wait_us'])} us for the stage's last rank to post its all-to-alls / "
                         f"reductions ({_fmt(mr['sync_wait_covered_us'])} us of it beside its own compute"
                         + (f"; expected {_fmt(p['expected_sync_wait_us'])} us with the plan's task-time spread"
                            if p.get("expected_sync_wait_us") is not None else "") + ")")
    dev = m.get("duration_ratio_by_kind", {})
    if dev:
        worst = sorted(dev.items(), key=lambda kv: -abs(math.log(kv[1])) if kv[1] > 0 else 0)
        lines.append("duration measured/planned (median) by kind: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in worst))
    return "\n".join(lines)


def _ratio(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def dumps(report: Report) -> str:
    return json.dumps(report.to_json(), indent=1)

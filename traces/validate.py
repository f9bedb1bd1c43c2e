"""Check a recorded trace against the plan it was meant to follow.

[Note: validation rules]
Trace range events whose name is a planned task id are the task's measured instances (rank from
the trace, stage from the id; the first instance per (rank, id) counts, repeats are counted in
``metrics.repeated_instances``). A rank's stage is the majority stage of its instances.
Violation types, each with (type, task_id, rank, detail, magnitude_us):

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
  producer stage's rank of the same replica index.
  Receive ends of a transfer are the exception: a P2P receive is posted early and waits for its
  send, so its start may precede the send's end. For a receive-side consumer of its sending
  producer -- ``act.recv`` / ``grad.recv`` of ``act.send`` / ``grad.send``, ``act.rstore`` (the
  peer side) of ``act.roffload``, ``act.ronload`` of ``act.rserve`` (see ``RECV_OF``) -- the rule
  compares the receive's END with the send's START: the data cannot arrive before the send began.
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

from k3sched.tasks import COMM_LANES, parse_task_id
from traces.events import EventTable
from traces.schema import PLAN_FORMAT, Plan, PlanError, check_report
from traces.schema import check_plan as _check_plan_schema

DEFAULT_TOLERANCE_US = 5.0
__all__ = ["PLAN_FORMAT", "PlanError", "Report", "Violation", "check_plan", "load_plan", "validate"]
_ONLOAD_OF = {"act.onload": "act.offload", "act.ronload": "act.roffload"}
# receive-side kind -> the sending kinds whose START bounds its END ([Note: validation rules])
RECV_OF = {"act.recv": ("act.send",), "grad.recv": ("grad.send",), "act.rstore": ("act.roffload",),
           "act.ronload": ("act.rserve",)}
_TYPE_ORDER = ("missing", "wrong_rank", "lane_mapping", "wrong_lane", "dependency", "onload_before_offload",
               "collective_order", "order", "unplanned")


@dataclass
class Violation:
    type: str
    task_id: str | None
    rank: int
    detail: str
    magnitude_us: float = 0.0


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
    """Read a plan.json and check it against its schema (``traces.schema.Plan``: types, then the
    cross-field rules, [Note: front doors]). Returns the document (a dict), or with
    ``typed=True`` the checked :class:`traces.schema.Plan`. Raises :class:`PlanError` (one line
    naming the file, the field path, the value and what is allowed)."""
    from traces.chrome import load_json
    from traces.events import TraceError

    try:
        doc = load_json(path)
    except TraceError as e:
        raise PlanError(str(e)) from None
    plan = _check_plan_schema(doc, str(path))
    return plan if typed else doc


def check_plan(plan, where: str = "plan") -> Plan:
    """Check a plan document (a dict) against its schema; returns it typed. Raises PlanError."""
    return _check_plan_schema(plan, where)


@dataclass
class _Plan:
    ids: list[str]
    index: dict[str, int]
    stage: np.ndarray
    lane: np.ndarray        # index into lanes
    pos: np.ndarray         # position within its (stage, lane)
    start: np.ndarray
    end: np.ndarray
    kind: list[str]
    lanes: list[str]
    dep_ptr: np.ndarray
    dep_idx: np.ndarray
    onload_pairs: np.ndarray  # (n, 2): onload idx, offload idx
    step_time_us: float


def _index_plan(plan) -> _Plan:
    typed = plan if isinstance(plan, Plan) else check_plan(plan)
    lanes = list(typed.lanes)
    ids, stage, lane, pos, start, end, kind, deps, tasks = [], [], [], [], [], [], [], [], []
    for st in typed.stages:
        for li, ln in enumerate(lanes):
            for p, t in enumerate(st.lanes.get(ln, [])):
                ids.append(t.id); stage.append(t.stage); lane.append(li); pos.append(p)  # noqa: E702
                start.append(t.start_us); end.append(t.end_us); kind.append(t.kind)  # noqa: E702
                deps.append(t.deps); tasks.append(t)  # noqa: E702
    index = {t: i for i, t in enumerate(ids)}  # unique, and every dep is one of them (the schema)
    dep_ptr = np.zeros(len(ids) + 1, dtype=np.int64)
    dep_list = []
    for i, ds in enumerate(deps):
        known = [index[d] for d in ds]
        dep_list.extend(known)
        dep_ptr[i + 1] = dep_ptr[i] + len(known)
    # onload -> offload pairs: by buffer, else by (stage, mb, layer, chunk)
    by_buf, by_scope = {}, {}
    for i, t in enumerate(tasks):
        if t.kind in _ONLOAD_OF.values():
            if t.buffer:
                by_buf[(t.kind, t.buffer)] = i
            by_scope[(t.kind, stage[i], t.mb, t.layer, t.chunk)] = i
    pairs = []
    for i, t in enumerate(tasks):
        off_kind = _ONLOAD_OF.get(t.kind)
        if off_kind:
            j = by_buf.get((off_kind, t.buffer)) if t.buffer else None
            if j is None:
                j = by_scope.get((off_kind, stage[i], t.mb, t.layer, t.chunk))
            if j is not None:
                pairs.append((i, j))
    step = typed.metrics.step_time_us if typed.metrics is not None else None
    if not step:
        step = (max(end) - min(start)) if ids else 0.0
    return _Plan(ids, index, np.array(stage, np.int64), np.array(lane, np.int64), np.array(pos, np.int64),
                 np.array(start, np.float64), np.array(end, np.float64), kind, lanes, dep_ptr,
                 np.array(dep_list, np.int64), np.array(pairs, np.int64).reshape(-1, 2), float(step))


# ---- intervals -------------------------------------------------------------------------

def merge_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted disjoint (start, end) arrays."""
    if not len(start):
        return np.empty(0), np.empty(0)
    o = np.argsort(start, kind="stable")
    s, e = start[o], end[o]
    run_end = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run_end[:-1]
    grp = np.cumsum(new) - 1
    ms = s[new]
    me = np.zeros(len(ms))
    np.maximum.at(me, grp, run_end)
    return ms, me


def union_length(start, end) -> float:
    s, e = merge_intervals(np.asarray(start, float), np.asarray(end, float))
    return float(np.sum(e - s))


def overlap_length(a_start, a_end, b_start, b_end) -> float:
    """Length of (union A) intersect (union B): a sweep over merged interval boundaries."""
    a_s, a_e = merge_intervals(np.asarray(a_start, float), np.asarray(a_end, float))
    b_s, b_e = merge_intervals(np.asarray(b_start, float), np.asarray(b_end, float))
    if not len(a_s) or not len(b_s):
        return 0.0
    t = np.concatenate([a_s, a_e, b_s, b_e])
    da = np.concatenate([np.ones(len(a_s)), -np.ones(len(a_e)), np.zeros(len(b_s) + len(b_e))])
    db = np.concatenate([np.zeros(len(a_s) + len(a_e)), np.ones(len(b_s)), -np.ones(len(b_e))])
    o = np.argsort(t, kind="stable")
    t, ca, cb = t[o], np.cumsum(da[o]), np.cumsum(db[o])
    both = (ca[:-1] > 0) & (cb[:-1] > 0)
    return float(np.sum(np.diff(t)[both]))


def _lis_mask(seq: np.ndarray) -> np.ndarray:
    """Mask of one longest strictly increasing subsequence of seq (patience sorting)."""
    n = len(seq)
    keep = np.zeros(n, dtype=bool)
    if not n:
        return keep
    tails: list[int] = []
    tails_idx: list[int] = []
    prev = [-1] * n
    import bisect
    for i, v in enumerate(seq.tolist()):
        k = bisect.bisect_left(tails, v)
        if k == len(tails):
            tails.append(v); tails_idx.append(i)  # noqa: E702
        else:
            tails[k] = v; tails_idx[k] = i  # noqa: E702
        prev[i] = tails_idx[k - 1] if k > 0 else -1
    i = tails_idx[-1]
    while i >= 0:
        keep[i] = True
        i = prev[i]
    return keep


# ---- validation ------------------------------------------------------------------------

def validate(plan: "dict | Plan", events, tolerance_us: float = DEFAULT_TOLERANCE_US, *, cross_rank_clocks: bool = False,
             only_traced_stages: bool = False, clock: str = "auto") -> Report:
    """Validate ``events`` (an EventTable, or a list of them) against ``plan`` (a plan.json
    dict, checked against its schema here, or an already checked :class:`traces.schema.Plan`);
    see [Note: validation rules]. ``only_traced_stages``: do not report stages no rank
    ran as missing (validating a subset of the ranks). ``clock``: ``"auto"`` checks a task on
    its GPU events where it has some ([Note: device timeline]), ``"host"`` only on its host
    ranges (the GPU events are ignored)."""
    if clock not in ("auto", "host"):
        raise ValueError(f"clock must be 'auto' or 'host', not {clock!r}")
    if isinstance(events, (list, tuple)):
        events = EventTable.concat(list(events))
    P = _index_plan(plan)
    V: list[Violation] = []
    n_tasks = len(P.ids)

    # -- join ranges to plan tasks by id
    rng = events.kind == "range"
    names, inv = np.unique(events.name[rng].astype(str), return_inverse=True) if rng.any() else (np.array([]), np.array([], int))
    uidx = np.array([P.index.get(n, -1) for n in names.tolist()], dtype=np.int64)
    unplanned_names = set()
    for n, u in zip(names.tolist(), uidx.tolist()):
        if u < 0 and n[:1] == "s" and "/" in n:
            try:
                parse_task_id(n)
                unplanned_names.add(n)
            except ValueError:
                pass
    rows = np.nonzero(rng)[0]
    task = uidx[inv] if len(rows) else np.empty(0, np.int64)
    if unplanned_names:
        um = np.isin(names[inv], list(unplanned_names))
        for r in np.nonzero(um)[0][:1000].tolist():
            row = rows[r]
            V.append(Violation("unplanned", str(events.name[row]), int(events.rank[row]),
                               f"range on tid {int(events.tid[row])} at {events.start_us[row]:.1f} us is not in the plan",
                               float(events.end_us[row] - events.start_us[row])))
    ok = task >= 0
    rows, task = rows[ok], task[ok]
    rank = events.rank[rows].astype(np.int64)
    tid = events.tid[rows]
    start = events.start_us[rows]
    end = events.end_us[rows]
    # first instance per (rank, task)
    o = np.lexsort((start, task, rank))
    rank, task, tid, start, end = rank[o], task[o], tid[o], start[o], end[o]
    first = np.ones(len(o), dtype=bool)
    first[1:] = (rank[1:] != rank[:-1]) | (task[1:] != task[:-1])
    repeats = int((~first).sum())
    next_start = np.full(len(o), np.inf)  # host start of the same (rank, task)'s next instance
    next_start[:-1] = np.where(first[1:], np.inf, start[1:])
    rank, task, tid, start, end = rank[first], task[first], tid[first], start[first], end[first]
    next_start = next_start[first]
    hstart, hend = start, end
    lane = P.lane[task] if len(task) else np.empty(0, np.int64)
    stage = P.stage[task] if len(task) else np.empty(0, np.int64)

    ranks = np.unique(rank)
    stage_of_rank = {}
    for r in ranks.tolist():
        st, cnt = np.unique(stage[rank == r], return_counts=True)
        stage_of_rank[r] = int(st[np.argmax(cnt)])
    stages = sorted({int(s) for s in P.stage.tolist()})
    ranks_of_stage = {s: [r for r in ranks.tolist() if stage_of_rank[r] == s] for s in stages}
    own = np.array([stage_of_rank[r] for r in rank.tolist()], dtype=np.int64) == stage if len(rank) else np.ones(0, bool)
    for i in np.nonzero(~own)[0].tolist():
        V.append(Violation("wrong_rank", P.ids[task[i]], int(rank[i]),
                           f"task of stage {stage[i]} recorded on rank {rank[i]}, which runs stage "
                           f"{stage_of_rank[int(rank[i])]}", float(end[i] - start[i])))

    # -- missing
    key = rank * n_tasks + task
    korder = np.argsort(key)
    skey = key[korder]

    def lookup(r_arr, t_arr):
        q = np.asarray(r_arr, np.int64) * n_tasks + np.asarray(t_arr, np.int64)
        p = np.clip(np.searchsorted(skey, q), 0, max(len(skey) - 1, 0))
        hit = (len(skey) > 0) & (skey[p] == q) if len(skey) else np.zeros(len(q), bool)
        return np.where(hit, korder[p] if len(skey) else -1, -1)

    for s in stages:
        tasks_s = np.nonzero(P.stage == s)[0]
        if not ranks_of_stage[s]:
            if not only_traced_stages:
                V.append(Violation("missing", P.ids[tasks_s[0]] if len(tasks_s) else None, -1,
                                   f"no rank ran stage {s}: all {len(tasks_s)} of its tasks are missing",
                                   float(np.sum(P.end[tasks_s] - P.start[tasks_s]))))
            continue
        for r in ranks_of_stage[s]:
            found = lookup(np.full(len(tasks_s), r), tasks_s)
            for t in tasks_s[found < 0].tolist():
                V.append(Violation("missing", P.ids[t], r, f"planned on lane {P.lanes[P.lane[t]]} at "
                                   f"{P.start[t]:.1f}-{P.end[t]:.1f} us, not found in the trace",
                                   float(P.end[t] - P.start[t])))

    # -- the device timeline ([Note: device timeline]): each instance's GPU span, and the clock
    # its (rank, lane) is checked on; start / end below are on that clock
    D = _project_device(events, P, rank, task, next_start) if clock == "auto" else None
    on_dev = np.zeros(len(task), bool)
    if D is not None and D.has.any():
        grp = rank.astype(np.int64) * len(P.lanes) + lane
        ug, ginv = np.unique(grp, return_inverse=True)
        all_dev = np.ones(len(ug), bool)
        np.logical_and.at(all_dev, ginv, D.has)
        on_dev = all_dev[ginv]
        start, end = np.where(on_dev, D.start, hstart), np.where(on_dev, D.end, hend)
    n_dev = int(on_dev.sum())
    used_clock = "device" if n_dev and n_dev == len(task) else ("mixed" if n_dev else "host")

    # -- alignment: measured time of rank r - offset[r] is on the plan's clock
    offset = {r: float(np.median(start[rank == r] - P.start[task[rank == r]])) for r in ranks.tolist()}

    # -- lane mapping and wrong lanes
    lane_tid: dict[tuple[int, int], int] = {}
    for r in ranks.tolist():
        m = rank == r
        taken: dict[int, int] = {}
        lanes_here = np.unique(lane[m])
        sizes = [(-int(np.sum(lane[m] == li)), int(li)) for li in lanes_here.tolist()]
        for _, li in sorted(sizes):
            ml = m & (lane == li)
            tids, cnt = np.unique(tid[ml], return_counts=True)
            first_pos = np.array([P.pos[task[ml & (tid == x)]].min() for x in tids.tolist()])
            cand = sorted(range(len(tids)), key=lambda k: (-cnt[k], int(tids[k]) in taken, first_pos[k]))
            best = int(tids[cand[0]])
            if best in taken:
                V.append(Violation("lane_mapping", None, r, f"lanes {P.lanes[taken[best]]} and {P.lanes[li]} both "
                                   f"run on tid {best}", 0.0))
            else:
                taken[best] = li
            lane_tid[(r, li)] = best
        for i in np.nonzero(m)[0].tolist():
            want = lane_tid[(r, int(lane[i]))]
            if tid[i] != want:
                other = taken.get(int(tid[i]))
                if other is not None:
                    V.append(Violation("wrong_lane", P.ids[task[i]], r,
                                       f"ran on tid {tid[i]} (lane {P.lanes[other]}), planned lane "
                                       f"{P.lanes[lane[i]]} (tid {want})", float(end[i] - start[i])))
                else:
                    V.append(Violation("lane_mapping", P.ids[task[i]], r,
                                       f"ran on tid {tid[i]}, which is no lane's; lane {P.lanes[lane[i]]} runs on "
                                       f"tid {want}", float(end[i] - start[i])))

    # -- lane -> stream mapping and tasks whose GPU events ran on another lane's stream
    dev_metrics = _check_streams(P, D, rank, task, lane, ranks.tolist(), V) if D is not None else {}

    # -- order within each (rank, lane)
    for (r, li) in sorted(lane_tid):
        m = np.nonzero((rank == r) & (lane == li))[0]
        m = m[np.lexsort((P.pos[task[m]], start[m]))]
        pos = P.pos[task[m]]
        # report the fewest tasks that explain the disorder: those outside a longest in-order
        # subsequence (one task moved), or those not at their planned rank (two tasks swapped)
        keep = _lis_mask(pos)
        in_place = np.argsort(np.argsort(pos, kind="stable"), kind="stable") == np.arange(len(pos))
        if (~in_place).sum() <= (~keep).sum():
            keep = in_place
        for k in np.nonzero(~keep)[0].tolist():
            i = m[k]
            later = [j for j in range(k) if pos[j] > pos[k]]
            if later:
                why = f"started after {P.ids[task[m[later[0]]]]}, which is planned after it"
            else:
                nxt = [j for j in range(k + 1, len(m)) if pos[j] < pos[k]]
                why = f"started before {P.ids[task[m[nxt[0]]]]}, which is planned before it" if nxt else "out of order"
            V.append(Violation("order", P.ids[task[i]], r,
                               f"lane {P.lanes[li]}{' on device' if on_dev[i] else ''}: ran #{k} (planned "
                               f"#{pos[k]}), {why}; measured start "
                               f"{start[i] - offset[r]:.1f} us, planned {P.start[task[i]]:.1f} us",
                               float(abs(start[i] - offset[r] - P.start[task[i]]))))

    # -- dependencies and onload-before-offload
    cons = np.repeat(np.arange(len(task)), P.dep_ptr[task + 1] - P.dep_ptr[task]) if len(task) else np.empty(0, np.int64)
    prod_task = P.dep_idx[np.concatenate([np.arange(P.dep_ptr[t], P.dep_ptr[t + 1]) for t in task.tolist()])
                          ] if len(cons) else np.empty(0, np.int64)
    pair_set = {(int(a), int(b)) for a, b in P.onload_pairs.tolist()}
    skip_pairs = np.array([(int(task[c]), int(p)) in pair_set for c, p in zip(cons.tolist(), prod_task.tolist())],
                          dtype=bool) if len(cons) else np.zeros(0, bool)
    # producer rank: same rank for same stage; else replica-matched rank when clocks comparable
    prod_rank = np.full(len(cons), -1, dtype=np.int64)
    same = P.stage[prod_task] == stage[cons] if len(cons) else np.zeros(0, bool)
    prod_rank[same] = rank[cons][same]
    skipped = 0
    if cross_rank_clocks and len(cons):
        for c in np.nonzero(~same)[0].tolist():
            r = int(rank[cons[c]])
            mine = ranks_of_stage.get(stage_of_rank[r], [])
            theirs = ranks_of_stage.get(int(P.stage[prod_task[c]]), [])
            if len(theirs) == 1:
                prod_rank[c] = theirs[0]
            elif len(theirs) == len(mine) and r in mine:
                prod_rank[c] = theirs[mine.index(r)]
    else:
        skipped = int((~same).sum())
    pi = lookup(np.maximum(prod_rank, 0), prod_task)
    valid = (prod_rank >= 0) & (pi >= 0) & ~skip_pairs
    # receive ends: END of the receive vs START of its send; everything else: START vs END
    recv_pair = np.array([P.kind[prod] in RECV_OF.get(P.kind[int(task[c])], ())
                          for c, prod in zip(cons.tolist(), prod_task.tolist())], dtype=bool) if len(cons) \
        else np.zeros(0, bool)
    # a pair is compared on the device clock when both ends are on it, else on the host clock
    pc = np.maximum(pi, 0)
    both = on_dev[cons] & on_dev[pc] if len(cons) else np.zeros(0, bool)
    cs, ce = np.where(both, start[cons], hstart[cons]), np.where(both, end[cons], hend[cons])
    ps, pe = np.where(both, start[pc], hstart[pc]), np.where(both, end[pc], hend[pc])
    late = np.zeros(len(cons), bool)
    plain = valid & ~recv_pair
    late[plain] = cs[plain] < pe[plain] - tolerance_us
    rv = valid & recv_pair
    late_recv = np.zeros(len(cons), bool)
    late_recv[rv] = ce[rv] < ps[rv] - tolerance_us
    for c in np.nonzero(late_recv)[0].tolist():
        ci, p = cons[c], pi[c]
        on = " on device" if both[c] else ""
        V.append(Violation("dependency", P.ids[task[ci]], int(rank[ci]),
                           f"receive ended{on} {ps[c] - ce[c]:.1f} us before its send {P.ids[task[p]]} (rank "
                           f"{rank[p]}) started (end {ce[c] - offset[int(rank[ci])]:.1f} us, send start "
                           f"{ps[c] - offset[int(rank[p])]:.1f} us)", float(ps[c] - ce[c])))
    for c in np.nonzero(late)[0].tolist():
        ci, p = cons[c], pi[c]
        on = " on device" if both[c] else ""
        V.append(Violation("dependency", P.ids[task[ci]], int(rank[ci]),
                           f"started{on} {pe[c] - cs[c]:.1f} us before its producer {P.ids[task[p]]} (rank "
                           f"{rank[p]}) ended (start {cs[c] - offset[int(rank[ci])]:.1f} us, producer end "
                           f"{pe[c] - offset[int(rank[p])]:.1f} us)", float(pe[c] - cs[c])))
    n_onload_checked = 0
    for on_t, off_t in P.onload_pairs.tolist():
        for r in ranks_of_stage.get(int(P.stage[on_t]), []):
            a, b = lookup([r], [on_t])[0], lookup([r], [off_t])[0]
            if a < 0 or b < 0:
                continue
            n_onload_checked += 1
            dv = bool(on_dev[a] and on_dev[b])
            sa, eb = (start[a], end[b]) if dv else (hstart[a], hend[b])
            if sa < eb - tolerance_us:
                V.append(Violation("onload_before_offload", P.ids[on_t], r,
                                   f"started{' on device' if dv else ''} {eb - sa:.1f} us before {P.ids[off_t]} "
                                   f"ended (onload start {sa - offset[r]:.1f} us, offload end {eb - offset[r]:.1f} us)",
                                   float(eb - sa)))

    # -- collective order across the ranks of a stage
    comm_li = [P.lanes.index(ln) for ln in COMM_LANES if ln in P.lanes]
    for s in stages:
        rs = ranks_of_stage[s]
        if len(rs) < 2:
            continue
        for li in comm_li:
            seqs = {}
            for r in rs:
                m = np.nonzero((rank == r) & (lane == li))[0]
                seqs[r] = task[m[np.argsort(start[m], kind="stable")]].tolist()
            ref = seqs[rs[0]]
            for r in rs[1:]:
                common = set(ref) & set(seqs[r])
                a = [t for t in ref if t in common]
                b = [t for t in seqs[r] if t in common]
                k = next((k for k in range(len(a)) if a[k] != b[k]), None)
                if k is not None:
                    V.append(Violation("collective_order", P.ids[b[k]], r,
                                       f"lane {P.lanes[li]}: rank {r} runs {P.ids[b[k]]} as its #{k} where rank "
                                       f"{rs[0]} runs {P.ids[a[k]]} (communicator deadlock)",
                                       float(len(a) - k)))

    metrics = _metrics(P, rank, task, lane, start, end, ranks.tolist(), stage_of_rank, stages)
    metrics.update({"tolerance_us": tolerance_us, "planned_tasks": n_tasks, "matched_instances": int(len(task)),
                    "repeated_instances": repeats, "ranks": len(ranks), "stage_of_rank": stage_of_rank,
                    "cross_rank_deps_skipped": skipped, "onload_pairs_checked": n_onload_checked,
                    "clock": used_clock, "clock_counts": {"device": n_dev, "host": int(len(task)) - n_dev},
                    "device": dev_metrics,
                    "violation_counts": {t: sum(v.type == t for v in V) for t in _TYPE_ORDER
                                         if any(v.type == t for v in V)}})
    V.sort(key=lambda v: (-v.magnitude_us, _TYPE_ORDER.index(v.type), v.rank, v.task_id or ""))
    return Report(conforms=not V, violations=V, metrics=metrics, clock=used_clock)


def _metrics(P: _Plan, rank, task, lane, start, end, ranks, stage_of_rank, stages) -> dict:
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


# ---- device timeline -------------------------------------------------------------------

_GPU_KINDS = ("kernel", "nccl", "memcpy", "memset")


@dataclass
class _Device:
    has: np.ndarray       # per instance: it has GPU events
    start: np.ndarray     # per instance: first GPU event's start (inf when none)
    end: np.ndarray       # per instance: last GPU event's end (-inf when none)
    stream: np.ndarray    # per instance: the stream most of its GPU events ran on (-1 when none)
    scount: np.ndarray    # per instance: its stream-checked GPU events (all but NCCL kernels)
    ev_inst: np.ndarray   # per joined GPU event: its instance
    ev_stream: np.ndarray
    ev_dur: np.ndarray
    ev_nccl: np.ndarray   # per joined GPU event: an NCCL kernel (not stream-checked)
    n_gpu: int            # GPU events in the table
    n_unjoined: int       # GPU events whose parent is no matched instance (no task range, or another rank's)


def _project_device(events: EventTable, P: _Plan, rank, task, next_start) -> _Device:
    """Join GPU events to the matched instances by (rank, parent task id); see [Note: device
    timeline]."""
    n, nt = len(task), max(len(P.ids), 1)
    gi = np.nonzero(np.isin(events.kind, _GPU_KINDS))[0]
    n_gpu = len(gi)
    get = P.index.get  # parents repeat a few strings: a dict lookup each beats sorting them
    et = np.fromiter((get(x, -1) if isinstance(x, str) else -1 for x in events.parent[gi].tolist()), np.int64,
                     len(gi))
    key = rank.astype(np.int64) * nt + task
    ko = np.argsort(key, kind="stable")
    sk = key[ko]
    q = events.rank[gi].astype(np.int64) * nt + et
    inst = np.full(len(gi), -1, np.int64)
    if len(sk) and len(q):
        pos = np.clip(np.searchsorted(sk, q), 0, len(sk) - 1)
        inst = np.where((et >= 0) & (sk[pos] == q), ko[pos], -1)
    es, ee = events.start_us[gi], events.end_us[gi]
    ok = inst >= 0
    ok[ok] = es[ok] < next_start[inst[ok]]  # a repeated instance's GPU work is not the first's
    inst, es, ee, st = inst[ok], es[ok], ee[ok], events.tid[gi][ok]
    nccl = events.kind[gi][ok] == "nccl"  # on the communicator's stream, not the lane's: not stream-checked
    dstart, dend = np.full(n, np.inf), np.full(n, -np.inf)
    np.minimum.at(dstart, inst, es)
    np.maximum.at(dend, inst, ee)
    count = np.bincount(inst, minlength=n)
    scount = np.bincount(inst[~nccl], minlength=n)
    stream = np.full(n, -1, np.int64)
    if (~nccl).any():
        o = np.lexsort((st[~nccl], inst[~nccl]))
        si, ss = inst[~nccl][o], st[~nccl][o]
        new = np.ones(len(o), bool)
        new[1:] = (si[1:] != si[:-1]) | (ss[1:] != ss[:-1])
        b = np.nonzero(new)[0]
        run_n = np.diff(np.append(b, len(o)))
        ri, rs = si[b], ss[b]
        best = np.lexsort((-run_n, ri))  # per instance: most events first (ties: lowest stream)
        firsts = np.ones(len(best), bool)
        firsts[1:] = ri[best][1:] != ri[best][:-1]
        stream[ri[best][firsts]] = rs[best][firsts]
    return _Device(count > 0, dstart, dend, stream, scount, inst, st, ee - es, nccl, n_gpu, n_gpu - len(inst))


def _check_streams(P: _Plan, D: _Device, rank, task, lane, ranks, V: list) -> dict:
    """Map each (rank, lane) to one stream (the stream most of its instances ran on, like the
    thread mapping) and report instances whose GPU events ran on another lane's stream."""
    lane_stream: dict[tuple[int, int], int] = {}
    owner: dict[int, dict[int, int]] = {}
    for r in ranks:
        m = (rank == r) & (D.scount > 0)
        taken: dict[int, int] = {}
        lanes_here = np.unique(lane[m])
        sizes = [(-int(np.sum(lane[m] == li)), int(li)) for li in lanes_here.tolist()]
        for _, li in sorted(sizes):
            ml = m & (lane == li)
            sts, cnt = np.unique(D.stream[ml], return_counts=True)
            first_pos = np.array([P.pos[task[ml & (D.stream == x)]].min() for x in sts.tolist()])
            cand = sorted(range(len(sts)), key=lambda k: (-cnt[k], int(sts[k]) in taken, first_pos[k]))
            best = int(sts[cand[0]])
            if best in taken:
                V.append(Violation("lane_mapping", None, r, f"lanes {P.lanes[taken[best]]} and {P.lanes[li]} both "
                                   f"run their GPU work on stream {best}", 0.0))
            else:
                taken[best] = li
            lane_stream[(r, li)] = best
        owner[r] = taken
    ev_r = rank[D.ev_inst].astype(np.int64)
    inst_want = np.array([lane_stream.get((int(r), int(li)), -1) for r, li in zip(rank.tolist(), lane.tolist())],
                         np.int64)
    want = inst_want[D.ev_inst] if len(ev_r) else np.empty(0, np.int64)
    # the lane owning each event's (rank, stream): via the few distinct (rank, stream) pairs
    us, sinv = np.unique(D.ev_stream, return_inverse=True)
    ur, rinv = np.unique(ev_r, return_inverse=True)
    ns = max(len(us), 1)
    pk, pinv = np.unique(np.ravel(rinv).astype(np.int64) * ns + np.ravel(sinv), return_inverse=True)
    pown = np.array([owner.get(int(ur[k // ns]), {}).get(int(us[k % ns]), -1) for k in pk.tolist()], np.int64)
    ev_owner = pown[np.ravel(pinv)] if len(ev_r) else np.empty(0, np.int64)
    wrong = (ev_owner >= 0) & (D.ev_stream != want) & ~D.ev_nccl
    for i in np.unique(D.ev_inst[wrong]).tolist():
        w = wrong & (D.ev_inst == i)
        s0 = int(D.ev_stream[w][0])
        li = int(lane[i])
        V.append(Violation("wrong_lane", P.ids[task[i]], int(rank[i]),
                           f"{int(w.sum())} of its {int(D.scount[i])} GPU events ran on stream {s0} (lane "
                           f"{P.lanes[int(ev_owner[w][0])]}), planned lane {P.lanes[li]} (stream "
                           f"{lane_stream.get((int(rank[i]), li))})", float(D.ev_dur[w].sum())))
    by_rank: dict = {}
    for (r, li), s in sorted(lane_stream.items()):
        by_rank.setdefault(r, {})[P.lanes[li]] = s
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
                     f"comm/compute overlap {_ratio(mr['comm_overlap_ratio'])} (plan {_ratio(p.get('comm_overlap_ratio'))})")
        busy = "  ".join(f"{ln} {_fmt(mr['busy_us'][ln])}/{_fmt(p.get('busy_us', {}).get(ln))}"
                         for ln in mr["busy_us"] if mr["busy_us"][ln] or p.get("busy_us", {}).get(ln))
        lines.append(f"    busy us measured/planned: {busy}")
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

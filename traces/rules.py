"""The conformance rules of [Note: validation rules] (traces/validate.py), one function each.

A trace is first joined to its plan (:func:`join`: the first instance of each (rank, planned
task), the stage of each rank, the clock each (rank, lane) is checked on, [Note: trace join] in
traces/join.py). Each rule is then a small function ``rule(J: Joined) -> list[Violation]`` that
reads the joined trace and returns its findings, in the style of HolisticTraceAnalysis' analysis
modules; ``RULES`` lists them in the order the report collects them (ties in the report's sort
keep that order). A rule needs no other rule: what two rules share (the lane -> thread mapping,
the dependency pairs) is computed once on the :class:`Joined` object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from k3sched.tasks import COMM_LANES, parse_task_id
from traces.device import DeviceSpans, device_clock, project_device
from traces.events import EventTable
from traces.intervals import lis_mask
from traces.join import RankStages, is_transfer, ranges_by_name
from k3sched.planfile import PlanDoc, check_plan_doc
from traces.schema import PlanError

# onload kind -> the offload kind it brings back (``onload_before_offload``)
ONLOAD_OF = {"act.onload": "act.offload", "act.ronload": "act.roffload"}
MAX_UNPLANNED = 1000  # unplanned ranges reported at most


@dataclass
class Violation:
    type: str
    task_id: str | None
    rank: int
    detail: str
    magnitude_us: float = 0.0


# ---- the plan, indexed -------------------------------------------------------------------

@dataclass
class PlanIndex:
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

    @property
    def stages(self) -> list[int]:
        return sorted({int(s) for s in self.stage.tolist()})


def index_plan(plan) -> PlanIndex:
    """The plan (a plan.json dict, checked here, or a checked :class:`k3sched.planfile.PlanDoc`) as
    arrays over its tasks, lane by lane in each stage."""
    typed = plan if isinstance(plan, PlanDoc) else check_plan_doc(plan, error=PlanError)
    lanes = list(typed.lanes)
    rows = [(li, p, t) for st in typed.stages for li, ln in enumerate(lanes) for p, t in enumerate(st.lanes.get(ln, []))]
    tasks = [t for _, _, t in rows]
    ids = [t.id for t in tasks]
    stage = [t.stage for t in tasks]
    index = {t: i for i, t in enumerate(ids)}  # unique, and every dep is one of them (the schema)
    dep_ptr = np.zeros(len(ids) + 1, dtype=np.int64)
    dep_list = []
    for i, t in enumerate(tasks):
        dep_list.extend(index[d] for d in t.deps)
        dep_ptr[i + 1] = dep_ptr[i] + len(t.deps)
    start = [t.start_us for t in tasks]
    end = [t.end_us for t in tasks]
    step = typed.metrics.step_time_us if typed.metrics is not None else None
    if not step:
        step = (max(end) - min(start)) if ids else 0.0
    return PlanIndex(ids, index, np.array(stage, np.int64), np.array([li for li, _, _ in rows], np.int64),
                     np.array([p for _, p, _ in rows], np.int64), np.array(start, np.float64), np.array(end, np.float64),
                     [t.kind for t in tasks], lanes, dep_ptr, np.array(dep_list, np.int64),
                     _onload_pairs(tasks, stage), float(step))


def _onload_pairs(tasks: list, stage: list[int]) -> np.ndarray:
    """(onload, offload) task index pairs: by ``buffer``, else by (stage, mb, layer, chunk)."""
    by_buf, by_scope = {}, {}
    for i, t in enumerate(tasks):
        if t.kind in ONLOAD_OF.values():
            if t.buffer:
                by_buf[(t.kind, t.buffer)] = i
            by_scope[(t.kind, stage[i], t.mb, t.layer, t.chunk)] = i
    pairs = []
    for i, t in enumerate(tasks):
        off_kind = ONLOAD_OF.get(t.kind)
        if off_kind:
            j = by_buf.get((off_kind, t.buffer)) if t.buffer else None
            if j is None:
                j = by_scope.get((off_kind, stage[i], t.mb, t.layer, t.chunk))
            if j is not None:
                pairs.append((i, j))
    return np.array(pairs, np.int64).reshape(-1, 2)


# ---- the trace, joined to the plan ---------------------------------------------------------

@dataclass
class LaneMap:
    """Each (rank, lane) mapped to one thread (or stream): the one most of its instances ran on."""

    unit: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, lane) -> tid / stream
    owner: dict[int, dict[int, int]] = field(default_factory=dict)  # rank -> {tid / stream: the lane owning it}
    shared: list[tuple[int, int, int, int]] = field(default_factory=list)  # (rank, owner, lane, unit): two lanes on one


@dataclass
class Joined:
    """A trace joined to its plan: per matched instance (the first of each (rank, planned task),
    sorted by rank, then task) its rank, task (index into ``P``), thread, lane, stage and times on
    the host (``hstart``, ``hend``) and on its checking clock (``start``, ``end``: the device span
    where its (rank, lane) is on the device clock, ``on_dev``)."""

    P: PlanIndex
    events: EventTable
    unplanned_rows: np.ndarray  # event rows of ranges named like a task id the plan lacks, in trace order
    rank: np.ndarray
    task: np.ndarray
    tid: np.ndarray
    lane: np.ndarray
    stage: np.ndarray
    hstart: np.ndarray
    hend: np.ndarray
    start: np.ndarray
    end: np.ndarray
    on_dev: np.ndarray
    D: DeviceSpans | None       # the device timeline (None with clock="host")
    stages: RankStages
    repeats: int                # instances after the first of a (rank, task)
    tolerance_us: float
    cross_rank_clocks: bool
    only_traced_stages: bool

    @property
    def ranks(self) -> list[int]:
        return list(self.stages.stage_of)

    @property
    def clock(self) -> str:
        n_dev = int(self.on_dev.sum())
        return "device" if n_dev and n_dev == len(self.task) else ("mixed" if n_dev else "host")

    @cached_property
    def offset(self) -> dict[int, float]:
        """Per rank: measured time - offset is on the plan's clock (median over its instances)."""
        r_, t_ = self.rank, self.task
        return {r: float(np.median(self.start[r_ == r] - self.P.start[t_[r_ == r]])) for r in self.ranks}

    @cached_property
    def _sorted_keys(self) -> tuple[np.ndarray, np.ndarray]:
        key = self.rank * len(self.P.ids) + self.task
        korder = np.argsort(key)
        return korder, key[korder]

    def lookup(self, r_arr, t_arr) -> np.ndarray:
        """The instance of each (rank, task) pair; -1 where the rank did not record the task."""
        korder, skey = self._sorted_keys
        q = np.asarray(r_arr, np.int64) * len(self.P.ids) + np.asarray(t_arr, np.int64)
        p = np.clip(np.searchsorted(skey, q), 0, max(len(skey) - 1, 0))
        hit = (len(skey) > 0) & (skey[p] == q) if len(skey) else np.zeros(len(q), bool)
        return np.where(hit, korder[p] if len(skey) else -1, -1)

    @cached_property
    def threads(self) -> LaneMap:
        return map_lanes(self, self.tid, np.ones(len(self.task), bool))

    @cached_property
    def streams(self) -> LaneMap:
        """Lanes on streams, from the instances with stream-checked GPU events (NCCL kernels are not)."""
        return map_lanes(self, self.D.stream, self.D.scount > 0)

    @cached_property
    def stream_events(self) -> tuple[np.ndarray, np.ndarray]:
        """Per joined GPU event: the lane owning its stream, and whether it is on a wrong one."""
        return _stream_events(self)

    @cached_property
    def dep_pairs(self) -> DepPairs:
        return dep_pairs(self)

    @cached_property
    def onloads(self) -> list[tuple[int, int, int, int, int]]:
        return onload_instances(self)

    @cached_property
    def off_thread(self) -> list[tuple[int, int, int | None]]:
        return _off_thread(self)


def join(plan, events: EventTable, *, clock: str = "auto", tolerance_us: float = 5.0,
         cross_rank_clocks: bool = False, only_traced_stages: bool = False) -> Joined:
    """Join ``events`` to ``plan`` (a plan.json dict, a checked PlanDoc or a :class:`PlanIndex`) by
    task id ([Note: trace join], [Note: device timeline] in traces/validate.py)."""
    P = plan if isinstance(plan, PlanIndex) else index_plan(plan)
    rows, names, inv = ranges_by_name(events)
    uidx = np.array([P.index.get(n, -1) for n in names.tolist()], dtype=np.int64)
    unplanned = _unplanned_rows(rows, names, inv, uidx)
    task = uidx[inv] if len(rows) else np.empty(0, np.int64)
    ok = task >= 0
    rows, task = rows[ok], task[ok]
    rank, tid = events.rank[rows].astype(np.int64), events.tid[rows]
    start, end = events.start_us[rows], events.end_us[rows]
    # first instance per (rank, task); the host start of its next instance bounds its GPU work
    o = np.lexsort((start, task, rank))
    rank, task, tid, start, end = rank[o], task[o], tid[o], start[o], end[o]
    first = np.ones(len(o), dtype=bool)
    first[1:] = (rank[1:] != rank[:-1]) | (task[1:] != task[:-1])
    next_start = np.full(len(o), np.inf)
    next_start[:-1] = np.where(first[1:], np.inf, start[1:])
    rank, task, tid, start, end, next_start = (a[first] for a in (rank, task, tid, start, end, next_start))
    lane = P.lane[task] if len(task) else np.empty(0, np.int64)
    stage = P.stage[task] if len(task) else np.empty(0, np.int64)
    D = project_device(events, P.index, len(P.ids), rank, task, next_start) if clock == "auto" else None
    on_dev = device_clock(D, rank, lane, len(P.lanes))
    d_start, d_end = (np.where(on_dev, D.start, start), np.where(on_dev, D.end, end)) if D is not None else (start, end)
    return Joined(P, events, unplanned, rank, task, tid, lane, stage, start, end, d_start, d_end, on_dev, D,
                  RankStages.by_majority(rank, stage, P.stages), int((~first).sum()), tolerance_us,
                  cross_rank_clocks, only_traced_stages)


def _unplanned_rows(rows: np.ndarray, names: np.ndarray, inv: np.ndarray, uidx: np.ndarray) -> np.ndarray:
    """Rows of ranges named like a task id (``parse_task_id`` accepts it) that the plan lacks."""
    unplanned = set()
    for n, u in zip(names.tolist(), uidx.tolist()):
        if u < 0 and n[:1] == "s" and "/" in n:
            try:
                parse_task_id(n)
                unplanned.add(n)
            except ValueError:
                pass
    if not unplanned:
        return np.empty(0, np.int64)
    return rows[np.isin(names[inv], list(unplanned))]


def map_lanes(J: Joined, unit: np.ndarray, usable: np.ndarray) -> LaneMap:
    """Per rank, map each lane to the unit (thread or stream) most of its ``usable`` instances ran
    on; larger lanes choose first, a unit already taken loses ties, then the unit of the earliest
    planned task wins. A lane whose unit another lane took is recorded in ``shared``."""
    P, rank, lane, task = J.P, J.rank, J.lane, J.task
    M = LaneMap()
    for r in J.ranks:
        m = (rank == r) & usable
        taken: dict[int, int] = {}
        lanes_here = np.unique(lane[m])
        sizes = [(-int(np.sum(lane[m] == li)), int(li)) for li in lanes_here.tolist()]
        for _, li in sorted(sizes):
            ml = m & (lane == li)
            units, cnt = np.unique(unit[ml], return_counts=True)
            first_pos = np.array([P.pos[task[ml & (unit == x)]].min() for x in units.tolist()])
            cand = sorted(range(len(units)), key=lambda k: (-cnt[k], int(units[k]) in taken, first_pos[k]))
            best = int(units[cand[0]])
            if best in taken:
                M.shared.append((r, taken[best], li, best))
            else:
                taken[best] = li
            M.unit[(r, li)] = best
        M.owner[r] = taken
    return M


@dataclass
class DepPairs:
    """Every planned dependency of a matched instance (``cons``) on a task (``prod_task``), with
    the producer's instance (``pi``, -1 when not compared) and the times compared, each pair on
    one clock (the device clock when both ends are on it, ``both``)."""

    cons: np.ndarray
    prod_task: np.ndarray
    pi: np.ndarray
    valid: np.ndarray       # compared: the producer found on a comparable rank, not an onload pair
    recv_pair: np.ndarray   # a receive on its send: END of the receive vs START of the send
    both: np.ndarray
    cs: np.ndarray
    ce: np.ndarray
    ps: np.ndarray
    pe: np.ndarray
    skipped: int            # cross-rank pairs not compared (clocks not declared comparable)


def dep_pairs(J: Joined) -> DepPairs:
    """The dependency pairs of the matched instances. The producer runs on the consumer's rank
    when both are of one stage; across stages on the replica-matched rank ([Note: trace join])
    when ``cross_rank_clocks``, else the pair is skipped."""
    P, task, rank, stage = J.P, J.task, J.rank, J.stage
    n_deps = P.dep_ptr[task + 1] - P.dep_ptr[task]
    cons = np.repeat(np.arange(len(task)), n_deps) if len(task) else np.empty(0, np.int64)
    prod_task = P.dep_idx[np.concatenate([np.arange(P.dep_ptr[t], P.dep_ptr[t + 1]) for t in task.tolist()])
                          ] if len(cons) else np.empty(0, np.int64)
    pair_set = {(int(a), int(b)) for a, b in P.onload_pairs.tolist()}
    skip_pairs = np.array([(int(task[c]), int(p)) in pair_set for c, p in zip(cons.tolist(), prod_task.tolist())],
                          dtype=bool) if len(cons) else np.zeros(0, bool)
    prod_rank = np.full(len(cons), -1, dtype=np.int64)
    same = P.stage[prod_task] == stage[cons] if len(cons) else np.zeros(0, bool)
    prod_rank[same] = rank[cons][same]
    skipped = 0
    if J.cross_rank_clocks and len(cons):
        for c in np.nonzero(~same)[0].tolist():
            peer = J.stages.peer(int(rank[cons[c]]), int(P.stage[prod_task[c]]))
            if peer is not None:
                prod_rank[c] = peer
    else:
        skipped = int((~same).sum())
    pi = J.lookup(np.maximum(prod_rank, 0), prod_task)
    valid = (prod_rank >= 0) & (pi >= 0) & ~skip_pairs
    recv_pair = np.array([is_transfer(P.kind[int(task[c])], P.kind[prod])
                          for c, prod in zip(cons.tolist(), prod_task.tolist())], dtype=bool) if len(cons) \
        else np.zeros(0, bool)
    pc = np.maximum(pi, 0)
    both = J.on_dev[cons] & J.on_dev[pc] if len(cons) else np.zeros(0, bool)
    cs, ce = np.where(both, J.start[cons], J.hstart[cons]), np.where(both, J.end[cons], J.hend[cons])
    ps, pe = np.where(both, J.start[pc], J.hstart[pc]), np.where(both, J.end[pc], J.hend[pc])
    return DepPairs(cons, prod_task, pi, valid, recv_pair, both, cs, ce, ps, pe, skipped)


def onload_instances(J: Joined) -> list[tuple[int, int, int, int, int]]:
    """(onload task, offload task, rank, onload instance, offload instance) for every planned
    onload / offload pair both of whose instances a rank of their stage recorded."""
    out = []
    for on_t, off_t in J.P.onload_pairs.tolist():
        for r in J.stages.ranks_of.get(int(J.P.stage[on_t]), []):
            a, b = J.lookup([r], [on_t])[0], J.lookup([r], [off_t])[0]
            if a >= 0 and b >= 0:
                out.append((on_t, off_t, r, int(a), int(b)))
    return out


# ---- the rules ---------------------------------------------------------------------------

def unplanned(J: Joined) -> list[Violation]:
    """A range named like a task id that the plan does not contain (the first MAX_UNPLANNED)."""
    ev = J.events
    return [Violation("unplanned", str(ev.name[row]), int(ev.rank[row]),
                      f"range on tid {int(ev.tid[row])} at {ev.start_us[row]:.1f} us is not in the plan",
                      float(ev.end_us[row] - ev.start_us[row])) for row in J.unplanned_rows[:MAX_UNPLANNED].tolist()]


def wrong_rank(J: Joined) -> list[Violation]:
    """A planned task found on a rank whose stage is another."""
    stage_of = J.stages.stage_of
    own = np.array([stage_of[r] for r in J.rank.tolist()], dtype=np.int64) == J.stage if len(J.rank) \
        else np.ones(0, bool)
    return [Violation("wrong_rank", J.P.ids[J.task[i]], int(J.rank[i]),
                      f"task of stage {J.stage[i]} recorded on rank {J.rank[i]}, which runs stage "
                      f"{stage_of[int(J.rank[i])]}", float(J.end[i] - J.start[i])) for i in np.nonzero(~own)[0].tolist()]


def missing(J: Joined) -> list[Violation]:
    """A task of stage s absent on a rank running stage s; rank -1 (all of the stage's tasks) when
    no rank ran stage s, unless ``only_traced_stages``."""
    P, V = J.P, []
    for s in P.stages:
        tasks_s = np.nonzero(P.stage == s)[0]
        ranks = J.stages.ranks_of[s]
        if not ranks:
            if not J.only_traced_stages:
                V.append(Violation("missing", P.ids[tasks_s[0]] if len(tasks_s) else None, -1,
                                   f"no rank ran stage {s}: all {len(tasks_s)} of its tasks are missing",
                                   float(np.sum(P.end[tasks_s] - P.start[tasks_s]))))
            continue
        for r in ranks:
            found = J.lookup(np.full(len(tasks_s), r), tasks_s)
            for t in tasks_s[found < 0].tolist():
                V.append(Violation("missing", P.ids[t], r, f"planned on lane {P.lanes[P.lane[t]]} at "
                                   f"{P.start[t]:.1f}-{P.end[t]:.1f} us, not found in the trace",
                                   float(P.end[t] - P.start[t])))
    return V


def _off_thread(J: Joined) -> list[tuple[int, int, int | None]]:
    """(instance, its lane's tid, the lane owning the tid it ran on or None) for every instance
    not on its lane's tid."""
    T = J.threads
    out = []
    for i, (r, li, t) in enumerate(zip(J.rank.tolist(), J.lane.tolist(), J.tid.tolist())):
        want = T.unit[(r, li)]
        if t != want:
            out.append((i, want, T.owner[r].get(int(t))))
    return out


def lane_mapping(J: Joined) -> list[Violation]:
    """Two lanes of a rank on one tid, or an instance on a tid that is no lane's."""
    P = J.P
    V = [Violation("lane_mapping", None, r, f"lanes {P.lanes[o]} and {P.lanes[li]} both run on tid {u}", 0.0)
         for r, o, li, u in J.threads.shared]
    for i, want, other in J.off_thread:
        if other is None:
            V.append(Violation("lane_mapping", P.ids[J.task[i]], int(J.rank[i]),
                               f"ran on tid {J.tid[i]}, which is no lane's; lane {P.lanes[J.lane[i]]} runs on "
                               f"tid {want}", float(J.end[i] - J.start[i])))
    return V


def wrong_lane(J: Joined) -> list[Violation]:
    """An instance on the tid of another lane."""
    P = J.P
    return [Violation("wrong_lane", P.ids[J.task[i]], int(J.rank[i]),
                      f"ran on tid {J.tid[i]} (lane {P.lanes[other]}), planned lane {P.lanes[J.lane[i]]} (tid {want})",
                      float(J.end[i] - J.start[i])) for i, want, other in J.off_thread if other is not None]


def stream_mapping(J: Joined) -> list[Violation]:
    """On the device timeline: two lanes of a rank whose GPU work runs on one stream."""
    if J.D is None:
        return []
    P = J.P
    return [Violation("lane_mapping", None, r, f"lanes {P.lanes[o]} and {P.lanes[li]} both run their GPU work "
                      f"on stream {u}", 0.0) for r, o, li, u in J.streams.shared]


def _stream_events(J: Joined) -> tuple[np.ndarray, np.ndarray]:
    """Per joined GPU event: the lane owning its (rank, stream) (-1: none), and whether it ran on
    another lane's stream than its instance's (NCCL kernels never)."""
    D, S = J.D, J.streams
    ev_r = J.rank[D.ev_inst].astype(np.int64)
    inst_want = np.array([S.unit.get((int(r), int(li)), -1) for r, li in zip(J.rank.tolist(), J.lane.tolist())],
                         np.int64)
    want = inst_want[D.ev_inst] if len(ev_r) else np.empty(0, np.int64)
    # the lane owning each event's (rank, stream): via the few distinct (rank, stream) pairs
    us, sinv = np.unique(D.ev_stream, return_inverse=True)
    ur, rinv = np.unique(ev_r, return_inverse=True)
    ns = max(len(us), 1)
    pk, pinv = np.unique(np.ravel(rinv).astype(np.int64) * ns + np.ravel(sinv), return_inverse=True)
    pown = np.array([S.owner.get(int(ur[k // ns]), {}).get(int(us[k % ns]), -1) for k in pk.tolist()], np.int64)
    ev_owner = pown[np.ravel(pinv)] if len(ev_r) else np.empty(0, np.int64)
    return ev_owner, (ev_owner >= 0) & (D.ev_stream != want) & ~D.ev_nccl


def wrong_stream(J: Joined) -> list[Violation]:
    """``wrong_lane`` on the device timeline: an instance with GPU events on another lane's
    stream (magnitude: those events' time)."""
    if J.D is None:
        return []
    P, D, V = J.P, J.D, []
    ev_owner, wrong = J.stream_events
    for i in np.unique(D.ev_inst[wrong]).tolist():
        w = wrong & (D.ev_inst == i)
        li = int(J.lane[i])
        V.append(Violation("wrong_lane", P.ids[J.task[i]], int(J.rank[i]),
                           f"{int(w.sum())} of its {int(D.scount[i])} GPU events ran on stream {int(D.ev_stream[w][0])} "
                           f"(lane {P.lanes[int(ev_owner[w][0])]}), planned lane {P.lanes[li]} (stream "
                           f"{J.streams.unit.get((int(J.rank[i]), li))})", float(D.ev_dur[w].sum())))
    return V


def order(J: Joined) -> list[Violation]:
    """Within a (rank, lane), measured start order differs from planned order: the fewest tasks
    that explain it are reported (those outside a longest in-order subsequence, or those not at
    their planned rank when fewer)."""
    P, V = J.P, []
    for (r, li) in sorted(J.threads.unit):
        m = np.nonzero((J.rank == r) & (J.lane == li))[0]
        m = m[np.lexsort((P.pos[J.task[m]], J.start[m]))]
        pos = P.pos[J.task[m]]
        keep = lis_mask(pos)
        in_place = np.argsort(np.argsort(pos, kind="stable"), kind="stable") == np.arange(len(pos))
        if (~in_place).sum() <= (~keep).sum():
            keep = in_place
        for k in np.nonzero(~keep)[0].tolist():
            i = m[k]
            later = [j for j in range(k) if pos[j] > pos[k]]
            if later:
                why = f"started after {P.ids[J.task[m[later[0]]]]}, which is planned after it"
            else:
                nxt = [j for j in range(k + 1, len(m)) if pos[j] < pos[k]]
                why = f"started before {P.ids[J.task[m[nxt[0]]]]}, which is planned before it" if nxt else "out of order"
            off = J.offset[r]
            V.append(Violation("order", P.ids[J.task[i]], r,
                               f"lane {P.lanes[li]}{' on device' if J.on_dev[i] else ''}: ran #{k} (planned "
                               f"#{pos[k]}), {why}; measured start {J.start[i] - off:.1f} us, planned "
                               f"{P.start[J.task[i]]:.1f} us", float(abs(J.start[i] - off - P.start[J.task[i]]))))
    return V


def dependency(J: Joined) -> list[Violation]:
    """A consumer started before its producer ended (beyond the tolerance); a receive on its send
    ended before the send started."""
    P, d, tol, off, V = J.P, J.dep_pairs, J.tolerance_us, J.offset, []
    late_recv = np.zeros(len(d.cons), bool)
    rv = d.valid & d.recv_pair
    late_recv[rv] = d.ce[rv] < d.ps[rv] - tol
    late = np.zeros(len(d.cons), bool)
    plain = d.valid & ~d.recv_pair
    late[plain] = d.cs[plain] < d.pe[plain] - tol
    # a receive: its END against its send's START; any other consumer: its START against its producer's END
    recv_words = ("receive ended", "send", "started", "end", "send start")
    plain_words = ("started", "producer", "ended", "start", "producer end")
    found = [(c, recv_words, d.ce, d.ps) for c in np.nonzero(late_recv)[0].tolist()] + \
            [(c, plain_words, d.cs, d.pe) for c in np.nonzero(late)[0].tolist()]
    for c, (verb, who, when, mine, theirs), a, b in found:
        ci, p = d.cons[c], d.pi[c]
        rc, rp = int(J.rank[ci]), int(J.rank[p])
        V.append(Violation("dependency", P.ids[J.task[ci]], rc,
                           f"{verb}{' on device' if d.both[c] else ''} {b[c] - a[c]:.1f} us before its {who} "
                           f"{P.ids[J.task[p]]} (rank {J.rank[p]}) {when} ({mine} {a[c] - off[rc]:.1f} us, {theirs} "
                           f"{b[c] - off[rp]:.1f} us)", float(b[c] - a[c])))
    return V


def onload_before_offload(J: Joined) -> list[Violation]:
    """An onload started before its offload ended (same buffer, else same scope), on one rank."""
    P, V = J.P, []
    for on_t, off_t, r, a, b in J.onloads:
        dv = bool(J.on_dev[a] and J.on_dev[b])
        sa, eb = (J.start[a], J.end[b]) if dv else (J.hstart[a], J.hend[b])
        if sa < eb - J.tolerance_us:
            V.append(Violation("onload_before_offload", P.ids[on_t], r,
                               f"started{' on device' if dv else ''} {eb - sa:.1f} us before {P.ids[off_t]} "
                               f"ended (onload start {sa - J.offset[r]:.1f} us, offload end {eb - J.offset[r]:.1f} us)",
                               float(eb - sa)))
    return V


def collective_order(J: Joined) -> list[Violation]:
    """On the ep and collective lanes, ranks of one stage run their tasks in different orders (a
    deadlock on a real communicator): each rank against the stage's first rank."""
    P, V = J.P, []
    comm_li = [P.lanes.index(ln) for ln in COMM_LANES if ln in P.lanes]
    for s in P.stages:
        rs = J.stages.ranks_of[s]
        if len(rs) < 2:
            continue
        for li in comm_li:
            seqs = {}
            for r in rs:
                m = np.nonzero((J.rank == r) & (J.lane == li))[0]
                seqs[r] = J.task[m[np.argsort(J.start[m], kind="stable")]].tolist()
            ref = seqs[rs[0]]
            for r in rs[1:]:
                common = set(ref) & set(seqs[r])
                a = [t for t in ref if t in common]
                b = [t for t in seqs[r] if t in common]
                k = next((k for k in range(len(a)) if a[k] != b[k]), None)
                if k is not None:
                    V.append(Violation("collective_order", P.ids[b[k]], r,
                                       f"lane {P.lanes[li]}: rank {r} runs {P.ids[b[k]]} as its #{k} where rank "
                                       f"{rs[0]} runs {P.ids[a[k]]} (communicator deadlock)", float(len(a) - k)))
    return V


# in the order the report collects them
RULES = (unplanned, wrong_rank, missing, lane_mapping, wrong_lane, stream_mapping, wrong_stream, order, dependency,
         onload_before_offload, collective_order)

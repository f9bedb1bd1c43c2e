"""Planner: places every task of a step on the five lanes of its stage.

Strategy ``k3`` is an event-driven list scheduler over (stage, lane) resources:

* the pipeline backbone (one list of slots per PP rank, see :mod:`k3sched.schedules`) orders the
  compute lane: tasks of slot k+1 become eligible once every non-WGrad compute task of slot k has
  started (gshard.add aside: [Note: compute tasks outside the backbone gate] in listsched.py);
  within a slot, ready tasks run in topological order (critical path first);
* WGrad (dW) tasks are *fill* work: the compute lane runs one whenever nothing of the current
  slot is ready (e.g. while an EP all-to-all is in flight), and must run one once it is
  ``schedule.wgrad_lag`` slots overdue;
* communication lanes (ep, collective) run ready tasks by backbone slot, so all-to-alls and P2P
  overlap independent compute of the same stage;
* offload runs as soon as the layer's last forward task ends; onload is released at layer
  granularity just ahead of its backward use (graph ``start_deps``);
* the device memory budget is met by offloading more activation sets (``schedule.offload``
  ``auto``), chosen among those resident at the peak; when even full offload does not fit the
  planner fails with the smallest feasible budget.

Strategy ``serial`` runs one task at a time per stage (all five lanes share one resource) in the
same backbone order, WGrad right after its dX: the no-overlap baseline.

Ties break on (time, priority, topological index), so the same config gives the same plan.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, replace

import numpy as np

from . import schedules
from .config import GiB, Config
from .cost import CostModel
from .cpurunner import contended_durations
from .graph import OffloadChoice, StepGraph, build_step, set_task_id
from .limits import InfeasibleBudget, check_limits, count_tasks, memory_lower_bound
from .listsched import lane_orders_of, list_schedule, prepare, retime
from .pipelines import TABLE
from .planfile import PlanMetrics
from .seqslice import seq1f1b
from .metrics import compute_metrics, device_memory, device_peak_per_stage
from .variability import expected, spread_active
from .simulator import MemoryEvents, MemoryTimeline
from .tasks import Kind, Task


@dataclass
class Plan:
    cfg: Config
    graph: StepGraph
    strategy: str
    pipeline: str
    lane_orders: dict[tuple[int, str], list[str]]
    memory: dict[tuple[int, str], MemoryTimeline]
    metrics: PlanMetrics
    backbone: dict[int, list]  # per rank: slots (for display and export)

    @property
    def tasks(self) -> dict[str, Task]:
        return self.graph.tasks


# -- backbone ---------------------------------------------------------------------------------
def backbone(cfg: Config) -> "schedules.Schedule":
    """The pipeline schedule named by ``schedule.pipeline`` for this config."""
    p = cfg.parallel
    extra = cfg.schedule.warmup_extra if cfg.schedule.pipeline == "interleaved-1f1b" else 0
    if TABLE[cfg.schedule.pipeline].copies == 2:
        # two copies of the model's pp stages, one of each per rank ([Note: dualpipe mapping])
        name = cfg.schedule.pipeline
        if p.vpp != 1:
            raise ValueError(f"parallel.vpp: {name} splits each of its two model copies into pp stages and "
                             f"places one stage of each copy per rank; set vpp 1, got {p.vpp}")
        return schedules.generate(name, p.pp, 2, p.microbatches)
    if p.seq_chunks > 1:  # Seq1F1B over M*S slice units ([Note: sequence slices] in k3sched/seqslice.py)
        base = schedules.generate(cfg.schedule.pipeline, p.pp, p.vpp, p.microbatches * p.seq_chunks,
                                  warmup_extra=extra)
        return seq1f1b(base, p.seq_chunks)  # checked there
    return schedules.generate(cfg.schedule.pipeline, p.pp, p.vpp, p.microbatches, warmup_extra=extra)


def slot_index(ranks: dict[int, list]) -> dict[tuple[int, str, int], int]:
    """(vstage, unit, mb) -> position of its slot on its rank. 'B' covers I and W; a pair both."""
    idx: dict[tuple[int, str, int], int] = {}
    for _, slots in ranks.items():
        for pos, slot in enumerate(slots):
            if slot is None:
                continue
            acts = (slot.fwd, slot.bwd) if hasattr(slot, "fwd") else (slot,)
            for a in acts:
                units = ("I", "W") if a.op == "B" else (a.op,)
                for u in units:
                    idx[(a.vstage, u, a.mb)] = pos
    return idx


# -- offload selection ------------------------------------------------------------------------
def _select_offload(att: "_Attempt", mem: MemoryTimeline, stage: int, chosen: OffloadChoice, target: int
                    ) -> list[tuple[int, int, int]]:
    """Activation sets of ``stage`` to offload so that its device curve, minus each chosen set's
    bytes over the span it is resident ([its attn.fwd end, its attn.dx start), ``att.span``), stays
    under ``target``. Greedy at the running peak, taking the set needed latest (longest away)."""
    g = att.graph
    if not len(mem.times_us):
        return []
    times = mem.times_us
    curve = mem.bytes.astype(np.int64).copy()
    spans = []
    for key, nbytes in g.offload_sets.items():  # (stage, mb, layer[, slice])
        if key[0] != stage or key in chosen or nbytes == 0:
            continue
        a, b = att.span(key)
        spans.append((np.searchsorted(times, a, "left"), np.searchsorted(times, b, "left"), b, nbytes, key))
    picked: list[tuple[int, int, int]] = []
    used = [False] * len(spans)
    while int(curve.max()) > target:
        at = int(np.argmax(curve))
        best = -1
        for j, (lo, hi, b, _, _) in enumerate(spans):
            if not used[j] and lo <= at < hi and (best < 0 or b > spans[best][2]):
                best = j
        if best < 0:
            break
        used[best] = True
        lo, hi, _, nbytes, key = spans[best]
        curve[lo:hi] -= nbytes
        picked.append(key)
    return picked


def _remote_peer(cfg: Config, stage: int, peaks: list[int], budget: int) -> int | None:
    """Kimi K3: offload an early stage's activations to a later stage with headroom."""
    best = None
    for peer in range(cfg.parallel.pp - 1, stage, -1):
        head = budget - peaks[peer]
        if head > 0 and (best is None or head > budget - peaks[best]):
            best = peer
    return best


class _Attempt:
    """One list schedule of the search: its memory, peaks and skipped offload pairs. On the fast
    search's shared base graph the schedule stays in arrays (start and end times by task index, the
    lanes' index orders, the durations when CPU contention changed them) until :meth:`materialize`
    writes it into the graph's tasks: most attempts are only looked at for their memory, and the
    graph then holds whichever attempt wrote last."""

    def __init__(self, graph: StepGraph, memory: dict[tuple[int, str], MemoryTimeline], peaks: list[int],
                 skip: frozenset[int] = frozenset(), *, lane_orders: dict | None = None, raw: tuple | None = None,
                 search: "_Search | None" = None) -> None:
        self.graph, self.memory, self.peaks, self.skip = graph, memory, peaks, skip
        self._lane_orders, self._raw, self._search = lane_orders, raw, search

    def materialize(self) -> None:
        """Write this attempt's times (and durations) into the graph's tasks and build its lane orders."""
        if self._raw is None:
            return
        orders, start_t, end_t, dur = self._raw
        prep = self._search.prep
        if dur is not None:
            tasks = self.graph.tasks
            for tid, d in zip(prep.ids, dur):
                tasks[tid].duration_us = d
        self._lane_orders = lane_orders_of(self.graph, prep, orders, start_t, end_t)
        self._raw = None

    @property
    def lane_orders(self) -> dict[tuple[int, str], list[str]]:
        self.materialize()
        return self._lane_orders

    def span(self, key: tuple) -> tuple[float, float]:
        """When activation set ``key`` is resident: its attn.fwd end and its attn.dx start."""
        if self._raw is not None:
            fwd, dx = self._search.span_idx[key]
            return self._raw[2][fwd], self._raw[1][dx]
        tasks = self.graph.tasks
        return tasks[set_task_id(key, Kind.ATTN_FWD)].end_us, tasks[set_task_id(key, Kind.ATTN_DX)].start_us


class _Search:
    """Runs scheduling attempts for growing offload choices. Without remote offload the graph is
    built once with an offload/onload pair for every activation set, and pairs not chosen are
    skipped; with remote offload each attempt rebuilds the graph (the lane of a set changes)."""

    def __init__(self, cfg: Config, slots: dict, serial: bool):
        self.cfg, self.slots, self.serial = cfg, slots, serial
        self.cost = CostModel(cfg)
        self.fast = not cfg.schedule.remote_offload and cfg.schedule.offload != "remote"
        offload = cfg.schedule.offload != "none"
        first = build_step(cfg, OffloadChoice(everything=offload and self.fast))
        self.all_sets = {k for k, b in first.offload_sets.items() if b} if offload else set()
        if self.fast:
            self.base = first
            self.prep = prepare(self.base, slots)
            idx = {tid: i for i, tid in enumerate(self.prep.ids)}
            self.pair = {k: (idx[set_task_id(k, Kind.ACT_OFFLOAD)], idx[set_task_id(k, Kind.ACT_ONLOAD)])
                         for k in self.all_sets}
            self.events = MemoryEvents([self.base.tasks[tid] for tid in self.prep.ids])
            self.span_idx = {k: (idx[set_task_id(k, Kind.ATTN_FWD)], idx[set_task_id(k, Kind.ATTN_DX)])
                             for k, b in first.offload_sets.items() if b}
            self.mem_base = {**{(s, "device"): d for s, d in enumerate(first.static_device)},
                             **{(s, "host"): h for s, h in enumerate(first.static_host)}}

    def run(self, chosen: OffloadChoice, lookahead: int, wgrad_lag: int) -> _Attempt:
        """One list schedule with the offload pairs of ``chosen``, at the given look-ahead and
        WGrad lag (the graph does not depend on them, so one search serves every memory level)."""
        la = 0 if self.serial else lookahead
        if self.fast:
            g, prep = self.base, self.prep
            skip = frozenset(i for k, pr in self.pair.items() if k not in chosen.local for i in pr)
        else:
            g = build_step(self.cfg, chosen)
            prep, skip = prepare(g, self.slots), frozenset()
        raw: list = []
        lane_orders = list_schedule(g, prep, self.serial, wgrad_lag, la, skip, raw, materialize=not self.fast)
        dur = None
        cpu = self.cost.cpu  # the CPU runner's contention ([Note: the CPU-runner model] in k3sched/cpurunner.py)
        if cpu is not None and cpu.acts(self.serial):
            slack = self.cfg.schedule.transfer_slack if not self.serial and cpu.models_transfer_wait() else 0.0
            for _ in range(2):  # two rounds: the second sees the first's stretched overlaps
                busy = replace(prep, dur=contended_durations(g, prep, skip, cpu, raw, 1.0 + slack))
                lane_orders = list_schedule(g, busy, self.serial, wgrad_lag, la, skip, raw, materialize=not self.fast)
            if slack:  # [Note: transfer slack]: these orders, the modelled durations
                busy = replace(prep, dur=contended_durations(g, prep, skip, cpu, raw))
                raw[1], raw[2] = retime(busy, raw[0], busy.dur, skip)
                if not self.fast:
                    lane_orders = lane_orders_of(g, busy, *raw)
            dur = busy.dur
            if not self.fast:
                for tid, d in zip(busy.ids, busy.dur):
                    g.tasks[tid].duration_us = d
        if self.fast:  # the base graph's memory events, laid out once; the schedule stays in arrays
            mem = self.events.timeline(raw[1], raw[2], skip, self.mem_base)
            return _Attempt(g, mem, device_peak_per_stage(mem, self.cfg.parallel.pp), skip,
                            raw=(raw[0], raw[1], raw[2], dur), search=self)
        mem = device_memory(g, [g.tasks[tid] for tid in prep.ids])
        return _Attempt(g, mem, device_peak_per_stage(mem, self.cfg.parallel.pp), skip, lane_orders=lane_orders)

    def finish(self, att: _Attempt) -> StepGraph:
        """The attempt's graph with skipped offload pairs removed. Only once: the base graph is
        changed in place, so the search cannot run again afterwards."""
        att.materialize()
        if not self.fast or not att.skip:
            return att.graph
        g, prep = att.graph, self.prep
        gone = {prep.ids[i] for i in att.skip}
        for i in att.skip:
            for j in prep.succ[i]:
                t = g.tasks[prep.ids[j]]
                t.deps = [d for d in t.deps if d not in gone]
        for tid in gone:
            del g.tasks[tid]
            g.unit.pop(tid, None)
            g.topo.pop(tid, None)
            g.start_deps.pop(tid, None)
        return g


# [Note: transfer slack] A plan orders each lane by its modelled durations, so where a compute task
# needs a transfer's result the schedule puts it right at the transfer's planned end, with other
# work just long enough to cover the transfer. On the CPU runner a synchronising transfer ends
# when the last rank has posted it, and the ranks drift (the replay of [Note: task-time spread] in
# k3sched/variability.py: one rank's compute of a step runs longer than another's), so the
# transfer ends late as often as not, and the compute that was placed at its planned end waits.
# ``schedule.transfer_slack`` s orders the lanes as if every transfer's
# wait beside compute ([Note: a transfer beside compute] in k3sched/cpurunner.py) were 1 + s times the modelled one: the
# list scheduler then fills a longer margin after each transfer with other ready work, and the
# plan keeps these orders with the modelled durations (:func:`k3sched.listsched.retime`: each
# task as soon as its dependencies and the task before it on its resource allow, as the executor
# runs them), so its times and step stay a prediction of the modelled machine. Whether a slack pays
# is the expected step's call (the replay with the probed spread), not the planned step's: a slack
# can leave the planned step as it is and still raise the expected overlap where transfers and
# compute are close (EP-bound plans); where they are not (PP-bound plans) it changes nothing. A
# larger slack also makes the plan's own overlap more honest: it leaves margins the spread does
# not eat, so the planned overlap comes closer to the expected one. What the slacks give on the
# shaped-link testbed is in docs/results.md. ``k3sched tune`` searches
# :data:`k3sched.tune.TRANSFER_SLACKS`, the bench picks among them with the look-ahead and WGrad
# lag. It acts only where the plan models that wait
# (:meth:`k3sched.cpurunner.CpuRunner.models_transfer_wait`): not on GPUs, not in a serial plan.


BISECTION_TASKS = 30_000  # tasks the infeasible-budget bisection may plan in all (a few seconds at most)


def _bisection_plans(cfg: Config) -> int:
    """Bisection plans of :func:`_infeasible_message`: 5 for small configs, fewer as plans grow
    (tiny-cpu: 5; K2-like, 38k tasks: none), by task count."""
    return max(0, min(5, BISECTION_TASKS // max(1, count_tasks(cfg).total)))


@dataclass
class _Outcome:
    """What meeting one budget at one memory level gave: the last attempt, its offload choice,
    the smallest peak per stage seen on the way and the peaks before anything was offloaded."""
    att: _Attempt
    chosen: OffloadChoice
    best_peak: list[int]
    first_peaks: list[int]
    budget: int

    @property
    def over(self) -> list[int]:
        return [s for s, p in enumerate(self.att.peaks) if p > self.budget]


def _meet_budget(search: _Search, budget: int, level: tuple[int, int]) -> _Outcome:
    """Offload activation sets (policy ``auto``/``remote``; ``all`` offloads every set, ``none``
    nothing) until every stage's device peak fits ``budget``, at the memory level ``level``
    (look-ahead, WGrad lag). Stops when the peaks fit, when offloading more no longer lowers them
    (three attempts without 1% progress), or after 64 attempts."""
    cfg = search.cfg
    policy, pp = cfg.schedule.offload, cfg.parallel.pp
    chosen = OffloadChoice(local=set(search.all_sets) if policy == "all" else set())
    best_peak: list[int] | None = None
    first_peaks: list[int] | None = None
    best_excess, stalled = None, 0
    for _ in range(64):
        att = search.run(chosen, *level)
        peaks = list(att.peaks)
        if first_peaks is None:
            first_peaks = list(peaks)
        best_peak = peaks if best_peak is None else [min(a, b) for a, b in zip(best_peak, peaks)]
        over = [s for s in range(pp) if peaks[s] > budget]
        if not over or policy not in ("auto", "remote"):
            break
        excess = sum(peaks[s] - budget for s in over)
        stalled = 0 if best_excess is None or excess < 0.99 * best_excess else stalled + 1
        best_excess = excess if best_excess is None else min(best_excess, excess)
        if stalled >= 3:  # offloading more no longer lowers the peaks (copies cannot keep up)
            break
        progressed = False
        for s in over:
            target = int(budget * 0.98)
            for key in _select_offload(att, att.memory[(s, "device")], s, chosen, target):
                peer = _remote_peer(cfg, s, peaks, budget) if cfg.schedule.remote_offload else None
                nbytes = att.graph.offload_sets[key]
                if policy == "remote" and s + 1 < pp:  # forced placement: the next stage holds it
                    chosen.remote[key] = s + 1
                    peaks[s + 1] += nbytes
                elif peer is not None and nbytes < budget - peaks[peer]:
                    chosen.remote[key] = peer
                    peaks[peer] += nbytes
                else:
                    chosen.local.add(key)
                progressed = True
        if not progressed:
            break
    return _Outcome(att, chosen, best_peak, first_peaks, budget)


def _memory_levels(cfg: Config, strategy: str) -> list[tuple[int, int]]:
    """[Note: memory levels] The (look-ahead, WGrad lag) pairs the planner may use to meet a
    budget, configured first. Deferring WGrad and running ahead both hold memory, so under
    ``auto``/``remote`` offload the k3 strategy may trade that overlap for memory, a step at a time:
    halve the WGrad lag down to none, then drop the look-ahead too. The last level is the leanest."""
    sc = cfg.schedule
    levels = [(sc.lookahead, sc.wgrad_lag)]
    if sc.offload in ("auto", "remote") and strategy == "k3":
        la, lag = levels[0]
        while la or lag:
            la, lag = (la if lag else 0), lag // 2
            levels.append((la, lag))
    return levels


NEAR_BOUND = 1.25
"""A budget below this multiple of the cheap memory bound ([Note: memory lower bound] in
k3sched/limits.py) is first tried where it is hardest to miss (:func:`_lean_cannot_fit`)."""


def _lean_cannot_fit(cfg: Config, search: _Search, budget: int, levels: list[tuple[int, int]]) -> bool:
    """[Note: fast infeasible budgets] Near the cheap memory bound a budget is often infeasible, and
    the configured memory level's offload search would spend many of its attempts finding that out.
    So, for a budget within :data:`NEAR_BOUND` of the bound, one list schedule at the leanest level with every activation set
    offloaded comes first. If even that misses the budget, the planner goes straight to the
    leanest level's search, which decides feasibility as it does after the configured level fails;
    if that search plans after all, planning goes on as usual. A budget this check passes, or one
    far above the bound, costs nothing more than without the check."""
    if len(levels) < 2 or not search.all_sets:
        return False
    if budget >= NEAR_BOUND * max(memory_lower_bound(cfg, search.cost).per_stage):
        return False
    return max(search.run(OffloadChoice(local=set(search.all_sets)), *levels[-1]).peaks) > budget


def _infeasible_message(cfg: Config, search: _Search, level: tuple[int, int], out: _Outcome,
                        best_peak: list[int]) -> str:
    """One line: which stage misses the budget and the smallest budget that plans.

    Every budget tried here is planned at the leanest memory level ``level`` with the same search
    (the step graph is built once): a budget that plans there also plans through :func:`plan`,
    which falls back to that level. The smallest peak seen while searching is a first candidate;
    it is confirmed by planning with it (raised while it does not plan), then a bisection between
    the failing budget and the confirmed one narrows it (to 1 MiB or 1%, at most
    :func:`_bisection_plans` more plans: a count fixed by the config, not a wall-clock limit, so
    the message is the same on a loaded machine). The value printed is a budget that was planned;
    where the bisection could not narrow it to 1% (large plans: none is allowed), the message says
    "at most" and names the smallest peak any attempt reached."""
    budget, peaks, policy = cfg.budget_bytes, out.att.peaks, cfg.schedule.offload
    s = max(range(len(peaks)), key=lambda i: peaks[i] - budget)
    ceil_gib = lambda b: math.ceil(b / GiB * 1000) / 1000  # noqa: E731 - printed with 3 decimals
    head = (f"schedule.device_memory_budget: {budget / GiB:.3f} GiB is infeasible: stage {s} peaks at "
            f"{peaks[s] / GiB:.3f} GiB with offload '{policy}'")

    def plans(gib: float) -> tuple[bool, int]:
        o = _meet_budget(search, int(gib * GiB), level)
        return not o.over, max(o.best_peak)

    hi, need = None, max(best_peak)
    for _ in range(3):
        cand = ceil_gib(need)
        ok, seen = plans(cand)
        if ok:
            hi = cand
            break
        need = max(int(cand * GiB * 1.25), seen)
    if hi is None:
        return f"{head}; no budget up to {need / GiB:.3f} GiB plans"
    lo = budget / GiB  # known not to plan
    narrow = lambda: hi - lo <= max(0.001, 0.01 * hi) or ceil_gib((lo + hi) / 2 * GiB) >= hi  # noqa: E731
    for _ in range(_bisection_plans(cfg)):
        if narrow():
            break
        mid = ceil_gib((lo + hi) / 2 * GiB)
        ok, _ = plans(mid)
        lo, hi = (lo, mid) if ok else (mid, hi)
    if narrow():
        return f"{head}; the smallest feasible budget is {hi:.3f} GiB"
    # too large a plan to bisect: name what was shown, not more
    return (f"{head}; the smallest feasible budget is at most {hi:.3f} GiB (it plans; no attempt on the way "
            f"peaked below {math.floor(max(best_peak) / GiB * 1000) / 1000:.3f} GiB)")


def plan(cfg: Config, strategy: str | None = None, schedule: "schedules.Schedule | None" = None) -> Plan:
    """Plan one training step on the backbone ``schedule`` (default: ``schedule.pipeline``).
    Raises InfeasibleBudget, DeadlockError or ConfigError."""
    check_limits(cfg)
    was_enabled = gc.isenabled()
    gc.disable()  # tens of thousands of small objects, no cycles: the cyclic GC only costs time
    try:
        return _plan(cfg, strategy, schedule)
    finally:
        if was_enabled:
            gc.enable()


def _plan(cfg: Config, strategy: str | None, schedule: "schedules.Schedule | None", confirm: bool = True) -> Plan:
    """:func:`plan` without the up-front limits; ``confirm=False`` skips the smallest-budget search
    of an infeasible budget (the error then carries the smallest peak seen)."""
    strategy = strategy or cfg.schedule.strategy
    if strategy not in ("k3", "serial"):
        raise ValueError(f"strategy: must be k3 or serial; got {strategy!r}")
    sched = schedule if schedule is not None else backbone(cfg)
    ranks = sched.ranks
    search = _Search(cfg, slot_index(ranks), strategy == "serial")
    budget = cfg.budget_bytes
    policy = cfg.schedule.offload
    levels = _memory_levels(cfg, strategy)
    if confirm and _lean_cannot_fit(cfg, search, budget, levels):
        lean = _meet_budget(search, budget, levels[-1])
        if lean.over:  # the leanest level decides feasibility ([Note: memory levels])
            raise InfeasibleBudget(_infeasible_message(cfg, search, levels[-1], lean, lean.best_peak))
    out, level = _meet_budget(search, budget, levels[0]), levels[0]
    best_peak = out.best_peak
    if out.over and len(levels) > 1:
        # [Note: memory levels] The leanest level decides feasibility (one search, not one per
        # level); only when it plans are the levels between tried, least lean first.
        lean = _meet_budget(search, budget, levels[-1])
        best_peak = [min(a, b) for a, b in zip(best_peak, lean.best_peak)]
        if lean.over:
            out = lean
        else:
            out, level = lean, levels[-1]
            for lv in levels[1:-1]:
                o = _meet_budget(search, budget, lv)
                if not o.over:
                    out, level = o, lv
                    break
    if out.over:
        if not confirm:
            raise InfeasibleBudget("infeasible", max(best_peak))
        raise InfeasibleBudget(_infeasible_message(cfg, search, levels[-1], out, best_peak))
    att, chosen = out.att, out.chosen
    if level != levels[0]:
        cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(
            update={"lookahead": level[0], "wgrad_lag": level[1]})})
    g = search.finish(att)
    metrics = compute_metrics(g, att.memory).model_copy(update={
        "peak_device_bytes": att.peaks,
        "offloaded_sets": {"local": len(chosen.local), "remote": len(chosen.remote), "total": len(search.all_sets)},
        "budget_bytes": budget,
        # per-stage peak before the planner offloaded anything (policy auto; None otherwise)
        "peak_device_bytes_before_offload": out.first_peaks if policy in ("auto", "remote") else None,
        "memory_lean": {"lookahead": level[0], "wgrad_lag": level[1]} if level != levels[0] else None,
        # [Note: task-time spread] in k3sched/variability.py
        "expected": expected(g.tasks, att.lane_orders, cfg, search.cost, serial=strategy == "serial")
        if spread_active(cfg, search.cost) else None})
    return Plan(cfg, g, strategy, sched.name, att.lane_orders, att.memory, metrics, ranks)

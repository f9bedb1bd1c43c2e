"""The free-order exact model with the device budget and activation decisions (OptPipe-style):
``solve_free`` and ``free_report`` ([Note: rounding] in k3sched/exact/__init__.py).

[Note: exact free-order model]
OptPipe's formulation on the task DAG of ``graph.build_step`` (no activation offload tasks):
* every lane of every stage runs one task at a time, in an order the solver picks (no backbone);
* each activation set (stage, mb, layer) is, by a decision, kept on the device; offloaded to
  its host (act.offload after the layer's forward, act.onload before its backward, on the
  offload_local lane); offloaded to the next stage's memory (act.roffload, act.rstore,
  act.rserve, act.ronload on the offload_remote lanes; the last stage has no such peer); or
  recomputed (dropped at the end of the layer's forward except the layer input, then the
  layer's forward tasks re-run on their lanes, compute and ep, before its backward). The added
  tasks, their durations and their memory effects are the planner's graph's (a graph built
  with that choice); the prefetch trigger of the planner's onloads is left to the solver;
* per stage a reservoir constraint keeps static bytes plus every present task's allocations
  (at its start) minus its frees (at its end), plus the bytes it holds for its peer, within the
  budget, as ``planner`` counts a stage's device peak (device + peer);
* minimise the makespan (the step time).
Durations are rounded up as in ``solve_exact``; found starts re-timed with the real durations
stay a schedule within the budget. Host memory is not bounded, as the planner does not bound it.
The bound of [Note: rounding] holds: its monotone shift keeps every allocation after the frees
that preceded it, so memory levels can only fall.

[Note: memory as a cumulative]
Each stage's device allocations are paired with the frees that return them (``_memory_pieces``:
a free takes bytes only from allocations of its ancestors in the DAG, an activation set's bytes
only from its own backward), and each pair is an interval from the allocating task's start to
the freeing task's end, its bytes the demand, in one cumulative per stage with capacity budget
minus static bytes; bytes never freed are held to the makespan. A set's pieces exist in one
version per choice: whole when kept; cut at the offload's end (the drop, for recompute) and
resumed at the onload's start (the first re-run task's) otherwise; the peer holds a remotely
offloaded set from the offload's start to the onload's end, and a recomputed set keeps its layer
input between the drop and the re-run. Only the version of the chosen storage is present. The
same levels as a reservoir of events, propagated far better by CP-SAT; if no pairing exists
(a free with no ancestor allocation) the model falls back to ``add_reservoir_constraint``.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

from ..config import Config
from ..graph import StepGraph, build_step
from ..tasks import Kind, Mem, Task, format_task_id
from .common import (STATUS, ExactResult, check_size, exact_config, gap_fields, int_durations, levels_fit,
                     int_lower_bound, one_at_a_time)

if TYPE_CHECKING:  # pragma: no cover
    from ..planner import Plan

ACT_CHOICES = ("keep", "local", "remote", "recompute")
_FWD_KINDS = ("attn.fwd", "router.fwd", "dispatch.fwd", "expert.fwd", "shared.fwd", "combine.fwd", "mlp.fwd")


def _option_tasks(cfg: Config, g: StepGraph, choices: Sequence[str]
                  ) -> tuple[dict[tuple[int, int, int], dict[str, list[Task]]], dict[tuple[int, int, int], list[str]]]:
    """Per activation set (stage, mb, layer) the tasks each non-keep choice adds, and the base tasks
    that must wait for the choice's last task (the layer's first backward tasks, which wait for an
    onload in the planner's graph). See [Note: exact free-order model]."""
    from ..cost import CostModel
    from ..graph import OffloadChoice

    pp = cfg.parallel.pp
    sets = [k for k, b in g.offload_sets.items() if b > 0]
    gl = build_step(cfg, OffloadChoice(local=set(sets)))
    remote = {k: k[0] + 1 for k in sets if k[0] + 1 < pp}
    gr = build_step(cfg, OffloadChoice(remote=remote)) if "remote" in choices and remote else None
    cost = CostModel(cfg)
    ckpt = int(cost.T * cfg.model.hidden * cost.b)  # the layer input, kept under recompute
    fwd: dict[tuple[int, int, int], list[Task]] = {}
    for t in g.tasks.values():
        if t.kind.value in _FWD_KINDS and t.mb is not None and t.layer is not None:
            fwd.setdefault((t.stage, t.mb, t.layer), []).append(t)
    opts: dict[tuple[int, int, int], dict[str, list[Task]]] = {}
    consumers: dict[tuple[int, int, int], list[str]] = {}
    onload_of = {format_task_id(s, Kind.ACT_ONLOAD, mb=m, layer=L): (s, m, L) for s, m, L in sets}
    for tid, t in gl.tasks.items():
        for d in t.deps:
            if d in onload_of:
                consumers.setdefault(onload_of[d], []).append(tid)
    for key in sets:
        s, m, L = key
        o: dict[str, list[Task]] = {}
        off = gl.tasks[format_task_id(s, Kind.ACT_OFFLOAD, mb=m, layer=L)]
        if "local" in choices:
            o["local"] = [replace(off, deps=list(off.deps)),
                          replace(gl.tasks[format_task_id(s, Kind.ACT_ONLOAD, mb=m, layer=L)])]
        if gr is not None and key in remote:
            peer = remote[key]
            o["remote"] = [replace(gr.tasks[format_task_id(st, k, mb=m, layer=L)]) for st, k in (
                (s, Kind.ACT_ROFFLOAD), (peer, Kind.ACT_RSTORE), (peer, Kind.ACT_RSERVE), (s, Kind.ACT_RONLOAD))]
        if "recompute" in choices:
            nbytes = max(0, g.offload_sets[key] - ckpt)
            drop = Task(f"s{s}/mb{m}/L{L}/drop@re", off.kind, "none", s, off.chunk, m, L, 0.0,
                        deps=list(off.deps), free=Mem(device=nbytes))
            copies = {f.id: f"{f.id}@re" for f in fwd[key]}
            re = [drop]
            for i, f in enumerate(sorted(fwd[key], key=lambda f: g.topo[f.id])):
                re.append(replace(f, id=copies[f.id], deps=[copies.get(d, d) for d in f.deps] + [f.id, drop.id],
                                  alloc=Mem(device=nbytes if i == 0 else 0), free=Mem()))
            o["recompute"] = re
        opts[key] = o
    return opts, consumers


def _memory_pieces(g: StepGraph) -> dict[int, list[tuple[str, str | None, int, tuple[int, int, int] | None]]] | None:
    """Each stage's device allocations paired with the frees that return them: [(allocating task,
    freeing task or None (held to the end of the step), bytes, activation set of the allocating
    forward task or None)]. A free is paired only with allocations of its ancestors (so the piece's
    interval has a non-negative length in every schedule), an activation set's bytes only with frees
    of the same set. None when some free finds no such allocation (then memory is modeled as a
    reservoir of events). See [Note: memory as a cumulative]."""
    tasks = g.tasks
    bit: dict[str, int] = {}
    for tid, t in tasks.items():
        if t.alloc.device:
            bit[tid] = 1 << len(bit)
    anc: dict[str, int] = {}
    for tid in sorted(tasks, key=g.topo.__getitem__):
        x = 0
        for d in tasks[tid].deps:
            x |= anc[d] | bit.get(d, 0)
        anc[tid] = x
    key_of = {tid: (t.stage, t.mb, t.layer) if t.kind.value in _FWD_KINDS and t.layer is not None else None
              for tid, t in tasks.items()}
    left: dict[int, list[list]] = {}
    for tid in sorted(bit, key=g.topo.__getitem__):
        t = tasks[tid]
        left.setdefault(t.stage, []).append([tid, t.alloc.device])
    out: dict[int, list] = {}
    for tid in sorted(tasks, key=g.topo.__getitem__):
        t = tasks[tid]
        frees = []
        if t.free.device:
            frees.append((t.stage, t.free.device))
        if t.release is not None and t.release[1]:
            frees.append((t.release[0], t.release[1]))
        mine = (t.stage, t.mb, t.layer)
        for st, need in frees:
            pool = left.get(st, [])
            # the set's own allocations first, then other non-set ones, earliest first
            for want_set in (True, False):
                for slot in pool:
                    a, rem = slot
                    if need == 0:
                        break
                    if rem == 0 or not (a == tid or anc[tid] & bit[a]):
                        continue
                    k = key_of[a]
                    if (k == mine) != want_set or (k is not None and k != mine):
                        continue
                    take = min(rem, need)
                    slot[1] -= take
                    need -= take
                    out.setdefault(st, []).append((a, tid, take, k))
            if need:
                return None
    for st, pool in left.items():
        for a, rem in pool:
            if rem:
                out.setdefault(st, []).append((a, None, rem, key_of[a]))
    return out


def _stretch(plan: "Plan", dur: dict[str, int]) -> dict[str, int]:
    """Integer starts of ``plan``'s own schedule under the (rounded up) durations ``dur``: a monotone
    map of its event times (every start and end), so every event keeps its order (ties stay ties)
    and each task still fits between its start and its end. Dependencies, lanes and the order of
    allocations and frees (hence the memory levels, which can only fall as ends come earlier) are
    those of the plan."""
    times = sorted({x for t in plan.tasks.values() for x in (t.start_us, t.end_us)})
    pos = {x: i for i, x in enumerate(times)}
    ending: dict[int, list[str]] = {}
    for tid, t in plan.tasks.items():
        ending.setdefault(pos[t.end_us], []).append(tid)
    at = [0] * len(times)
    for i in range(len(times)):
        v = at[i - 1] + 1 if i else 0
        for tid in ending.get(i, ()):
            v = max(v, at[pos[plan.tasks[tid].start_us]] + dur[tid])
        at[i] = v
    return {tid: at[pos[t.start_us]] for tid, t in plan.tasks.items()}


def _last_of(key: tuple[int, int, int], choice: str, tasks: list[Task], g: StepGraph) -> list[str]:
    """The option tasks the set's consumers wait for: the onload, or the copies of the forward's
    last tasks (those the offload waits for)."""
    if choice == "keep":
        return []
    if choice != "recompute":
        return [tasks[-1].id]
    return [f"{d}@re" for d in tasks[0].deps]


def solve_free(cfg: Config, *, budget_bytes: int | None = None, choices: Sequence[str] = ACT_CHOICES,
               hint_plans: "Sequence[Plan]" = (), deterministic_time: float = 5.0, time_limit_s: float = 60.0,
               workers: int = 1, seed: int = 0, scale: int = 100,
               fixed: "dict[tuple[int, int, int], str] | None" = None, memory: str = "cumulative") -> ExactResult:
    """Minimise the step time of ``cfg`` with the compute order free, the device memory bounded
    by ``budget_bytes`` (default ``cfg.budget_bytes``) and each activation set's storage a
    decision ([Note: exact free-order model]). Stops on CP-SAT's deterministic time
    (``deterministic_time``, single worker, fixed seed: the result does not depend on machine load;
    ``time_limit_s`` is only a safety net). ``hint_plans``: heuristic plans of the same config
    (any backbone on the same placement and offload policy); each one's schedule, re-timed with the
    rounded durations, is a starting solution when it stays within the budget. ``fixed``: activation
    sets whose storage is given (set -> choice), the rest decided. ``memory``: ``cumulative`` ([Note:
    memory as a cumulative]) or ``reservoir`` (the same levels as events; slower, kept as a check).
    """
    from ortools.sat.python import cp_model

    bad = [c for c in choices if c not in ACT_CHOICES]
    if bad or "keep" not in choices:
        raise ValueError(f"exact solve: activation choices must include keep and be among {', '.join(ACT_CHOICES)}; "
                         f"got {', '.join(choices)}")
    t0 = time.perf_counter()
    ecfg = exact_config(cfg)
    budget = int(cfg.budget_bytes if budget_bytes is None else budget_bytes)
    g = build_step(ecfg)
    base = g.tasks
    check_size(len(base))
    opts, consumers = _option_tasks(ecfg, g, choices)
    every, owner = _every_task(base, opts)
    dur = {tid: int(math.ceil(t.duration_us * scale - 1e-9)) for tid, t in every.items()}
    rounding_us = sum(dur[t] / scale - every[t].duration_us for t in every)
    cands, unusable = _plan_candidates(g, every, owner, dur, hint_plans, choices, scale)
    hint, rejected = _free_hint(g, every, opts, dur, cands, budget, unusable)
    head, tail, lb = int_lower_bound(g, dur, scale)
    horizon = hint[2] if hint is not None else sum(dur.values())
    lb = min(lb, horizon)
    m = cp_model.CpModel()
    start, lit, one, by_res = _free_variables(m, g, opts, dur, head, tail, horizon, fixed)
    makespan = _free_precedence(m, g, opts, consumers, start, lit, dur, lb, horizon)
    for ivs in by_res.values():
        if len(ivs) > 1:
            m.add_no_overlap(ivs)
    if memory not in ("cumulative", "reservoir"):
        raise ValueError(f"exact solve: memory must be cumulative or reservoir; got {memory!r}")
    pieces = _memory_pieces(g) if memory == "cumulative" else None
    if pieces is None:  # no pairing of allocations with frees: one reservoir per stage
        _memory_reservoir(m, g, every, owner, start, lit, one, dur, budget)
    else:
        _memory_cumulative(m, g, pieces, opts, start, lit, dur, makespan, budget, horizon)
    m.minimize(makespan)
    if hint is not None:
        _add_free_hint(m, hint, start, lit, opts, makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = float(deterministic_time)
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    code = solver.solve(m)
    status = STATUS.get(int(code), str(code))
    found = _free_solution(solver, status, start, lit, opts, base, owner, hint, lb)
    if found is None:
        return ExactResult(status, math.inf, max(0.0, lb / scale - rounding_us), time.perf_counter() - t0,
                           num_tasks=len(base), rounding_us=rounding_us, mode="free-memory",
                           bound_int=float(lb), hints_rejected=rejected, scale=scale, budget_bytes=budget)
    status, ch, starts_i, bound_i = found
    out = _scheduled_tasks(every, starts_i, ch, opts, consumers, g, scale)
    makespan_us = max(t.end_us for t in out.values())
    bound_us = max(0.0, bound_i / scale - rounding_us)
    return ExactResult(status, makespan_us, min(bound_us, makespan_us), time.perf_counter() - t0,
                       {tid: t.start_us for tid, t in out.items()}, len(base),
                       None if hint is None else hint[2] / scale, rounding_us, "free-memory", None, None,
                       max(s + dur[t] for t, s in starts_i.items()) / scale, max(float(bound_i), float(lb)), rejected,
                       starts_i, scale, choices=ch, tasks=out, budget_bytes=budget)


_Key = tuple[int, int, int]  # an activation set: (stage, mb, layer)


def _every_task(base: dict[str, Task], opts: dict) -> tuple[dict[str, Task], dict[str, tuple[_Key, str]]]:
    """The base tasks and every option's tasks; each option task's owner (set, choice)."""
    every: dict[str, Task] = dict(base)
    owner: dict[str, tuple[_Key, str]] = {}
    for key, o in opts.items():
        for c, ts in o.items():
            for t in ts:
                every[t.id] = t
                owner[t.id] = (key, c)
    return every, owner


def _events(t: Task, s: int, d: int) -> list[tuple[int, int, int]]:
    """(stage, time, delta) memory events of ``t`` started at ``s`` with duration ``d`` (peer bytes
    count on the peer)."""
    e, end = [], s + d
    if t.alloc.device:
        e.append((t.stage, s, t.alloc.device))
    if t.free.device:
        e.append((t.stage, end, -t.free.device))
    if t.release is not None and t.release[1]:
        e.append((t.release[0], end, -t.release[1]))
    holder = t.peer_stage if t.peer_stage is not None else t.stage
    if t.alloc.peer:
        e.append((holder, s, t.alloc.peer))
    if t.free.peer:
        e.append((holder, end, -t.free.peer))
    return e


def _plan_candidates(g: StepGraph, every: dict[str, Task], owner: dict, dur: dict[str, int],
                     hint_plans: "Sequence[Plan]", choices: Sequence[str], scale: int) -> tuple[list, int]:
    """Candidate hints (integer starts, storage choices): one micro-batch at a time with every set
    kept, then each plan re-timed with the rounded durations, its offload choice mapped; and how many
    plans are on another graph (durations, tasks) or use a storage the model lacks."""
    base = g.tasks
    cands: list[tuple[dict[str, int], dict[_Key, str]]] = [(one_at_a_time(g, base, dur), {})]
    unusable = 0
    for p in hint_plans:
        pdur = int_durations(p.graph, scale)
        if any(tid not in p.tasks or pdur[tid] != dur[tid] for tid in base):
            unusable += 1
            continue
        h = _stretch(p, pdur)
        ch: dict[_Key, str] = {}
        ok = True
        for tid, t in p.tasks.items():
            if tid in base:
                continue
            if tid not in every or owner[tid][1] not in choices:
                ok = False
                break
            ch[owner[tid][0]] = owner[tid][1]
        if ok:
            cands.append((h, ch))
        else:
            unusable += 1
    return cands, unusable


def _free_hint(g: StepGraph, every: dict[str, Task], opts: dict, dur: dict[str, int], cands: list, budget: int,
               unusable: int) -> tuple[tuple | None, int]:
    """The shortest candidate within the budget as (starts, choices, makespan), and the plans left
    out (``unusable`` plus those over the budget; the one-at-a-time start may not fit)."""
    rejected, hint = unusable, None
    for i, (h, ch) in enumerate(cands):
        present = set(g.tasks) | {t.id for k, c in ch.items() for t in opts[k][c]}
        ev: dict[int, list[tuple[int, int]]] = {}
        for tid in present:
            for st, x, d in _events(every[tid], h[tid], dur[tid]):
                ev.setdefault(st, []).append((x, d))
        if not levels_fit(ev, budget, g.static_device):
            rejected += i > 0
            continue
        span_h = max(h[t] + dur[t] for t in present)
        if hint is None or span_h < hint[2]:
            hint = (h, ch, span_h)
    return hint, rejected


def _free_variables(m, g: StepGraph, opts: dict, dur: dict[str, int], head: dict[str, int], tail: dict[str, int],
                    horizon: int, fixed: "dict[_Key, str] | None"):
    """Starts of every task, one literal per (set, choice) (exactly one per set; ``fixed`` ones
    forced), the constant-true literal, and the intervals per (stage, lane) resource (optional for
    option tasks). Returns (start, lit, one, by_res)."""
    start: dict = {}
    lit: dict[tuple[_Key, str], object] = {}
    one = m.new_bool_var("one")
    m.add(one == 1)
    by_res: dict[tuple[int, str], list] = {}
    for tid, t in g.tasks.items():
        s = m.new_int_var(head[tid], max(head[tid], horizon - tail[tid] - dur[tid]), f"s:{tid}")
        start[tid] = s
        by_res.setdefault((t.stage, t.lane), []).append(m.new_fixed_size_interval_var(s, dur[tid], f"i:{tid}"))
    for key, o in opts.items():
        keep = m.new_bool_var(f"keep:{key}")
        lits = [keep]
        lit[(key, "keep")] = keep
        for c, ts in o.items():
            x = lit[(key, c)] = m.new_bool_var(f"{c}:{key}")
            lits.append(x)
            for t in ts:
                s = start[t.id] = m.new_int_var(0, max(0, horizon - dur[t.id]), f"s:{t.id}")
                if t.lane != "none":
                    by_res.setdefault((t.stage, t.lane), []).append(
                        m.new_optional_fixed_size_interval_var(s, dur[t.id], x, f"i:{t.id}"))
        m.add_exactly_one(lits)
        if fixed and key in fixed:
            if (key, fixed[key]) not in lit:
                raise ValueError(f"exact solve: activation set {key} cannot be {fixed[key]!r} here")
            m.add(lit[(key, fixed[key])] == 1)
    return start, lit, one, by_res


def _free_precedence(m, g: StepGraph, opts: dict, consumers: dict, start: dict, lit: dict, dur: dict[str, int],
                     lb: int, horizon: int):
    """Dependencies of the base tasks, of each option's tasks (enforced by its literal) and of the
    set's consumers on the option's last tasks; every task ends by the makespan, which is returned."""
    base = g.tasks
    for tid, t in base.items():
        for d in t.deps:
            m.add(start[d] + dur[d] <= start[tid])
        for d in g.start_deps.get(tid, ()):
            m.add(start[d] <= start[tid])
    makespan = m.new_int_var(lb, horizon, "makespan")
    has_succ = {d for t in base.values() for d in t.deps}
    for tid in base:
        if tid not in has_succ:
            m.add(start[tid] + dur[tid] <= makespan)
    for key, o in opts.items():
        for c, ts in o.items():
            x = lit[(key, c)]
            for t in ts:
                for d in t.deps:
                    m.add(start[d] + dur[d] <= start[t.id]).only_enforce_if(x)
                m.add(start[t.id] + dur[t.id] <= makespan).only_enforce_if(x)
            for last in _last_of(key, c, ts, g):
                for cons in consumers.get(key, ()):
                    m.add(start[last] + dur[last] <= start[cons]).only_enforce_if(x)
    return makespan


def _memory_reservoir(m, g: StepGraph, every: dict[str, Task], owner: dict, start: dict, lit: dict, one,
                      dur: dict[str, int], budget: int) -> None:
    """Each stage's memory as a reservoir of events, each active with its task's literal."""
    ev: dict[int, tuple[list, list, list]] = {}
    for tid, t in every.items():
        x = one if tid in g.tasks else lit[(owner[tid][0], owner[tid][1])]
        for st, when, d in _events(t, 0, dur[tid]):
            e = ev.setdefault(st, ([], [], []))
            e[0].append(start[tid] + when)
            e[1].append(int(d))
            e[2].append(x)
    for st, (times, deltas, actives) in ev.items():
        m.add_reservoir_constraint_with_active(times, deltas, actives, -sum(abs(d) for d in deltas) - 1,
                                               budget - int(g.static_device[st]))


def _memory_cumulative(m, g: StepGraph, pieces: dict, opts: dict, start: dict, lit: dict, dur: dict[str, int],
                       makespan, budget: int, horizon: int) -> None:
    """[Note: memory as a cumulative]: one interval per held piece (a version per storage choice,
    present with its literal), the peer's hold of a remote set, a recomputed set's layer input."""
    cum: dict[int, tuple[list, list]] = {}

    def hold(st: int, a, b, nbytes: int, x, name: str) -> None:
        size = m.new_int_var(0, horizon, f"z:{name}")
        iv = (m.new_interval_var(a, size, b, f"h:{name}") if x is None
              else m.new_optional_interval_var(a, size, b, x, f"h:{name}"))
        e = cum.setdefault(st, ([], []))
        e[0].append(iv)
        e[1].append(int(nbytes))

    end = lambda tid: start[tid] + dur[tid]  # noqa: E731
    for st, ps in pieces.items():
        for i, (a, f, nbytes, key) in enumerate(ps):
            stop = makespan if f is None else end(f)
            o = opts.get(key) if key is not None else None
            if not o:
                hold(st, start[a], stop, nbytes, None, f"{st}:{i}")
                continue
            hold(st, start[a], stop, nbytes, lit[(key, "keep")], f"{st}:{i}:keep")
            for c, ts in o.items():
                x = lit[(key, c)]
                if c == "recompute":  # dropped at the drop, back from the first copy's start
                    cut, back = start[ts[0].id], start[ts[1].id]
                else:  # away from the offload's end to the onload's start
                    cut, back = end(ts[0].id), start[ts[-1].id]
                hold(st, start[a], cut, nbytes, x, f"{st}:{i}:{c}:0")
                hold(st, back, stop, nbytes, x, f"{st}:{i}:{c}:1")
    for key, o in opts.items():
        s_ = key[0]
        if "remote" in o:  # the peer holds the set from the offload's start to the onload's end
            ts = o["remote"]
            hold(ts[0].peer_stage, start[ts[0].id], end(ts[-1].id), ts[0].alloc.peer, lit[(key, "remote")],
                 f"peer:{key}")
        if "recompute" in o:  # the layer input stays while the rest is dropped
            ts = o["recompute"]
            kept = g.offload_sets[key] - ts[0].free.device
            if kept:
                hold(s_, start[ts[0].id], start[ts[1].id], kept, lit[(key, "recompute")], f"ckpt:{key}")
    for st, (ivs, dem) in cum.items():
        m.add_cumulative(ivs, dem, budget - int(g.static_device[st]))


def _add_free_hint(m, hint: tuple, start: dict, lit: dict, opts: dict, makespan) -> None:
    h, ch, span_h = hint
    for tid, s in h.items():
        if tid in start:
            m.add_hint(start[tid], s)
    for key, o in opts.items():
        for c in ("keep", *o):
            m.add_hint(lit[(key, c)], int(ch.get(key, "keep") == c))
    m.add_hint(makespan, span_h)


def _free_solution(solver, status: str, start: dict, lit: dict, opts: dict, base: dict, owner: dict,
                   hint: tuple | None, lb: int) -> tuple[str, dict, dict[str, int], float] | None:
    """(status, choice per set, integer starts of the present tasks, proven bound) of the solve, or
    of the hint when the solver found nothing better in time; None when there is neither."""
    if status in ("OPTIMAL", "FEASIBLE"):
        ch = {key: next(c for c in ("keep", *o) if solver.boolean_value(lit[(key, c)])) for key, o in opts.items()}
        starts_i = {tid: solver.value(start[tid]) for tid in base}
        for key, c in ch.items():
            for t in opts[key].get(c, ()):
                starts_i[t.id] = solver.value(start[t.id])
        return status, ch, starts_i, solver.best_objective_bound
    if hint is not None:
        ch = {key: hint[1].get(key, "keep") for key in opts}
        starts_i = {tid: s for tid, s in hint[0].items() if tid in base or tid in owner}
        return "FEASIBLE", ch, starts_i, float(lb)
    return None


def _scheduled_tasks(every: dict[str, Task], starts_i: dict[str, int], ch: dict, opts: dict, consumers: dict,
                     g: StepGraph, scale: int) -> dict[str, Task]:
    """The present tasks with their start_us / end_us, the consumers of each non-kept set waiting
    for its option's last tasks."""
    out: dict[str, Task] = {}
    for tid, s in starts_i.items():
        t = replace(every[tid], deps=list(every[tid].deps))
        t.start_us = s / scale
        t.end_us = t.start_us + t.duration_us
        out[tid] = t
    for key, c in ch.items():
        for last in _last_of(key, c, opts[key].get(c, []), g):
            for cons in consumers.get(key, ()):
                out[cons].deps.append(last)
    return out


def free_report(cfg: Config, plan: "Plan", *, extra_hints: "Sequence[Plan]" = (), deterministic_time: float = 5.0,
                time_limit_s: float = 60.0) -> dict:
    """Solve ``cfg`` with ``solve_free`` under the config's budget (hinted with ``plan`` and
    ``extra_hints``) and compare ``plan`` with it, as ``exact_report`` does."""
    res = solve_free(cfg, hint_plans=[plan, *extra_hints], deterministic_time=deterministic_time,
                     time_limit_s=time_limit_s)
    heur = float(plan.metrics.step_time_us)
    if not math.isfinite(res.makespan_us):
        raise ValueError(f"no schedule within the budget found in deterministic time {deterministic_time:g} "
                         f"(CP-SAT status {res.status})")
    counts = {c: sum(1 for x in res.choices.values() if x == c) for c in ACT_CHOICES}
    return {
        **gap_fields(res, heur),
        "choices": counts,
        "budget_bytes": res.budget_bytes,
        "num_tasks": res.num_tasks,
        "rounding_us": res.rounding_us,
        "wall_s": res.wall_s,
    }

"""Pipeline schedules as plain data: generate, validate, simulate, import/export torch CSV.

The data model (``Action``, ``Pair``, ``Placement``, ``Schedule``, torch CSV; [Note: schedule data
model], [Note: torch CSV format]) is in :mod:`k3sched.schedule_ir`, the generators ([Note: dualpipe
mapping], [Note: controllable-memory V schedules]) in :mod:`k3sched.schedule_generators`. This
module re-exports both and holds the validator, the uniform-cost simulation, the registry
(``GENERATORS``, ``REGISTRY``) and ``generate``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .pipelines import TABLE, Pipeline
from .schedule_generators import require
from .schedule_ir import (BWD_OPS, OPS, PAIR_TAG, Action, Pair, Placement, Schedule, Slot, deps_of, resolve_dep,
                          parse_slot, slot_actions)
from .simulator import DeadlockError, simulate
from .tasks import Kind, Task

__all__ = ["BWD_OPS", "GENERATORS", "OPS", "PAIR_TAG", "REGISTRY", "Action", "Pair", "Placement", "Schedule",
           "Slot", "UniformResult", "check", "generate", "parse_slot", "simulate_uniform",
           "slot_actions", "validate"]


# ----------------------------------------------------------------------------------------------
# validation


@dataclass
class _Err:
    msg: str
    rank: int
    step: int

    def __str__(self) -> str:
        return f"rank {self.rank}, step {self.step}: {self.msg}"


def _validate(s: Schedule) -> list[_Err]:
    errs: list[_Err] = []
    if set(s.ranks) != set(range(s.pp)):
        errs.append(_Err(f"ranks are {sorted(s.ranks)}; expected 0..{s.pp - 1}", 0, 0))
        return errs
    index: dict[Action, tuple[int, int]] = {}
    home: dict[int, tuple[int, int]] = {}  # vstage -> first (rank, step) it was seen on
    for r in range(s.pp):
        done: set[Action] = set()
        for i, slot in enumerate(s.ranks[r]):
            if slot is not None and not isinstance(slot, (Action, Pair)):
                errs.append(_Err(f"slot {slot!r} is not an Action, Pair or None", r, i))
                continue
            for a in slot_actions(slot):
                if not 0 <= a.vstage < s.num_stages:
                    errs.append(_Err(f"{a}: vstage outside 0..{s.num_stages - 1}", r, i))
                    continue
                if a.mb >= s.microbatches:
                    errs.append(_Err(f"{a}: micro-batch outside 0..{s.microbatches - 1}", r, i))
                    continue
                if a.vstage not in s.route(a.mb):
                    errs.append(_Err(f"{a}: micro-batch {a.mb} does not pass vstage {a.vstage}", r, i))
                    continue
                want = s.placement.rank_of(a.vstage)
                if a.vstage in home and home[a.vstage][0] != r:
                    hr, hi = home[a.vstage]
                    errs.append(_Err(f"{a}: vstage {a.vstage} is on two ranks ({hr} at step {hi} and {r})", r, i))
                else:
                    home.setdefault(a.vstage, (r, i))
                    if want != r:
                        errs.append(_Err(f"{a}: vstage {a.vstage} belongs to rank {want} by the "
                                         f"{s.placement.style} placement", r, i))
                if a in index:
                    errs.append(_Err(f"{a} appears twice (first at rank {index[a][0]}, step {index[a][1]})", r, i))
                    continue
                f, ii = Action(a.vstage, "F", a.mb), Action(a.vstage, "I", a.mb)
                b = Action(a.vstage, "B", a.mb)
                if a.op in BWD_OPS and f not in done:
                    errs.append(_Err(f"{a} before its forward {f}", r, i))
                if a.op == "W" and ii not in done:
                    errs.append(_Err(f"{a} before its input backward {ii}", r, i))
                if (a.op == "I" and b in index) or (a.op == "B" and ii in index):
                    errs.append(_Err(f"{a}: micro-batch has both a full backward B and a split I", r, i))
                if a.op == "W" and b in index:
                    errs.append(_Err(f"{a}: micro-batch already has a full backward {b}", r, i))
                index[a] = (r, i)
            done.update(slot_actions(slot))
    # completeness: every (vstage, mb) on its route has one F and one backward
    for mb in range(s.microbatches):
        for v in s.route(mb):
            r = s.placement.rank_of(v)
            end = (r, len(s.ranks[r]))
            f, ii, w, b = (Action(v, op, mb) for op in "FIWB")
            if f not in index:
                errs.append(_Err(f"missing forward {f}", *end))
            if b not in index and ii not in index:
                errs.append(_Err(f"missing backward {b} (or {ii} and {w})", *end))
            if ii in index and w not in index:
                errs.append(_Err(f"missing weight backward {w} after {ii}", *end))
    if errs:
        return errs
    # deadlock: evaluate the dependency + per-rank order graph on unit-duration tasks
    try:
        _simulate(s, 1.0, 2.0, 1.0, 0.0, with_deps_on_same_rank=True)
    except DeadlockError:
        r, i, a, need = _stuck_head(s, index)
        errs.append(_Err(f"deadlock: {a} waits for {need}, which waits (directly or not) for this rank", r, i))
    return errs


def _stuck_head(s: Schedule, index: dict[Action, tuple[int, int]]) -> tuple[int, int, Action, Action]:
    """Run ranks in order until none can progress; return the first blocked head slot."""
    pos = {r: 0 for r in range(s.pp)}
    done: set[Action] = set()

    def blocker(slot: Slot) -> tuple[Action, Action] | None:
        for a in slot_actions(slot):
            for d in deps_of(s, a):
                rd = resolve_dep(index, d)
                if rd is not None and rd not in done and rd not in slot_actions(slot):
                    return a, rd
        return None

    progress = True
    while progress:
        progress = False
        for r in range(s.pp):
            while pos[r] < len(s.ranks[r]) and blocker(s.ranks[r][pos[r]]) is None:
                done.update(slot_actions(s.ranks[r][pos[r]]))
                pos[r] += 1
                progress = True
    for r in range(s.pp):
        if pos[r] < len(s.ranks[r]):
            a, need = blocker(s.ranks[r][pos[r]])  # type: ignore[misc]
            return r, pos[r], a, need
    raise AssertionError("simulate reported a deadlock the progress sweep does not see")


def validate(schedule: Schedule) -> list[str]:
    """All problems of ``schedule`` as ``"rank R, step S: ..."`` strings; empty when valid."""
    return [str(e) for e in _validate(schedule)]


def check(schedule: Schedule) -> Schedule:
    """Raise ValueError (first problem, the count, and the grid with the failing slot marked
    ``<-- ERROR HERE``) unless ``schedule`` is valid; returns it otherwise."""
    errs = _validate(schedule)
    if errs:
        e = errs[0]
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise ValueError(f"schedule {schedule.name!r} (pp {schedule.pp}, vpp {schedule.vpp}, "
                         f"microbatches {schedule.microbatches}) is invalid: {e}{more}\n\n"
                         f"{schedule.render_grid(error=(e.rank, e.step))}")
    return schedule


# ----------------------------------------------------------------------------------------------
# uniform-cost simulation


@dataclass
class UniformResult:
    """Times in the unit of F/B/W. ``bubble[r]`` = idle compute time of rank r / step time."""

    step_time: float
    busy: dict[int, float]
    idle: dict[int, float]
    bubble: dict[int, float]
    peak_inflight: dict[int, int]
    """Peak count of (vstage, mb) activation sets held on the rank (F start .. W or B end)."""
    starts: dict[tuple[int, int], float]
    """(rank, step) -> start time of that slot."""

    @property
    def peak_activations(self) -> dict[int, float]:
        """peak_inflight in units of one micro-batch through all of a rank's layers (/vpp)."""
        return {r: n / self._vpp for r, n in self.peak_inflight.items()}

    _vpp: int = 1


def _simulate(s: Schedule, F: float, B: float, W: float, comm: float,
              with_deps_on_same_rank: bool = False) -> tuple[float, dict[str, Task], dict[tuple[int, int], str]]:
    I = B - W
    dur = {"F": F, "I": I, "W": W, "B": B}
    index: dict[Action, tuple[int, int]] = {}
    for r, i, a in s.actions():
        index[a] = (r, i)
    tid = {(r, i): f"r{r}/{i}/{s.ranks[r][i]}" for r in s.ranks for i in range(len(s.ranks[r]))}
    tasks: dict[str, Task] = {}
    orders: dict[tuple[int, str], list[str]] = {}
    for r in range(s.pp):
        order = []
        for i, slot in enumerate(s.ranks[r]):
            if slot is None:
                continue
            deps: list[str] = []
            for a in slot_actions(slot):
                for d in deps_of(s, a):
                    rd = resolve_dep(index, d)
                    if rd is None:
                        continue
                    dr, di = index[rd]
                    if (dr, di) == (r, i):
                        continue
                    if dr == r and not with_deps_on_same_rank:
                        continue
                    src = tid[(dr, di)]
                    if dr != r and comm > 0:
                        cid = f"p2p/{src}->{tid[(r, i)]}"
                        if cid not in tasks:
                            tasks[cid] = Task(cid, Kind.FWD_SEND, "collective", dr, 0, a.mb, None,
                                              duration_us=comm, deps=[src])
                            orders[(dr, cid)] = [cid]
                        src = cid
                    deps.append(src)
            parts = slot_actions(slot)
            tasks[tid[(r, i)]] = Task(tid[(r, i)], Kind.ATTN_FWD, "compute", r, 0, parts[0].mb, None,
                                      duration_us=sum(dur[a.op] for a in parts), deps=deps)
            order.append(tid[(r, i)])
        orders[(r, "compute")] = order
    step = simulate(tasks, orders)
    return step, tasks, tid


def simulate_uniform(schedule: Schedule, F: float = 1.0, B: float = 2.0, W: float | None = None,
                     comm: float = 0.0) -> UniformResult:
    """Step time, per-rank bubble and peak in-flight activations with uniform costs.

    ``B`` is the full backward; ``W`` its weight part (default ``B/2``), so I = B - W. A Pair
    lasts F + B (its backward's B or I). ``comm`` delays every cross-rank dependency.
    """
    if W is None:
        W = B / 2
    if not 0 <= W <= B:
        raise ValueError(f"need 0 <= W <= B; got W {W}, B {B}")
    step, tasks, tid = _simulate(schedule, F, B, W, comm)
    busy: dict[int, float] = defaultdict(float)
    events: dict[int, list[tuple[float, int]]] = defaultdict(list)
    starts: dict[tuple[int, int], float] = {}
    for r in range(schedule.pp):
        for i, slot in enumerate(schedule.ranks[r]):
            if slot is None:
                continue
            t = tasks[tid[(r, i)]]
            assert t.start_us is not None and t.end_us is not None
            starts[(r, i)] = t.start_us
            busy[r] += t.end_us - t.start_us
            for a in slot_actions(slot):
                if a.op == "F":
                    events[r].append((t.start_us, 1))
                elif a.op in ("W", "B"):
                    events[r].append((t.end_us, -1))
    peak: dict[int, int] = {}
    for r in range(schedule.pp):
        cur = best = 0
        for _, delta in sorted(events[r]):  # frees (-1) sort before allocs (+1) at equal times
            cur += delta
            best = max(best, cur)
        peak[r] = best
    idle = {r: step - busy[r] for r in range(schedule.pp)}
    bubble = {r: (idle[r] / step if step else 0.0) for r in range(schedule.pp)}
    return UniformResult(step, dict(busy), idle, bubble, peak, starts, _vpp=schedule.vpp)


GENERATORS = {name: p.generator for name, p in TABLE.items()}
REGISTRY: dict[str, Pipeline] = TABLE
"""Every schedule's entry (:mod:`k3sched.pipelines`, [Note: schedule registry])."""


def generate(name: str, pp: int, vpp: int, microbatches: int, *, warmup_extra: int = 0) -> Schedule:
    """Generate the named schedule (one of ``GENERATORS``) and check it; ValueError with the
    reason when the name or the (pp, vpp, microbatches) combination is not supported.

    ``warmup_extra`` only applies to ``interleaved-1f1b`` (Kimi K2's extra warm-up
    micro-batches); other schedules reject a non-zero value.
    """
    gen = GENERATORS.get(name)
    if gen is None:
        raise ValueError(f"pipeline schedule {name!r} is not supported; supported: {', '.join(GENERATORS)}")
    require(pp >= 1 and vpp >= 1 and microbatches >= 1,
          f"{name}: need pp, vpp, microbatches >= 1; got {pp}, {vpp}, {microbatches}")
    require(warmup_extra >= 0, f"warmup_extra must be >= 0; got {warmup_extra}")
    require(warmup_extra == 0 or name == "interleaved-1f1b",
          f"warmup_extra applies to interleaved-1f1b only; {name} got {warmup_extra}")
    return check(gen(pp, vpp, microbatches, warmup_extra))

"""Static check of a plan's point-to-point transfers under NCCL semantics (no torch).

[Note: NCCL P2P model]
gloo buffers where NCCL blocks, and NCCL ignores tags, so a plan that trains on gloo can hang on
GPUs. :func:`check_p2p_transfers` executes a plan abstractly, one rank per PP stage (the ranks of a stage
run the same lanes; their collectives on ep / dense / expert / optim groups involve that stage
only), under these rules:

* each stage runs the lane program its ranks run, lowered from the plan by the same passes
  ([Note: lowering] in k3sched/lowering.py): a lane runs its tasks in order, one at a time; a
  task starts once the task before it on its lane finished, its same-stage dependencies (plan
  ``deps``, shared-link and ``serial`` tokens) finished and its ``start_deps`` started;
  dependencies on other stages are satisfied by the transfer itself;
* a P2P task posts one operation on a communicator: act.send / grad.send / act.roffload /
  act.rserve a send, act.recv / grad.recv / act.rstore / act.ronload a receive (a remote
  transfer's header and payload travel back to back: one operation);
* operations on one communicator complete in the order the stage issued them (one stream per
  communicator, driven by one lane); a send completes only together with its matching receive,
  once both are first on their stage's stream of that communicator (a send blocks until the peer
  has posted the receive); NCCL matches the k-th send from a to b with b's k-th receive from a
  on that communicator, whatever the tag;
* act.send / grad.send end once posted (``isend``; the runtime waits for them at the end of the
  step); every other P2P task ends when its operation completes.

Which communicator carries a transfer is the ``comms`` policy:

``directed`` (the runtime, [Note: rank layout] in runtime/groups.py)
    one per (kind, sending stage, receiving stage): activations a->b, gradients b->a, each its own;
``kind``
    one per (kind, stage pair): the earlier ``pp`` / ``pp_grad`` groups (NCCL's P2P communicator is
    per peer pair), activations of V placements cross on it in both directions;
``shared``
    one per stage pair for both kinds (a single ``pp`` group);

remote offload (roffload / rstore / rserve / ronload) uses one communicator per pipeline column in
every policy (the offload_remote lane's group; its transfers block the lane anyway).

The execution stalls exactly when the plan would deadlock under these rules; the wait-for graph
of the stalled tasks (lane order, dependency, issue order on a communicator, matching transfer)
then has a cycle, and :class:`P2PDeadlock` names it in one line: task ids (``sN/...`` = stage N:
every rank of PP stage N) and why each waits for the next. Order mismatches (the k-th send is not
the peer's k-th receive: NCCL would deliver the wrong tensor) and transfers without a partner
are reported too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from .lowering import LoweringError, PlanTask, lower_stage
from .tasks import LANES, RECV_KINDS, SEND_KINDS, SEND_OF, Kind

POSTED_ONLY = frozenset({Kind.FWD_SEND, Kind.BWD_SEND})
"""Sends whose task ends once posted (isend, waited at the end of the step)."""
COMM_POLICIES = ("directed", "kind", "shared")


class P2PDeadlock(ValueError):
    """The plan cannot complete under NCCL point-to-point semantics; one line naming why."""


@dataclass
class _View:
    """What the check reads of a plan: per stage, per lane, the ordered tasks, and each task's
    same-stage dependencies, as the stage's rank runs them ([Note: lowering] in k3sched/lowering.py)."""

    lanes: dict[int, dict[str, list[PlanTask]]]
    deps: dict[str, tuple[str, ...]]


def _view(plan) -> _View:
    """A plan.json dict, or a :class:`k3sched.planner.Plan` read as its plan.json, lowered stage by
    stage as the runtime lowers it (:func:`k3sched.lowering.lower_stage`, the step table's implied data edges included).
    Raises :class:`k3sched.lowering.LoweringError` for a stage that cannot be lowered."""
    if not isinstance(plan, Mapping):
        from .planfile import plan_to_json

        plan = plan_to_json(plan, native=True)  # read once into PlanTasks, which copy what they keep
    lanes: dict[int, dict[str, list[PlanTask]]] = {}
    deps: dict[str, tuple[str, ...]] = {}
    for st in plan["stages"]:
        prog = lower_stage(plan, int(st["stage"]))
        lanes[prog.stage] = prog.lanes
        deps.update(prog.deps)
    return _View(lanes, deps)


def _comm(kind: Kind, src: int, dst: int, comms: str) -> str:
    """The communicator of a transfer from stage ``src`` to ``dst`` under policy ``comms``."""
    if kind in (Kind.ACT_ROFFLOAD, Kind.ACT_RSTORE, Kind.ACT_RSERVE, Kind.ACT_RONLOAD):
        return "remote"
    what = "act" if kind in (Kind.FWD_SEND, Kind.FWD_RECV) else "grad"
    if comms == "directed":
        return f"{what} {src}->{dst}"
    lo, hi = min(src, dst), max(src, dst)
    return f"{what} {lo}<->{hi}" if comms == "kind" else f"pp {lo}<->{hi}"


@dataclass
class Result:
    """What :func:`analyse` found: ``error`` None when the plan completes; ``cycle`` the task
    ids of the wait-for cycle (closing on its first) when it deadlocks."""

    error: str | None
    cycle: list[str] | None = None
    transfers: int = 0


class _Mismatch(Exception):
    """A transfer without its partner, or two paired out of order: the plan cannot run."""


def _partners(task: dict[str, PlanTask]) -> dict[str, str]:
    """Send <-> receive, from each receive's dependency on its send (on another stage)."""
    partner: dict[str, str] = {}
    for t in task.values():
        if t.kind in RECV_KINDS:
            want = SEND_OF[t.kind]
            sends = [d for d in t.deps if d in task and task[d].kind is want and task[d].stage != t.stage]
            if len(sends) != 1:
                raise _Mismatch(f"{t.id} (stage {t.stage}): {'no' if not sends else 'more than one'} matching "
                                f"{want.value} on another stage among its dependencies")
            if sends[0] in partner:
                raise _Mismatch(f"{sends[0]} is received twice: by {partner[sends[0]]} and {t.id}")
            partner[sends[0]], partner[t.id] = t.id, sends[0]
    for t in task.values():
        if t.kind in SEND_KINDS and t.id not in partner:
            raise _Mismatch(f"{t.id} (stage {t.stage}): no stage receives it (a send without a matching receive "
                            "never completes)")
    return partner


def _match_by_order(v: _View, task: dict[str, PlanTask], partner: dict[str, str], comm: dict[str, str]) -> dict[str, str]:
    """NCCL matching: the k-th send a->b on a communicator meets b's k-th receive from a on it;
    raises :class:`_Mismatch` where that is not the planned partner."""
    sent: dict[tuple, list[str]] = {}
    recvd: dict[tuple, list[str]] = {}
    for s in sorted(v.lanes):
        for lane in LANES:
            for t in v.lanes[s][lane]:
                if t.id in partner:
                    p = task[partner[t.id]]
                    if t.kind in SEND_KINDS:
                        sent.setdefault((comm[t.id], s, p.stage), []).append(t.id)
                    else:
                        recvd.setdefault((comm[t.id], p.stage, s), []).append(t.id)
    match: dict[str, str] = {}
    for key, ids in sent.items():
        got = recvd.get(key, [])
        c, a, b = key
        for k, (x, y) in enumerate(zip(ids, got)):
            if partner[x] != y:
                raise _Mismatch(f"communicator {c}: transfer #{k} from stage {a} to stage {b} is {x} on "
                                f"stage {a} but {y} on stage {b} (NCCL pairs them by order, not tag)")
            match[x], match[y] = y, x
    return match


@dataclass
class _Run:
    """The abstract execution of [Note: NCCL P2P model]: lanes run in order; a transfer task
    blocks its lane until its transfer completed, and a transfer completes when it is at the head
    of its communicator queue on both ranks."""

    v: _View
    task: dict[str, PlanTask]
    deps: dict[str, tuple[str, ...]]
    comm: dict[str, str]
    match: dict[str, str]
    started: set[str] = field(default_factory=set)
    done: set[str] = field(default_factory=set)
    complete: set[str] = field(default_factory=set)
    queues: dict[tuple[int, str], deque] = field(default_factory=dict)
    # [Note: P2P check worklist]: lanes to visit, and the lanes waiting for a task to finish (or
    # its transfer to complete) / to start
    dirty: set[tuple[int, str]] = field(default_factory=set)
    wait_done: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    wait_started: dict[str, list[tuple[int, str]]] = field(default_factory=dict)

    def _blocker(self, t: PlanTask) -> tuple[set[str], str] | None:
        """What keeps ``t`` from starting: (the set it must join, the task), or None when ready."""
        for d in self.deps[t.id]:
            if d not in self.done:
                return self.done, d
        for d in t.start_deps:
            if d not in self.started:
                return self.started, d
        return None

    def _advance_lane(self, key: tuple[int, str], ts: list[PlanTask], i: int) -> tuple[int, bool]:
        """Start and finish tasks of one lane from position ``i``: (the new position, whether a
        task started: a start can make a start dependency elsewhere ready). A lane that stops
        registers with what it waits for (a task to finish or start, a transfer to complete),
        which wakes it ([Note: P2P check worklist])."""
        s, began = key[0], False
        while i < len(ts):
            t = ts[i]
            if t.id not in self.started:
                blocker = self._blocker(t)
                if blocker is not None:
                    on, d = blocker
                    (self.wait_done if on is self.done else self.wait_started).setdefault(d, []).append(key)
                    break
                self.started.add(t.id)
                began = True
                self._wake(self.wait_started, t.id)
                if t.id in self.comm:
                    self.queues.setdefault((s, self.comm[t.id]), deque()).append(t.id)
            if t.id in self.comm and t.kind not in POSTED_ONLY and t.id not in self.complete:
                self.wait_done.setdefault(t.id, []).append(key)  # woken when the transfer completes
                break
            self.done.add(t.id)
            self._wake(self.wait_done, t.id)
            i += 1
        return i, began

    def _wake(self, waiting: dict[str, list[tuple[int, str]]], tid: str) -> None:
        keys = waiting.pop(tid, None)
        if keys:
            self.dirty.update(keys)

    def _complete_heads(self) -> bool:
        """Complete every transfer at the head of its queue on both ranks; whether any did."""
        changed = False
        for (s, c), q in self.queues.items():
            while q:
                x = q[0]
                if self.task[x].kind not in SEND_KINDS:
                    break
                y = self.match[x]
                qy = self.queues.get((self.task[y].stage, c))
                if not qy or qy[0] != y:
                    break
                q.popleft()
                qy.popleft()
                self.complete.update((x, y))
                self._wake(self.wait_done, x)
                self._wake(self.wait_done, y)
                changed = True
        return changed

    def execute(self) -> list[str]:
        """Run to a fixed point; the tasks left unfinished (or with a transfer not complete).

        [Note: P2P check worklist] Sweeps visit the lanes in a fixed order until nothing moves,
        completing queue heads after each sweep; a sweep skips a lane that nothing woke since it
        last stopped (it would stop at the same task again), so the result, queue order included,
        is that of visiting every lane every sweep, at a fraction of the cost."""
        order = [(s, lane) for s in self.v.lanes for lane in LANES]
        pos = dict.fromkeys(order, 0)
        self.dirty.update(order)
        changed = True
        while changed:
            changed = False
            for key in order:
                if key in self.dirty:
                    self.dirty.discard(key)
                    i, began = self._advance_lane(key, self.v.lanes[key[0]][key[1]], pos[key])
                    if began or i != pos[key]:
                        pos[key], changed = i, True
            changed = self._complete_heads() or changed
        return [tid for tid in self.task if tid not in self.done or (tid in self.comm and tid not in self.complete)]

    def waits(self, tid: str, lane_prev: dict[str, str | None]) -> tuple[str, str]:
        """(the task ``tid`` waits for, why) of a task not finished or a transfer not complete."""
        t = self.task[tid]
        if tid not in self.started:
            prev = lane_prev[tid]
            if prev is not None and prev not in self.done:
                return prev, f"before it on the {t.lane} lane"
            for d in self.deps[tid]:
                if d not in self.done:
                    return d, "its dependency" if d in t.deps else "the link token before it"
            for d in t.start_deps:
                if d not in self.started:
                    return d, "its start dependency"
            raise AssertionError(f"{tid} is ready but did not start")  # pragma: no cover
        c = self.comm[tid]
        q = self.queues[(t.stage, c)]
        k = q.index(tid)
        if k:
            return q[k - 1], f"issued before it on communicator {c}"
        y = self.match[tid]
        other = "receive" if t.kind in SEND_KINDS else "send"
        if y not in self.started:
            return y, f"its matching {other}, not posted"
        qy = self.queues[(self.task[y].stage, c)]
        return qy[qy.index(y) - 1], f"issued before its matching {other} {y} on communicator {c}"

    def cycle(self, pending: list[str]) -> tuple[str, list[tuple[str, str]]]:
        """The wait-for cycle reached from the earliest-planned pending task: (its first task,
        [(task, why the one before it waits for it)], closing on the first)."""
        lane_prev: dict[str, str | None] = {}
        for lanes in self.v.lanes.values():
            for ts in lanes.values():
                for i, t in enumerate(ts):
                    lane_prev[t.id] = ts[i - 1].id if i else None
        seen: dict[str, int] = {}
        path: list[tuple[str, str]] = []
        cur = min(pending, key=lambda tid: (self.task[tid].start_us, tid))
        while cur not in seen:
            seen[cur] = len(path)
            nxt, why = self.waits(cur, lane_prev)
            path.append((nxt, why))
            cur = nxt
        return cur, path[seen[cur]:]


def analyse(plan, comms: str = "directed") -> Result:
    """Run the [Note: NCCL P2P model] on a plan.json dict or a Plan object."""
    if comms not in COMM_POLICIES:
        raise ValueError(f"comms: one of {', '.join(COMM_POLICIES)}; got {comms!r}")
    try:
        v = _view(plan)
    except LoweringError as e:
        return Result(str(e))
    task = {t.id: t for lanes in v.lanes.values() for ts in lanes.values() for t in ts}
    try:
        partner = _partners(task)
        comm: dict[str, str] = {}
        for tid, p in partner.items():
            t = task[tid]
            src, dst = (t.stage, task[p].stage) if t.kind in SEND_KINDS else (task[p].stage, t.stage)
            comm[tid] = _comm(t.kind, src, dst, comms)
        match = _match_by_order(v, task, partner, comm)
    except _Mismatch as e:
        return Result(str(e))
    run = _Run(v, task, v.deps, comm, match)
    pending = run.execute()
    n = len(partner) // 2
    if not pending:
        return Result(None, transfers=n)
    cur, cyc = run.cycle(pending)
    ids = [cur] + [tid for tid, _ in cyc]
    stages = sorted({task[tid].stage for tid in ids})
    text = cur + "".join(f" -> {tid} [{why}]" for tid, why in cyc)
    return Result(f"P2P deadlock under NCCL semantics (communicators: {comms}), stage{'s' if len(stages) > 1 else ''} "
                  f"{', '.join(map(str, stages))}: {text}", ids, n)


def check_p2p_transfers(plan, comms: str = "directed") -> int:
    """Raise :class:`P2PDeadlock` (one line) when ``plan`` (plan.json dict or Plan) cannot
    complete under the [Note: NCCL P2P model]; else return the number of transfers checked."""
    r = analyse(plan, comms)
    if r.error is not None:
        raise P2PDeadlock(r.error)
    return r.transfers

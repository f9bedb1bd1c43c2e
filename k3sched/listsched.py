"""One list schedule of a step graph: the event-driven scheduler behind the planner's ``k3`` and
``serial`` strategies (see the module docstring of :mod:`k3sched.planner` for the rules). The
planner calls :func:`list_schedule` once per offload choice and memory level it tries."""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

from .cost import CostModel
from .graph import StepGraph
from .simulator import DeadlockError
from .tasks import LANE_INDEX, LANES, P2P_KINDS, RECV_KINDS, SEND_OF, WGRAD_KINDS, Kind

# -- list scheduler ---------------------------------------------------------------------------
_BACKGROUND = frozenset({Kind.GRAD_RS, Kind.GSHARD_ONLOAD, Kind.GSHARD_OFFLOAD})


@dataclass
class Prepared:
    """Per-task arrays of a step graph, built once and reused by every scheduling attempt."""

    ids: list[str]
    succ: list[list[int]]
    ssucc: list[list[int]]
    ndeps: list[int]
    nsdeps: list[int]
    stage: list[int]
    lane: list[int]
    slot: list[int]
    wgrad: list[bool]
    main: list[bool]
    p2p: list[bool]
    background: list[bool]
    dur: list[float]
    feeds_main: list[bool]  # a non-compute task whose end a main compute task of its stage waits on
    forward: list[bool]  # a main task of a forward (F) backbone unit
    comm: list[int]  # the communicator of a pipeline send or receive, -1 for other tasks
    send_of: list[int]  # a pipeline receive's send, -1 for other tasks
    ncomms: int
    layer: list[int]  # the task's layer, -1 for none
    vstage: list[int]  # the task's virtual stage (model chunk) in the backbone


# [Note: receives in send order] NCCL pairs the k-th send from stage a to stage b with b's k-th
# receive from a on their communicator, whatever the tag (k3sched/p2pcheck.py). A receive becomes
# ready when its send ended, and the sends of one communicator leave one lane one at a time, so the
# receives become ready in send order; but a busy receiving lane that picked among ready receives
# by its own backbone slot would, where the sender runs two micro-batches' backwards out of slot
# order (look-ahead while an all-to-all is in flight), post the receives in the other order, a
# plan the P2P check refuses (e.g. s9 sends mb31's gradient before mb30's while s8 posts mb30's
# receive first). So the receives of a communicator start in the order their sends started:
# one that is ready before its turn is held until the receive before it started.
_PIPE_RECV = RECV_KINDS & P2P_KINDS  # act.recv, grad.recv (not the remote-offload receives)


_MAX_SLOT = 1 << 30
# [Note: compute tasks outside the backbone gate] A compute task is "main" (counts for the slot
# gate, :class:`_SlotGate`) when it is backbone work: not WGrad, not the optimizer, and not
# gshard.add, the host-shard accumulation of a flushed gradient (grad_offload). gshard.add waits on
# its layer's DP reduce-scatter, a background collective that yields the NIC to every EP and P2P
# transfer; as a main task it would hold every later slot of its rank until those buckets were
# through, with the rank's compute idle meanwhile. Outside the gate it
# still runs with its slot's priority (ahead of later slots) as soon as its reduction is done.
_NOT_MAIN = frozenset({Kind.OPTIM, Kind.GSHARD_ADD})


def prepare(g: StepGraph, slots: dict[tuple[int, str, int], int]) -> Prepared:
    tasks = g.tasks
    ids = list(tasks)  # creation order == topological order
    index = {t: i for i, t in enumerate(ids)}
    n = len(ids)
    succ: list[list[int]] = [[] for _ in range(n)]
    ssucc: list[list[int]] = [[] for _ in range(n)]
    ndeps, nsdeps, stage, lane, slot, wgrad, main, p2p, bg, dur, fwd = ([] for _ in range(11))
    comm, send_of = [-1] * n, [-1] * n  # [Note: receives in send order]
    comm_ids: dict[tuple[Kind, int, int], int] = {}
    unit, start_deps, slot_of = g.unit, g.start_deps, slots.get
    for i, tid in enumerate(ids):
        t = tasks[tid]
        kind = t.kind
        v, u, mb = unit[tid]
        s = slot_of((v, u, mb))
        if s is None:
            s = _MAX_SLOT if (kind is Kind.OPTIM or mb < 0) else slot_of((v, "I", mb), _MAX_SLOT)
        ln = LANE_INDEX[t.lane]
        wg = kind in WGRAD_KINDS
        m = ln == 0 and not wg and kind not in _NOT_MAIN
        stage.append(t.stage)
        lane.append(ln)
        slot.append(s)
        wgrad.append(wg)
        main.append(m)
        fwd.append(m and u == "F")
        p2p.append(kind in P2P_KINDS)
        bg.append(kind in _BACKGROUND)
        dur.append(t.duration_us)
        deps = t.deps
        for d in deps:
            succ[index[d]].append(i)
        ndeps.append(len(deps))
        sd = start_deps.get(tid, ())
        for d in sd:
            ssucc[index[d]].append(i)
        nsdeps.append(len(sd))
        if kind in _PIPE_RECV:
            sk = SEND_OF[kind]
            d = next(index[d] for d in deps if tasks[d].kind is sk)
            c = comm_ids.setdefault((kind, stage[d], t.stage), len(comm_ids))
            comm[i] = comm[d] = c
            send_of[i] = d
    feeds = [lane[i] != 0 and any(main[j] and stage[j] == stage[i] for j in succ[i]) for i in range(n)]
    layer = [-1 if tasks[tid].layer is None else tasks[tid].layer for tid in ids]
    vstage = [unit[tid][0] for tid in ids]
    return Prepared(ids, succ, ssucc, ndeps, nsdeps, stage, lane, slot, wgrad, main, p2p, bg, dur, feeds, fwd,
                     comm, send_of, len(comm_ids), layer, vstage)


def _resources(g: StepGraph, prep: Prepared, serial: bool) -> tuple[list[int], list[int]]:
    """Resource id of every task and the compute resource of every stage. Communication and copy
    lanes come before compute, so a compute decision at an instant sees the transfers that start at
    that instant (gap-aware WGrad fill); lanes of one shared link are one resource
    ([Note: shared links]); under ``serial`` a stage is one resource."""
    nlanes, nstages = len(LANES), g.cfg.parallel.pp
    share = list(range(nlanes))  # lane -> the lane whose resource it uses
    for group in CostModel(g.cfg).shared_links():
        for lane in group[1:]:
            share[LANE_INDEX[lane]] = LANE_INDEX[group[0]]
    res = [st if serial else ((share[ln] - 1) % nlanes) * nstages + st for st, ln in zip(prep.stage, prep.lane)]
    res_compute = [st if serial else (nlanes - 1) * nstages + st for st in range(nstages)]
    return res, res_compute


def _priority_keys(prep: Prepared, serial: bool, lag: int, by_layer: bool = False) -> list[int]:
    """Ready-queue key of every task: backbone slot first (a WGrad task counts ``lag`` slots later
    and loses ties; a background collective yields to everything on its lane), then index."""
    key = []
    for i in range(len(prep.ids)):
        if prep.background[i] and not serial:
            k = _MAX_SLOT
        elif prep.wgrad[i]:
            k = min(prep.slot[i] + lag, _MAX_SLOT)
        else:
            k = prep.slot[i]
        key.append((2 * k + (1 if prep.wgrad[i] else 0)) * (1 << 22) + i)
    if by_layer and not serial:  # [Note: the WGrad drain by layer]
        last: dict[int, int] = {}
        for i in range(len(prep.ids)):
            if prep.main[i] and prep.slot[i] < _MAX_SLOT:
                last[prep.stage[i]] = max(last.get(prep.stage[i], -1), prep.slot[i])
        drain = [i for i in range(len(prep.ids)) if prep.wgrad[i] and prep.slot[i] < _MAX_SLOT
                 and prep.slot[i] + lag > last.get(prep.stage[i], _MAX_SLOT)]
        ready: dict[tuple[int, int, int], int] = {}  # (stage, vstage, layer) -> slot of its last drain WGrad
        for i in drain:
            g = (prep.stage[i], prep.vstage[i], prep.layer[i])
            ready[g] = max(ready.get(g, -1), prep.slot[i])
        order = sorted(drain, key=lambda i: (ready[(prep.stage[i], prep.vstage[i], prep.layer[i])], -prep.layer[i],
                                             prep.slot[i], i))
        for r, i in enumerate(order):
            key[i] = (2 * (last[prep.stage[i]] + 1) + 1) * (1 << 22) + r
    return key


def _drain_by_layer(pipeline: str) -> bool:
    """Whether the backbone ``pipeline`` drains its WGrad by layer ([Note: the WGrad drain by
    layer]): the loop-placed, one-copy schedules."""
    from .pipelines import TABLE

    p = TABLE.get(pipeline)
    return p is None or (p.placement == "loop" and p.copies == 1)


# [Note: the WGrad drain by layer] The WGrad tasks whose lagged slot lies past the stage's last
# backbone slot run in the drain, after every forward and backward of the stage; a layer's gradient
# reduction waits for the WGrad of every micro-batch of that layer. Taken by slot (micro-batch), the
# drain would run each micro-batch's WGrad over all layers before the next one's, so every layer's
# last WGrad would come at the very end and its reduction would be exposed, one layer after another.
# Taken by layer (first the layers whose last drain WGrad has the earliest slot, then the highest
# layer: the backward reaches it first, and layer numbers are global, so this holds across a stage's
# virtual stages; then by slot), each layer's reduction starts as soon as its WGrad is done and runs
# beside the next layers' WGrad. Only for the loop-placed one-copy schedules (gpipe, 1f1b,
# interleaved-1f1b, zb-h1, zb-h2, pipedream-2bw): on the V-shaped and bidirectional ones (zb-v,
# dualpipev, dualpipe, chimera) the earlier reductions share the NIC with the cool-down's P2P
# transfers and make the plans longer, so they keep the order by slot. Serial plans keep the plain
# order.


def lane_orders_of(g: StepGraph, prep: Prepared, orders: list[list[int]], start_t: list[float],
                 end_t: list[float]) -> dict[tuple[int, str], list[str]]:
    """Write the start and end times into the graph's tasks; the task ids per (stage, lane) in the
    order they started."""
    tasks, ids = g.tasks, prep.ids
    for i, tid in enumerate(ids):
        t = tasks[tid]
        t.start_us = start_t[i]
        t.end_us = end_t[i]
    lane_orders: dict[tuple[int, str], list[str]] = {(s, lane): [] for s in range(g.cfg.parallel.pp)
                                                      for lane in LANES}
    for order in orders:
        for i in order:
            t = tasks[ids[i]]
            lane_orders[(t.stage, t.lane)].append(t.id)
    return lane_orders


def retime(prep: Prepared, orders: list[list[int]], dur: list[float], skip: frozenset[int] = frozenset()
            ) -> tuple[list[float], list[float]]:
    """Start and end times of a schedule's fixed orders with durations ``dur``: each task starts
    when its dependencies have ended, its start dependencies have started and the task before it
    on its resource (``orders``, as :func:`list_schedule` leaves them) has ended, as the executor
    runs a plan. Skipped tasks count as met. ([Note: transfer slack] in k3sched/planner.py.)"""
    n = len(prep.ids)
    succ, ssucc = prep.succ, prep.ssucc
    after: list[int] = [-1] * n  # the next task on the same resource
    indeg = [0] * n
    for order in orders:
        for a, b in zip(order, order[1:]):
            after[a] = b
            indeg[b] += 1
    for i in range(n):
        if i in skip:
            continue
        for j in succ[i]:
            indeg[j] += 1
        for j in ssucc[i]:
            indeg[j] += 1
    ready_at = [0.0] * n
    start_t, end_t = [0.0] * n, [0.0] * n
    todo = [i for i in range(n) if i not in skip and indeg[i] == 0]
    done = 0
    while todo:
        i = todo.pop()
        done += 1
        s = start_t[i] = ready_at[i]
        e = end_t[i] = s + dur[i]
        nxt = [after[i]] if after[i] >= 0 else []
        for js, t in ((succ[i], e), (nxt, e), (ssucc[i], s)):
            for j in js:
                ready_at[j] = max(ready_at[j], t)
                indeg[j] -= 1
                if indeg[j] == 0 and j not in skip:
                    todo.append(j)
    if done != n - len(skip):
        raise DeadlockError(f"retiming a schedule: {n - len(skip) - done} tasks never became ready")
    return start_t, end_t


class _SlotGate:
    """Per rank, main tasks of slot s are eligible once all main tasks of the slots before the first
    unfinished one (plus ``lookahead`` slots) have started; a main task past its rank's gate is
    held until the gate opens.

    [Note: backward look-ahead at look-ahead 0] With ``lookahead`` 0 (the leanest memory level, or
    as configured) a k3 plan still lets the slot after the first unfinished one start when it has
    no forward: a backward or WGrad slot frees activation memory rather than allocating it, and it
    fills the compute lane while the current slot waits on an EP all-to-all or a neighbour, which
    matters most to plans that fit only at look-ahead 0 (K2-like zb-h2 at 80 GiB). ``serial`` plans
    keep the strict order."""

    def __init__(self, prep: Prepared, skip: frozenset[int], nstages: int, lookahead: int,
                 serial: bool = False) -> None:
        self.remaining: list[dict[int, int]] = [defaultdict(int) for _ in range(nstages)]
        for i in range(len(prep.ids)):
            if prep.main[i] and i not in skip:
                self.remaining[prep.stage[i]][prep.slot[i]] += 1
        self.slots = [sorted(r) for r in self.remaining]
        self.pos = [0] * nstages
        self.lookahead = lookahead
        self.back_ahead = lookahead == 0 and not serial
        self.fwd_slots: list[set[int]] = [set() for _ in range(nstages)]
        for i in range(len(prep.ids)):
            if prep.forward[i] and i not in skip:
                self.fwd_slots[prep.stage[i]].add(prep.slot[i])
        self.held: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(nstages)]
        self.gates = [self._gate(st) for st in range(nstages)]

    def _gate(self, st: int) -> int:
        gs, pos = self.slots[st], self.pos[st] + self.lookahead
        if self.back_ahead and pos + 1 < len(gs) and gs[pos + 1] not in self.fwd_slots[st]:
            pos += 1  # [Note: backward look-ahead at look-ahead 0]
        return gs[pos] if pos < len(gs) else _MAX_SLOT

    def first_open(self, st: int) -> int:
        gs = self.slots[st]
        return gs[self.pos[st]] if self.pos[st] < len(gs) else _MAX_SLOT

    def started(self, st: int, slot: int) -> list[int]:
        """A main task of ``slot`` on rank ``st`` started: the held tasks the gate now releases."""
        rem, gs = self.remaining[st], self.slots[st]
        rem[slot] -= 1
        out: list[int] = []
        while self.pos[st] < len(gs) and rem[gs[self.pos[st]]] == 0:
            self.pos[st] += 1
            old, self.gates[st] = self.gates[st], self._gate(st)
            h = self.held[st]
            for s_ in [s_ for s_ in h if old < s_ <= self.gates[st]]:
                out.extend(h.pop(s_))
        return out


def list_schedule(g: StepGraph, prep: Prepared, serial: bool, wgrad_lag: int, lookahead: int = 0,
                   skip: frozenset[int] = frozenset(), times: list | None = None, materialize: bool = True
                   ) -> dict[tuple[int, str], list[str]] | None:
    """Event-driven list scheduling (see module docstring). ``skip``: task indices left out (offload
    tasks not chosen in this attempt); a dependency on a skipped task counts as met. ``times``, when
    given, receives ``(orders, start_t, end_t)``: each resource's task indices in start order and the
    times by task index. With ``materialize`` the times are written into the tasks and the lane
    orders (task ids per (stage, lane)) returned; without, nothing is written and None returned
    (:func:`lane_orders_of` does it later for the attempt kept)."""
    n = len(prep.ids)
    stage_of, slot, succ, ssucc, dur = prep.stage, prep.slot, prep.succ, prep.ssucc, prep.dur
    is_main, is_p2p, is_bg, is_w, feeds = prep.main, prep.p2p, prep.background, prep.wgrad, prep.feeds_main
    nstages = g.cfg.parallel.pp
    res, res_compute = _resources(g, prep, serial)
    lag = 0 if serial else wgrad_lag
    key = _priority_keys(prep, serial, lag, by_layer=_drain_by_layer(g.cfg.schedule.pipeline))
    npending = [a + b for a, b in zip(prep.ndeps, prep.nsdeps)]
    unstarted = list(prep.ndeps)  # deps not yet started (for the imminent-P2P rule)
    for i in skip:
        npending[i] = 1 << 40  # never becomes ready
        for j in succ[i]:
            npending[j] -= 1
            unstarted[j] -= 1
        for j in ssucc[i]:
            npending[j] -= 1
    gate = _SlotGate(prep, skip, nstages, lookahead, serial)
    gates, held = gate.gates, gate.held
    # [Note: receives in send order]: per communicator, sends started and receives started; the
    # sequence number of each started send; ready receives held until their turn (seq -> task)
    comm, send_of = prep.comm, prep.send_of
    comm_sent, comm_recvd = [0] * prep.ncomms, [0] * prep.ncomms
    send_seq = [0] * n
    turn: list[dict[int, int]] = [{} for _ in range(prep.ncomms)]
    nres = max(res) + 1 if n else 0
    ready: list[list[tuple[int, int]]] = [[] for _ in range(nres)]
    imminent = [0] * nres  # P2P tasks whose deps have all started but are not yet running
    busy = [False] * nres
    orders: list[list[int]] = [[] for _ in range(nres)]
    events: list[tuple[float, int, int]] = []
    heappush, heappop = heapq.heappush, heapq.heappop
    start_t = [0.0] * n
    end_t = [0.0] * n
    # [Note: gap-aware WGrad fill] A WGrad task fills compute idle time only if the idle gap it fills
    # (until the earliest in-flight transfer that a backbone (main) compute task of the stage waits
    # on ends) is at least as long as the delay it causes past that point (duration <= 2 x gap);
    # else another WGrad that qualifies is taken, or the lane waits. An overdue WGrad (more than
    # `wgrad_lag` slots behind the first unfinished slot) is never held back.
    feeding: list[list[float]] = [[] for _ in range(nstages)]

    def pick_fill(q: list[tuple[int, int]], top: int, t_now: float, st: int) -> int:
        fq = feeding[st]
        while fq and fq[0] <= t_now:
            heappop(fq)
        gap = fq[0] - t_now if fq else float("inf")
        if dur[top] <= 2 * gap or slot[top] + lag < gate.first_open(st):
            heappop(q)
            return top
        best = -1
        for k_, j in q:
            if is_w[j] and dur[j] <= 2 * gap and (best < 0 or k_ < key[best]):
                best = j
        if best >= 0:
            q.remove((key[best], best))
            heapq.heapify(q)
        return best

    def make_ready(i: int) -> None:
        st = stage_of[i]
        if is_main[i] and slot[i] > gates[st]:
            held[st][slot[i]].append(i)
        else:
            heappush(ready[res[i]], (key[i], i))

    # Resources that may be able to start a task now, visited in resource order (a heap plus a flag).
    # The hot loop below inlines "wake resource r" (flag it and push it once) and make_ready: this
    # loop runs once per task and attempt (about 100k times a K2-like attempt).
    pend_heap = list(range(nres))
    flagged = [True] * nres
    seq = 0  # events at one instant pop in start order
    main_gate_started = gate.started

    for i in range(n):
        if i in skip:
            continue
        if is_p2p[i] and unstarted[i] == 0:
            imminent[res[i]] += 1
        if npending[i] == 0:
            make_ready(i)
    now = 0.0
    started = 0
    while True:
        while pend_heap:
            r = heappop(pend_heap)
            flagged[r] = False
            q = ready[r]
            if busy[r] or not q:
                continue
            i = q[0][1]
            if is_bg[i] and imminent[r] and not serial:
                continue  # a P2P transfer is about to become ready: keep the lane for it
            if is_w[i] and not serial:
                i = pick_fill(q, i, now, stage_of[i])
                if i < 0:
                    continue  # every WGrad would delay the backbone task about to become ready
            else:
                heappop(q)
            # start task i on resource r at `now`
            busy[r] = True
            orders[r].append(i)
            d_end = now + dur[i]
            heappush(events, (d_end, seq, i))
            seq += 1
            start_t[i] = now
            st = stage_of[i]
            if feeds[i]:
                heappush(feeding[st], d_end)
            if is_p2p[i]:
                imminent[r] -= 1
                c = comm[i]
                if send_of[i] < 0:  # a send: its place in the communicator's order
                    send_seq[i] = comm_sent[c]
                    comm_sent[c] += 1
                else:  # a receive: the next one's turn
                    comm_recvd[c] += 1
                    j = turn[c].pop(comm_recvd[c], -1)
                    if j >= 0:
                        rj = res[j]
                        heappush(ready[rj], (key[j], j))
                        if not flagged[rj]:
                            flagged[rj] = True
                            heappush(pend_heap, rj)
            for j in succ[i]:
                unstarted[j] -= 1
                if unstarted[j] == 0 and is_p2p[j]:
                    imminent[res[j]] += 1
            for j in ssucc[i]:
                npending[j] -= 1
                if npending[j] == 0:
                    rj = res[j]
                    sj = stage_of[j]
                    if is_main[j] and slot[j] > gates[sj]:
                        held[sj][slot[j]].append(j)
                    elif send_of[j] >= 0 and send_seq[send_of[j]] != comm_recvd[comm[j]]:
                        turn[comm[j]][send_seq[send_of[j]]] = j  # not its turn yet
                        continue
                    else:
                        heappush(ready[rj], (key[j], j))
                    if not flagged[rj]:
                        flagged[rj] = True
                        heappush(pend_heap, rj)
            if is_main[i]:
                for j in main_gate_started(st, slot[i]):
                    rj = res[j]
                    heappush(ready[rj], (key[j], j))
                    if not flagged[rj]:
                        flagged[rj] = True
                        heappush(pend_heap, rj)
            started += 1
        if not events:
            break
        now, _, i = heappop(events)
        batch = [i]
        while events and events[0][0] == now:
            batch.append(heappop(events)[2])
        for i in batch:
            end_t[i] = now
            r = res[i]
            busy[r] = False
            if not flagged[r]:
                flagged[r] = True
                heappush(pend_heap, r)
            r = res_compute[stage_of[i]]  # a fill decision may change now
            if not flagged[r]:
                flagged[r] = True
                heappush(pend_heap, r)
            for j in succ[i]:
                npending[j] -= 1
                if npending[j] == 0:
                    rj = res[j]
                    sj = stage_of[j]
                    if is_main[j] and slot[j] > gates[sj]:
                        held[sj][slot[j]].append(j)
                    elif send_of[j] >= 0 and send_seq[send_of[j]] != comm_recvd[comm[j]]:
                        turn[comm[j]][send_seq[send_of[j]]] = j  # not its turn yet
                        continue
                    else:
                        heappush(ready[rj], (key[j], j))
                    if not flagged[rj]:
                        flagged[rj] = True
                        heappush(pend_heap, rj)
    if started != n - len(skip):
        stuck = [prep.ids[i] for i in range(n) if i not in skip and not any(i in o for o in orders)][:6]
        raise DeadlockError(f"plan deadlocks: {n - len(skip) - started} tasks never became ready, e.g. "
                            f"{', '.join(stuck)}")
    if times is not None:
        times[:] = (orders, start_t, end_t)
    return lane_orders_of(g, prep, orders, start_t, end_t) if materialize else None

"""The CPU-runner model: what changes when a rank's lanes are CPU threads sharing a host's cores.

[Note: the CPU-runner model] On GPUs every rank has its own device and a transfer moves by DMA, so
a task's duration is its own. On the CPU runner (the gloo runner, ``hardware.cpu_runner`` set) the
ranks of a host share its cores, caches and memory bandwidth, and a transfer's threads run on the
same cores as the compute beside it. Five effects follow, each from a field of
:class:`k3sched.config.CpuRunnerConfig` and each off at its default: [Note: CPU sharing]
(``host_cores``), [Note: CPU cost of communication] (``comm_cpu_ns_per_byte``,
``comm_cpu_us_per_call``), [Note: a transfer beside compute] (``comm_wait_us_per_call``),
[Note: compute alone] (``compute_alone_factor``) and the task-time spread (``task_time_cv``, replayed
by [Note: task-time spread] in k3sched/variability.py). The cost model builds a :class:`CpuRunner`
only when the section is set, and the planner calls :func:`contended_durations` only then: a GPU
config never reaches this module. ``k3sched probe`` measures every field on CPU and
``traces/calibrate.py`` takes the same effects out of a measured run.

[Note: CPU sharing] The ranks of one node share ``host_cores`` cores: compute and local-copy tasks
run ``ranks per node / host_cores`` times slower than on one core of their own (a processor-sharing
model that assumes every rank computes at once; pipeline bubbles make it pessimistic). 0 means one
device per rank, as on GPUs. It is a model of the machine, the same for every config, never fitted
to a run.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from .config import Config, CpuRunnerConfig
from .intervals import alone_shares, covered_each, merge
from .tasks import LANE_OF, Kind

if TYPE_CHECKING:  # pragma: no cover
    from .cost import CostModel
    from .graph import StepGraph
    from .listsched import Prepared

WIRE_WAIT_LANES = ("ep", "collective", "offload_remote")
"""Lanes whose transfers wait for a core beside compute ([Note: a transfer beside compute])."""


def task_time_cv(cfg: Config) -> float:
    """``hardware.cpu_runner.task_time_cv``: the spread of every compute task's duration where no profile
    gives its kind's own ([Note: task-time spread] in k3sched/variability.py); 0 on GPUs."""
    rc = cfg.hardware.cpu_runner
    return rc.task_time_cv if rc is not None else 0.0


class CpuRunner:
    """The CPU-runner terms of one cost model (``cost.cpu``, built only when ``hardware.cpu_runner`` is
    set): every effect but ``host_cores``'s needs ``host_cores`` set, as the lanes are then threads."""

    def __init__(self, cost: "CostModel", rc: CpuRunnerConfig):
        self.cost, self.rc = cost, rc

    def share(self, kind: Kind) -> float:
        """[Note: CPU sharing] factor of a task of ``kind``: compute and local-copy tasks of the ranks of
        one node share ``host_cores`` cores, so each takes ``ranks per node / host_cores`` times its
        one-core duration (at least 1). Communication waits on the wire, not on a core."""
        p = self.cost.cfg.parallel
        if not self.rc.host_cores or LANE_OF[kind] not in ("compute", "offload_local"):
            return 1.0
        return max(1.0, min(p.world, self.cost.cfg.hardware.gpus_per_node) / self.rc.host_cores)

    def comm_cpu_load(self, kind: Kind, nbytes: int) -> tuple[float, float]:
        """What a communication task costs the rank's CPU ([Note: CPU cost of communication]): (bytes it
        sends plus receives, host-side µs). An all-to-all and a ring reduction send and receive
        ``nbytes`` each; a P2P receive takes the activation bytes; an EP task also runs its host-side
        work (``CostModel.overhead_us``), and with ``host_cores`` set every call costs
        ``comm_cpu_us_per_call`` (``CostModel.comm_calls``). (0, 0) for other lanes."""
        lane, cost = LANE_OF[kind], self.cost
        if lane not in ("ep", "collective", "offload_remote"):
            return 0.0, 0.0
        per_call = self.rc.comm_cpu_us_per_call * cost.comm_calls(kind) if self.rc.host_cores else 0.0
        if kind in (Kind.FWD_RECV, Kind.BWD_RECV):
            return float(cost.p2p_bytes()), per_call
        moved = 2 * nbytes if lane == "ep" or kind in (Kind.GRAD_RS, Kind.GRAD_MIRROR) else nbytes
        return float(moved), (cost.overhead_us(kind) if lane == "ep" else 0.0) + per_call

    def comm_cpu_ns_per_byte(self) -> float:
        """CPU time per byte a rank sends or receives: the profile's fitted value, else
        ``comm_cpu_ns_per_byte``; 0 without ``host_cores`` ([Note: CPU cost of communication])."""
        fitted = self.cost.profile.comm_cpu_ns_per_byte
        return (self.rc.comm_cpu_ns_per_byte if fitted is None else fitted) if self.rc.host_cores else 0.0

    def models_transfer_wait(self) -> bool:
        """Whether transfers wait longer beside compute (:meth:`comm_wait_us`), the wait
        ``schedule.transfer_slack`` scales ([Note: transfer slack] in k3sched/planner.py)."""
        return bool(self.rc.host_cores and self.rc.comm_wait_us_per_call)

    def comm_wait_us(self, kind: Kind, layer: int | None = None, nbytes: int = 0) -> float:
        """How much longer a communication task takes when compute runs beside it for its whole span:
        ``comm_wait_us_per_call`` per call or ring step of its wire (the unit the link latency is paid
        in, [Note: wire model] in k3sched/cost.py); 0 for other lanes ([Note: a transfer beside compute])."""
        if not self.models_transfer_wait() or LANE_OF[kind] not in WIRE_WAIT_LANES:
            return 0.0
        w = self.cost.wire(kind, layer=layer, nbytes=nbytes)
        return self.rc.comm_wait_us_per_call * (w.steps if w is not None and w.steps else self.cost.comm_calls(kind))

    def compute_alone_factor(self) -> float:
        """``compute_alone_factor`` where it can act ([Note: compute alone]): ``host_cores`` set, more
        than one pipeline stage, one rank per stage (a stage's replicas compute in step, so a rank of a
        wider stage never computes alone); else 1."""
        p = self.cost.cfg.parallel
        if not self.rc.host_cores or p.pp < 2 or p.world > p.pp:
            return 1.0
        return self.rc.compute_alone_factor

    def comm_costs_cpu(self) -> bool:
        """Whether a transfer and the compute beside it contend for the rank's cores (the transfer's CPU
        per byte or per call, or its wake-ups' wait for a core): the planner then stretches both where
        they overlap ([Note: CPU cost of communication], [Note: a transfer beside compute])."""
        return bool(self.comm_cpu_ns_per_byte()
                    or (self.rc.host_cores and (self.rc.comm_cpu_us_per_call or self.rc.comm_wait_us_per_call)))

    def acts(self, serial: bool) -> bool:
        """Whether :func:`contended_durations` changes a plan of this config (a serial plan has no
        transfer beside compute, but its stages may still compute alone)."""
        return (not serial and self.comm_costs_cpu()) or self.compute_alone_factor() < 1.0


def contended_durations(g: "StepGraph", prep: "Prepared", skip: frozenset[int], cpu: CpuRunner, raw: list,
                        wait_scale: float = 1.0) -> list[float]:
    """[Note: CPU cost of communication] On the CPU runner a transfer costs the rank's cores too:
    gloo's threads and the kernel's TCP path spend ``comm_cpu_ns_per_byte`` per byte a rank
    sends or receives and ``comm_cpu_us_per_call`` per call (``k3sched probe`` measures
    both, as what concurrent all-to-alls cost a computing thread), and an EP task's host-side work (routing
    bookkeeping, permutes: its ``overhead_us``) runs on the same core. A compute task that overlaps a transfer
    shares its core with that work, so it takes longer by the CPU time the overlapping transfers
    spend during it (each transfer's CPU spread evenly over its planned span). Returns the
    durations of ``prep`` with compute tasks stretched by the overlaps of the last schedule (``raw``:
    its lane orders, start and end times by task index); the caller schedules again with them.
    ``wait_scale``: the transfers' waits beside compute times this ([Note: transfer slack] in
    k3sched/planner.py).

    [Note: a transfer beside compute] The other side of the same contention: a transfer's threads
    (the lane's, gloo's) sleep between its messages and each wake-up waits for a core the compute
    thread holds, so a call takes ``comm_wait_us_per_call`` longer while compute runs
    beside it (``k3sched probe`` measures an all-to-all beside a GEMM loop against the same call
    alone; on a shared CPU that is a sizeable part of an all-to-all). Each transfer is lengthened by
    that times its calls or ring steps times the share of its span the stage's compute overlaps in
    the last schedule; a serial plan has no compute beside a transfer and keeps its durations.
    Without it the plan puts just an all-to-all's worth of compute beside each one, and the run's
    compute waits for every late one: far longer than planned, with an overlap and a gain over the
    serial plan well below the planned ones."""
    ns = cpu.comm_cpu_ns_per_byte()
    contend = cpu.comm_costs_cpu()  # else only [Note: compute alone] acts
    dur = list(prep.dur)
    tasks, ids = g.tasks, prep.ids
    start_t, end_t = raw[1], raw[2]
    by_stage: dict[int, tuple[list[int], list[tuple[float, float, float]], list[tuple[int, float]]]] = \
        defaultdict(lambda: ([], [], []))
    for i, tid in enumerate(ids):
        if i in skip:
            continue
        t = tasks[tid]
        comp, comm, waits = by_stage[t.stage]
        if t.lane == "compute":
            comp.append(i)
        elif contend and end_t[i] > start_t[i]:
            moved, host_us = cpu.comm_cpu_load(t.kind, t.bytes)
            cpu_us = moved * ns / 1e3 + host_us
            if cpu_us:
                comm.append((start_t[i], end_t[i], min(1.0, cpu_us / (end_t[i] - start_t[i]))))
            wait = cpu.comm_wait_us(t.kind, t.layer, t.bytes) * wait_scale
            if wait:
                waits.append((i, wait))
    for comp, comm, waits in by_stage.values():
        if comm:
            ms = np.array([c[0] for c in comm])
            me = np.array([c[1] for c in comm])
            rate = np.array([c[2] for c in comm])
            for i in comp:
                ov = np.clip(np.minimum(me, end_t[i]) - np.maximum(ms, start_t[i]), 0.0, None)
                dur[i] = prep.dur[i] + float(ov @ rate)
        if waits and comp:
            busy = np.array([(start_t[i], end_t[i]) for i in comp], dtype=float)
            busy = merge(busy[busy[:, 1] > busy[:, 0]])
            span = np.array([(start_t[i], end_t[i]) for i, _ in waits], dtype=float)
            share = covered_each(span, busy) / (span[:, 1] - span[:, 0])
            for (i, wait), sh in zip(waits, share):
                dur[i] = prep.dur[i] + wait * float(sh)
    alone = cpu.compute_alone_factor()
    if alone < 1.0:
        _compute_alone(dur, prep, {s: v[0] for s, v in by_stage.items()}, start_t, end_t, alone)
    return dur


def _compute_alone(dur: list[float], prep: "Prepared", comp: dict[int, list[int]], start_t, end_t,
                   factor: float) -> None:
    """[Note: compute alone] On the CPU runner the ranks of a host share its caches and memory
    bandwidth besides its cores: the model's operators timed in one process run faster than with
    two processes timing them at once (``k3sched probe --config`` measures the factor; the smaller
    the shapes, the closer it is to 1), and the operator profile is measured with every rank
    at once, as the ranks of an EP stage always compute. A pipeline stage of one rank computes alone
    in the other stages' bubbles and while they wait for it, and there it runs faster: each compute
    task is shortened by ``1 - factor`` (``compute_alone_factor``) of its duration times
    the share of its span (in the last schedule) no other stage computes. Without it a pipeline
    config's compute runs well under its planned time while an EP config's on the same machine does
    not. Changes ``dur`` in place."""
    ids = {s: [i for i in v if end_t[i] > start_t[i]] for s, v in comp.items()}
    ids = {s: v for s, v in ids.items() if v}
    shares = alone_shares({s: np.array([(start_t[i], end_t[i]) for i in v], dtype=float) for s, v in ids.items()})
    for s, v in ids.items():
        for i, a in zip(v, shares[s]):
            dur[i] -= prep.dur[i] * (1.0 - factor) * float(a)

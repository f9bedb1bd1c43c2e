"""What one training rank records step by step, and the per-rank traces it writes from it:
:class:`StepLog` (losses, times, peaks, routing, lane busy times, the executor's records),
:func:`lane_busy` (a step's busy time per lane and its communication overlap, gathered over ranks)
and :func:`write_trace` (trace_rank{R}.json, and trace_steps_rank{R}.json with ``--trace-steps``;
docs/formats.md). Used by :mod:`runtime.train`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StepLog:
    """Per step of :func:`runtime.train._run_steps`: loss, step time, peak device bytes, wall time, routing counts;
    ``record`` is the executor's record of the last step."""

    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    routed: list[dict] = field(default_factory=list)  # per step: this rank's routing counts per MoE layer
    busy: list[list[list[float]]] = field(default_factory=list)  # per step, per rank: lane_busy
    record: object = None
    records: list = field(default_factory=list)  # with --trace-steps: the records from the last warm-up step on


def lane_busy(record, device) -> list[list[float]]:
    """Every rank's busy time per lane (s, the sum of its task spans, lanes in ``LANES`` order) in
    the step ``record`` timed, then the length of its communication lanes' union and the part of it
    its compute overlaps (s, with the validator's interval functions): the compute a rank ran and
    the overlap it got, step by step, without its trace (``summary.json``'s ``lane_busy_s``,
    ``comm_overlap_ratio``)."""
    import torch
    import torch.distributed as dist

    from k3sched.tasks import COMM_LANES, LANES
    from k3sched.intervals import overlap_length, union_length

    timings = record.timings if record is not None else ()
    busy = torch.zeros(len(LANES) + 2, dtype=torch.float64)
    for t in timings:
        busy[LANES.index(t.lane)] += max(0.0, t.end_us - t.start_us) / 1e6
    comm = [(t.start_us, t.end_us) for t in timings if t.lane in COMM_LANES]
    comp = [(t.start_us, t.end_us) for t in timings if t.lane == "compute"]
    busy[len(LANES)] = union_length([a for a, _ in comm], [b for _, b in comm]) / 1e6
    busy[len(LANES) + 1] = overlap_length([a for a, _ in comm], [b for _, b in comm],
                                          [a for a, _ in comp], [b for _, b in comp]) / 1e6
    if not dist.is_initialized():
        return [busy.tolist()]
    parts = [torch.zeros_like(busy).to(device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, busy.to(device))
    return [x.cpu().tolist() for x in parts]


def write_trace(ex, runner, log: StepLog, rank: int, out: Path, device, predicted_us: float,
                 planned_peak: int) -> None:
    """trace_rank{R}.json: the last step, aligned so the earliest task of any rank starts at 0; with
    ``--trace-steps`` also trace_steps_rank{R}.json (:func:`_steps_trace`)."""
    record = log.record
    t0 = _first_start_us(record, device)
    if log.records:
        _steps_trace(ex, log.records, rank, out, device, predicted_us)
    if record is not None:
        trace = ex.chrome_trace(record, plan_step_time_us=predicted_us, t0_us=t0)
        trace["traceEvents"] += runner.memory.counter_events(rank, t0)
        trace["otherData"]["peak_device_bytes"] = runner.memory.peak_device
        trace["otherData"].update(runner.memory.trace_fields())  # [Note: measured memory] in offload/memory.py
        trace["otherData"]["plan_peak_device_bytes"] = planned_peak
        if log.routed and log.routed[-1]:  # this rank's routed slots in the traced step
            trace["otherData"]["routing"] = {str(L): {"tokens_per_expert": e, "tokens_per_slot": g}
                                             for L, (e, g) in log.routed[-1].items()}
        (out / f"trace_rank{rank}.json").write_text(json.dumps(trace))


def _first_start_us(record, device) -> float:
    """The earliest task start of ``record`` over every rank (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    t0 = torch.tensor([min(t.start_us for t in record.timings) if record and record.timings else 0.0],
                      dtype=torch.float64)
    if dist.is_initialized():
        t0 = t0.to(device)
        dist.all_reduce(t0, op=dist.ReduceOp.MIN)
    return float(t0)


def _steps_trace(ex, records: list, rank: int, out: Path, device, predicted_us: float) -> None:
    """[Note: traces of the measured steps] trace_steps_rank{R}.json: the tasks of every step from
    the last warm-up step on (``--warmup-steps`` N: steps N .. the last, counting from 1), on one
    clock aligned so the earliest task of any rank in the first of them starts at 0; the same
    format as trace_rank{R}.json without the memory counters (``otherData.steps``: the steps).
    trace_rank{R}.json holds the last step only, while the summary's measured step is the median of
    the steps after the warm-up, and steady steps differ from one to the next by several percent,
    so a profile fitted from the last alone costs the ops of another step than the one measured. ``k3sched calibrate`` on this file drops each task's first instance as
    warm-up (as for an nsys trace of a whole run) and fits the rest: exactly the steps the measured
    step is the median of (runtime/transfer.py uses it)."""
    t0 = _first_start_us(records[0], device)
    doc = None
    for rec in records:
        trace = ex.chrome_trace(rec, plan_step_time_us=predicted_us, t0_us=t0)
        if doc is None:
            doc = trace
            doc["otherData"]["steps"] = []
        else:
            doc["traceEvents"] += [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        doc["otherData"]["steps"].append(rec.step)
    doc["otherData"].pop("step", None)
    doc["otherData"].pop("measured_step_time_us", None)
    (out / f"trace_steps_rank{rank}.json").write_text(json.dumps(doc))

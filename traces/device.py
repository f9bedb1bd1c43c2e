"""The device timeline of a trace joined to its plan: each matched task instance's GPU events and
the clock each (rank, lane) is checked on ([Note: device timeline] in traces/validate.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from traces.events import EventTable

GPU_KINDS = ("kernel", "nccl", "memcpy", "memset")


@dataclass
class DeviceSpans:
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


def project_device(events: EventTable, index: dict[str, int], n_tasks: int, rank, task, next_start) -> DeviceSpans:
    """Join GPU events to the matched instances (``rank``, ``task``: indices into the plan's
    ``index``) by (rank, parent task id); see [Note: device timeline]."""
    n, nt = len(task), max(n_tasks, 1)
    gi = np.nonzero(np.isin(events.kind, GPU_KINDS))[0]
    n_gpu = len(gi)
    get = index.get  # parents repeat a few strings: a dict lookup each beats sorting them
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
    stream = _majority_stream(n, inst[~nccl], st[~nccl])
    return DeviceSpans(count > 0, dstart, dend, stream, scount, inst, st, ee - es, nccl, n_gpu, n_gpu - len(inst))


def _majority_stream(n: int, inst: np.ndarray, st: np.ndarray) -> np.ndarray:
    """Per instance, the stream most of its (stream-checked) events ran on (ties: the lowest
    stream; -1 for an instance without any)."""
    stream = np.full(n, -1, np.int64)
    if len(inst):
        o = np.lexsort((st, inst))
        si, ss = inst[o], st[o]
        new = np.ones(len(o), bool)
        new[1:] = (si[1:] != si[:-1]) | (ss[1:] != ss[:-1])
        b = np.nonzero(new)[0]
        run_n = np.diff(np.append(b, len(o)))
        ri, rs = si[b], ss[b]
        best = np.lexsort((-run_n, ri))  # per instance: most events first (ties: lowest stream)
        firsts = np.ones(len(best), bool)
        firsts[1:] = ri[best][1:] != ri[best][:-1]
        stream[ri[best][firsts]] = rs[best][firsts]
    return stream


def device_clock(D: DeviceSpans | None, rank, lane, n_lanes: int) -> np.ndarray:
    """Per instance: checked on the device clock, i.e. every instance of its (rank, lane) has
    GPU events (all False without a device timeline)."""
    on_dev = np.zeros(len(rank), bool)
    if D is not None and D.has.any():
        grp = rank.astype(np.int64) * n_lanes + lane
        ug, ginv = np.unique(grp, return_inverse=True)
        all_dev = np.ones(len(ug), bool)
        np.logical_and.at(all_dev, ginv, D.has)
        on_dev = all_dev[ginv]
    return on_dev

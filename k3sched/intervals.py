"""Interval unions on numpy arrays, the one implementation the plan's metrics (k3sched/metrics.py,
the planner, the variability replay) and the trace tools (traces/validate.py, traces/calibrate.py)
share; numpy only, so traces may import it beside the plan format."""

from __future__ import annotations

import numpy as np


def merge(iv: np.ndarray) -> np.ndarray:
    """Union of [start, end) intervals (n x 2), sorted."""
    if len(iv) == 0:
        return iv.reshape(0, 2)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    ends = np.maximum.accumulate(iv[:, 1])
    new = np.empty(len(iv), dtype=bool)
    new[0] = True
    new[1:] = iv[1:, 0] > ends[:-1]
    starts = iv[new, 0]
    grp = np.cumsum(new) - 1
    gend = np.zeros(int(grp[-1]) + 1)
    np.maximum.at(gend, grp, ends)
    return np.stack([starts, gend], axis=1)


def covered(a: np.ndarray, b: np.ndarray) -> float:
    """Length of merged intervals a intersected with merged intervals b."""
    return float(covered_each(a, b).sum())


def covered_each(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For each interval of a (any, n x 2), the length of it that merged intervals b cover: the
    length of b below its end minus that below its start (b's cumulative length at x is its
    whole intervals ending by x plus the part of the next one before x)."""
    if len(a) == 0 or len(b) == 0:
        return np.zeros(len(a))
    bs, be = b[:, 0], b[:, 1]
    cum = np.concatenate(([0.0], np.cumsum(be - bs)))
    last = len(b) - 1

    def below(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(be, x, side="right")
        return cum[k] + np.where(k <= last, np.maximum(x - bs[np.minimum(k, last)], 0.0), 0.0)

    return below(a[:, 1]) - below(a[:, 0])


def alone_shares(groups: dict) -> dict:
    """For each group's intervals (key -> n x 2 array, every end after its start), the share of each
    interval that no other group's intervals cover ([Note: compute alone] in k3sched/cpurunner.py:
    the groups are ranks or stages, the intervals their compute)."""
    merged = {g: merge(iv) for g, iv in groups.items()}
    out = {}
    for g, iv in groups.items():
        others = [v for h, v in merged.items() if h != g and len(v)]
        cov = covered_each(iv, merge(np.concatenate(others))) if others else np.zeros(len(iv))
        out[g] = np.maximum(0.0, 1.0 - cov / (iv[:, 1] - iv[:, 0]))
    return out


def _pairs(start, end) -> np.ndarray:
    return np.stack([np.asarray(start, float), np.asarray(end, float)], axis=1).reshape(-1, 2)


def merge_intervals(start, end) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals given as start and end sequences, as sorted disjoint (start, end) arrays."""
    m = merge(_pairs(start, end))
    return m[:, 0], m[:, 1]


def union_length(start, end) -> float:
    """Length of the union of intervals given as start and end sequences."""
    m = merge(_pairs(start, end))
    return float(np.sum(m[:, 1] - m[:, 0]))


def overlap_length(a_start, a_end, b_start, b_end) -> float:
    """Length of (union A) intersect (union B), A and B given as start and end sequences."""
    return covered(merge(_pairs(a_start, a_end)), merge(_pairs(b_start, b_end)))

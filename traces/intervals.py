"""Interval arithmetic on numpy arrays for trace analysis: unions, overlaps, and the longest
in-order subsequence the ``order`` rule keeps ([Note: validation rules] in traces/validate.py)."""

from __future__ import annotations

import bisect

import numpy as np


def merge_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted disjoint (start, end) arrays."""
    if not len(start):
        return np.empty(0), np.empty(0)
    o = np.argsort(start, kind="stable")
    s, e = start[o], end[o]
    run_end = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run_end[:-1]
    grp = np.cumsum(new) - 1
    ms = s[new]
    me = np.zeros(len(ms))
    np.maximum.at(me, grp, run_end)
    return ms, me


def union_length(start, end) -> float:
    s, e = merge_intervals(np.asarray(start, float), np.asarray(end, float))
    return float(np.sum(e - s))


def overlap_length(a_start, a_end, b_start, b_end) -> float:
    """Length of (union A) intersect (union B): a sweep over merged interval boundaries."""
    a_s, a_e = merge_intervals(np.asarray(a_start, float), np.asarray(a_end, float))
    b_s, b_e = merge_intervals(np.asarray(b_start, float), np.asarray(b_end, float))
    if not len(a_s) or not len(b_s):
        return 0.0
    t = np.concatenate([a_s, a_e, b_s, b_e])
    da = np.concatenate([np.ones(len(a_s)), -np.ones(len(a_e)), np.zeros(len(b_s) + len(b_e))])
    db = np.concatenate([np.zeros(len(a_s) + len(a_e)), np.ones(len(b_s)), -np.ones(len(b_e))])
    o = np.argsort(t, kind="stable")
    t, ca, cb = t[o], np.cumsum(da[o]), np.cumsum(db[o])
    both = (ca[:-1] > 0) & (cb[:-1] > 0)
    return float(np.sum(np.diff(t)[both]))


def lis_mask(seq: np.ndarray) -> np.ndarray:
    """Mask of one longest strictly increasing subsequence of seq (patience sorting)."""
    n = len(seq)
    keep = np.zeros(n, dtype=bool)
    if not n:
        return keep
    tails: list[int] = []
    tails_idx: list[int] = []
    prev = [-1] * n
    for i, v in enumerate(seq.tolist()):
        k = bisect.bisect_left(tails, v)
        if k == len(tails):
            tails.append(v); tails_idx.append(i)  # noqa: E702
        else:
            tails[k] = v; tails_idx[k] = i  # noqa: E702
        prev[i] = tails_idx[k - 1] if k > 0 else -1
    i = tails_idx[-1]
    while i >= 0:
        keep[i] = True
        i = prev[i]
    return keep

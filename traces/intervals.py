"""The longest in-order subsequence the ``order`` rule keeps ([Note: validation rules] in
traces/validate.py); interval unions and overlaps are k3sched/intervals.py's."""

from __future__ import annotations

import bisect

import numpy as np


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

"""Interval helpers behind the plan's exposed-communication figures (k3sched/intervals.py), against
plain pairwise references."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from k3sched.intervals import covered, merge

intervals = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 30)), max_size=25).map(
    lambda xs: np.array([(s / 4, (s + d) / 4) for s, d in xs], dtype=float).reshape(-1, 2))


def _pairwise_overlap(a: np.ndarray, b: np.ndarray) -> float:
    return sum(max(0.0, min(e, f) - max(s, r)) for s, e in a for r, f in b)


@settings(max_examples=300, deadline=None)
@given(intervals, intervals)
def test_covered_is_the_overlap_of_the_two_unions(a, b):
    ma, mb = merge(a), merge(b)
    # merged intervals are disjoint, so pairwise overlaps of the unions count every point once
    assert abs(covered(ma, mb) - _pairwise_overlap(ma, mb)) < 1e-9
    assert abs(covered(ma, mb) - covered(mb, ma)) < 1e-9


@settings(max_examples=300, deadline=None)
@given(intervals)
def test_merge_keeps_the_union_and_makes_it_disjoint(a):
    m = merge(a)
    assert all(m[i, 1] < m[i + 1, 0] for i in range(len(m) - 1))  # sorted, disjoint, not touching
    for x in np.arange(0, 58, 0.125):  # every point of the grid is in the union exactly when in a
        inside_a = any(s <= x < e for s, e in a)
        assert inside_a == any(s <= x < e for s, e in m), x

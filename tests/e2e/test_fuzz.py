"""Fuzzing the front doors ([Note: CLI error boundary] in k3sched/cli.py): mutations of every
input format (tests/fuzzcases.py), each run through ``k3sched``'s own entry point. Garbage is
refused with one line and exit 2; nothing ends in a traceback, an internal error (exit 3) or
takes more than 20 s. hypothesis drives the random choices and shrinks a failing case to its
mutation; ``make fuzz`` (benchmarks/fuzz_campaign.py) runs thousands of seeded cases."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzzcases

EXAMPLES = 50  # per family: 400 cases, about a minute on this 2-core machine


@pytest.fixture(scope="module", autouse=True)
def _base():
    fuzzcases.base()  # build the valid inputs once, outside hypothesis's timing


@pytest.mark.parametrize("family", fuzzcases.FAMILIES)
def test_front_door_never_crashes_and_refuses_garbage(family, tmp_path_factory):
    n = iter(range(10**6))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.randoms(use_true_random=False))
    def check(rnd: random.Random):
        case = fuzzcases.MAKERS[family](rnd)
        out = fuzzcases.run_case(case, tmp_path_factory.mktemp(f"{family}{next(n)}"))
        problem = fuzzcases.judge(case, out)
        assert problem is None, (f"{family}: {case.what}: {problem} (exit {out.code}, {out.seconds:.1f} s)\n"
                                 f"argv: {case.argv}\nstderr: {out.err[-2000:]}\nstdout: {out.out[-1000:]}")

    check()


@pytest.mark.parametrize("family", fuzzcases.FAMILIES)
def test_unmutated_input_succeeds(family, tmp_path):
    """Each family's mutations start from an input its command accepts (exit 0), so a refusal
    is about the mutation."""
    case = fuzzcases.control(family)
    out = fuzzcases.run_case(case, tmp_path)
    assert out.code == 0, (case.argv, out.err[-2000:])


def test_the_judge_fails_what_it_must():
    """The judge itself: a traceback, exit 3, a garbage accept, a two-line refusal and a slow
    refusal are each problems; a one-line exit 2 on garbage is not."""
    case = fuzzcases.Case("config", "x", ["plan"], garbage=True)
    O = fuzzcases.Outcome
    assert fuzzcases.judge(case, O(2, "", "error: x: bad\n", 0.1)) is None
    assert fuzzcases.judge(case, O(1, "", "Traceback (most recent call last):\n", 0.1)) == "traceback"
    assert fuzzcases.judge(case, O(3, "", "internal error\n", 0.1)) == "internal error"
    assert fuzzcases.judge(case, O(0, "ok", "", 0.1)) == "accepted garbage"
    assert fuzzcases.judge(case, O(2, "", "error: a\nerror: b\n", 0.1)) == "not one line"
    assert fuzzcases.judge(case, O(2, "", "error: x\n", 25.0)) == "slow"

"""Task ids: grammar round-trips, bad ids are rejected with the id named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3sched.tasks import LANE_OF, LANES, Kind, format_task_id, parse_task_id

small = st.integers(min_value=0, max_value=10_000)


@given(stage=small, kind=st.sampled_from(list(Kind)), scope=st.sampled_from(["mbL", "mbv", "vL", "step"]),
       mb=small, layer=small, chunk=small, bucket=st.one_of(st.none(), small), slice_=st.one_of(st.none(), small))
def test_task_id_round_trips(stage, kind, scope, mb, layer, chunk, bucket, slice_):
    kw = {"mbL": dict(mb=mb, layer=layer), "mbv": dict(mb=mb, chunk=chunk), "vL": dict(chunk=chunk, layer=layer),
          "step": {}}[scope]
    if scope in ("mbL", "mbv"):
        kw["slice"] = slice_
    tid = format_task_id(stage, kind, bucket=bucket, **kw)
    key = parse_task_id(tid)
    assert str(key) == tid
    assert key.kind is kind and key.stage == stage and key.bucket == bucket
    assert key.slice == kw.get("slice")


def test_examples_from_the_grammar():
    assert parse_task_id("s0/mb3/L5/attn.fwd").layer == 5
    assert parse_task_id("s0/mb2/v0/act.send").chunk == 0
    assert parse_task_id("s3/v1/L12/grad.rs.b0").bucket == 0
    assert parse_task_id("s0/step/optim.run").kind is Kind.OPTIM
    key = parse_task_id("s1/mb2q3/L4/attn.fwd")
    assert (key.mb, key.slice, key.layer) == (2, 3, 4)
    assert parse_task_id("s1/mb2/L4/attn.fwd").slice is None


def test_a_slice_needs_a_micro_batch():
    with pytest.raises(ValueError, match="slice"):
        format_task_id(0, Kind.GRAD_RS, chunk=0, layer=1, slice=2)


@pytest.mark.parametrize("bad", ["s0/mb3/L5/attn", "mb3/L5/attn.fwd", "s0/mb3/L5/attn.sideways", "s0/L5/attn.fwd",
                                 "s0/mb3/L5/attn.fwd/extra", "", "s0/mb3q/L5/attn.fwd",
                                 "s0/q1/L5/attn.fwd", "s0/v1q2/L5/grad.rs"])
def test_bad_ids_are_rejected(bad):
    with pytest.raises(ValueError, match="task"):
        parse_task_id(bad)


def test_every_kind_has_one_of_the_five_lanes():
    assert LANES == ("compute", "ep", "collective", "offload_local", "offload_remote")
    assert set(LANE_OF) == set(Kind) and set(LANE_OF.values()) == set(LANES)

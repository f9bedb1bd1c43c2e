"""Cross-checks of k3sched.schedules against torch.distributed.pipelining (torch 2.13 CPU).

k3sched itself never imports torch; these tests do. They read our CSV with the same calls
torch's ``_load_csv(format="compute_only")`` makes (``csv.reader`` + ``_Action.from_str`` per
cell, then ``_validate_schedule``), lower it with torch's ``_add_send_recv`` (which fails on a
send/recv order that cannot progress), write it back the way ``_dump_csv`` does, and compare
our ZB-V / DualPipeV orders with torch's own generators.
"""

from __future__ import annotations

import csv
import io
import types

import pytest

T = pytest.importorskip("torch.distributed.pipelining.schedules")

from k3sched.schedules import Placement, Schedule, generate, validate  # noqa: E402

CASES = [
    ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 8, 1, 32), ("interleaved-1f1b", 4, 2, 8),
    ("interleaved-1f1b", 8, 4, 16), ("zb-h1", 4, 1, 8), ("zb-h2", 8, 1, 32), ("zb-v", 4, 2, 8),
    ("zb-v", 8, 2, 32), ("dualpipev", 4, 2, 8), ("dualpipev", 8, 2, 32), ("v-half", 4, 2, 8), ("v-half", 8, 2, 32),
    ("v-min", 4, 2, 8), ("v-min", 6, 2, 12),
]


def _torch_load(text: str) -> dict[int, list]:
    return {rank: [T._Action.from_str(c) for c in row] for rank, row in enumerate(csv.reader(io.StringIO(text)))}


def _torch_dump(order: dict[int, list]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    for rank in order:
        w.writerow(order[rank])
    return buf.getvalue()


@pytest.mark.parametrize("name,pp,vpp,m", CASES)
def test_torch_loads_validates_lowers_and_dumps_our_csv(name, pp, vpp, m):
    s = generate(name, pp, vpp, m)
    text = s.to_torch_csv()
    order = _torch_load(text)
    stage_to_rank = T._validate_schedule(order, pp, pp * vpp, m)
    assert stage_to_rank == {v: s.placement.rank_of(v) for v in range(pp * vpp)}
    lowered = T._add_send_recv({r: list(a) for r, a in order.items()}, lambda st: stage_to_rank[st], pp * vpp)
    assert sum(len(v) for v in lowered.values()) >= sum(len(v) for v in order.values())
    assert _torch_dump(order) == text  # torch's writer reproduces our bytes exactly
    back = Schedule.from_torch_csv(_torch_dump(order), pp, vpp, m, placement=s.placement)
    assert back.ranks == s.ranks


def test_torch_rejects_what_our_validator_rejects_deadlock():
    P = T._Action.from_str
    order = {0: [P("0F0"), P("0B0"), P("0F1"), P("0B1")], 1: [P("1F1"), P("1B1"), P("1F0"), P("1B0")]}
    with pytest.raises(AssertionError, match="can't schedule"):
        T._add_send_recv(order, lambda st: st, 2)
    ours = Schedule.from_torch_csv(_torch_dump({0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F1", "1B1", "1F0", "1B0"]}),
                                   2, 1, 2, placement=Placement("loop", 2, 1))
    assert any("deadlock" in e for e in validate(ours))


def _torch_orders(cls, pp: int, m: int) -> dict[int, list[str]]:
    # the generators only read these attributes of the schedule object
    fake = types.SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
    return {r: [str(a) for a in cls._calculate_single_rank_operations(fake, r) if a is not None]
            for r in range(pp)}


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 9), (8, 16), (8, 32)])
@pytest.mark.parametrize("name,cls", [("zb-v", "ScheduleZBVZeroBubble"), ("dualpipev", "ScheduleDualPipeV")])
def test_v_schedules_match_torch_generators(name, cls, pp, m):
    ours = generate(name, pp, 2, m)
    assert {r: [str(x) for x in ours.ranks[r]] for r in range(pp)} == _torch_orders(getattr(T, cls), pp, m)

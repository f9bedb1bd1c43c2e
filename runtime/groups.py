"""Rank layout and process groups: one communicator per lane use, order checked at start-up.

[Note: rank layout]
``parallel.order`` ([Note: rank order] in k3sched/placement.py) maps ranks to (pp, dp, ep)
coordinates; the default ``ep-dp-pp`` is ep innermost, then dp, then pp: ``rank = (pp_idx * dp +
dp_idx) * ep + ep_idx`` (an EP group is ``ep`` consecutive ranks). The cost model prices the links
from the same map. The data replica of a rank is ``replica = dp_idx * ep + ep_idx``: every (dp, ep)
pair sees different tokens, whatever the order (coordinates, not rank numbers, choose data and
model shards, so the order changes no number a run computes).

Groups (``None`` where the group would have one rank):
  ep      ep lane          ranks with the same (pp, dp): EP dispatch / combine all-to-alls
  pp      main thread      ranks with the same (dp, ep): start-up checks only (pairing, order)
  p2p     collective lane  two ranks of one (dp, ep) column, one group per direction of each
                           transfer kind: ``p2p[("act", a, b)]`` carries the activations stage a
                           sends to stage b, ``p2p[("grad", b, a)]`` the gradients back, each its
                           own communicator ([Note: NCCL-safe P2P])
  ready   collective lane  beside each p2p group under ``--p2p strict`` (gloo): the receiver's
                           ready tokens ([Note: strict P2P] in runtime/stage/p2p.py)
  dense   collective lane  ranks with the same pp (ep * dp of them): grad.rs of non-expert weights
  expert  collective lane  ranks with the same (pp, ep): grad.rs of expert weights (over dp)
  optim   compute lane     like ``dense``: optim.run reduces embed / head / final-norm gradients
                           (and, with schedule.grad_offload, all-gathers the dense parameter shards)
  optim_expert compute lane like ``expert``: optim.run all-gathers the expert parameter shards
                           (schedule.grad_offload; the collective lane keeps ``expert`` to itself)
  mirror  collective lane  chimera / dualpipe only: stages s and pp-1-s of one (dp, ep) column, which
                           hold the two model copies of the same stages; grad.mirror sums their
                           gradients ([Note: replica gradient reduction] in runtime/stage/gradients.py;
                           :func:`build_mirror_groups`)
  world   main thread      between steps only (loss and step-time reductions, barriers)
Every rank creates every group in the same order (torch.distributed.new_group requires it).

[Note: NCCL-safe P2P]
NCCL blocks a send until the peer has posted the matching receive, runs the operations of one
communicator in issue order on one stream, and pairs sends with receives by order only (tags are
ignored). On one communicator per stage pair, a stage that sends before it receives while its
peer does the same deadlocks: gloo buffers that (crossing orders occur: activations and
gradients in 1F1B, activations in both directions between the stages of V placements, see
k3sched/p2pcheck.py). So each direction of each transfer kind has its own two-rank communicator
(:func:`build_p2p_groups`): its operations are all sends on one side and all receives on the
other, in plan order on both (checked at start-up, :func:`verify_pairing`, and at plan time,
:mod:`k3sched.p2pcheck`), so a send waits only for its own receive to be posted, never behind a
transfer of the other direction. Every such communicator is connected before the lanes start
(:func:`warm_up_p2p`: one small message per group, in one order on every rank, each wait bounded
by the run's timeout): NCCL would otherwise create it inside a lane thread, at its first
transfer, while other communicators are busy.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from k3sched.placement import DEFAULT_ORDER, RankOrder
from k3sched.tasks import P2P_KINDS, SEND_KINDS, Kind

from .executor import PlanTask


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    ep: int
    rank: int
    order: str = DEFAULT_ORDER
    """``parallel.order`` ([Note: rank layout])."""

    @property
    def ranks(self) -> RankOrder:
        return RankOrder(self.pp, self.dp, self.ep, self.order)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep

    @property
    def ep_idx(self) -> int:
        return self.ranks.coords(self.rank)[2]

    @property
    def dp_idx(self) -> int:
        return self.ranks.coords(self.rank)[1]

    @property
    def pp_idx(self) -> int:
        return self.ranks.coords(self.rank)[0]

    @property
    def replica(self) -> int:
        return self.dp_idx * self.ep + self.ep_idx

    def rank_of(self, pp_idx: int, dp_idx: int, ep_idx: int) -> int:
        return self.ranks.rank_of(pp_idx, dp_idx, ep_idx)


@dataclass
class Groups:
    layout: Layout
    ep: object | None = None
    pp: object | None = None
    p2p: dict = field(default_factory=dict)  # (kind, src stage, dst stage) -> group ([Note: NCCL-safe P2P])
    ready: dict = field(default_factory=dict)  # same keys: ready-token groups (--p2p strict)
    dense: object | None = None
    expert: object | None = None
    optim: object | None = None
    optim_expert: object | None = None
    mirror: object | None = None
    world: object | None = None

    def pp_rank(self, stage: int) -> int:
        """Global rank of PP stage ``stage`` in this rank's (dp, ep) column."""
        lo = self.layout
        return lo.rank_of(stage, lo.dp_idx, lo.ep_idx)


def _members(lo: Layout) -> dict[str, list[list[int]]]:
    """Every group of each name, as lists of global ranks (all ranks compute the same lists)."""
    r = lo.rank_of
    return {
        "ep": [[r(p, d, e) for e in range(lo.ep)] for p in range(lo.pp) for d in range(lo.dp)],
        "pp": [[r(p, d, e) for p in range(lo.pp)] for d in range(lo.dp) for e in range(lo.ep)],
        "dense": [[r(p, d, e) for d in range(lo.dp) for e in range(lo.ep)] for p in range(lo.pp)],
        "expert": [[r(p, d, e) for d in range(lo.dp)] for p in range(lo.pp) for e in range(lo.ep)],
        "optim": [[r(p, d, e) for d in range(lo.dp) for e in range(lo.ep)] for p in range(lo.pp)],
        "optim_expert": [[r(p, d, e) for d in range(lo.dp)] for p in range(lo.pp) for e in range(lo.ep)],
    }


def build_groups(lo: Layout, timeout=None) -> Groups:
    """Create the groups of [Note: rank layout] (needs an initialised default group)."""
    g = Groups(lo, world=dist.group.WORLD if dist.is_initialized() else None)
    if lo.world == 1:
        return g
    for name, groups in _members(lo).items():
        for ranks in groups:
            if len(ranks) < 2:
                continue
            pg = dist.new_group(ranks, timeout=timeout)
            if lo.rank in ranks:
                setattr(g, name, pg)
    return g


def mirror_pairs(lo: Layout) -> list[list[int]]:
    """The ``mirror`` groups (chimera, dualpipe): ranks of stages s and pp-1-s with the same
    (dp, ep), for s < pp/2 (pp is even for these schedules)."""
    r = lo.rank_of
    return [sorted([r(s, d, e), r(lo.pp - 1 - s, d, e)]) for s in range(lo.pp // 2) for d in range(lo.dp)
            for e in range(lo.ep)]


def build_mirror_groups(groups: Groups, timeout=None) -> None:
    """Create the ``mirror`` groups of [Note: rank layout] (every rank, same order) into
    ``groups.mirror``; only for the schedules with two model copies."""
    lo = groups.layout
    for ranks in mirror_pairs(lo):
        pg = dist.new_group(ranks, timeout=timeout)
        if lo.rank in ranks:
            groups.mirror = pg


def p2p_edges(vstage_rank: Sequence[int]) -> list[tuple[str, int, int]]:
    """The directed transfers of a placement (``vstage_rank[v]``: the PP stage of virtual stage
    v): ``("act", a, b)`` where vstage v on stage a feeds v + 1 on stage b != a, ``("grad", b, a)``
    the way back; sorted (every rank computes the same list)."""
    out = set()
    for v in range(len(vstage_rank) - 1):
        a, b = vstage_rank[v], vstage_rank[v + 1]
        if a != b:
            out.update({("act", a, b), ("grad", b, a)})
    return sorted(out)


def build_p2p_groups(groups: Groups, edges: Sequence[tuple[str, int, int]], *, ready: bool = False,
                     timeout=None) -> None:
    """One two-rank group per directed transfer ``edges`` of each (dp, ep) column, into
    ``groups.p2p`` (and ``groups.ready`` with ``ready``); every rank calls this with the same
    ``edges`` and flag, creating every column's groups in the same order."""
    lo = groups.layout
    for key in edges:
        _, a, b = key
        for d in range(lo.dp):
            for e in range(lo.ep):
                ranks = sorted({lo.rank_of(a, d, e), lo.rank_of(b, d, e)})
                pgs = [dist.new_group(ranks, timeout=timeout) for _ in range(2 if ready else 1)]
                if lo.rank in ranks:
                    groups.p2p[key] = pgs[0]
                    if ready:
                        groups.ready[key] = pgs[1]


def wait_bounded(work, deadline: float, what: str) -> None:
    from datetime import timedelta

    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{what}: no answer within the run's timeout")
    try:
        work.wait(timeout=timedelta(seconds=left))
    except RuntimeError as e:
        raise TimeoutError(f"{what}: {str(e).strip().splitlines()[0] if str(e).strip() else 'failed'}") from e
    while not work.is_completed():  # NCCL: wait() only orders the current stream
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: no answer within the run's timeout")
        time.sleep(0.001)


def warm_up_p2p(groups: Groups, timeout_s: float, device=None) -> int:
    """Connect every P2P communicator of this rank before the lanes start ([Note: NCCL-safe P2P]):
    one one-element message per group in the direction it is used (data src -> dst, ready tokens
    dst -> src), groups in one sorted order on every rank (the first unfinished exchange of a
    column always has both ranks at it, so the sequence completes). Raises TimeoutError naming
    the group when a peer does not answer within ``timeout_s``. Returns the number of exchanges."""
    import torch

    lo = groups.layout
    stage = lo.pp_idx
    deadline = time.monotonic() + timeout_s
    n = 0
    todo = [("p2p", k, g) for k, g in groups.p2p.items()] + [("ready", k, g) for k, g in groups.ready.items()]
    for what, (kind, a, b), pg in sorted(todo, key=lambda x: (x[1], x[0])):
        src, dst = (a, b) if what == "p2p" else (b, a)
        buf = torch.zeros(1, dtype=torch.int64, device=device)
        name = f"P2P warm-up of the {what} group {kind} {a}->{b} (rank {lo.rank}, stage {stage})"
        if stage == src:
            buf.fill_(1)
            work = dist.isend(buf, dst=groups.pp_rank(dst), group=pg)
        else:
            work = dist.irecv(buf, src=groups.pp_rank(src), group=pg)
        wait_bounded(work, deadline, name)
        if stage == dst and int(buf.item()) != 1:
            raise RuntimeError(f"{name}: received {int(buf.item())}, expected 1")
        n += 1
    return n


# -- start-up order check -----------------------------------------------------------------------

def _sig(t: PlanTask) -> list:
    return [t.lane, t.kind.value, t.layer, t.mb, t.chunk, t.bucket]


def group_orders(lanes: Mapping[str, list[PlanTask]]) -> dict[str, list[list]]:
    """The ordered communication of each equal-order group: what every rank of it must agree on."""
    ep = [_sig(t) for t in lanes["ep"]]
    rs = [_sig(t) for t in lanes["collective"] if t.kind is Kind.GRAD_RS]
    optim = [_sig(t) for t in lanes["compute"] if t.kind is Kind.OPTIM and t.layer is None]  # per-layer: no comm
    mirror = [_sig(t) for t in lanes["collective"] if t.kind is Kind.GRAD_MIRROR]
    return {"ep": ep, "dense": rs, "expert": rs, "optim": optim, "optim_expert": optim, "mirror": mirror}


def p2p_order(lanes: Mapping[str, list[PlanTask]], peer_of) -> dict[str, dict[int, list]]:
    """Sends and receives of the collective lane by peer stage, in plan order, as
    ``(direction, mb, vstage-pair)`` keys that the peer's opposite list must reproduce."""
    out: dict[str, dict[int, list]] = {"send": {}, "recv": {}}
    for t in lanes["collective"]:
        if t.kind not in P2P_KINDS:
            continue
        peer, key = peer_of(t)
        side = "send" if t.kind in SEND_KINDS else "recv"
        out[side].setdefault(peer, []).append(key)
    return out


def _digest(x) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True).encode()).hexdigest()[:16]


class GroupOrderError(RuntimeError):
    """Ranks of one communicator would issue different collective sequences (a deadlock)."""


def verify_orders(groups: Groups, lanes: Mapping[str, list[PlanTask]], peer_of, stage: int) -> None:
    """All-gather each group's ordered collective list and fail fast naming the first mismatch.

    Equal-order groups (ep, dense, expert, optim, mirror) must agree exactly; on the pp group, the sends of
    stage a to stage b must be, in order, the receives of b from a."""
    orders = group_orders(lanes)
    for name in ("ep", "dense", "expert", "optim", "optim_expert", "mirror"):
        pg = getattr(groups, name)
        if pg is None:
            continue
        mine = orders[name]
        got: list = [None] * dist.get_world_size(pg)
        dist.all_gather_object(got, (_digest(mine), mine, dist.get_rank()), group=pg)
        ref_digest, ref, ref_rank = got[0]
        for dig, other, other_rank in got[1:]:
            if dig == ref_digest:
                continue
            i = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
            a = ref[i] if i < len(ref) else "end of list"
            b = other[i] if i < len(other) else "end of list"
            raise GroupOrderError(f"{name} group: collective #{i} differs: rank {ref_rank} issues {a}, rank "
                                  f"{other_rank} issues {b} (ranks would deadlock)")
    verify_pairing(groups, "pp group", p2p_order(lanes, peer_of), stage)


def verify_pairing(groups: Groups, what: str, mine: dict[str, dict[int, list]], stage: int) -> None:
    """Point-to-point pairing check over the pp group (outside any lane): ``mine`` holds this
    stage's ordered ``send``s and ``recv``s per peer stage; the sends of stage a to stage b must be,
    in order, b's receives from a, or the lanes would deadlock."""
    if groups.pp is None:
        return
    got: list = [None] * dist.get_world_size(groups.pp)
    dist.all_gather_object(got, (stage, mine), group=groups.pp)
    by_stage = {s: o for s, o in got}
    for a, oa in by_stage.items():
        for b, sends in oa["send"].items():
            recvs = by_stage.get(b, {"recv": {}})["recv"].get(a, [])
            if sends != recvs:
                i = next((i for i, (x, y) in enumerate(zip(sends, recvs)) if x != y), min(len(sends), len(recvs)))
                x = sends[i] if i < len(sends) else "nothing"
                y = recvs[i] if i < len(recvs) else "nothing"
                raise GroupOrderError(f"{what}: transfer #{i} from stage {a} to stage {b}: stage {a} sends {x}, "
                                      f"stage {b} receives {y}")


def verify_same_plan(plan_bytes: bytes) -> None:
    """Every rank planned the same bytes (the planner is deterministic; a mismatch means the ranks
    read different configs or code)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = hashlib.sha256(plan_bytes).hexdigest()
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    bad = [r for r, h in enumerate(got) if h != got[0]]
    if bad:
        raise GroupOrderError(f"plan differs between rank 0 and rank(s) {bad} (different config or code?)")

"""Rank layout and process groups: one communicator per lane use, order checked at start-up.

[Note: rank layout]
ep innermost, then dp, then pp: ``rank = (pp_idx * dp + dp_idx) * ep + ep_idx`` (as
k3sched.cost assumes: an EP group is ``ep`` consecutive ranks). The data replica of a rank is
``replica = dp_idx * ep + ep_idx``: every (dp, ep) pair sees different tokens.

Groups (``None`` where the group would have one rank):
  ep      ep lane          ranks with the same (pp, dp): EP dispatch / combine all-to-alls
  pp      collective lane  ranks with the same (dp, ep): act.send / act.recv
  pp_grad collective lane  the same ranks: grad.send / grad.recv. A communicator per direction of
                           the pipeline: gloo moves a message only after the receiver's "ready"
                           note arrives, and in one shared connection that note queues behind the
                           receiver's own outgoing payload, so activations and gradients crossing
                           in opposite directions would take turns instead of using both
                           directions of the link ([Note: full-duplex all-to-all on gloo])
  dense   collective lane  ranks with the same pp (ep * dp of them): grad.rs of non-expert weights
  expert  collective lane  ranks with the same (pp, ep): grad.rs of expert weights (over dp)
  optim   compute lane     like ``dense``: optim.run reduces embed / head / final-norm gradients
                           (and, with schedule.grad_offload, all-gathers the dense parameter shards)
  optim_expert compute lane like ``expert``: optim.run all-gathers the expert parameter shards
                           (schedule.grad_offload; the collective lane keeps ``expert`` to itself)
  world   main thread      between steps only (loss and step-time reductions, barriers)
Every rank creates every group in the same order (torch.distributed.new_group requires it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from k3sched.tasks import Kind, P2P_KINDS

from .executor import PlanTask


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    ep: int
    rank: int

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep

    @property
    def ep_idx(self) -> int:
        return self.rank % self.ep

    @property
    def dp_idx(self) -> int:
        return (self.rank // self.ep) % self.dp

    @property
    def pp_idx(self) -> int:
        return self.rank // (self.ep * self.dp)

    @property
    def replica(self) -> int:
        return self.dp_idx * self.ep + self.ep_idx

    def rank_of(self, pp_idx: int, dp_idx: int, ep_idx: int) -> int:
        return (pp_idx * self.dp + dp_idx) * self.ep + ep_idx


@dataclass
class Groups:
    layout: Layout
    ep: object | None = None
    pp: object | None = None
    pp_grad: object | None = None
    dense: object | None = None
    expert: object | None = None
    optim: object | None = None
    optim_expert: object | None = None
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
        "pp_grad": [[r(p, d, e) for p in range(lo.pp)] for d in range(lo.dp) for e in range(lo.ep)],
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


# -- start-up order check -----------------------------------------------------------------------

def _sig(t: PlanTask) -> list:
    return [t.lane, t.kind.value, t.layer, t.mb, t.chunk, t.bucket]


def group_orders(lanes: Mapping[str, list[PlanTask]]) -> dict[str, list[list]]:
    """The ordered communication of each equal-order group: what every rank of it must agree on."""
    ep = [_sig(t) for t in lanes["ep"]]
    rs = [_sig(t) for t in lanes["collective"] if t.kind is Kind.GRAD_RS]
    optim = [_sig(t) for t in lanes["compute"] if t.kind is Kind.OPTIM]
    return {"ep": ep, "dense": rs, "expert": rs, "optim": optim, "optim_expert": optim}


def p2p_order(lanes: Mapping[str, list[PlanTask]], peer_of) -> dict[str, dict[int, list]]:
    """Sends and receives of the collective lane by peer stage, in plan order, as
    ``(direction, mb, vstage-pair)`` keys that the peer's opposite list must reproduce."""
    out: dict[str, dict[int, list]] = {"send": {}, "recv": {}}
    for t in lanes["collective"]:
        if t.kind not in P2P_KINDS:
            continue
        peer, key = peer_of(t)
        side = "send" if t.kind in (Kind.FWD_SEND, Kind.BWD_SEND) else "recv"
        out[side].setdefault(peer, []).append(key)
    return out


def _digest(x) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True).encode()).hexdigest()[:16]


class GroupOrderError(RuntimeError):
    """Ranks of one communicator would issue different collective sequences (a deadlock)."""


def verify_orders(groups: Groups, lanes: Mapping[str, list[PlanTask]], peer_of, stage: int) -> None:
    """All-gather each group's ordered collective list and fail fast naming the first mismatch.

    Equal-order groups (ep, dense, expert, optim) must agree exactly; on the pp group, the sends of
    stage a to stage b must be, in order, the receives of b from a."""
    orders = group_orders(lanes)
    for name in ("ep", "dense", "expert", "optim", "optim_expert"):
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

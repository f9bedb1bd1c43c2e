"""Rank order (``parallel.order``): which global rank holds which (pp, dp, ep) coordinate, and
which groups that puts inside one node.

[Note: rank order]
As Megatron's ``--order``, the order names the dimensions innermost first: ``ep-dp-pp`` (the
default) gives ``rank = (pp_idx * dp + dp_idx) * ep + ep_idx`` (an EP group is ``ep`` consecutive
ranks); ``pp-ep-dp`` gives ``rank = (dp_idx * ep + ep_idx) * pp + pp_idx`` (adjacent PP stages on
consecutive ranks). Node ``n`` holds ranks ``n * gpus_per_node .. (n + 1) * gpus_per_node - 1``.
A group's link is NVLink when all its ranks share a node, the NIC otherwise; a PP transfer's link
is that of its two ranks. A rank's coordinates, and so its data and model shard, do not depend on
the order: only which global rank (and node) holds them does, so a run's losses are the same
under every order (tests/unit/k3sched/test_order.py). Within any group, global rank grows with the group's own
coordinate under every order, so a group's local rank is that coordinate (the EP all-to-all's
chunk index) whatever the order.

Pure Python, no torch: the cost model (k3sched/cost.py) and the runtime's groups
(runtime/groups.py) both read it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable

DIMS = ("ep", "dp", "pp")
DEFAULT_ORDER = "ep-dp-pp"
ALL_ORDERS = tuple("-".join(p) for p in itertools.permutations(DIMS))
"""Every order of the three dimensions (innermost first)."""


def order_error(text: object) -> str | None:
    """Why ``text`` is no rank order (one line, what was given and what is allowed), or None."""
    allowed = f"a permutation of {', '.join(DIMS)} joined by '-' (one of {', '.join(ALL_ORDERS)})"
    if not isinstance(text, str):
        return f"must be a string (got {text!r}); allowed: {allowed}"
    names = text.strip().lower().split("-")
    unknown = [n for n in names if n not in DIMS]
    if unknown:
        return f"unknown dimension {unknown[0]!r} in {text!r}; allowed: {allowed}"
    twice = [n for n in DIMS if names.count(n) > 1]
    if twice:
        return f"dimension {twice[0]!r} given twice in {text!r}; allowed: {allowed}"
    if len(names) != len(DIMS):
        missing = [n for n in DIMS if n not in names]
        return f"missing dimension {missing[0]!r} in {text!r}; allowed: {allowed}"
    return None


@dataclass(frozen=True)
class RankOrder:
    """The rank <-> (pp, dp, ep) map of one order ([Note: rank order])."""

    pp: int
    dp: int
    ep: int
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        err = order_error(self.order)
        if err:
            raise ValueError(f"parallel.order: {err}")

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(self.order.strip().lower().split("-"))

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep

    def _size(self, dim: str) -> int:
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep}[dim]

    def rank_of(self, pp_idx: int, dp_idx: int, ep_idx: int) -> int:
        c = {"pp": pp_idx, "dp": dp_idx, "ep": ep_idx}
        rank, stride = 0, 1
        for d in self.dims:
            rank += c[d] * stride
            stride *= self._size(d)
        return rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_idx, dp_idx, ep_idx) of global ``rank``."""
        c: dict[str, int] = {}
        for d in self.dims:
            rank, c[d] = divmod(rank, self._size(d))
        return c["pp"], c["dp"], c["ep"]

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of each kind, as lists of global ranks: ``ep`` (same pp, dp), ``dense`` (same
        pp: the ep*dp ranks reducing non-expert gradients), ``expert`` (same pp, ep: over dp), ``pp``
        (same dp, ep: one column of stages)."""
        r = self.rank_of
        P, D, E = range(self.pp), range(self.dp), range(self.ep)
        return {
            "ep": [[r(p, d, e) for e in E] for p in P for d in D],
            "dense": [[r(p, d, e) for d in D for e in E] for p in P],
            "expert": [[r(p, d, e) for d in D] for p in P for e in E],
            "pp": [[r(p, d, e) for p in P] for d in D for e in E],
        }


def node_of(rank: int, gpus_per_node: int) -> int:
    return rank // gpus_per_node


def in_one_node(ranks: Iterable[int], gpus_per_node: int) -> bool:
    return len({node_of(r, gpus_per_node) for r in ranks}) <= 1


@dataclass(frozen=True)
class GroupPlacement:
    """Where one kind of group lands: how many of its groups span nodes, and the most ranks of
    one group that share a node (the all-to-all's NVLink peers + 1)."""

    name: str
    size: int
    groups: int
    crossing: int
    ranks_per_node: int

    @property
    def crosses(self) -> bool:
        return self.crossing > 0


def group_placement(ro: RankOrder, gpus_per_node: int) -> dict[str, GroupPlacement]:
    """Per group kind (``ep``, ``dense``, ``expert``; ``p2p``: the pairs of adjacent stages of
    every column) where its groups land under ``ro`` on nodes of ``gpus_per_node`` ranks."""
    out: dict[str, GroupPlacement] = {}
    for name, gs in ro.groups().items():
        if name == "pp":
            continue
        size = len(gs[0])
        cross = sum(not in_one_node(g, gpus_per_node) for g in gs) if size > 1 else 0
        per_node = min((max(sum(1 for r in g if node_of(r, gpus_per_node) == n)
                            for n in {node_of(r, gpus_per_node) for r in g}) for g in gs), default=1)
        out[name] = GroupPlacement(name, size, len(gs), cross, per_node)
    pairs = [(col[s], col[s + 1]) for col in ro.groups()["pp"] for s in range(ro.pp - 1)]
    cross = sum(node_of(a, gpus_per_node) != node_of(b, gpus_per_node) for a, b in pairs)
    out["p2p"] = GroupPlacement("p2p", 2 if pairs else 1, len(pairs), cross, 2 if pairs else 1)
    return out


def stage_pair_crosses(ro: RankOrder, gpus_per_node: int, a: int, b: int) -> bool:
    """Whether a transfer between PP stages ``a`` and ``b`` crosses nodes in any (dp, ep) column
    (the columns move at once; the slowest sets the pace)."""
    return any(node_of(ro.rank_of(a, d, e), gpus_per_node) != node_of(ro.rank_of(b, d, e), gpus_per_node)
               for d in range(ro.dp) for e in range(ro.ep))


def describe(ro: RankOrder, gpus_per_node: int, p2p_pairs: Iterable[tuple[int, int]] = ()) -> list[str]:
    """Lines for ``k3sched plan``: each group kind, its size, and whether (how many of) its groups
    cross nodes; P2P per stage pair of ``p2p_pairs`` (the plan's transfers)."""
    pl = group_placement(ro, gpus_per_node)
    lines = [f"rank order {ro.order} (innermost first), {gpus_per_node} ranks per node, "
             f"{-(-ro.world // gpus_per_node)} node(s)"]
    what = {"ep": "EP all-to-all", "dense": "DP dense grads", "expert": "DP expert grads"}
    for name in ("ep", "dense", "expert"):
        g = pl[name]
        if g.size < 2:
            continue
        where = (f"crosses nodes ({g.crossing} of {g.groups} groups; NIC; {g.ranks_per_node} of a group per node)"
                 if g.crosses else f"within a node ({g.groups} group(s); NVLink)")
        lines.append(f"  {what[name]:<16} {g.size:>4} ranks  {where}")
    pairs = sorted(set(p2p_pairs))
    if pairs:
        cross = [(a, b) for a, b in pairs if stage_pair_crosses(ro, gpus_per_node, a, b)]
        nv = [(a, b) for a, b in pairs if (a, b) not in cross]
        show = lambda ps: ", ".join(f"{a}->{b}" for a, b in ps[:8]) + (" ..." if len(ps) > 8 else "")  # noqa: E731
        lines.append(f"  {'PP P2P':<16} {len(pairs):>4} pairs  NVLink: {len(nv)}" + (f" ({show(nv)})" if nv else "")
                     + f"; NIC: {len(cross)}" + (f" ({show(cross)})" if cross else ""))
    return lines

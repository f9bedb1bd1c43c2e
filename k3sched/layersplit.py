"""Layer split: which layers each virtual stage (model chunk) holds (``parallel.layer_split``,
``parallel.stage_layers``), for the graph builder, the limits and the runtime's stage spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import Config, ConfigError
from .cost import CostModel
from .profile import PROFILE_FORMAT, load_profile
from .tasks import Kind


def split_layers(cfg: Config) -> list[list[int]]:
    """Layers of each virtual stage for ``parallel.layer_split``: ``even`` (as even as possible,
    earlier vstages get the extra layer) or ``balanced`` (contiguous split minimising the largest
    vstage compute time, counting the embedding on the first and the output head on the last
    vstage, which may then hold no layer at all -- the way 61-layer models leave room for the head),
    or ``profile`` (the same, by the measured times of ``schedule.profile``, [Note: profile split] in
    k3sched/rebalance.py); ``parallel.stage_layers``, when set, gives the counts outright."""
    nv = cfg.parallel.pp * cfg.parallel.vpp
    if cfg.parallel.stage_layers is not None:
        out, start = [], 0
        for n in cfg.parallel.stage_layers:
            out.append(list(range(start, start + n)))
            start += n
        return out
    if cfg.parallel.layer_split == "even":
        return layers_by_vstage(cfg.model.layers, nv)
    if cfg.parallel.layer_split == "profile":
        return profile_split(times_from_profile(cfg), nv)
    key = cfg.model_dump_json()  # a pure function of the config: one plan asks three times
    if key not in _BALANCED:
        cost = CostModel(cfg)
        fwd = {False: (Kind.ATTN_FWD, Kind.MLP_FWD),
               True: (Kind.ATTN_FWD, Kind.ROUTER_FWD, Kind.SHARED_FWD, Kind.EXPERT_FWD)}
        w = [sum(3 * cost.flops(k) for k in fwd[cfg.model.is_moe(L)]) for L in range(cfg.model.layers)]
        head = sum(cost.flops(k) for k in (Kind.HEAD_FWD, Kind.HEAD_DX, Kind.HEAD_DW))
        embed = sum(cost.flops(k) for k in (Kind.EMBED_FWD, Kind.EMBED_DW))
        if len(_BALANCED) >= 32:
            _BALANCED.clear()
        _BALANCED[key] = min_max_split(w, nv, first_extra=embed, last_extra=head)
    return [list(g) for g in _BALANCED[key]]


_BALANCED: dict[str, list[list[int]]] = {}
"""Balanced splits by config (its JSON): the limits, the graph and the memory bound each need it."""


def min_max_split(w: list[float], parts: int, first_extra: float, last_extra: float) -> list[list[int]]:
    """Contiguous split of items ``w`` into ``parts`` groups minimising the largest group weight
    (group 0 also carries ``first_extra``, the last group ``last_extra``); among those, the one
    whose group 0 holds the fewest items but at least one, unless the plain DP leaves it empty
    ([Note: a light first vstage]). Inner groups hold at least one item; the first and last may be
    empty. DP over (group, prefix), O(parts * n^2), at most three passes."""
    optimum, split = _min_max_dp(w, parts, first_extra, last_extra, None)
    if parts == 1 or len(split[0]) <= 1:
        return split
    first = _fewest_first(w, parts, first_extra, last_extra, optimum + 1e-9 * max(1.0, abs(optimum)))
    return _min_max_dp(w, parts, first_extra, last_extra, first)[1] if first < len(split[0]) else split


def _fewest_first(w: list[float], parts: int, first_extra: float, last_extra: float, limit: float) -> int:
    """The fewest items (at least one) group 0 can hold when no group may weigh over ``limit``:
    which suffixes ``items[j:]`` split into groups g..parts-1 within it, from the last group back
    (one DP pass of the same size)."""
    n = len(w)
    pre = [0.0]
    for x in w:
        pre.append(pre[-1] + x)
    ok = [last_extra + pre[n] - pre[j] <= limit for j in range(n + 1)]  # the last group, maybe empty
    for _ in range(parts - 2, 0, -1):  # inner groups: items[j:i], i > j
        ok = [any(ok[i] for i in range(j + 1, n + 1) if pre[i] - pre[j] <= limit) for j in range(n + 1)]
    return next(i for i in range(1, n + 1) if first_extra + pre[i] <= limit and ok[i])


# [Note: a light first vstage]
# The first vstage (layer 0, the embedding) is the last one the backward reaches, so the reduction
# of its layers' gradients (and of the embedding's) runs after every other stage has finished its
# backward: nothing is left to overlap it, and it ends the step. Among the splits with the same
# largest vstage, the balanced split therefore gives the first vstage the fewest layers, but at
# least one: an empty first vstage still takes its slots in the schedule and a P2P hop per
# micro-batch, for the embedding alone, and plans a longer step than one layer there. Where the
# layers do not divide evenly (K2-like: 61 layers over 32 vstages) the light vstage is the first
# one, not one in the middle, which takes one layer's reduction off that tail.


def _min_max_dp(w: list[float], parts: int, first_extra: float, last_extra: float,
                first: int | None) -> tuple[float, list[list[int]]]:
    """(largest group weight, split) of :func:`min_max_split`'s DP; ``first``: group 0 holds
    exactly that many items (None: any number)."""
    n = len(w)
    pre = [0.0]
    for x in w:
        pre.append(pre[-1] + x)
    inf = float("inf")
    # best[g][i]: smallest max weight splitting items[:i] into groups 0..g; arg for reconstruction
    best = [[inf] * (n + 1) for _ in range(parts)]
    arg = [[0] * (n + 1) for _ in range(parts)]
    for i in (range(n + 1) if first is None else [first]):
        best[0][i] = first_extra + pre[i]
    if parts == 1:
        return best[0][n], [list(range(n))]
    for g in range(1, parts):
        last = g == parts - 1
        extra = last_extra if last else 0.0
        for i in ([n] if last else range(n + 1)):
            for j in range(i + 1 if last else i):  # group g = items[j:i]; only the last may be empty
                cand = max(best[g - 1][j], extra + pre[i] - pre[j])
                if cand < best[g][i] - 1e-9:
                    best[g][i], arg[g][i] = cand, j
    if best[parts - 1][n] == inf:
        return inf, []
    out: list[list[int]] = []
    i = n
    for g in range(parts - 1, 0, -1):
        j = arg[g][i]
        out.append(list(range(j, i)))
        i = j
    out.append(list(range(0, i)))
    return best[parts - 1][n], out[::-1]


def layers_by_vstage(n_layers: int, n_vstages: int) -> list[list[int]]:
    """Contiguous, as even as possible; earlier vstages get the extra layer."""
    base, extra = divmod(n_layers, n_vstages)
    out, start = [], 0
    for v in range(n_vstages):
        n = base + (1 if v < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


@dataclass
class LayerTimes:
    """Measured per-micro-batch times (µs) of a run ([Note: profile split])."""

    layer_us: list[float]
    embed_us: float
    head_us: float
    p2p_us: float
    steps: int
    ranks: int

    def to_profile(self, source: str = "") -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "source": source,
                "layer_us": [round(x, 3) for x in self.layer_us], "embed_us": round(self.embed_us, 3),
                "head_us": round(self.head_us, 3), "p2p_us": round(self.p2p_us, 3)}


def profile_split(lt: LayerTimes, parts: int) -> list[list[int]]:
    """The layers of each of ``parts`` vstages minimising the largest vstage time ([Note: profile
    split]). Every vstage but the first and the last pays two receives, those two one each (with
    ``parts > 1``); the same constant taken off every vstage leaves the argmin unchanged."""
    r = lt.p2p_us if parts > 1 else 0.0
    return min_max_split(list(lt.layer_us), parts, first_extra=lt.embed_us - r, last_extra=lt.head_us - r)


def times_from_profile(cfg: Config) -> LayerTimes:
    """The measured times of ``cfg``'s ``schedule.profile`` for ``layer_split: profile``; ConfigError
    (one line) when the profile has no per-layer times or not one per model layer."""
    path = cfg.schedule.profile
    if not path:
        raise ConfigError("parallel.layer_split: profile needs schedule.profile (a profile with layer_us, written "
                          "by k3sched rebalance); got no schedule.profile")
    prof = load_profile(path)
    if not prof.layer_us:
        raise ConfigError(f"schedule.profile: {path}: no per-layer times (layer_us) for parallel.layer_split: "
                          "profile; allowed: a profile written by k3sched rebalance RUN_DIR (or "
                          "layer_split balanced / even)")
    if len(prof.layer_us) != cfg.model.layers:
        raise ConfigError(f"schedule.profile: {path}: layer_us has {len(prof.layer_us)} per-layer times, the "
                          f"model has {cfg.model.layers} layers; allowed: one time per model layer (rebalance a "
                          f"run of this model)")
    return LayerTimes(list(prof.layer_us), prof.embed_us, prof.head_us, prof.p2p_us, 0, 0)

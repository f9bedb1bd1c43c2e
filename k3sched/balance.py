"""Expert load balance: per-expert loads, redundant-expert placements (EPLB-style) and their cost.

No torch: the planner, the CLI (``k3sched balance``) and the runtime read the same placements.

[Note: router skew] ``model.router_skew`` s (a Zipf exponent, 0 = uniform) adds the fixed bias
``-s * ln(e + 1)`` to expert e's router logit (``moe/functional.py``, ``skew_bias``), so expert e's
softmax score is multiplied by ``(e + 1) ** -s`` before top-k selection. The bias is a constant of
the model (not a parameter, not learned), so training stays deterministic. If the logits were
i.i.d. Gumbel, top-1 routing would pick expert e with probability exactly ``(e + 1) ** -s / H``
(the Gumbel-max trick, H = sum of ``(j + 1) ** -s``): :func:`zipf_shares` is that share, and it is
what the planner assumes without measurements. Real logits are closer to Gaussian and top-k picks
k distinct experts (no expert can take more than 1/k of the slots), so measured shares are flatter
at the head and steeper at the tail; ``k3sched run`` measures them (summary.json ``routing``) and
``k3sched balance`` writes them into the placement file, where the planner prefers them.

[Note: expert placement] A placement gives each EP rank ``experts / ep + redundant_experts`` slots,
each holding one expert; every expert has at least one slot and at most one per rank. Tokens of
an expert with n replicas are split among them deterministically (each source rank sends the j-th
of its c tokens for the expert, in token order, to replica ``j * n // c``, replicas in (rank, slot)
order), so every replica gets about 1/n of the expert's load. Replica gradients are summed into one
(``runtime/stage/gradients.py``, grad.rs), so the model is the one without replicas. Without a file the
placement is computed from the modelled loads (:func:`balance` on :func:`expected_loads`), so plan
and run agree with no file at all. The file (YAML, written by ``k3sched balance``)::

    format: k3sched.placement/1
    experts: 8
    ep: 2
    redundant: 1
    slots: [[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]]   # per EP rank: the expert of each slot
    loads: [..]                                 # optional: measured tokens per expert

[Note: balancing] :func:`balance` follows DeepSeek's EPLB: the ``ep * redundant`` extra slots go
one by one to the expert with the largest load per replica; the replicas are then packed, heaviest
first, onto the least-loaded rank with a free slot that does not hold that expert yet. When
``gpus_per_node`` (> 1) splits the EP group into nodes, it first packs the experts onto nodes (equal
counts, balanced load) and then replicates and packs within each node, so a hot expert's replicas
stay inside one node and its traffic does not cross the NIC more than before. With one rank per
node, or more slots per rank than a node has experts, it balances over the whole group.

[Note: skewed cost] Each EP rank's share ``s_r`` of the routed tokens is the sum over its slots of
``load(e) / replicas(e)`` over the total. Its expert GEMMs see ``ep * s_r`` times the balanced
token count, and an all-to-all ends when its busiest rank does: rank r receives
``(ep - 1) * s_r`` and sends ``1 - s_r`` of a balanced rank's ``T k`` rows, so the wire carries
``max_r max((ep - 1) s_r, 1 - s_r) / ((ep - 1) / ep)`` times the balanced bytes. Both factors are
1 under uniform routing and a contiguous placement. A measured profile's expert durations are
taken as measured under balanced routing and scaled the same way, so calibrate from a run without
skew (or one whose placement balances it). The replicas' gradient sum adds one all-reduce of the
replicated experts' parameters over the stage's EP x DP ranks to each MoE layer's grad.rs. Not
modelled: the busiest rank's larger expert activations (memory is costed at balanced routing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Config
from .yamlfile import ConfigError, read_text_file, yaml_load

PLACEMENT_FORMAT = "k3sched.placement/1"


def zipf_shares(experts: int, skew: float) -> list[float]:
    """Expected token share of each expert under ``model.router_skew`` ([Note: router skew])."""
    w = [(e + 1) ** -skew for e in range(experts)]
    total = sum(w)
    return [x / total for x in w]


@dataclass(frozen=True)
class Placement:
    """Which expert each slot of each EP rank holds ([Note: expert placement])."""

    slots: tuple[tuple[int, ...], ...]
    """``slots[r][s]``: the expert in slot s of EP rank r."""
    experts: int
    loads: tuple[float, ...] | None = None
    """Measured tokens per expert this placement was computed from (None: none recorded)."""

    @property
    def ep(self) -> int:
        return len(self.slots)

    @property
    def per_rank(self) -> int:
        return len(self.slots[0])

    @property
    def redundant(self) -> int:
        return self.per_rank - self.experts // self.ep

    def replicas(self) -> list[int]:
        """Number of slots of each expert."""
        n = [0] * self.experts
        for row in self.slots:
            for e in row:
                n[e] += 1
        return n

    def replicated(self) -> list[int]:
        """Experts with more than one slot, ascending."""
        return [e for e, n in enumerate(self.replicas()) if n > 1]

    def rank_shares(self, loads: list[float] | tuple[float, ...]) -> list[float]:
        """Each EP rank's share of the routed tokens under per-expert ``loads`` ([Note: skewed cost])."""
        n = self.replicas()
        total = float(sum(loads)) or 1.0
        return [sum(loads[e] / n[e] for e in row) / total for row in self.slots]

    def rank_loads(self, loads: list[float] | tuple[float, ...]) -> list[float]:
        """Tokens each EP rank's slots receive under per-expert ``loads`` (split evenly over replicas)."""
        n = self.replicas()
        return [sum(loads[e] / n[e] for e in row) for row in self.slots]

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"format": PLACEMENT_FORMAT, "experts": self.experts, "ep": self.ep,
                               "redundant": self.redundant, "slots": [list(r) for r in self.slots]}
        if self.loads is not None:
            doc["loads"] = [float(x) for x in self.loads]
        return doc


def contiguous(experts: int, ep: int) -> Placement:
    """The placement without redundant experts: expert e on rank ``e // (experts / ep)``."""
    per = experts // ep
    return Placement(tuple(tuple(range(r * per, (r + 1) * per)) for r in range(ep)), experts)


def imbalance(rank_loads: list[float]) -> float:
    """Max over mean of the per-rank loads (1.0 = balanced; 1.0 when nothing was routed)."""
    mean = sum(rank_loads) / len(rank_loads) if rank_loads else 0.0
    return max(rank_loads) / mean if mean > 0 else 1.0


def _pack(items: list[tuple[float, int]], bins: int, cap: int) -> list[list[int]]:
    """Heaviest first onto the least-loaded bin with room that does not hold the item's expert yet
    (ties: lowest bin). ``items``: (load, expert). Returns the experts of each bin."""
    out: list[list[int]] = [[] for _ in range(bins)]
    load = [0.0] * bins
    for w, e in sorted(items, key=lambda it: (-it[0], it[1])):
        free = [b for b in range(bins) if len(out[b]) < cap]
        fresh = [b for b in free if e not in out[b]] or free
        b = min(fresh, key=lambda b: (load[b], b))
        out[b].append(e)
        load[b] += w
    return out


def _replicate(experts: list[int], loads: list[float], extra: int, cap: int) -> list[tuple[float, int]]:
    """Give ``extra`` more slots, one at a time, to the expert with the most load per replica
    (ties: lowest id) that has fewer than ``cap`` replicas (one per rank); return (load per
    replica, expert) for every replica."""
    n = {e: 1 for e in experts}
    for _ in range(extra):
        e = max((e for e in experts if n[e] < cap), key=lambda e: (loads[e] / n[e], -e))
        n[e] += 1
    return [(loads[e] / n[e], e) for e in experts for _ in range(n[e])]


def balance(loads: list[float], ep: int, redundant: int, gpus_per_node: int = 0) -> Placement:
    """EPLB-style placement of ``len(loads)`` experts on ``ep`` ranks with ``redundant`` extra slots
    each ([Note: balancing]); hierarchical when ``gpus_per_node`` (< ep, dividing it) splits the
    EP group into nodes."""
    E = len(loads)
    if ep < 1 or E % ep:
        raise ValueError(f"ep ({ep}) must divide the expert count ({E})")
    per = E // ep + redundant
    if per > E:
        raise ValueError(f"{per} slots per rank but only {E} experts: at most {E - E // ep} redundant slots")
    g = gpus_per_node if 1 < gpus_per_node < ep and ep % gpus_per_node == 0 else ep
    if per > E // (ep // g):  # a node's ranks cannot hold that many replicas of its own experts
        g = ep
    nodes = ep // g
    if nodes > 1:
        groups = _pack([(float(loads[e]), e) for e in range(E)], nodes, E // nodes)
    else:
        groups = [list(range(E))]
    slots: list[list[int]] = []
    for members in groups:
        items = _replicate(sorted(members), list(loads), g * redundant, g)
        slots += _pack(items, g, per)
    for row in slots:
        row.sort()
    return Placement(tuple(tuple(r) for r in slots), E, tuple(float(x) for x in loads))


def expected_loads(cfg: Config) -> list[float]:
    """Per-expert token shares the planner assumes: the placement file's measured loads, else the
    Zipf shares of ``model.router_skew`` (uniform at 0)."""
    pl = placement_file(cfg)
    if pl is not None and pl.loads is not None:
        total = sum(pl.loads) or 1.0
        return [x / total for x in pl.loads]
    return zipf_shares(cfg.model.experts, cfg.model.router_skew)


def placement_for(cfg: Config) -> Placement:
    """The placement plan and run use: ``schedule.expert_placement``, else computed from the
    modelled loads when ``parallel.redundant_experts`` > 0, else contiguous."""
    pl = placement_file(cfg)
    if pl is not None:
        return pl
    m, p = cfg.model, cfg.parallel
    if p.redundant_experts:
        return balance(expected_loads(cfg), p.ep, p.redundant_experts, cfg.hardware.gpus_per_node)
    return contiguous(m.experts, p.ep)


def load_factors(cfg: Config) -> tuple[float, float]:
    """(expert GEMM factor, all-to-all bytes factor) of the busiest EP rank ([Note: skewed cost],
    [Note: routing imbalance])."""
    ep = cfg.parallel.ep
    if ep == 1 or not cfg.model.experts:
        return 1.0, 1.0
    shares = placement_for(cfg).rank_shares(expected_loads(cfg))
    gemm = ep * max(shares)
    a2a = max(max((ep - 1) * s, 1 - s) for s in shares) / ((ep - 1) / ep)
    noise = cfg.model.routing_imbalance
    return min(float(ep), gemm * noise), min(float(ep), a2a * noise)


def routing_imbalance(tokens_per_expert: list[list[int]], ep: int) -> float:
    """[Note: routing imbalance] An all-to-all ends when its busiest rank does, and that rank's expert
    GEMMs are the longest: what matters is max over mean of the EP ranks' routed tokens *per call*.
    Even an unskewed router spreads tokens unevenly: its initial weights and the data give some
    experts more than others, differently in every layer and micro-batch, and per-layer noise
    does not average out over a step, since every call waits for its own busiest rank. Given
    each call's tokens per expert (one row per layer and micro-batch, from a run at
    EP 1: ``k3sched probe``'s operator profile), this is the mean over the calls of that ratio on
    the contiguous placement of ``ep`` ranks; ``model.routing_imbalance`` carries it to the cost
    model, which scales the modelled loads' factors by it ([Note: skewed cost]). 1.0 without
    calls or at ep 1."""
    if ep <= 1 or not tokens_per_expert:
        return 1.0
    flat = contiguous(len(tokens_per_expert[0]), ep)
    vals = [imbalance(flat.rank_loads(row)) for row in tokens_per_expert if sum(row)]
    return sum(vals) / len(vals) if vals else 1.0


_PLACEMENT_CACHE: dict[tuple[str, float, int, int], Placement] = {}


def placement_file(cfg: Config) -> Placement | None:
    """``schedule.expert_placement`` read and checked against the config (None when unset);
    :class:`ConfigError` (one line) when unreadable, malformed or not fitting."""
    path = cfg.schedule.expert_placement
    if not path:
        return None
    try:
        mtime = Path(path).stat().st_mtime
    except OSError:
        mtime = -1.0
    key = (str(path), mtime, cfg.model.experts, cfg.parallel.ep * 1000003 + cfg.parallel.redundant_experts)
    if key not in _PLACEMENT_CACHE:
        _PLACEMENT_CACHE[key] = load_placement(path, cfg.model.experts, cfg.parallel.ep,
                                               cfg.parallel.redundant_experts)
    return _PLACEMENT_CACHE[key]


def load_placement(path: str | Path, experts: int, ep: int, redundant: int) -> Placement:
    """Read a placement YAML and check it fits ``experts`` on ``ep`` ranks with ``redundant`` extra
    slots each; :class:`ConfigError` naming the file and field otherwise."""
    where = f"schedule.expert_placement: {path}"
    text = read_text_file(path, "schedule.expert_placement")
    doc = yaml_load(text, where)
    return placement_from_doc(doc, experts, ep, redundant, where)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def placement_from_doc(doc: Any, experts: int, ep: int, redundant: int, where: str = "placement") -> Placement:
    """Check a placement document (see [Note: expert placement]); :class:`ConfigError` (one line)."""
    if not isinstance(doc, dict) or doc.get("format") != PLACEMENT_FORMAT:
        raise ConfigError(f"{where}: format: not a placement file (expected {PLACEMENT_FORMAT!r}, as "
                          f"k3sched balance writes)")
    known = {"format", "experts", "ep", "redundant", "slots", "loads"}
    unknown = sorted(str(k) for k in doc if k not in known)
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(known))}")
    per = experts // ep + redundant
    for name, want in (("experts", experts), ("ep", ep), ("redundant", redundant)):
        if name in doc and doc[name] != want:
            raise ConfigError(f"{where}: {name}: the config has {want}; got {doc[name]!r}")
    slots = doc.get("slots")
    if not isinstance(slots, list) or len(slots) != ep:
        raise ConfigError(f"{where}: slots: must be a list of {ep} lists (one per EP rank); got "
                          f"{type(slots).__name__ if not isinstance(slots, list) else f'{len(slots)} lists'}")
    for r, row in enumerate(slots):
        if not isinstance(row, list) or len(row) != per:
            got = f"{len(row)} slots" if isinstance(row, list) else type(row).__name__
            raise ConfigError(f"{where}: slots[{r}]: must list {per} experts (experts/ep {experts // ep} + "
                              f"redundant {redundant}); got {got}")
        for s, e in enumerate(row):
            if not _is_int(e) or not 0 <= e < experts:
                raise ConfigError(f"{where}: slots[{r}][{s}]: must be an expert id in 0..{experts - 1}; got {e!r}")
        if len(set(row)) != len(row):
            dup = next(e for e in row if row.count(e) > 1)
            raise ConfigError(f"{where}: slots[{r}]: expert {dup} twice on one rank (a replica must be on "
                              f"another rank)")
    held = {e for row in slots for e in row}
    if len(held) != experts:
        missing = min(set(range(experts)) - held)
        raise ConfigError(f"{where}: slots: expert {missing} has no slot (every expert needs at least one)")
    loads = doc.get("loads")
    if loads is not None:
        if (not isinstance(loads, list) or len(loads) != experts
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                           for x in loads)):
            raise ConfigError(f"{where}: loads: must be {experts} finite numbers >= 0 (tokens per expert)")
    return Placement(tuple(tuple(r) for r in slots), experts,
                     tuple(float(x) for x in loads) if loads is not None else None)


# -- routing statistics of a run (summary.json ``routing``) ----------------------------------------

def loads_from_summary(doc: Any, where: str) -> tuple[list[float], int]:
    """(tokens per expert summed over steps and MoE layers, EP size) of a run summary; ConfigError
    (one line) when it has no routing statistics."""
    routing = doc.get("routing") if isinstance(doc, dict) else None
    if not isinstance(routing, dict) or not routing.get("tokens_per_expert"):
        raise ConfigError(f"{where}: no routing statistics (summary.json has no 'routing' entry: the run "
                          f"had no MoE layer, or predates routing measurement); run k3sched run again")
    tpe = routing["tokens_per_expert"]
    try:
        E = len(tpe[0][0])
        loads = [0.0] * E
        for step in tpe:
            for layer in step:
                if len(layer) != E:
                    raise ValueError
                for e, x in enumerate(layer):
                    loads[e] += float(x)
        ep = int(routing["ep"])
    except (TypeError, ValueError, KeyError, IndexError):
        raise ConfigError(f"{where}: routing.tokens_per_expert: must be [step][layer][expert] token counts "
                          f"with routing.ep set") from None
    if ep < 1 or E % ep:
        raise ConfigError(f"{where}: routing.ep: must divide the expert count ({E}); got {ep}")
    return loads, ep

"""Stage rebalancing from a measured run: ``k3sched rebalance RUN_DIR -o config.yaml``.

[Note: profile split]
``parallel.layer_split: profile`` splits the layers over the (virtual) stages by measured time
instead of analytic FLOPs. The times come from a recorded run (its ``plan.json`` and
``trace_rank*.json``), per micro-batch, the median over ranks, micro-batches and steps (the first
step dropped as warm-up when there are several):

- ``layer_us[L]``: every compute-lane task of layer L (forward, dX, dW) plus the *exposed* part of
  its EP all-to-alls: the time of an ``ep``-lane task during which its rank's compute lane was idle
  (the overlapped part costs the stage nothing);
- ``embed_us``, ``head_us``: the embedding's and the output head's compute tasks;
- ``p2p_us``: the exposed part of one P2P receive (activations or gradients), from its send's end
  (the wait for the sender to produce is the pipeline's, not the transfer's), which every vstage
  pays once per neighbour stage per micro-batch.

The split minimises the largest vstage time ``sum(layer_us of its layers) + embed (first) + head
(last) + p2p_us x its neighbours`` over contiguous splits (the dynamic program of
``layer_split: balanced``, :func:`k3sched.layersplit.min_max_split`, where only the first and the last
vstage may be empty). What the measured times leave out: optim.run (once per step, proportional
to the stage's parameters) and local offload copies, which run beside compute.

k3sched imports no ``traces``: the CLI reads the trace files and passes their events (any object
with columns ``name``, ``rank``, ``start_us``, ``end_us``) to :func:`measure`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .config import Config
from .layersplit import LayerTimes, profile_split

_COMPUTE_LANES = ("compute",)
_HEAD = ("head.fwd", "head.dx", "head.dw")
_EMBED = ("embed.fwd", "embed.dw")
_RECV = ("act.recv", "grad.recv")
_SEND = ("act.send", "grad.send")


def _merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _covered(s: float, e: float, busy: list[tuple[float, float]]) -> float:
    import bisect

    i = max(0, bisect.bisect_right(busy, (s, float("inf"))) - 1)
    got = 0.0
    while i < len(busy) and busy[i][0] < e:
        a, b = busy[i]
        got += max(0.0, min(b, e) - max(a, s))
        i += 1
    return got


def measure(plan: dict, events) -> LayerTimes:
    """Per-layer, embedding, head and exposed-P2P times per micro-batch of the run planned in
    ``plan`` from its trace ``events`` ([Note: profile split]). Raises ValueError (one line) when no
    event names a task of the plan or a layer has no measured task."""
    tasks = {t["id"]: t for st in plan["stages"] for ts in st["lanes"].values() for t in ts}
    inst: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    kinds = getattr(events, "kind", None)
    for i in range(len(events.name)):
        if kinds is not None and kinds[i] != "range":
            continue
        n = str(events.name[i])
        if n in tasks:
            inst[(int(events.rank[i]), n)].append((float(events.start_us[i]), float(events.end_us[i])))
    if not inst:
        raise ValueError("no trace event names a task of the plan (wrong plan, or traces of another run?)")
    most = max(len(v) for v in inst.values())
    first = 1 if most > 1 else 0
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for (r, tid), v in inst.items():
        v.sort()
        if tasks[tid]["lane"] in _COMPUTE_LANES:
            busy[r].extend(v)
    merged = {r: _merge(iv) for r, iv in busy.items()}
    # the send a receive waits for: its plan dependency, on the rank of the same replica in the
    # sending stage (ranks of a stage in rank order; [Note: rank order] keeps replicas aligned)
    votes: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for (r, tid) in inst:
        votes[r][int(tasks[tid]["stage"])] += 1
    stage_of = {r: max(v, key=v.get) for r, v in votes.items()}
    ranks_of: dict[int, list[int]] = defaultdict(list)
    for r in sorted(stage_of):
        ranks_of[stage_of[r]].append(r)

    def send_end(r: int, t: dict, k: int) -> float | None:
        send = next((d for d in t.get("deps") or [] if d in tasks and tasks[d]["kind"] in _SEND), None)
        if send is None:
            return None
        mine, theirs = ranks_of[stage_of[r]], ranks_of.get(int(tasks[send]["stage"]), [])
        if len(theirs) != len(mine):
            return None
        got = inst.get((theirs[mine.index(r)], send))
        return got[first:][k][1] if got is not None and len(got[first:]) > k else None
    # cost of each (rank, step, mb) group: layer L, embed, head; and every receive's exposed time
    per: dict[tuple[str, int, int, int], float] = defaultdict(float)
    recv: list[float] = []
    for (r, tid), v in inst.items():
        t = tasks[tid]
        kind, lane, mb, layer = t["kind"], t["lane"], t.get("mb"), t.get("layer")
        for k, (s, e) in enumerate(v[first:]):
            if lane in _COMPUTE_LANES:
                cost = e - s
            elif lane == "ep" or kind in _RECV:
                if kind in _RECV:  # waiting for the sender to produce is not the transfer's cost
                    sent = send_end(r, t, k)
                    s = min(e, max(s, sent)) if sent is not None else s
                cost = max(0.0, (e - s) - _covered(s, e, merged.get(r, [])))
            else:
                continue
            if kind in _RECV:
                recv.append(cost)
            elif layer is not None and mb is not None:
                per[("L", int(layer), r, k * 1_000_003 + int(mb))] += cost
            elif kind in _EMBED and mb is not None:
                per[("embed", 0, r, k * 1_000_003 + int(mb))] += cost
            elif kind in _HEAD and mb is not None:
                per[("head", 0, r, k * 1_000_003 + int(mb))] += cost
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for (what, L, _r, _k), c in per.items():
        groups[(what, L)].append(c)
    n_layers = int((plan.get("config") or {}).get("model", {}).get("layers") or
                   1 + max((L for w, L in groups if w == "L"), default=-1))
    missing = [L for L in range(n_layers) if ("L", L) not in groups]
    if missing:
        raise ValueError(f"no measured task of layer {missing[0]} in the traces ({len(missing)} of {n_layers} "
                         "layers missing: traces of every rank are needed)")
    med = lambda key: statistics.median(groups[key]) if key in groups else 0.0  # noqa: E731
    return LayerTimes([med(("L", L)) for L in range(n_layers)], med(("embed", 0)), med(("head", 0)),
                      statistics.median(recv) if recv else 0.0, max(len(v) for v in inst.values()) - first,
                      len({r for r, _ in inst}))


def vstage_us(lt: LayerTimes, split: list[list[int]]) -> list[float]:
    """Measured-time estimate of each vstage per micro-batch under ``split``."""
    n = len(split)
    out = []
    for v, layers in enumerate(split):
        t = sum(lt.layer_us[L] for L in layers)
        t += (lt.embed_us if v == 0 else 0.0) + (lt.head_us if v == n - 1 else 0.0)
        t += lt.p2p_us * ((v > 0) + (v < n - 1))
        out.append(t)
    return out


def stage_us(cfg: Config, lt: LayerTimes, split: list[list[int]]) -> list[float]:
    """Per physical stage: the sum of its vstages' times (:func:`vstage_us`) per micro-batch."""
    from .graph import placement_for

    pl = placement_for(cfg)
    per_v = vstage_us(lt, split)
    out = [0.0] * cfg.parallel.pp
    for v, t in enumerate(per_v):
        out[pl.locate(v)[0]] += t
    return out


@dataclass
class Proposal:
    """What ``k3sched rebalance`` proposes: the split before and after, their per-stage measured-time
    estimates, and the planner's predicted step for both configs."""

    before: list[list[int]]
    after: list[list[int]]
    stage_before_us: list[float]
    stage_after_us: list[float]
    step_before_us: float
    step_after_us: float
    config: dict[str, Any]
    times: LayerTimes


def propose(plan_doc: dict, lt: LayerTimes, profile_path: str) -> Proposal:
    """The rebalanced config for the run planned in ``plan_doc`` with measured times ``lt`` (already
    written to ``profile_path`` by :func:`write_profile`; the new config names it): ``layer_split: profile``,
    ``stage_layers`` dropped. Both configs planned with the source's own cost model."""
    from .config import config_from_dict
    from .layersplit import split_layers
    from .planner import plan

    data = {k: dict(v) for k, v in plan_doc["config"].items() if isinstance(v, dict)}
    src = config_from_dict(data)
    before = split_layers(src)
    after = profile_split(lt, src.parallel.pp * src.parallel.vpp)
    new = {k: dict(v) for k, v in data.items()}
    new["parallel"].pop("stage_layers", None)
    new["parallel"]["layer_split"] = "profile"
    new["schedule"]["profile"] = profile_path
    cfg_after = config_from_dict(new)
    if split_layers(cfg_after) != after:  # the planner reads the profile written for it
        raise AssertionError("the profile split of the written config differs from the proposal")
    return Proposal(before, after, stage_us(src, lt, before), stage_us(src, lt, after),
                    float(plan(src).metrics.step_time_us), float(plan(cfg_after).metrics.step_time_us),
                    cfg_after.to_dict(), lt)


def write_profile(lt: LayerTimes, path: str | Path, source: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("# k3sched rebalance: measured per-layer times per micro-batch (us), "
                          "[Note: profile split] in k3sched/rebalance.py\n"
                          + yaml.safe_dump(lt.to_profile(source), sort_keys=False))


def write_config(prop: Proposal, path: str | Path, source: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(f"# k3sched rebalance of {source}: layers split by measured time\n"
                          + yaml.safe_dump(prop.config, sort_keys=False))


def render(prop: Proposal) -> list[str]:
    def counts(split: list[list[int]]) -> str:
        return "[" + ", ".join(str(len(x)) for x in split) + "]"

    lt = prop.times
    lines = [f"measured per micro-batch ({lt.ranks} ranks, {lt.steps} step(s)): layers "
             + ", ".join(f"{x / 1e3:.2f}" for x in lt.layer_us) + f" ms; embed {lt.embed_us / 1e3:.2f}, "
             f"head {lt.head_us / 1e3:.2f}, exposed P2P receive {lt.p2p_us / 1e3:.2f} ms",
             f"layers per vstage: before {counts(prop.before)}, after {counts(prop.after)}",
             "stage   before ms/mb   after ms/mb"]
    for s, (a, b) in enumerate(zip(prop.stage_before_us, prop.stage_after_us)):
        lines.append(f"{s:>5} {a / 1e3:>14.2f} {b / 1e3:>13.2f}")
    lines.append(f"slowest stage per micro-batch: {max(prop.stage_before_us) / 1e3:.2f} -> "
                 f"{max(prop.stage_after_us) / 1e3:.2f} ms (measured times)")
    lines.append(f"planner's predicted step: {prop.step_before_us / 1e3:.2f} -> {prop.step_after_us / 1e3:.2f} ms "
                 f"({(prop.step_after_us / prop.step_before_us - 1) * 100:+.1f}%); run the new config to measure it")
    return lines

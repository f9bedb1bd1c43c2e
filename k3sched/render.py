"""Plan outputs: plan.json, Chrome/Perfetto trace, ASCII timeline, PNG timeline.

All of them are views of one :class:`~k3sched.planner.Plan`; nothing here changes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from .cost import CostModel
from .tasks import LANES, FWD_KINDS, Kind, Task, WGRAD_KINDS

if TYPE_CHECKING:  # pragma: no cover
    from .planner import Plan

PLAN_FORMAT = "k3sched.plan/1"

# One character per task category in the ASCII timeline (legend printed under it).
_GLYPH = {
    Kind.DISPATCH_FWD: "D", Kind.COMBINE_FWD: "C", Kind.COMBINE_BWD: "c", Kind.DISPATCH_BWD: "d",
    Kind.DISPATCH_RE: "R", Kind.FWD_SEND: ">", Kind.FWD_RECV: "<", Kind.BWD_SEND: "}", Kind.BWD_RECV: "{",
    Kind.GRAD_RS: "G", Kind.ACT_OFFLOAD: "o", Kind.ACT_ONLOAD: "n", Kind.ACT_ROFFLOAD: "O",
    Kind.ACT_RONLOAD: "N", Kind.ACT_RSTORE: "S", Kind.ACT_RSERVE: "V", Kind.GSHARD_ONLOAD: "n",
    Kind.GSHARD_OFFLOAD: "o", Kind.GSHARD_ADD: "+",
    Kind.OPTIM: "*",
}
LEGEND = ("F forward  B backward dX  W WGrad  D/C dispatch/combine  d/c their backward  R dispatch recompute  "
          "> < } { P2P send/recv fwd/bwd  G grad reduce-scatter  o/n offload/onload  O/N remote  "
          "S/V peer store/serve  + grad add  . idle")


def glyph(kind: Kind) -> str:
    if kind in _GLYPH:
        return _GLYPH[kind]
    if kind in WGRAD_KINDS:
        return "W"
    if kind in FWD_KINDS:
        return "F"
    return "B"


def task_json(t: Task) -> dict:
    return {
        "id": t.id, "kind": t.kind.value, "lane": t.lane, "stage": t.stage, "chunk": t.chunk, "mb": t.mb,
        "layer": t.layer, "start_us": round(t.start_us, 3), "end_us": round(t.end_us, 3), "deps": list(t.deps),
        "mem": {"alloc": t.alloc.to_json(), "free": t.free.to_json()}, "bytes": t.bytes, "buffer": t.buffer,
        "peer_stage": t.peer_stage, "duration_us": round(t.duration_us, 3),
        "release": None if t.release is None else {"stage": t.release[0], "device": t.release[1]},
    }


def plan_to_json(plan: "Plan") -> dict:
    """The plan.json document (format ``k3sched.plan/1``, see docs/formats.md)."""
    tasks = plan.tasks
    stages = []
    for s in range(plan.cfg.parallel.pp):
        lanes = {lane: [task_json(tasks[tid]) for tid in plan.lane_orders[(s, lane)]] for lane in LANES}
        stages.append({"stage": s, "lanes": lanes,
                       "start_deps": {tid: d for tid, d in sorted(plan.graph.start_deps.items())
                                      if tasks[tid].stage == s}})
    return {
        "format": PLAN_FORMAT,
        "config": plan.cfg.to_dict(),
        "strategy": plan.strategy,
        "pipeline": plan.pipeline,
        "lanes": list(LANES),
        "shared_links": [list(g) for g in CostModel(plan.cfg).shared_links()],
        "backbone": {str(r): [None if x is None else str(x) for x in slots] for r, slots in plan.backbone.items()},
        "stages": stages,
        "metrics": _jsonable(plan.metrics),
    }


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item"):
        return x.item()
    return x


def dumps_plan(plan: "Plan") -> str:
    return json.dumps(plan_to_json(plan), indent=1, sort_keys=False) + "\n"


def perfetto_trace(plan: "Plan") -> dict:
    """Chrome trace JSON: one process per stage, one thread per lane, flow arrows for cross-lane
    dependencies, a memory counter track per stage. Opens in ui.perfetto.dev as is."""
    ev: list[dict] = []
    tid_of = {lane: i + 1 for i, lane in enumerate(LANES)}
    pp = plan.cfg.parallel.pp
    for s in range(pp):
        ev.append({"ph": "M", "name": "process_name", "pid": s, "tid": 0, "args": {"name": f"stage {s}"}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": s, "tid": 0, "args": {"sort_index": s}})
        for lane, tid in tid_of.items():
            ev.append({"ph": "M", "name": "thread_name", "pid": s, "tid": tid, "args": {"name": lane}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": s, "tid": tid, "args": {"sort_index": tid}})
    tasks = plan.tasks
    flow = 0
    for s in range(pp):
        for lane in LANES:
            for tid in plan.lane_orders[(s, lane)]:
                t = tasks[tid]
                ev.append({"ph": "X", "name": t.id, "cat": t.lane, "pid": t.stage, "tid": tid_of[t.lane],
                           "ts": round(t.start_us, 3), "dur": round(t.duration_us, 3),
                           "args": {"kind": t.kind.value, "mb": t.mb, "layer": t.layer, "bytes": t.bytes}})
                for d in t.deps:
                    p = tasks[d]
                    if p.lane == t.lane and p.stage == t.stage:
                        continue
                    flow += 1
                    ev.append({"ph": "s", "id": flow, "name": "dep", "cat": "dep", "pid": p.stage,
                               "tid": tid_of[p.lane], "ts": round(p.end_us, 3)})
                    ev.append({"ph": "f", "bp": "e", "id": flow, "name": "dep", "cat": "dep", "pid": t.stage,
                               "tid": tid_of[t.lane], "ts": round(t.start_us, 3)})
    for (s, space), tl in sorted(plan.memory.items()):
        for t_us, b in zip(tl.times_us.tolist(), tl.bytes.tolist()):
            ev.append({"ph": "C", "name": f"memory {space} (MiB)", "pid": s, "ts": round(t_us, 3),
                       "args": {space: round(b / 2**20, 3)}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"format": "k3sched.plan-trace/1", "strategy": plan.strategy, "pipeline": plan.pipeline}}


def ascii_timeline(plan: "Plan", width: int = 100, stages: list[int] | None = None) -> str:
    """One row per (stage, lane); each column is step_time/width µs, showing the task that covers
    most of it. Lanes with no tasks are left out."""
    step = plan.metrics["step_time_us"] or 1.0
    col = step / width
    lines = [f"timeline: {step / 1e3:.3f} ms, one column = {col / 1e3:.3f} ms"]
    tasks = plan.tasks
    for s in stages if stages is not None else range(plan.cfg.parallel.pp):
        for lane in LANES:
            order = plan.lane_orders[(s, lane)]
            if not order:
                continue
            cover = [0.0] * width
            row = ["."] * width
            for tid in order:
                t = tasks[tid]
                a, b = t.start_us / col, t.end_us / col
                for c in range(int(a), min(width, int(b) + 1)):
                    ov = min(b, c + 1) - max(a, c)
                    if ov > cover[c]:
                        cover[c] = ov
                        row[c] = glyph(t.kind)
            lines.append(f"s{s:<2} {lane:<14} |{''.join(row)}|")
    lines.append(LEGEND)
    return "\n".join(lines)


def png_timeline(plans: "list[Plan] | Plan", path: str | Path, titles: list[str] | None = None) -> Path:
    """Gantt chart of every stage's lanes with the device memory curve under it; several plans
    are stacked (``k3sched compare``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = plans if isinstance(plans, list) else [plans]
    colors = {"F": "#4c72b0", "B": "#55a868", "W": "#8172b3", "D": "#dd8452", "C": "#dd8452", "d": "#c44e52",
              "c": "#c44e52", "R": "#937860", ">": "#da8bc3", "<": "#da8bc3", "}": "#da8bc3", "{": "#da8bc3",
              "G": "#8c8c8c", "o": "#ccb974", "n": "#64b5cd", "O": "#b5a642", "N": "#3a8fb7", "+": "#999999",
              "S": "#b5a642", "V": "#3a8fb7",
              "*": "#000000"}
    fig, axes = plt.subplots(2 * len(plans), 1, figsize=(14, 5.5 * len(plans)), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1] * len(plans)})
    for k, plan in enumerate(plans):
        ax, axm = axes[2 * k][0], axes[2 * k + 1][0]
        pp = plan.cfg.parallel.pp
        yt, yl = [], []
        y = 0
        for s in range(pp):
            for lane in LANES:
                order = plan.lane_orders[(s, lane)]
                spans = [(plan.tasks[t].start_us / 1e3, plan.tasks[t].duration_us / 1e3) for t in order]
                cols = [colors[glyph(plan.tasks[t].kind)] for t in order]
                if spans:
                    ax.broken_barh(spans, (y, 0.8), facecolors=cols, linewidth=0)
                yt.append(y + 0.4)
                yl.append(f"s{s} {lane}")
                y += 1
        ax.set_yticks(yt)
        ax.set_yticklabels(yl, fontsize=6)
        if k == 0:
            from matplotlib.patches import Patch

            legend = [("F", "forward"), ("B", "backward dX"), ("W", "WGrad"), ("D", "dispatch/combine"),
                      ("d", "a2a backward"), (">", "P2P"), ("G", "grad reduce-scatter"), ("o", "offload"),
                      ("n", "onload"), ("O", "remote offload")]
            ax.legend(handles=[Patch(color=colors[g], label=lbl) for g, lbl in legend], fontsize=6, ncol=10,
                      loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False)
        ax.invert_yaxis()
        ax.set_xlim(0, plan.metrics["step_time_us"] / 1e3)
        title = titles[k] if titles else f"{plan.strategy} / {plan.pipeline}"
        ax.set_title(f"{title}: step {plan.metrics['step_time_us'] / 1e3:.2f} ms "
                     f"(lower bound {plan.metrics['lower_bound_us'] / 1e3:.2f} ms)", fontsize=9, loc="left")
        for s in range(pp):
            tl = plan.memory.get((s, "device"))
            if tl is not None and len(tl.times_us):
                axm.step(tl.times_us / 1e3, tl.bytes / 2**30, where="post", linewidth=0.8, label=f"s{s}")
        axm.axhline(plan.metrics.get("budget_bytes", 0) / 2**30, color="red", linestyle="--", linewidth=0.8)
        axm.set_ylabel("device GiB", fontsize=7)
        axm.set_xlabel("time (ms)", fontsize=7)
        axm.set_xlim(0, plan.metrics["step_time_us"] / 1e3)
        if pp <= 8:
            axm.legend(fontsize=6, ncol=pp)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

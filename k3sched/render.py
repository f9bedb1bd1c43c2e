"""Plan outputs: plan.json, Chrome/Perfetto trace, ASCII timeline, PNG timeline.

All of them are views of one :class:`~k3sched.planner.Plan`; nothing here changes it.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING

from .planfile import dumps_json, dumps_plan_bytes, gc_paused
from .tasks import LANES, FWD_KINDS, Kind, WGRAD_KINDS

if TYPE_CHECKING:  # pragma: no cover
    from .planner import Plan

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


def dumps_trace_bytes(plan: "Plan") -> bytes:
    """plan.trace.json as written (compact JSON, see :func:`perfetto_trace`)."""
    with gc_paused():
        return dumps_json(perfetto_trace(plan))


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
    add = ev.append
    end_at: dict[str, float] = {}  # each task's rounded end, the ts of every flow arrow leaving it
    where = {tid: (t.stage, tid_of[t.lane]) for tid, t in tasks.items()}
    for s in range(pp):
        for lane in LANES:
            tid_lane = tid_of[lane]
            for tid in plan.lane_orders[(s, lane)]:
                t = tasks[tid]
                start = round(t.start_us, 3)
                add({"ph": "X", "name": t.id, "cat": lane, "pid": s, "tid": tid_lane,
                     "ts": start, "dur": round(t.duration_us, 3),
                     "args": {"kind": t.kind.value, "mb": t.mb, "layer": t.layer, "bytes": t.bytes}})
                for d in t.deps:
                    ps, pt = where[d]
                    if ps == s and pt == tid_lane:
                        continue
                    flow += 1
                    end = end_at.get(d)
                    if end is None:
                        end = end_at[d] = round(tasks[d].end_us, 3)
                    add({"ph": "s", "id": flow, "name": "dep", "cat": "dep", "pid": ps, "tid": pt, "ts": end})
                    add({"ph": "f", "bp": "e", "id": flow, "name": "dep", "cat": "dep", "pid": s,
                         "tid": tid_lane, "ts": start})
    for (s, space), tl in sorted(plan.memory.items()):
        name = f"memory {space} (MiB)"
        for t_us, b in zip(tl.times_us.tolist(), tl.bytes.tolist()):
            add({"ph": "C", "name": name, "pid": s, "ts": round(t_us, 3), "args": {space: round(b / 2**20, 3)}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"format": "k3sched.plan-trace/1", "strategy": plan.strategy, "pipeline": plan.pipeline}}


def ascii_timeline(plan: "Plan", width: int = 100, stages: list[int] | None = None) -> str:
    """One row per (stage, lane); each column is step_time/width µs, showing the task that covers
    most of it. Lanes with no tasks are left out."""
    step = plan.metrics.step_time_us or 1.0
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


_COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#8172b3", "D": "#dd8452", "C": "#dd8452", "d": "#c44e52",
           "c": "#c44e52", "R": "#937860", ">": "#da8bc3", "<": "#da8bc3", "}": "#da8bc3", "{": "#da8bc3",
           "G": "#8c8c8c", "o": "#ccb974", "n": "#64b5cd", "O": "#b5a642", "N": "#3a8fb7", "+": "#999999",
           "S": "#b5a642", "V": "#3a8fb7", "*": "#000000"}
_PNG_LEGEND = [("F", "forward"), ("B", "backward dX"), ("W", "WGrad"), ("D", "dispatch/combine"),
               ("d", "a2a backward"), ("R", "dispatch recompute"), (">", "P2P"), ("G", "grad reduce"),
               ("o", "offload"), ("n", "onload"), ("O", "remote offload"), ("*", "optimizer")]
_STAGE_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"]


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return int(hex_color[1:3], 16), int(hex_color[3:5], 16), int(hex_color[5:7], 16)


def load_font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size)
    except TypeError:  # Pillow < 10.1: one fixed bitmap font
        return ImageFont.load_default()


def _lane_image(plan: "Plan", width: int, row_h: int, gap: int) -> "tuple[object, list[str]]":
    """[Note: rasterised timeline] Every (stage, lane) row as pixels: a task paints the columns
    [floor(start), ceil(end)) of its span (at least one), later tasks of a lane over earlier ones
    (a lane runs one task at a time, so only sub-pixel tasks share a column). One numpy image,
    no drawing call per task."""
    import numpy as np

    rows = [(s, lane) for s in range(plan.cfg.parallel.pp) for lane in LANES]
    img = np.full((len(rows) * row_h, width, 3), 255, np.uint8)
    step = plan.metrics.step_time_us or 1.0
    scale = width / step
    palette = {g: np.array(_rgb(c), np.uint8) for g, c in _COLORS.items()}
    tasks = plan.tasks
    labels = []
    for r, (s, lane) in enumerate(rows):
        labels.append(f"s{s} {lane}")
        order = plan.lane_orders[(s, lane)]
        if not order:
            continue
        ts = [tasks[t] for t in order]
        a = np.floor(np.fromiter((t.start_us for t in ts), float, len(ts)) * scale).astype(np.int64)
        b = np.ceil(np.fromiter((t.end_us for t in ts), float, len(ts)) * scale).astype(np.int64)
        a = np.clip(a, 0, width - 1)
        b = np.clip(np.maximum(b, a + 1), 1, width)
        # one glyph per column: the last task that starts at or before it and reaches it
        col = np.full(width, -1, np.int64)
        for i in range(len(ts)):
            col[a[i]:b[i]] = i
        used = col >= 0
        if not used.any():
            continue
        glyphs = [glyph(t.kind) for t in ts]
        rgb = np.stack([palette[g] for g in glyphs])
        band = img[r * row_h:(r + 1) * row_h - gap]
        band[:, used] = rgb[col[used]]
    return img, labels


def png_timeline(plans: "list[Plan] | Plan", path: str | Path, titles: list[str] | None = None) -> Path:
    """Gantt chart of every stage's lanes with the device memory curve under it; several plans
    are stacked (``k3sched compare``). Drawn with Pillow on a rasterised image ([Note: rasterised
    timeline]): no matplotlib, a fraction of a second for tens of thousands of tasks."""
    from PIL import Image, ImageDraw

    plans = plans if isinstance(plans, list) else [plans]
    width, left, right, top = 1400, 130, 20, 8
    row_h, gap, mem_h, title_h, axis_h = 6, 1, 150, 22, 30
    font, small = load_font(12), load_font(9)
    blocks = []
    for plan in plans:
        pp = plan.cfg.parallel.pp
        row_h_p = max(3, min(row_h * 3, 480 // max(1, pp * len(LANES))))
        img, labels = _lane_image(plan, width, row_h_p, gap if row_h_p > 3 else 0)
        blocks.append((plan, img, labels, row_h_p))
    legend_h = 20
    total_h = legend_h + sum(title_h + img.shape[0] + axis_h + mem_h + axis_h + top for _, img, _, _ in blocks)
    canvas = Image.new("RGB", (left + width + right, total_h), "white")
    draw = ImageDraw.Draw(canvas)
    x = left
    for g, lbl in _PNG_LEGEND:
        draw.rectangle([x, 5, x + 10, 15], fill=_COLORS[g])
        draw.text((x + 14, 4), lbl, fill="black", font=small)
        x += 24 + int(draw.textlength(lbl, font=small))
    y = legend_h
    for k, (plan, img, labels, rh) in enumerate(blocks):
        m = plan.metrics
        step = m.step_time_us or 1.0
        title = titles[k] if titles else f"{plan.strategy} / {plan.pipeline}"
        draw.text((left, y + 4), f"{title}: step {step / 1e3:.2f} ms (lower bound {m.lower_bound_us / 1e3:.2f} "
                                 f"ms)", fill="black", font=font)
        y += title_h
        canvas.paste(Image.fromarray(img), (left, y))
        draw.rectangle([left - 1, y - 1, left + width, y + img.shape[0]], outline="#444444")
        if rh >= 7:
            for r, lbl in enumerate(labels):
                draw.text((4, y + r * rh), lbl, fill="black", font=small)
        else:  # too thin for one label per lane: one per stage
            for s in range(plan.cfg.parallel.pp):
                draw.text((4, y + s * len(LANES) * rh), f"stage {s}", fill="black", font=small)
        y += img.shape[0]
        _time_axis(draw, left, width, y, step, small)
        y += axis_h
        y = _memory_panel(draw, plan, left, width, y, mem_h, step, small)
        _time_axis(draw, left, width, y, step, small)
        y += axis_h + top
    path = Path(path)
    canvas.save(path, format="PNG", compress_level=1)
    return path


def _memory_panel(draw, plan: "Plan", left: int, width: int, y: int, mem_h: int, step: float, small) -> int:
    """The device memory of every stage under a plan's lanes (the highest value within each pixel
    column, as a step curve) with the budget dashed in red; returns the panel's bottom."""
    import numpy as np

    m = plan.metrics
    budget = m.budget_bytes or 0
    peak = max([float(tl.bytes.max()) for (s, sp), tl in plan.memory.items()
                if sp == "device" and len(tl.bytes)] + [float(budget), 1.0])
    ytop, ybot = y, y + mem_h
    draw.rectangle([left - 1, ytop, left + width, ybot], outline="#444444")
    edges = np.linspace(0.0, step, width + 1)
    for s in range(plan.cfg.parallel.pp):
        tl = plan.memory.get((s, "device"))
        if tl is None or not len(tl.times_us):
            continue
        t, b = np.asarray(tl.times_us, float), np.asarray(tl.bytes, float)
        # value at each column's start, then the max of any change inside the column
        idx = np.clip(np.searchsorted(t, edges[:-1], side="right") - 1, 0, len(b) - 1)
        val = b[idx]
        inside = np.clip((t * width / step).astype(np.int64), 0, width - 1)
        np.maximum.at(val, inside, b)
        ys = ybot - val / peak * (mem_h - 4)
        pts = list(zip((left + np.arange(width)).tolist(), ys.tolist()))
        draw.line(pts, fill=_STAGE_COLORS[s % len(_STAGE_COLORS)], width=1)
    if budget:
        yb = ybot - budget / peak * (mem_h - 4)
        for xs in range(left, left + width, 12):
            draw.line([(xs, yb), (xs + 6, yb)], fill="red", width=1)
    draw.text((4, ytop), "device GiB", fill="black", font=small)
    for frac in (0.0, 0.5, 1.0):
        draw.text((left - 40, ybot - frac * (mem_h - 4) - 6), f"{peak * frac / 2**30:.1f}", fill="black",
                  font=small)
    draw.text((4, ytop + 14), "red: budget", fill="red", font=small)
    return ybot


def _time_axis(draw, left: int, width: int, y: int, step_us: float, font) -> None:
    """Ticks in ms under a panel: about ten, at 1/2/5 x 10^k."""
    import math

    ms = step_us / 1e3
    raw = ms / 10 or 1.0
    mag = 10 ** math.floor(math.log10(raw))
    tick = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    v = 0.0
    while v <= ms + 1e-9:
        x = left + v / ms * width if ms else left
        draw.line([(x, y), (x, y + 4)], fill="black")
        draw.text((x - 8, y + 6), f"{v:g}", fill="black", font=font)
        v += tick
    draw.text((left + width - 50, y + 16), "time (ms)", fill="black", font=font)


def write_outputs(plan: "Plan", out: str | Path, png: bool = True, parallel: bool | None = None,
                  before=None) -> list[Path]:
    """Write ``plan.json``, ``plan.trace.json``, ``timeline.txt`` and (``png``) ``timeline.png``
    into ``out``; returns their paths. ``before``: called here before ``out`` is created or any
    file written (``k3sched plan``: its P2P check and report); what it raises propagates, and
    then nothing is written.

    [Note: parallel outputs] With two cores or more (``parallel`` None) a forked child builds the
    trace and the ASCII timeline while this process runs ``before`` and builds plan.json; the
    child writes them and draws the PNG once this process says go (after ``before``), else
    writes nothing. The two halves cost about the same CPU, so the outputs and the check take
    about half the wall time. The child reports a failure through a pipe; it is raised here as
    the same exception type when it is an OSError (a path the user named), else as a
    RuntimeError naming the child's exception."""
    import os

    out = Path(out)
    paths = [out / "plan.json", out / "plan.trace.json", out / "timeline.txt"] + ([out / "timeline.png"] if png else [])
    if parallel is None:
        parallel = (os.cpu_count() or 1) > 1 and hasattr(os, "fork")
    if not parallel:
        if before is not None:
            before()
        out.mkdir(parents=True, exist_ok=True)
        paths[0].write_bytes(dumps_plan_bytes(plan))
        _write_rest(plan, paths, dumps_trace_bytes(plan), ascii_timeline(plan, 160))
        return paths
    go_r, go_w = os.pipe()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        os.close(go_w)
        os.close(report_r)
        _outputs_child(plan, paths, go_r, report_w)
    os.close(go_r)
    os.close(report_w)
    go = False
    try:
        try:
            if before is not None:
                before()
            out.mkdir(parents=True, exist_ok=True)
            go = True
            os.write(go_w, b"1")
        except BrokenPipeError:  # the child failed before it waited: its report says why
            pass
        finally:
            os.close(go_w)  # without a go, the child leaves writing nothing
        if go:
            paths[0].write_bytes(dumps_plan_bytes(plan))
    finally:
        with os.fdopen(report_r, "rb") as f:
            report = f.read()
        _, status = os.waitpid(pid, 0)
    if status != 0 or report:
        _raise_child_failure(report)
    return paths


def _write_rest(plan: "Plan", paths: list[Path], trace: bytes, text: str) -> None:
    paths[1].write_bytes(trace)
    paths[2].write_text(text + "\n")
    if len(paths) > 3:
        png_timeline(plan, paths[3])


def _outputs_child(plan: "Plan", paths: list[Path], go_fd: int, report_fd: int) -> None:
    """The forked half of [Note: parallel outputs]: build the trace and the ASCII timeline, wait
    for go, write them and the PNG; leave with ``os._exit`` (no exit handler of the parent runs)."""
    import os

    code = 0
    try:
        gc.disable()  # [Note: no GC while building outputs]; the child ends with os._exit
        trace, text = dumps_trace_bytes(plan), ascii_timeline(plan, 160)
        if os.read(go_fd, 1) == b"1":
            _write_rest(plan, paths, trace, text)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        code = 1
        errno = getattr(e, "errno", None) or 0
        msg = f"{type(e).__name__}\0{errno}\0{getattr(e, 'strerror', None) or e}\0{getattr(e, 'filename', '')}"
        os.write(report_fd, msg.encode("utf-8", "replace")[:4000])
    finally:
        os._exit(code)


def _raise_child_failure(report: bytes) -> None:
    name, errno, text, filename = (report.decode("utf-8", "replace").split("\0") + ["", "", "", ""])[:4]
    if name in ("OSError", "PermissionError", "FileNotFoundError", "IsADirectoryError", "NotADirectoryError",
                "FileExistsError"):
        raise OSError(int(errno or 0), text, filename or None)
    raise RuntimeError(f"writing the trace and timelines failed: {name}: {text}")

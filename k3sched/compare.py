"""Compare pipeline backbones (and the serial baseline) on one config: ``k3sched compare``.

Each supported schedule is planned with the k3 strategy on a copy of the config whose
``schedule.pipeline`` (and, where the schedule needs it, ``parallel.vpp``) is changed; the
``serial`` strategy runs on the config's own pipeline as the no-overlap baseline. A schedule the
config's shape does not support gives a row with the reason instead of numbers.

vpp per schedule: gpipe, 1f1b, zb-h1, zb-h2 place one chunk per rank (vpp 1), and so do dualpipe
and chimera (one stage of each of their two model copies); zb-v, dualpipev, v-half and v-min two (V shape, vpp 2); interleaved-1f1b keeps the config's vpp when it is at least 2, else uses 2.
A schedule is skipped when the model has fewer layers than pp * vpp chunks. pipedream-2bw plans two
training steps at once ([Note: pipedream-2bw] in k3sched/schedule_generators.py); its row's times
and P2P bytes are per step (the plan's divided by 2), its bubble and peak memory the plan's.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import Config, ConfigError, config_from_dict, load_config
from .pipelines import PIPELINES
from .pipelines import TABLE as PIPELINE_TABLE
from .planfile import ranking_step
from .tasks import Kind

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console
    from rich.table import Table

    from .planner import Plan

SCHEDULES: tuple[str, ...] = PIPELINES  # [Note: schedule registry]
_VPP1 = tuple(n for n, p in PIPELINE_TABLE.items() if p.config_vpp == 1)  # dualpipe, chimera: one stage of each copy
_VPP2 = tuple(n for n, p in PIPELINE_TABLE.items() if p.config_vpp == 2)


@dataclass
class Row:
    """One compared plan. Times in µs, memory and volumes in bytes; ``error`` is set (and the
    numbers are None) when the schedule could not be planned for this config."""

    schedule: str
    strategy: str
    vpp: int
    step_us: float | None = None
    lower_bound_us: float | None = None
    ratio_to_bound: float | None = None
    bubble: float | None = None  # mean over stages of the compute lane's idle fraction
    exposed_ep_us: float | None = None  # per stage, mean over stages
    exposed_ep_ratio: float | None = None
    exposed_collective_us: float | None = None
    exposed_collective_ratio: float | None = None
    peak_device_max: int | None = None
    peak_device: list[int] | None = None
    p2p_bytes: int | None = None
    expected_us: float | None = None  # with a task-time spread: the mean step of the plan's replay
    num_tasks: int | None = None
    plan_s: float | None = None
    error: str | None = None
    plan: "Plan | None" = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        return f"{self.schedule}-{self.strategy}"

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("plan")
        return d


def variant(cfg: Config, pipeline: str) -> Config:
    """``cfg`` with ``schedule.pipeline`` set and ``parallel.vpp`` adapted to it (see module
    docstring); ConfigError (one line) when the shape does not fit."""
    vpp = cfg.parallel.vpp
    if pipeline in _VPP1:
        vpp = 1
    elif pipeline in _VPP2:
        vpp = 2
    elif pipeline == "interleaved-1f1b":
        vpp = max(2, vpp)
    layers, pp = cfg.model.layers, cfg.parallel.pp
    if layers < pp * vpp:
        raise ConfigError(f"skipped: {pipeline} needs pp*vpp = {pp}*{vpp} = {pp * vpp} chunks, model has {layers} layers")
    data = cfg.to_dict()
    data["parallel"]["vpp"] = vpp
    data["schedule"]["pipeline"] = pipeline
    if pipeline != "interleaved-1f1b":
        data["schedule"]["warmup_extra"] = 0
    return config_from_dict(data)


def _row(cfg: Config, schedule: str, strategy: str) -> Row:
    from .planner import plan
    from .simulator import DeadlockError

    row = Row(schedule, strategy, cfg.parallel.vpp)
    t0 = time.perf_counter()
    try:
        p = plan(cfg, strategy)
    except (ValueError, DeadlockError) as e:  # ConfigError, InfeasibleBudget, generator shape errors
        row.error = str(e).splitlines()[0] if str(e) else type(e).__name__
        row.plan_s = time.perf_counter() - t0
        return row
    row.plan_s = time.perf_counter() - t0
    m = p.metrics
    per = PIPELINE_TABLE[cfg.schedule.pipeline].steps  # pipedream-2bw: a plan of two steps, shown per step
    step = m.step_time_us / per
    pp = cfg.parallel.pp
    row.step_us = step
    row.lower_bound_us = m.lower_bound_us / per
    row.ratio_to_bound = step / row.lower_bound_us if m.lower_bound_us else None
    row.bubble = sum(b["compute"] for b in m.bubble_ratio) / pp
    ep = sum(e["ep"] for e in m.exposed_comm_us) / pp / per
    coll = sum(e["collective"] for e in m.exposed_comm_us) / pp / per
    row.exposed_ep_us, row.exposed_collective_us = ep, coll
    row.exposed_ep_ratio = ep / step if step else 0.0
    row.exposed_collective_ratio = coll / step if step else 0.0
    row.peak_device = [int(b) for b in m.peak_device_bytes]
    row.peak_device_max = max(row.peak_device)
    row.p2p_bytes = sum(t.bytes for t in p.tasks.values() if t.kind in (Kind.FWD_SEND, Kind.BWD_SEND)) // per
    row.num_tasks = m.num_tasks
    if m.expected_step_us is not None:  # [Note: ranking with a task-time spread]
        row.expected_us = m.expected_step_us / per
    row.plan = p
    return row


def compare(cfg: Config, pipelines: list[str] | None = None) -> list[Row]:
    """Plan ``cfg`` under each schedule in ``pipelines`` (default: all of ``SCHEDULES``) with the k3
    strategy, plus the serial strategy on the config's own pipeline (last row). Errors per schedule
    become rows with ``error`` set; an unknown schedule name raises ValueError."""
    names = list(SCHEDULES) if pipelines is None else list(pipelines)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule(s) {', '.join(unknown)}; supported: {', '.join(SCHEDULES)}")
    rows = []
    for name in names:
        try:
            c = variant(cfg, name)
        except ConfigError as e:
            vpp = 1 if name in _VPP1 else 2 if name in _VPP2 else max(2, cfg.parallel.vpp)
            rows.append(Row(name, "k3", vpp, error=str(e)))
            continue
        rows.append(_row(c, name, "k3"))
    rows.append(_row(cfg, cfg.schedule.pipeline, "serial"))
    return rows


def rank_us(r: Row) -> float:
    """[Note: ranking with a task-time spread] What a row is ranked by: its expected step when the
    config has a task-time spread (``hardware.cpu_runner.task_time_cv`` or a profile's ``time_cv``: the mean
    step of a replay of the plan's lane orders with sampled durations, [Note: task-time spread] in
    k3sched/variability.py), else its planned step. The planned step assumes every task takes its
    mean time; where durations spread, a plan whose transfers are hidden with little slack loses
    more of its overlap than one with room, so two plans' planned steps can rank them the wrong way
    round (the mean of a maximum is above the maximum of the means)."""
    return ranking_step(r.step_us, r.expected_us)


def best_row(rows: list[Row], strategy: str = "k3") -> Row | None:
    """The fastest planned row of ``strategy`` by :func:`rank_us`."""
    ok = [r for r in rows if r.ok and r.strategy == strategy]
    return min(ok, key=rank_us) if ok else None


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def render_table(rows: list[Row], title: str | None = None, wide: bool = False) -> "Table":
    """The comparison as a rich table. Default: the columns that matter, within 120 columns; a row
    that could not be planned says ``skipped (n)`` and its reason is note n under the table (see
    :func:`render_notes`). ``wide``: every column, the reasons in a note column."""
    from rich.table import Table

    t = Table(title=title or "schedule comparison", title_justify="left")
    spread = any(r.expected_us is not None for r in rows)  # [Note: ranking with a task-time spread]
    if wide:
        names = ("schedule", "strategy", "vpp", "step ms", *(("expected ms",) if spread else ()), "x bound",
                 "bubble", "exposed EP ms (%)", "exposed coll ms (%)", "peak dev GiB max", "peak dev GiB per stage",
                 "P2P MiB", "plan s")
    else:
        names = ("schedule", "strategy", "vpp", "step ms", *(("expected",) if spread else ()), "x bound", "bubble",
                 "exp. EP", "exp. coll", "peak GiB", "P2P MiB", *(() if spread else ("plan s",)))
    for name in names:
        t.add_column(name, justify="left" if name in ("schedule", "strategy") else "right", no_wrap=True)
    if wide:
        t.add_column("note", justify="left", overflow="fold", min_width=20)
    best = best_row(rows)
    n_err = 0
    for r in rows:
        if not r.ok:
            n_err += 1
            if wide:
                t.add_row(r.schedule, r.strategy, str(r.vpp), *["-"] * (len(names) - 3), r.error, style="dim")
            else:
                t.add_row(r.schedule, r.strategy, str(r.vpp), f"skipped ({n_err})", *["-"] * (len(names) - 4),
                          style="dim")
            continue
        mark = " *" if r is best else ""
        exp = ((f"{r.expected_us / 1e3:.3f}" if r.expected_us is not None else "-"),) if spread else ()
        if wide:
            per = " ".join(_gib(b) for b in r.peak_device) if len(r.peak_device) <= 8 else (
                f"{_gib(min(r.peak_device))}..{_gib(max(r.peak_device))}")
            t.add_row(r.schedule + mark, r.strategy, str(r.vpp), f"{r.step_us / 1e3:.3f}", *exp,
                      f"{r.ratio_to_bound:.3f}",
                      f"{r.bubble * 100:.1f}%", f"{r.exposed_ep_us / 1e3:.2f} ({r.exposed_ep_ratio * 100:.1f}%)",
                      f"{r.exposed_collective_us / 1e3:.2f} ({r.exposed_collective_ratio * 100:.1f}%)",
                      _gib(r.peak_device_max), per, f"{r.p2p_bytes / 2**20:.1f}", f"{r.plan_s:.2f}", "")
        else:
            t.add_row(r.schedule + mark, r.strategy, str(r.vpp), f"{r.step_us / 1e3:.3f}", *exp,
                      f"{r.ratio_to_bound:.3f}",
                      f"{r.bubble * 100:.1f}%", f"{r.exposed_ep_ratio * 100:.1f}%",
                      f"{r.exposed_collective_ratio * 100:.1f}%", _gib(r.peak_device_max),
                      f"{r.p2p_bytes / 2**20:.1f}", *(() if spread else (f"{r.plan_s:.2f}",)))
    t.caption = (("* fastest k3 row by its expected step (the plan replayed with the config's task-time spread); "
                  "expected = that mean step in ms" if spread else "* fastest k3 row")
                 + "; bubble and exposed comm (share of the step) are means over stages; x bound = "
                 "step / lower bound; peak = the highest stage" + ("" if wide else "; --wide: every column"))
    return t


def render_notes(rows: list[Row]) -> list[str]:
    """The reasons of the rows that could not be planned, numbered as :func:`render_table` marks
    them (``(n) schedule: reason``)."""
    errs = [r for r in rows if not r.ok]
    return [f"({n}) {r.schedule}: {r.error}" for n, r in enumerate(errs, 1)]


def write_compare(rows: list[Row], plans: "list[Plan | None] | None", out_dir: str | Path, png: bool = True
                  ) -> list[Path]:
    """Write ``<out>/<schedule>-<strategy>/plan.json`` for each planned row, ``<out>/compare.json``
    (the rows) and ``<out>/compare.png`` (every timeline stacked). ``plans`` aligns with ``rows``
    (None: the plans the rows carry)."""
    from .planfile import dumps_plan_bytes
    from .render import png_timeline

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plans = [r.plan for r in rows] if plans is None else list(plans)
    written: list[Path] = []
    done, titles = [], []
    for r, p in zip(rows, plans):
        if p is None:
            continue
        d = out / r.label
        d.mkdir(parents=True, exist_ok=True)
        path = d / "plan.json"
        path.write_bytes(dumps_plan_bytes(p))
        written.append(path)
        done.append(p)
        titles.append(f"{r.schedule} / {r.strategy} (vpp {r.vpp})")
    summary = out / "compare.json"
    summary.write_text(json.dumps({"format": "k3sched.compare/1", "rows": [r.to_json() for r in rows]}, indent=1) + "\n")
    written.append(summary)
    if png and done:
        written.append(png_timeline(done, out / "compare.png", titles))
    return written


def compare_command(config_path: str | Path, schedules: list[str] | None, out: Path | None,
                    overrides: list[str] | None, console: "Console", wide: bool = False) -> int:
    """``k3sched compare CONFIG [--schedules a,b] [--out DIR] [--set K=V] [--wide]``: print the table
    (within 120 columns unless ``wide``), write outputs. Exit code: 0 when at least one row planned,
    1 when none did, 2 on a bad config or schedule name (one line on the console)."""
    try:
        cfg = load_config(config_path, overrides)
        rows = compare(cfg, schedules)
    except (ConfigError, ValueError) as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    console.print(render_table(rows, f"{cfg.model.name}: pp {cfg.parallel.pp}, {cfg.parallel.microbatches} "
                                     f"micro-batches, serial on {cfg.schedule.pipeline}", wide=wide))
    if not wide:
        for line in render_notes(rows):
            console.print(line, highlight=False, markup=False)
    if out is not None:
        for path in write_compare(rows, None, out):
            console.print(f"wrote {path}", highlight=False)
    return 0 if any(r.ok for r in rows) else 1


# -- rank orders (``k3sched compare --orders``) -----------------------------------------------

@dataclass
class OrderRow:
    """One rank order of a config ([Note: rank order] in k3sched/placement.py): its predicted step
    (k3 on the config's own pipeline) and the link each group gets."""

    order: str
    step_us: float | None = None
    links: dict[str, str] = field(default_factory=dict)  # group kind -> "NVLink" | "NIC" | "-"
    p2p_nvlink_pairs: int = 0
    p2p_nic_pairs: int = 0
    error: str | None = None


def p2p_pairs(p: "Plan") -> list[tuple[int, int]]:
    """The (sending, receiving) stage pairs of a plan's activation transfers (its ``act.recv``
    tasks; gradients go back over the same pairs)."""
    return sorted({(t.release[0], t.stage) for t in p.tasks.values() if t.kind is Kind.FWD_RECV and t.release})


def compare_orders(cfg: Config, orders: list[str] | None = None) -> list[OrderRow]:
    """Plan ``cfg`` (k3) under each rank order (default: every one, :data:`placement.ALL_ORDERS`);
    an invalid name raises ConfigError naming it."""
    from .placement import ALL_ORDERS, RankOrder, group_placement, order_error, stage_pair_crosses
    from .planner import plan

    names = list(ALL_ORDERS) if orders is None else list(orders)
    for n in names:
        err = order_error(n)
        if err:
            raise ConfigError(f"--orders: {err}")
    gpn = cfg.hardware.gpus_per_node
    rows = []
    for name in names:
        row = OrderRow(name)
        data = cfg.to_dict()
        data["parallel"] = {**data["parallel"], "order": name}
        pairs: list[tuple[int, int]] = []
        try:
            planned = plan(config_from_dict(data))
            row.step_us = float(planned.metrics.step_time_us)
            pairs = p2p_pairs(planned)
        except ValueError as e:
            row.error = str(e).splitlines()[0] if str(e) else type(e).__name__
        ro = RankOrder(cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.ep, name)
        for kind, g in group_placement(ro, gpn).items():
            if kind != "p2p":
                row.links[kind] = "-" if g.size < 2 else (f"NIC {g.ranks_per_node}/node" if g.crosses else "NVLink")
        cross = sum(stage_pair_crosses(ro, gpn, a, b) for a, b in pairs)
        row.p2p_nic_pairs, row.p2p_nvlink_pairs = cross, len(pairs) - cross
        rows.append(row)
    return rows


def render_orders(rows: list[OrderRow], current: str) -> "Table":
    from rich.table import Table

    t = Table(title="rank orders (innermost first), k3 on the config's pipeline", title_justify="left")
    for name in ("order", "step ms", "vs current", "EP a2a", "DP dense", "DP expert", "P2P pairs NVLink/NIC"):
        t.add_column(name, justify="right" if name != "order" else "left", no_wrap=True)
    cur = next((r.step_us for r in rows if r.order == current and r.step_us), None)
    for r in rows:
        mark = " (current)" if r.order == current else ""
        if r.step_us is None:
            t.add_row(r.order + mark, "error", r.error or "", "", "", "", "")
            continue
        vs = f"{(r.step_us / cur - 1) * 100:+.1f}%" if cur else ""
        t.add_row(r.order + mark, f"{r.step_us / 1e3:.3f}", vs, r.links.get("ep", "-"), r.links.get("dense", "-"),
                  r.links.get("expert", "-"), f"{r.p2p_nvlink_pairs}/{r.p2p_nic_pairs}")
    return t


@dataclass
class SliceRow:
    """One sequence-slicing variant of a config ([Note: sequence slices] in k3sched/seqslice.py):
    its predicted step, planned peak device memory (largest stage) and largest slice time."""

    seq_chunks: int
    seq_split: str
    step_us: float | None = None
    peak_device_max: int | None = None
    largest_slice_us: float | None = None
    plan_s: float | None = None
    error: str | None = None


def parse_int_list(option: str, text: str) -> list[int]:
    """``1,2,4,8`` -> [1, 2, 4, 8]; ConfigError (one line naming ``option``) otherwise."""
    items = [s.strip() for s in text.split(",")]
    if not items or any(not s.isdigit() or int(s) < 1 for s in items):
        raise ConfigError(f"{option}: expected comma-separated integers >= 1, e.g. 1,2,4,8 (got {text!r}); allowed: "
                          f"slice counts for parallel.seq_chunks")
    return [int(s) for s in items]


def compare_slices(cfg: Config, chunks: list[int], splits: list[str]) -> list[SliceRow]:
    """Plan ``cfg`` (k3, its own pipeline) for every (seq_chunks, seq_split); one slice is planned
    once (the split does not matter). A combination the config refuses is a row with its error."""
    from .planner import plan
    from .seqslice import slice_times_us

    for s in splits:
        if s not in ("even", "compute"):
            raise ConfigError(f"--seq-split: {s!r} is not a split; allowed: even, compute (comma-separated)")
    rows = []
    for n in chunks:
        for split in (splits[:1] if n == 1 else splits):
            row = SliceRow(n, split if n > 1 else "-")
            t0 = time.perf_counter()
            try:
                data = cfg.to_dict()
                data["parallel"] = {**data["parallel"], "seq_chunks": n, "seq_split": split}
                p = plan(config_from_dict(data))
                row.step_us = float(p.metrics.step_time_us)
                row.peak_device_max = int(max(p.metrics.peak_device_bytes))
                times = slice_times_us(p)
                row.largest_slice_us = max(times) if times else None
            except ValueError as e:
                row.error = str(e).splitlines()[0] if str(e) else type(e).__name__
            row.plan_s = time.perf_counter() - t0
            rows.append(row)
    return rows


def render_slices(rows: list[SliceRow], cfg: Config) -> "Table":
    from rich.table import Table

    t = Table(title=f"{cfg.model.name}: sequence slices (Seq1F1B), k3 on {cfg.schedule.pipeline}, seq_len "
                    f"{cfg.model.seq_len}", title_justify="left")
    for name in ("S", "split", "step ms", "vs S=1", "peak device GiB", "largest slice ms", "plan s"):
        t.add_column(name, justify="right", no_wrap=True)
    base = next((r.step_us for r in rows if r.seq_chunks == 1 and r.step_us), None)
    errors = []
    for r in rows:
        if r.step_us is None:
            t.add_row(str(r.seq_chunks), r.seq_split, "error", "", "", "", "")
            errors.append(f"S={r.seq_chunks} {r.seq_split}: {r.error}")
            continue
        vs = f"{(r.step_us / base - 1) * 100:+.1f}%" if base else ""
        t.add_row(str(r.seq_chunks), r.seq_split, f"{r.step_us / 1e3:.1f}", vs, f"{r.peak_device_max / 2**30:.3f}",
                  "-" if r.largest_slice_us is None else f"{r.largest_slice_us / 1e3:.1f}", f"{r.plan_s:.1f}")
    t.caption = "\n".join(errors) or None
    t.caption_justify = "left"
    return t

"""Search a config's schedule knobs for the fastest step that fits a device-memory budget:
``k3sched tune``.

[Note: tune search] The knobs: the pipeline schedule with its vpp, the micro-batch size and count
(their product, the sequences of one step, stays fixed), ``warmup_extra`` (interleaved 1F1B),
activation offload (none / local ``auto`` / ``remote``), ``recompute``, FP8 activation storage
(``act_quant``), ``dispatch_recompute``, ``wgrad_lag``, ``lookahead``, ``transfer_slack`` (CPU runner), ``grad_offload``, the
per-layer optimizer step (``layer_optim``) and the sequence slices of Seq1F1B
(``parallel.seq_chunks``: a slice's all-to-alls hide under the next slice's compute, which the
pipeline fill otherwise leaves exposed, and a slice holds a fraction of a micro-batch's
activations). Their product is far too large to plan exhaustively (a K2-like plan takes
seconds), so the search goes coarse to fine:

1. *coarse*: every shape (schedule, vpp, micro-batching) the config supports, each with the
   config's own memory settings and with a lean preset (local offload, recompute, FP8 storage,
   gradient shards on the host), so that a shape is not dropped only because it needs memory
   savers to fit;
2. *fine*: the fastest few candidates that fit, one knob at a time (coordinate descent: every
   value of a knob planned at once, the best kept), knob after knob, pass after pass, until a pass
   improves nothing or time runs out.

Plans run in worker processes, one forked process per plan, at most ``--jobs`` at once; a plan
that runs past four times the median planning time so far (at least 15 s) is abandoned, so one
slow corner of the space (remote offload rebuilds the graph on every attempt) cannot eat the time
limit. A config already planned (same config after normalisation, e.g.
``warmup_extra`` outside interleaved 1F1B) is answered from the cache. Every plan is made under the
budget (``schedule.device_memory_budget``), so a plan that cannot fit it is infeasible and left out
of the front; the Pareto front is taken over (step time, peak device memory) of the feasible
plans. The search stops at the time limit with the best found so far (the plans in flight are
abandoned), keeping time to re-plan and write the best. With a task-time spread in the config
(``hardware.cpu_runner.task_time_cv``, or a profile's ``time_cv``) "step time" here is each plan's expected
step, its lane orders replayed with sampled durations ([Note: ranking with a task-time spread] in
k3sched/compare.py); the planned step is shown beside it.

The comparison point, "what a Megatron user runs by default": interleaved 1F1B (the config's vpp,
at least 2), the config's micro-batching, no offload, no recompute, no FP8 storage, no dispatch
recompute, gradients on the device and stepped together, no extra warm-up, dX and dW back to
back (``wgrad_lag`` 0), no look-ahead and no transfer slack, on the k3 lanes (EP and collectives on their own
streams). It is planned without a memory limit, so its step time is known even when it does not
fit.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .config import GiB, Config, ConfigError, config_from_dict
from .pipelines import TABLE as PIPELINE_TABLE
from .planfile import ranking_step

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console
    from rich.table import Table

NO_LIMIT_GIB = float(1 << 20)
"""The budget the Megatron default is planned under (no limit; see the module docstring)."""

_VPP1 = tuple(n for n, p in PIPELINE_TABLE.items() if p.config_vpp == 1)  # [Note: schedule registry]
_VPP2 = tuple(n for n, p in PIPELINE_TABLE.items() if p.config_vpp == 2)
TRANSFER_SLACKS = (0, 1, 2, 3, 4, 6, 8)
"""The ``schedule.transfer_slack`` values tune and benchmarks/bench_overlap.py try ([Note: transfer
slack] in k3sched/planner.py): up to 8, since EP-bound rows can pick a slack well above 3."""
_KNOBS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("parallel.seq_chunks", (1, 2, 4)),
    ("schedule.offload", ("none", "auto", "remote")),
    ("schedule.recompute", (False, True)),
    ("schedule.act_quant", ("none", "fp8")),
    ("schedule.grad_offload", (False, True)),
    ("schedule.layer_optim", (False, True)),
    ("schedule.dispatch_recompute", (False, True)),
    ("schedule.warmup_extra", (0, 1, 2, 4)),
    ("schedule.lookahead", (0, 1, 2)),
    ("schedule.wgrad_lag", (0, 2, 4, 8, 16, 32, 64)),
    ("schedule.transfer_slack", TRANSFER_SLACKS),
)
"""The fine knobs, in the order coordinate descent visits them ([Note: tune search])."""
LEAN = {"schedule.offload": "auto", "schedule.recompute": True, "schedule.act_quant": "fp8",
        "schedule.grad_offload": True}
"""Memory savers of the coarse phase's second try of each shape."""
MEGATRON = {"schedule.offload": "none", "schedule.remote_offload": False, "schedule.recompute": False,
            "schedule.act_quant": "none", "schedule.dispatch_recompute": False, "schedule.grad_offload": False,
            "schedule.layer_optim": False, "schedule.warmup_extra": 0, "schedule.wgrad_lag": 0,
            "schedule.lookahead": 0, "schedule.transfer_slack": 0.0, "schedule.strategy": "k3", "parallel.seq_chunks": 1}


@dataclass
class Result:
    """One planned candidate: ``overrides`` (SECTION.KEY -> value, relative to the tuned config)
    and what its plan predicts (times in µs, memory in bytes), or ``error`` (infeasible budget,
    unsupported shape)."""

    overrides: dict[str, Any]
    step_us: float | None = None
    lower_bound_us: float | None = None
    peak_device: int | None = None
    exposed_ep_ratio: float | None = None
    bubble: float | None = None
    expected_us: float | None = None  # with a task-time spread: the mean step of the plan's replay
    plan_s: float = 0.0
    error: str | None = None
    phase: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def rank_us(self) -> float | None:
        """What the search minimises: the expected step when the config has a task-time spread,
        else the planned step ([Note: ranking with a task-time spread] in k3sched/compare.py)."""
        return ranking_step(self.step_us, self.expected_us)

    def set_args(self) -> list[str]:
        return [f"{k}={_yaml(v)}" for k, v in sorted(self.overrides.items())]


def _yaml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return ""
    return str(v)


def apply(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config dict) with ``overrides`` applied (a copy)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for key, value in overrides.items():
        sec, name = key.split(".", 1)
        out.setdefault(sec, {})[name] = value
    return out


def normalise(cfg: Config) -> Config:
    """The same plan, one spelling: ``warmup_extra`` only matters for interleaved 1F1B,
    ``transfer_slack`` only where the plan models a transfer's wait beside compute (k3 on the CPU
    runner, [Note: transfer slack] in k3sched/planner.py)."""
    from .cost import CostModel

    drop = {}
    if cfg.schedule.pipeline != "interleaved-1f1b" and cfg.schedule.warmup_extra:
        drop["warmup_extra"] = 0
    cpu = CostModel(cfg).cpu  # None on GPUs
    if cfg.schedule.transfer_slack and (cfg.schedule.strategy == "serial" or cpu is None or not cpu.models_transfer_wait()):
        drop["transfer_slack"] = 0.0
    if drop:
        data = cfg.to_dict()
        data["schedule"].update(drop)
        return config_from_dict(data)
    return cfg


def _key(cfg: Config) -> bytes:
    import orjson

    return orjson.dumps(cfg.to_dict(), option=orjson.OPT_SORT_KEYS)


def plan_metrics(data: dict[str, Any]) -> dict[str, Any]:
    """Plan the config ``data`` (a worker process runs this) and return its figures, or its error
    in one line. An infeasible budget is reported without the planner's search for the smallest
    feasible one (it costs more plans)."""
    import gc

    from . import planner
    from .limits import InfeasibleBudget, check_limits
    from .simulator import DeadlockError

    t0 = time.perf_counter()
    try:
        cfg = config_from_dict(data)
        check_limits(cfg)
        gc.disable()
        try:
            try:
                p = planner._plan(cfg, None, None, confirm=False)  # no smallest-budget search
            except TypeError:  # the planner's private signature changed: the public entry point
                p = planner.plan(cfg)
        finally:
            gc.enable()
    except InfeasibleBudget as e:
        peak = e.args[1] if len(e.args) > 1 and isinstance(e.args[1], (int, float)) else None
        msg = f"does not fit the budget (peak {peak / GiB:.1f} GiB)" if peak else str(e).splitlines()[0]
        return {"error": msg, "plan_s": time.perf_counter() - t0}
    except (ValueError, DeadlockError) as e:
        return {"error": (str(e).splitlines() or [type(e).__name__])[0], "plan_s": time.perf_counter() - t0}
    m = p.metrics
    pp = cfg.parallel.pp
    return {"step_us": float(m.step_time_us), "lower_bound_us": float(m.lower_bound_us),
            "peak_device": int(max(m.peak_device_bytes)), "exposed_ep_ratio": float(m.exposed_ep_ratio),
            "bubble": float(sum(b["compute"] for b in m.bubble_ratio) / pp),
            **({"expected_us": float(m.expected_step_us)} if m.expected_step_us is not None else {}),
            "plan_s": time.perf_counter() - t0}


def shapes(cfg: Config) -> list[dict[str, Any]]:
    """Every (schedule, vpp, micro-batch size and count) the config supports, the config's own
    first; the sequences of one step (size x count) stay fixed, counts below pp are left out."""
    m, p = cfg.model, cfg.parallel
    seqs = m.micro_batch_size * p.microbatches
    sizes = sorted({d for d in range(1, seqs + 1) if seqs % d == 0 and seqs // d >= min(p.pp, p.microbatches)},
                   key=lambda d: (abs(math.log2(d / m.micro_batch_size)), d))[:4]
    out = []
    for pipe in ("interleaved-1f1b", "dualpipev", "zb-v", "1f1b", "zb-h1", "zb-h2", "dualpipe", "gpipe"):
        if pipe in _VPP1:
            vpps = [1]
        elif pipe in _VPP2:
            vpps = [2]
        else:
            vpps = sorted({max(2, p.vpp), 2, 4} & set(range(2, m.layers // p.pp + 1)))
        for vpp in vpps:
            for mbs in sizes:
                out.append({"schedule.pipeline": pipe, "parallel.vpp": vpp, "model.micro_batch_size": mbs,
                            "parallel.microbatches": seqs // mbs})
    own = {"schedule.pipeline": cfg.schedule.pipeline, "parallel.vpp": p.vpp,
           "model.micro_batch_size": m.micro_batch_size, "parallel.microbatches": p.microbatches}
    return [own] + [s for s in out if s != own]


@dataclass
class Tuner:
    """The search state: the tuned config, its budget, the cache of planned configs and every
    result in the order it came back."""

    cfg: Config
    budget_gib: float
    time_limit_s: float
    jobs: int
    on_result: Callable[["Tuner", Result], None] | None = None
    results: list[Result] = field(default_factory=list)
    cache: dict[bytes, Result] = field(default_factory=dict)
    cache_hits: int = 0
    timed_out: bool = False
    t0: float = field(default_factory=time.perf_counter)
    reserve_s: float = 2.0

    def __post_init__(self) -> None:
        self.base = self.cfg.to_dict()
        self.base["schedule"]["device_memory_budget"] = self.budget_gib

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_gib * GiB)

    def remaining(self) -> float:
        """Seconds the search may still use: the limit less what has passed and the time to re-plan
        and write the best at the end (1.5 x its planning time + 2 s, at most 30% of the limit)."""
        b = self.best()
        reserve = self.reserve_s if b is None else min(0.3 * self.time_limit_s,
                                                       max(self.reserve_s, 1.5 * b.plan_s + 2.0))
        return self.time_limit_s - (time.perf_counter() - self.t0) - reserve

    def best(self) -> Result | None:
        ok = [r for r in self.results if r.ok and r.peak_device <= self.budget_bytes]
        return min(ok, key=lambda r: (r.rank_us, r.peak_device)) if ok else None

    def evaluate(self, pool, batch: list[dict[str, Any]], phase: str, budget_gib: float | None = None) -> list[Result]:
        """Plan every override set of ``batch`` (cached ones answered at once), in parallel; stop
        at the time limit (what has not come back is dropped)."""
        todo: list[tuple[bytes, Result, dict]] = []
        out: list[Result] = []
        seen: set[bytes] = set()
        for ov in batch:
            ov = {k: v for k, v in ov.items() if _differs(self.cfg, k, v)}
            data = apply(self.base, ov)
            if budget_gib is not None:
                data["schedule"]["device_memory_budget"] = budget_gib
            try:
                c = normalise(config_from_dict(data))
            except ConfigError as e:
                r = Result(ov, error=str(e), phase=phase)
                out.append(r)
                continue
            key = _key(c)
            if key in self.cache:
                self.cache_hits += 1
                out.append(self.cache[key])
                continue
            if key in seen:
                continue
            seen.add(key)
            todo.append((key, Result(ov, phase=phase), c.to_dict()))
        if pool is None:  # in this process, one after the other (tests)
            for key, r, data in todo:
                if self.remaining() <= 0:
                    self.timed_out = True
                    break
                self._record(key, r, plan_metrics(data), out)
            return out
        for key, r, data in todo:
            pool.submit((key, r), data)
        while not pool.idle():
            if self.remaining() <= 0:
                self.timed_out = True
                pool.close()
                break
            done = pool.poll(self.plan_limit())
            if not done:
                time.sleep(0.05)
            for (key, r), res in done:
                self._record(key, r, res, out)
        return out

    def _record(self, key: bytes, r: Result, res: dict, out: list[Result]) -> None:
        for k, v in res.items():
            setattr(r, k, v)
        self.cache[key] = r
        self.results.append(r)
        out.append(r)
        if self.on_result:
            self.on_result(self, r)

    def plan_limit(self) -> float:
        """How long one plan may run before it is abandoned: four times the median of the plans so
        far, at least 15 s (none before three plans came back)."""
        done = sorted(r.plan_s for r in self.results if not (r.error or "").startswith("abandoned"))
        if len(done) < 3:
            return math.inf
        return max(15.0, 4 * done[len(done) // 2])


class Workers:
    """At most ``jobs`` planning processes at a time, one per plan (forked: the imports are
    shared), each killed when it runs past the limit :meth:`poll` is given, or when the search
    ends ([Note: tune search])."""

    def __init__(self, jobs: int):
        import multiprocessing as mp
        from collections import deque

        self.ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        self.jobs = jobs
        self.queue: Any = deque()
        self.running: list[list[Any]] = []

    def submit(self, item: Any, data: dict) -> None:
        self.queue.append((item, data))

    def idle(self) -> bool:
        return not self.queue and not self.running

    def _start(self) -> None:
        while self.queue and len(self.running) < self.jobs:
            item, data = self.queue.popleft()
            recv, send = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=_child, args=(data, send), daemon=True)
            proc.start()
            send.close()
            self.running.append([proc, recv, time.perf_counter(), item])

    def poll(self, limit_s: float) -> list[tuple[Any, dict]]:
        """Start what fits, collect what finished: (item, figures) pairs."""
        self._start()
        done = []
        for entry in list(self.running):
            proc, recv, t0, item = entry
            took = time.perf_counter() - t0
            if recv.poll():
                try:
                    res = recv.recv()
                except (EOFError, OSError):
                    res = {"error": "the planning process died", "plan_s": took}
            elif not proc.is_alive():
                res = {"error": f"the planning process died (exit code {proc.exitcode})", "plan_s": took}
            elif took > limit_s:
                proc.kill()
                res = {"error": f"abandoned after {took:.0f} s (plans so far took a fraction of that)",
                       "plan_s": took}
            else:
                continue
            proc.join(5)
            recv.close()
            self.running.remove(entry)
            done.append((item, res))
        self._start()
        return done

    def close(self) -> None:
        """Kill what runs, forget what waits."""
        self.queue.clear()
        for proc, recv, _, _ in self.running:
            proc.kill()
            proc.join(5)
            recv.close()
        self.running.clear()


def _child(data: dict, conn) -> None:
    try:
        res = plan_metrics(data)
    except BaseException as e:  # noqa: BLE001 - a bug in planning: reported as this plan's error
        res = {"error": f"{type(e).__name__}: {e}", "plan_s": 0.0}
    conn.send(res)
    conn.close()


def _differs(cfg: Config, key: str, value: Any) -> bool:
    sec, name = key.split(".", 1)
    return getattr(getattr(cfg, sec), name) != value


def megatron_overrides(cfg: Config) -> dict[str, Any]:
    """What a Megatron user runs by default on this config (module docstring)."""
    ov = dict(MEGATRON)
    ov["schedule.pipeline"] = "interleaved-1f1b"
    ov["parallel.vpp"] = max(2, cfg.parallel.vpp)
    return ov


def search(tuner: Tuner, pool) -> None:
    """[Note: tune search]: coarse shapes, then coordinate descent over the fine knobs."""
    cfg = tuner.cfg
    own = tuner.evaluate(pool, [{}], "config")
    del own
    coarse = []
    for s in shapes(cfg):
        coarse.append(dict(s))
        coarse.append({**s, **LEAN})
    tuner.evaluate(pool, coarse, "coarse")
    passes = 0
    while tuner.remaining() > 0:
        passes += 1
        fits = sorted((r for r in tuner.results if r.ok and r.peak_device <= tuner.budget_bytes),
                      key=lambda r: r.rank_us)
        starts: list[Result] = []
        for r in fits:
            if all(r.overrides != s.overrides for s in starts):
                starts.append(r)
            if len(starts) == 3:
                break
        if not starts:
            break
        improved = False
        for knob, values in _KNOBS:
            if tuner.remaining() <= 0:
                break
            batch = []
            for s in starts:
                if knob == "schedule.warmup_extra" and s.overrides.get(
                        "schedule.pipeline", cfg.schedule.pipeline) != "interleaved-1f1b":
                    continue
                for v in values:
                    batch.append({**s.overrides, knob: v})
            res = tuner.evaluate(pool, batch, f"fine {passes}")
            for i, s in enumerate(starts):
                mine = [r for r in res if r.ok and r.peak_device <= tuner.budget_bytes
                        and {k: v for k, v in r.overrides.items() if k != knob}
                        == {k: v for k, v in s.overrides.items() if k != knob}]
                if mine:
                    b = min(mine, key=lambda r: r.rank_us)
                    if b.rank_us < s.rank_us * (1 - 1e-6):
                        starts[i] = b
                        improved = True
        if not improved:
            break


def pareto(results: list[Result], budget: int | None = None) -> list[Result]:
    """The feasible results no other beats on both step time (:attr:`Result.rank_us`) and peak
    device memory, by step."""
    ok = sorted((r for r in results if r.ok and (budget is None or r.peak_device <= budget)),
                key=lambda r: (r.rank_us, r.peak_device))
    front: list[Result] = []
    for r in ok:
        if not front or r.peak_device < front[-1].peak_device:
            if front and r.rank_us == front[-1].rank_us:
                continue
            front.append(r)
    return front


def _num(x: float) -> str:
    """An axis label: whole numbers from 100 up, three significant digits below."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _gib(b: float) -> str:
    g = b / GiB
    return f"{g:.2f}" if g >= 1 else f"{g:.4f}"


def pareto_table(front: list[Result], best: Result | None, title: str) -> "Table":
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    spread = any(r.expected_us is not None for r in front)
    for name in ("step ms", *(("expected ms",) if spread else ()), "peak GiB", "x bound", "exp. EP", "bubble",
                 "overrides"):
        t.add_column(name, justify="left" if name == "overrides" else "right", no_wrap=name != "overrides",
                     overflow="fold")
    for r in front:
        mark = " *" if r is best else ""
        exp = ((f"{r.expected_us / 1e3:.1f}{mark}" if r.expected_us is not None else "-"),) if spread else ()
        t.add_row(f"{r.step_us / 1e3:.1f}{'' if spread else mark}", *exp, _gib(r.peak_device),
                  f"{r.step_us / r.lower_bound_us:.3f}", f"{r.exposed_ep_ratio * 100:.1f}%", f"{r.bubble * 100:.1f}%",
                  " ".join(r.set_args()) or "(config)")
    t.caption = ("* best within the budget" + (" by its expected step (the plan replayed with the config's task-time "
                                               "spread)" if spread else "")
                 + "; overrides: --set arguments on top of the config")
    return t


def pareto_png(results: list[Result], front: list[Result], best: Result | None, megatron: Result | None,
               budget: int, path: Path) -> Path:
    """Every feasible plan (grey), the front (red, joined), the best (ringed), the Megatron default
    (blue square): step time against peak device memory, drawn with Pillow."""
    from PIL import Image, ImageDraw

    from .render import load_font

    ok = [r for r in results if r.ok] + ([megatron] if megatron is not None and megatron.ok else [])
    w, h, left, bottom, top, right = 900, 560, 80, 50, 30, 20
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    font = load_font(11)
    d.text((left, 8), "k3sched tune: step time vs peak device memory (red: Pareto front, blue: Megatron default)",
           fill="black", font=font)
    if ok:
        xs = [r.peak_device / GiB for r in ok] + [budget / GiB]
        ys = [r.rank_us / 1e3 for r in ok]
        x0, x1 = 0.0, max(xs) * 1.05
        y0, y1 = min(ys) * 0.95, max(ys) * 1.05 if max(ys) > min(ys) else min(ys) * 1.1

        def px(r_x: float, r_y: float) -> tuple[float, float]:
            return (left + (r_x - x0) / (x1 - x0 or 1) * (w - left - right),
                    h - bottom - (r_y - y0) / (y1 - y0 or 1) * (h - top - bottom))

        d.rectangle([left, top, w - right, h - bottom], outline="black")
        for i in range(6):
            gx, gy = x0 + (x1 - x0) * i / 5, y0 + (y1 - y0) * i / 5
            a, _ = px(gx, y0)
            d.text((a - 10, h - bottom + 4), _num(gx), fill="black", font=font)
            _, b = px(x0, gy)
            d.text((4, b - 6), _num(gy), fill="black", font=font)
        d.text((w // 2 - 60, h - 20), "peak device GiB", fill="black", font=font)
        d.text((4, top - 16), "expected step ms" if any(r.expected_us is not None for r in ok) else "step ms",
               fill="black", font=font)
        bx, _ = px(budget / GiB, y0)
        for yy in range(top, h - bottom, 10):
            d.line([(bx, yy), (bx, yy + 5)], fill="red")
        for r in results:
            if r.ok:
                x, y = px(r.peak_device / GiB, r.rank_us / 1e3)
                d.ellipse([x - 2, y - 2, x + 2, y + 2], fill="#999999")
        pts = [px(r.peak_device / GiB, r.rank_us / 1e3) for r in sorted(front, key=lambda r: r.peak_device)]
        if len(pts) > 1:
            d.line(pts, fill="red", width=2)
        for x, y in pts:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill="red")
        if best is not None:
            x, y = px(best.peak_device / GiB, best.rank_us / 1e3)
            d.ellipse([x - 7, y - 7, x + 7, y + 7], outline="black", width=2)
        if megatron is not None and megatron.ok:
            x, y = px(megatron.peak_device / GiB, megatron.rank_us / 1e3)
            d.rectangle([x - 4, y - 4, x + 4, y + 4], fill="#1f77b4")
    img.save(path, format="PNG")
    return path


def _progress_bar(tuner: Tuner, console: "Console", time_limit_s: float):
    """A rich progress bar over the time limit, updated by ``tuner`` after each result."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, transient=False)
    task = bar.add_task("tune", total=time_limit_s, info="")

    def on_result(t: Tuner, r: Result) -> None:
        b = t.best()
        bar.update(task, completed=min(time_limit_s, time.perf_counter() - t.t0),
                   description=f"tune ({r.phase})",
                   info=f"{len(t.results)} planned, {t.cache_hits} cached, best "
                        f"{b.rank_us / 1e3:.1f} ms" if b else f"{len(t.results)} planned, none fits yet")

    tuner.on_result = on_result
    return bar


def tune_command(config_path: str | Path, overrides: list[str] | None, budget_gib: float | None,
                 time_limit_s: float, jobs: int | None, out: Path | None, console: "Console",
                 progress: bool = True) -> int:
    """``k3sched tune``: search, print the Pareto front and the speed-up over the Megatron default,
    write OUT/best/plan.json, OUT/best/overrides.txt, OUT/pareto.png and OUT/tune.json. Exit 0
    when a plan fits the budget, 1 when none does (2: bad config, raised as ConfigError)."""
    from .config import load_config

    t_start = time.perf_counter()
    cfg = load_config(config_path, overrides)
    budget = float(budget_gib if budget_gib is not None else (cfg.schedule.device_memory_budget
                                                             or cfg.hardware.device_memory_gb))
    jobs = max(1, jobs or os.cpu_count() or 1)
    tuner = Tuner(cfg, budget, time_limit_s, jobs, t0=t_start)
    bar = _progress_bar(tuner, console, time_limit_s) if progress else None
    pool = Workers(jobs)
    megatron = None
    try:
        if bar is not None:
            bar.start()
        mov = megatron_overrides(cfg)
        mres = tuner.evaluate(pool, [mov], "megatron", budget_gib=NO_LIMIT_GIB)
        megatron = mres[0] if mres else None
        if megatron is not None:
            tuner.results.remove(megatron) if megatron in tuner.results else None
        search(tuner, pool)
    finally:
        pool.close()
        if bar is not None:
            bar.stop()
    best = tuner.best()
    front = pareto(tuner.results, tuner.budget_bytes)
    elapsed = time.perf_counter() - tuner.t0
    console.print(pareto_table(front, best, f"{cfg.model.name}: Pareto front (step time vs peak device memory), "
                                            f"budget {budget:g} GiB"))
    stop = "stopped at the time limit" if tuner.timed_out else "search complete"
    console.print(f"{len(tuner.results)} plans ({tuner.cache_hits} answered from the cache) in {elapsed:.1f} s, "
                  f"{jobs} processes; {stop}", highlight=False)
    if best is not None and best.expected_us is not None:
        console.print("times below are expected steps: the plans replayed with the config's task-time spread "
                      "([Note: ranking with a task-time spread] in k3sched/compare.py)", highlight=False)
    if megatron is not None and megatron.ok:
        fits = "fits" if megatron.peak_device <= tuner.budget_bytes else "does NOT fit"
        line = (f"Megatron default (interleaved-1f1b vpp {mov['parallel.vpp']}, no offload, the config's "
                f"micro-batching): {megatron.rank_us / 1e3:.1f} ms, peak {megatron.peak_device / GiB:.1f} GiB "
                f"({fits} the {budget:g} GiB budget)")
        if best is not None:
            line += (f"; tuned: {best.rank_us / 1e3:.1f} ms, {megatron.rank_us / best.rank_us:.3f}x faster "
                     f"({(1 - best.rank_us / megatron.rank_us) * 100:.1f}% less step time)")
        console.print(line, highlight=False)
    elif megatron is not None:
        console.print(f"Megatron default: not planned ({megatron.error})", highlight=False)
    own = next((r for r in tuner.results if r.phase == "config"), None)
    if own is not None and best is not None:
        console.print("the config as given: " + (f"{own.rank_us / 1e3:.1f} ms, peak {own.peak_device / GiB:.1f} GiB; "
                                                  f"tuned {own.rank_us / best.rank_us:.3f}x faster" if own.ok
                                                  else f"not planned ({own.error})"), highlight=False)
    if best is None:
        console.print(f"no plan fits {budget:g} GiB", highlight=False)
    else:
        console.print("best: " + (" ".join(f"--set {a}" for a in best.set_args()) or "the config as is"),
                      highlight=False)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        written = [_write_json(out / "tune.json", tuner, megatron, front, best, elapsed)]
        written.append(pareto_png(tuner.results, front, best, megatron, tuner.budget_bytes, out / "pareto.png"))
        if best is not None:
            written += write_best(cfg, best, budget, out / "best")
        for p in written:
            console.print(f"wrote {p}", highlight=False)
    return 0 if best is not None else 1


def write_best(cfg: Config, best: Result, budget: float, out: Path) -> list[Path]:
    """Re-plan the best candidate here and write its plan.json and the --set overrides (one per line,
    the budget included) that reproduce it."""
    from .planner import plan
    from .planfile import dumps_plan_bytes

    out.mkdir(parents=True, exist_ok=True)
    sets = best.set_args()
    if cfg.schedule.device_memory_budget != budget:
        sets.append(f"schedule.device_memory_budget={budget:g}")
    c = config_from_dict(cfg.to_dict(), sets)
    p = plan(c)
    (out / "plan.json").write_bytes(dumps_plan_bytes(p))
    (out / "overrides.txt").write_text("".join(f"--set {s}\n" for s in sets))
    return [out / "plan.json", out / "overrides.txt"]


def _write_json(path: Path, tuner: Tuner, megatron: Result | None, front: list[Result], best: Result | None,
                elapsed: float) -> Path:
    from .planfile import dumps_json

    def row(r: Result) -> dict:
        d = asdict(r)
        d["set"] = r.set_args()
        return d

    doc = {"format": "k3sched.tune/1", "budget_gib": tuner.budget_gib, "time_limit_s": tuner.time_limit_s,
           "elapsed_s": elapsed, "timed_out": tuner.timed_out, "cache_hits": tuner.cache_hits,
           "megatron": row(megatron) if megatron else None, "best": row(best) if best else None,
           "front": [row(r) for r in front], "results": [row(r) for r in tuner.results]}
    path.write_bytes(dumps_json(doc, indent=True) + b"\n")
    return path

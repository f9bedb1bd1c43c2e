"""Run a one-rank plan (pp = ep = dp = 1) in this process, without torch.distributed: the
executor, the stage runner and the trace, as the ranks of a launched run use them. For tests,
benchmarks and debugging."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3sched.config import Config
from k3sched.lowering import implied_edges, stage_lanes
from k3sched.planfile import plan_to_json
from k3sched.planner import plan

from .executor import Executor, StepRecord
from .groups import Layout, build_groups
from .options import RuntimeOptions
from .stage import StageRunner, StageSpec


@dataclass
class LocalRun:
    plan: dict
    losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] | None = None  # step 0, before AdamW
    records: list[StepRecord] = field(default_factory=list)
    traces: list[dict] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    """Each step's measured peak device bytes (``runner.memory.peak_device`` after the step)."""
    runner: StageRunner | None = None
    """The stage runner, after the run (its memory tracker, activation pools, parameters)."""


def local_run(cfg: Config, steps: int, *, strategy: str | None = None, seed: int | None = None, lr: float = 1e-3,
              weight_decay: float = 0.01, perturb=None, capture_grads: bool = False,
              options: RuntimeOptions | None = None,
              setup: Callable[[StageRunner], None] | None = None,
              device: torch.device | None = None) -> LocalRun:
    """Train ``steps`` steps of a one-rank config in-process; returns losses, grads, traces,
    measured peaks and the runner. ``options``: the test hooks of a launched run ([Note: runtime
    options]; ``perturb`` wins). ``setup``: called with the bound runner before the first step
    (a test wraps a handler or the memory tracker there). ``device``: where the model and the
    lanes run (default CPU); on CUDA each lane issues on its own stream, as in a launched run, and
    the step times come from CUDA events."""
    device = torch.device("cpu") if device is None else torch.device(device)
    opts = options or RuntimeOptions()
    p = cfg.parallel
    if p.world != 1:
        raise ValueError(f"local_run needs a one-rank config (pp*ep*dp = 1); got {p.pp}*{p.ep}*{p.dp}")
    seed = cfg.schedule.seed if seed is None else seed
    doc = plan_to_json(plan(cfg, strategy))
    lanes = stage_lanes(doc, 0)
    runner = StageRunner(cfg, StageSpec.of(cfg, 0), build_groups(Layout(1, 1, 1, 0)), seed=seed, lr=lr,
                         weight_decay=weight_decay, options=opts, device=device)
    runner.bind_plan(lanes)
    if setup is not None:
        setup(runner)
    run = LocalRun(doc, runner=runner)
    with Executor(lanes, runner.handlers(), perturb=perturb or opts.perturb, extra_deps=implied_edges(lanes),
                  dep_timeout_s=60.0, serial=doc["strategy"] == "serial",
                  shared_links=doc.get("shared_links", ()), device=device) as ex:
        runner.bind_streams(ex.lane_streams())
        for step in range(steps):
            runner.optim.capture_grads = capture_grads and step == 0
            runner.begin_step(step)
            rec = ex.run_step(step)
            run.losses.append(runner.end_step() / p.microbatches)
            if runner.optim.captured is not None:
                run.grads, runner.optim.captured = runner.optim.captured, None
            run.records.append(rec)
            run.peaks.append(runner.memory.peak_device)
            run.traces.append(ex.chrome_trace(rec, plan_step_time_us=doc["metrics"]["step_time_us"],
                                              t0_us=min(t.start_us for t in rec.timings)))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # one rank, no collectives: nothing to wait for but this device
    return run

"""Cheap up-front bounds, checked first thing in :func:`k3sched.planner.plan`.

A config whose fields are each within their ranges ([Note: config limits] in k3sched/config.py)
can still describe a step too large to plan in reasonable time, or a budget no plan can meet.
These checks take milliseconds (nothing here builds the task graph) and refuse such configs with
one line naming the limit and how to change it:

* :func:`count_tasks`: the number of tasks the planner would build, counted from layers x
  micro-batches x kinds, P2P boundaries, gradient buckets and offload copies, exactly as
  :mod:`k3sched.graph` builds them (the search graph, with an offload pair for every activation
  set when ``schedule.offload`` is not ``none``). More than ``schedule.max_tasks`` is refused
  (ConfigError): the planner's time grows with its tasks, so the limit bounds it.
* the balanced layer split (``parallel.layer_split: balanced``) is a dynamic program of about
  chunks x layers^2 / 2 steps; more than :data:`MAX_SPLIT_STEPS` is refused (ConfigError).
* :func:`memory_lower_bound`: per stage, bytes that every plan holds at some instant; a budget
  below it is refused with InfeasibleBudget ([Note: memory lower bound]), naming a
  lower bound of the smallest feasible budget. Small plans (:data:`EXACT_BUDGET_TASKS`) are left to
  the planner, whose search then names the exact smallest feasible budget within about a second;
  for a larger plan that search would take far longer than the bound, which refuses it at once.
* one step's bytes must fit the int64 memory curves (:data:`MAX_STEP_BYTES`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import MAX_TASKS_LIMIT, GiB, Config, ConfigError
from .cost import CostModel
from .graph import placement_for
from .layersplit import split_layers
from .pipelines import TABLE as PIPELINE_TABLE
from .seqslice import slice_bounds
from .steptable import BOUNDARY, CHUNK_FIRST, CHUNK_LAST, layer_steps
from .tasks import Kind

MAX_SPLIT_STEPS = 1_000_000
"""Largest balanced layer split taken on: chunks x layers^2 / 2 DP steps in Python, so the split
stays within seconds (128 layers over 64 chunks or 200 over 32 fit, k2-like takes 59k)."""
EXACT_SPLIT_STEPS = 200_000
"""Up to this many DP steps the memory bound computes the planner's own layer split (per-stage
bound); beyond it the bound uses the mean over stages (no split needed)."""
EXACT_BUDGET_TASKS = 1_000
"""A budget below the memory lower bound of a plan with at most this many tasks is left to the
planner, whose search names the exact smallest feasible budget (one it planned) in about a second;
a larger plan is refused from the bound at once."""
MAX_STEP_BYTES = 1 << 62
"""One step's static plus activation bytes must stay below this (memory curves are int64)."""


class InfeasibleBudget(ValueError):
    """The device memory budget cannot be met; the message gives the smallest feasible budget."""


def check_limits(cfg: Config) -> None:
    """Refuse, before planning, a config whose plan is too large (ConfigError) or whose device
    memory budget is below a lower bound of every plan's peak (InfeasibleBudget)."""
    steps = split_steps(cfg)
    if steps > MAX_SPLIT_STEPS:
        nv = cfg.parallel.pp * cfg.parallel.vpp
        raise ConfigError(
            f"parallel.layer_split: the balanced split of {cfg.model.layers} layers over {nv} chunks takes "
            f"{steps:,} steps (chunks x layers^2 / 2); allowed: at most {MAX_SPLIT_STEPS:,} (set "
            f"parallel.layer_split=even, or use fewer layers or chunks)")
    cost = CostModel(cfg)
    count = count_tasks(cfg, cost)
    bound = memory_lower_bound(cfg, cost)
    budget = cfg.budget_bytes
    worst = max(range(len(bound.per_stage)), key=lambda s: bound.per_stage[s])
    need = bound.per_stage[worst]
    if need > budget and count.total > EXACT_BUDGET_TASKS:
        field = ("schedule.device_memory_budget" if cfg.schedule.device_memory_budget is not None
                 else "hardware.device_memory_gb (the budget: schedule.device_memory_budget is unset)")
        at_least = math.floor(need / GiB * 1000) / 1000
        where = f"stage {worst}" if bound.exact else "the average stage"
        act = bound.activations[worst]
        parts = f"{bound.static[worst] / GiB:.3f} GiB of parameters, gradients and optimizer state"
        if act:
            parts += f" + {act / GiB:.3f} GiB of one layer's saved activations"
        raise InfeasibleBudget(
            f"{field}: {budget / GiB:.3f} GiB is infeasible: {where} holds at least {at_least:.3f} GiB in every "
            f"plan ({parts}); the smallest feasible budget is at least {at_least:.3f} GiB")
    limit = cfg.schedule.max_tasks
    if count.total > limit:
        raise_to = _round_up(count.total)
        how = (f"shrink the config, or raise the limit with --set schedule.max_tasks={raise_to}"
               if raise_to <= MAX_TASKS_LIMIT else f"shrink the config: schedule.max_tasks goes up to "
                                                   f"{MAX_TASKS_LIMIT:,}")
        raise ConfigError(
            f"schedule.max_tasks: this step would have {count.total:,} tasks ({count.describe(cfg)}); allowed: "
            f"at most {limit:,} (the planner runs at about 15k tasks/s: {how})")
    step_bytes = _step_bytes(cfg, cost)
    if step_bytes >= MAX_STEP_BYTES:
        raise ConfigError(
            f"model: one step's parameters and activations come to {step_bytes:.3g} bytes (model.hidden "
            f"{cfg.model.hidden}, model.seq_len {cfg.model.seq_len}, parallel.microbatches "
            f"{cfg.parallel.microbatches}); allowed: below 2^62 bytes")


def _round_up(n: int) -> int:
    """``n`` rounded up to two significant digits (a limit to suggest)."""
    mag = 10 ** max(0, len(str(n)) - 2)
    return -(-n // mag) * mag


def split_steps(cfg: Config) -> int:
    """DP steps of the balanced (or profile) layer split (:func:`k3sched.layersplit.min_max_split`); 0 for
    ``even`` or explicit ``stage_layers``."""
    if cfg.parallel.layer_split == "even" or cfg.parallel.stage_layers is not None:
        return 0
    n, parts = cfg.model.layers, cfg.parallel.pp * cfg.parallel.vpp
    return max(0, parts - 2) * (n + 1) * (n + 2) // 2 + n


@dataclass
class TaskCount:
    """Tasks of one step by origin (see :func:`count_tasks`)."""

    layers: int
    """Compute and EP tasks of every (layer, micro-batch)."""
    offload: int
    """Activation offload / onload copies (one pair per activation set in the search graph)."""
    edges: int
    """Embedding, head and P2P send / receive tasks per micro-batch."""
    grads: int
    """Gradient reduction buckets and gradient-shard copies."""
    optim: int
    """Optimizer steps: one per stage and planned step, and one per layer with ``schedule.layer_optim``."""
    buckets_per_layer: int

    @property
    def total(self) -> int:
        return self.layers + self.offload + self.edges + self.grads + self.optim

    def describe(self, cfg: Config) -> str:
        m, p, s = cfg.model, cfg.parallel, cfg.schedule
        parts = [
            (self.layers, f"{self.layers:,} layer tasks for parallel.microbatches {p.microbatches} x model.layers "
                          f"{m.layers}"),
            (self.offload, f"{self.offload:,} offload copies (schedule.offload {s.offload})"),
            (self.edges, f"{self.edges:,} embedding, head and P2P tasks"),
            (self.grads, f"{self.grads:,} gradient tasks ({self.buckets_per_layer:,} grad.rs "
                         f"bucket{'s' if self.buckets_per_layer != 1 else ''} per layer at "
                         f"schedule.grad_bucket_mb {s.grad_bucket_mb:g})"),
        ]
        parts.sort(key=lambda x: -x[0])
        return ", ".join(text for n, text in parts if n)


def _buckets(cfg: Config, cost: CostModel, layer: int) -> int:
    """Buckets of one layer's DP gradient reduction (as :meth:`k3sched.graph._Builder.grad_rs`)."""
    nbytes = cost.grad_wire(layer).nbytes
    return max(1, math.ceil(nbytes / (cfg.schedule.grad_bucket_mb * 2**20)))


def count_tasks(cfg: Config, cost: CostModel | None = None) -> TaskCount:
    """Tasks the planner builds for ``cfg`` (its search graph: with an offload / onload pair for
    every activation set unless ``schedule.offload`` is ``none``), counted without building them.
    O(pp x vpp) time."""
    cost = cost or CostModel(cfg)
    m, p, s = cfg.model, cfg.parallel, cfg.schedule
    steps = PIPELINE_TABLE[s.pipeline].steps  # pipedream-2bw plans two steps
    M = p.microbatches * steps
    moe = m.layers - m.dense_layers
    dense = m.dense_layers
    per_moe = len(layer_steps(True, s.dispatch_recompute))  # the rows of the step table ([Note: step table])
    per_dense = len(layer_steps(False, s.dispatch_recompute))
    U = M * p.seq_chunks  # pipeline units: each sequence slice has its own layer, offload and edge tasks
    layers = U * (moe * per_moe + dense * per_dense)
    offload = 2 * U * m.layers if s.offload != "none" else 0
    pl = placement_for(cfg)
    nv = pl.num_stages
    ranks = [pl.locate(v)[0] for v in range(nv)]
    boundaries = sum(1 for v in range(nv - 1) if ranks[v] != ranks[v + 1])
    copies = PIPELINE_TABLE[s.pipeline].copies
    if copies == 2:  # a micro-batch passes one copy's pp stages ([Note: dualpipe mapping])
        boundaries = p.pp - 1
    edges = U * (len(CHUNK_FIRST) + len(CHUNK_LAST) + len(BOUNDARY) * boundaries)
    reduce = p.ep * p.dp > 1
    b_moe = _buckets(cfg, cost, m.dense_layers) if moe and reduce else 0
    b_dense = _buckets(cfg, cost, 0) if dense and reduce else 0
    if s.grad_offload:  # per copy of a layer: its micro-batches in groups of pp
        groups = copies * -(-(M // copies) // max(1, p.pp))
        grads = groups * (moe * (b_moe + 3) + dense * (b_dense + 3))
    else:  # per step; with schedule.layer_optim one optim.run per layer ([Note: per-layer optimizer])
        grads = steps * copies * (moe * b_moe + dense * b_dense)
    layer_optim = steps * copies * m.layers if s.layer_optim and not s.grad_offload else 0
    mirror = p.pp if copies == 2 else 0  # grad.mirror ([Note: replica gradient reduction] in runtime/stage/gradients.py)
    return TaskCount(layers, offload, edges, grads + mirror, steps * p.pp + layer_optim, max(b_moe, b_dense))


@dataclass
class MemoryBound:
    per_stage: list[int]
    static: list[int]
    activations: list[int]
    exact: bool
    """True: per physical stage with the planner's layer split; False: one bound for the stage
    with the most (the mean over stages), repeated."""


def _set_bytes(cost: CostModel, moe: bool) -> int:
    """Device bytes of one (layer, micro-batch) activation set, as the graph builder sums them."""
    return sum(sum(cost.saved_bytes(r.kind)) for r in layer_steps(moe) if r.unit == "F")


def _positive_durations(cfg: Config, cost: CostModel) -> bool:
    return cfg.hardware.launch_us > 0 and all(v > 0 for v in cost.profile.durations_us.values())


def memory_lower_bound(cfg: Config, cost: CostModel | None = None) -> MemoryBound:
    """[Note: memory lower bound] Device bytes that every plan of ``cfg`` holds on each stage at
    some instant, whatever it offloads, recomputes or defers:

    * the stage's parameters, gradients and optimizer state (:meth:`CostModel.static_bytes`), held
      all step long: the planner's memory curve starts there, and every buffer it allocates is
      freed only after it was allocated, so the curve never dips below it;
    * plus the largest activation set of one (layer, micro-batch) on the stage (or the head's saved
      activations on the last stage): a layer's forward tasks allocate their saved activations at
      their start, the last of them (combine.fwd / mlp.fwd) starts after all the others started, and
      nothing of the set is freed before that instant: the offload copy and the backward tasks that
      free it all start after the layer's forward ends and free at their own end. That holds when
      every such task takes time (``hardware.launch_us`` > 0 and no zero duration in a profile);
      else the activation term is left out.

    With the planner's layer split cheap to compute (:data:`EXACT_SPLIT_STEPS`) the bound is per
    stage; else it is one number, the mean over stages of the static bytes (the fullest stage holds
    at least the mean), with no activation term."""
    cost = cost or CostModel(cfg)
    m, p = cfg.model, cfg.parallel
    act_ok = _positive_durations(cfg, cost)
    head_act = sum(cost.saved_bytes(Kind.HEAD_FWD)) if act_ok else 0
    set_bytes = {True: _set_bytes(cost, True), False: _set_bytes(cost, False)} if act_ok else {True: 0, False: 0}
    if p.seq_chunks > 1 and act_ok:  # a set is one slice's ([Note: sequence slices] in k3sched/seqslice.py)
        parts = [cost.sliced(*b) for b in slice_bounds(cfg)]
        head_act = max(sum(c.saved_bytes(Kind.HEAD_FWD)) for c in parts)
        set_bytes = {moe: max(_set_bytes(c, moe) for c in parts) for moe in (True, False)}
    versions = 2 if PIPELINE_TABLE[cfg.schedule.pipeline].steps > 1 else 1  # pipedream-2bw: two weight versions
    if split_steps(cfg) <= EXACT_SPLIT_STEPS:
        pl = placement_for(cfg)
        split = split_layers(cfg)
        firsts, lasts = {0}, {pl.num_stages - 1}
        if PIPELINE_TABLE[cfg.schedule.pipeline].copies == 2:  # two model copies ([Note: dualpipe mapping])
            split, firsts, lasts = split + split, {0, p.pp}, {p.pp - 1, 2 * p.pp - 1}
        static, acts = [], []
        for s in range(p.pp):
            vs = [v for v in range(pl.num_stages) if pl.locate(v)[0] == s]
            layers = [L for v in vs for L in split[v]]
            head = bool(lasts & set(vs))
            static.append(cost.static_bytes(layers, embed=bool(firsts & set(vs)), head=head)[0]
                          + (versions - 1) * cost.weight_bytes(layers, embed=bool(firsts & set(vs)), head=head))
            act = max((set_bytes[m.is_moe(L)] for L in layers), default=0)
            acts.append(max(act, head_act if head else 0))
        return MemoryBound([a + b for a, b in zip(static, acts)], static, acts, True)
    # static_bytes is linear in the parameters up to integer division: the sum over stages is at
    # least that of one stage holding everything, less one byte per floor (3 per stage at most).
    everything = cost.static_bytes(list(range(m.layers)), embed=True, head=True)[0]
    mean = max(0, everything - 3 * (cost.b + 1) * p.pp) // p.pp
    return MemoryBound([mean] * p.pp, [mean] * p.pp, [0] * p.pp, False)


def _step_bytes(cfg: Config, cost: CostModel) -> int:
    """Static bytes of the whole model plus every activation set and output gradient of the step:
    about the most any memory curve of the planner can add up to."""
    m, p = cfg.model, cfg.parallel
    static = sum(cost.static_bytes(list(range(m.layers)), embed=True, head=True))
    moe = m.layers - m.dense_layers
    sets = (moe * _set_bytes(cost, True) + m.dense_layers * _set_bytes(cost, False)
            + sum(cost.saved_bytes(Kind.HEAD_FWD)))
    grads = max(cost.grad_out_bytes(k) for k in Kind)
    return static + p.microbatches * (sets + m.layers * grads) + p.pp * 2 * cost.p2p_bytes()

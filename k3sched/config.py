"""Typed configuration: YAML -> validated pydantic objects.

Four sections: ``model``, ``parallel``, ``hardware``, ``schedule``. Units: memory in GiB,
bandwidth in GB/s (1e9 bytes/s, one direction), latency in microseconds, compute in TFLOP/s.
Invariants are checked where the config is built; a violation raises :class:`ConfigError` whose
message is one line: ``<file or field>: <what is wrong> (got <value>); allowed: <what>``.

[Note: config limits] Every number is checked strictly: a YAML boolean (``yes``, ``true``) is no
number, an integer field takes no float, and every float is finite (no ``.nan`` / ``.inf``). Each
field states its range in its description; the upper limits are far above real models (Kimi K2:
61 layers, hidden 7168, 384 experts, seq_len 4096) and keep every quantity the planner derives
finite and within int64 bytes. Sizes that are each allowed but together make a plan too large to
compute in reasonable time are refused before planning by :mod:`k3sched.limits`
(``schedule.max_tasks``).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from .pipelines import PIPELINES
from .pipelines import TABLE as PIPELINE_TABLE
from .yamlfile import ConfigError, read_text_file, show_value, yaml_load

GiB = 1 << 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
STRATEGIES = ("k3", "serial")
DEFAULT_MAX_TASKS = 200_000
"""Default ``schedule.max_tasks`` (see [Note: config limits])."""
MAX_TASKS_LIMIT = 100_000_000
"""The most ``schedule.max_tasks`` may be raised to."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, strict=True)


def _int(lo: int, hi: int, **kw: Any) -> Any:
    """An integer field in [lo, hi] (strict: no bool, no float)."""
    return Field(ge=lo, le=hi, **kw)


def _float(lo: float, hi: float, *, open_low: bool = True, **kw: Any) -> Any:
    """A finite float field in (lo, hi] (``open_low``) or [lo, hi]; an int is taken as a float."""
    low = {"gt": lo} if open_low else {"ge": lo}
    return Field(le=hi, allow_inf_nan=False, **low, **kw)


class ModelConfig(_Section):
    """The model's shape: layers, widths, experts and routing, sequence and micro-batch size, dtype."""

    name: str = "moe"
    """Free-form model name, shown in reports."""
    layers: int = _int(1, 4096)
    """Number of transformer blocks, 1..4096."""
    dense_layers: int = _int(0, 4096, default=0)
    """The first ``dense_layers`` blocks use a dense SwiGLU MLP instead of MoE (K2: 1, DSv3: 3);
    0..layers."""
    hidden: int = _int(1, 1 << 20)
    """Model (residual stream) width, 1..1048576 (2^20)."""
    heads: int = _int(1, 65536)
    """Attention heads, 1..65536; must divide ``hidden``."""
    experts: int = _int(1, 65536)
    """Routed experts per MoE layer, 1..65536."""
    top_k: int = _int(1, 65536)
    """Experts each token is routed to, 1..experts."""
    shared_experts: int = _int(0, 1024, default=1)
    """Shared experts, replicated on every EP rank, 0..1024."""
    expert_hidden: int = _int(1, 1 << 20)
    """SwiGLU hidden width of one routed (and shared) expert, 1..1048576 (2^20)."""
    dense_hidden: int = _int(0, 1 << 22, default=0)
    """SwiGLU hidden width of the dense layers (0: 4 x hidden), 0..4194304 (2^22)."""
    vocab: int = _int(1, 1 << 24, default=32000)
    """Vocabulary size (embedding and output head), 1..16777216 (2^24)."""
    seq_len: int = _int(1, 1 << 24)
    """Sequence length in tokens, 1..16777216 (2^24)."""
    micro_batch_size: int = _int(1, 65536, default=1)
    """Sequences per micro-batch per rank, 1..65536."""
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Compute and activation dtype."""
    aux_loss_coef: float = _float(0.0, 1000.0, open_low=False, default=0.0)
    """Load-balancing auxiliary loss coefficient, 0..1000."""
    max_route_nodes: int | None = _int(1, 65536, default=None)
    """Node-limited routing (DeepSeek-V3: 4): each token goes to experts on at most this many nodes
    and crosses the NIC once per node it reaches ([Note: node-limited routing] in k3sched/cost.py);
    1..65536, empty: unlimited. Left out of plan.json's config when unset."""
    router_skew: float = _float(0.0, 16.0, open_low=False, default=0.0)
    """Zipf exponent of the synthetic router's expert popularity, 0..16 (0: uniform): a fixed bias
    ``-router_skew * ln(e + 1)`` on expert e's router logit ([Note: router skew] in
    k3sched/balance.py). Left out of plan.json's config when 0."""
    routing_imbalance: float = _float(1.0, 64.0, open_low=False, default=1.0)
    """Expected busiest EP rank's routed tokens over the EP ranks' mean in one all-to-all, 1..64, from
    the router's own spread (no placement removes it): the busiest rank's expert GEMMs and all-to-all
    bytes scale by it on top of the modelled loads ([Note: routing imbalance] in k3sched/balance.py).
    ``k3sched probe`` measures it on the model at its initial weights; 1: balanced. Left out of
    plan.json's config when 1."""

    @model_serializer(mode="wrap")
    def _drop_unset_routing(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if self.max_route_nodes is None:
            out.pop("max_route_nodes", None)
        if not self.router_skew:
            out.pop("router_skew", None)
        if self.routing_imbalance == 1.0:
            out.pop("routing_imbalance", None)
        return out

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def ffn_dense_hidden(self) -> int:
        return self.dense_hidden or 4 * self.hidden

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch per rank."""
        return self.micro_batch_size * self.seq_len

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_layers


class ParallelConfig(_Section):
    """How the model is split: PP, virtual stages, EP and DP degrees, micro-batches, layer split, rank order,
    redundant expert slots and sequence slices."""

    pp: int = _int(1, 1024, default=1)
    """Pipeline-parallel degree (physical stages), 1..1024."""
    vpp: int = _int(1, 256, default=1)
    """Virtual stages (model chunks) per PP rank, 1..256 (pp*vpp <= layers)."""
    ep: int = _int(1, 65536, default=1)
    """Expert-parallel degree, 1..65536; must divide model.experts."""
    dp: int = _int(1, 1 << 20, default=1)
    """Data-parallel replicas of the PP x EP group (gradients reduce-scattered over dp), 1..1048576."""
    microbatches: int = _int(1, 65536, default=1)
    """Micro-batches per training step, 1..65536 (and the plan within ``schedule.max_tasks``)."""
    layer_split: Literal["balanced", "even", "profile"] = "balanced"
    """How layers are split over virtual stages: balanced by compute time (embedding and head
    counted), even by count, or profile: by the measured per-layer times (``layer_us``, embedding,
    head, exposed P2P) of ``schedule.profile`` (``k3sched rebalance`` writes one;
    k3sched/rebalance.py). ``stage_layers``, when set, is used instead."""
    stage_layers: list[int] | None = None
    """Optional: layers of each virtual stage in model order (pp*vpp counts summing to model.layers;
    only the first and the last may be 0), e.g. [3, 1]; overrides ``layer_split``. Left out of
    plan.json's config when unset."""
    order: str = "ep-dp-pp"
    """Rank order as Megatron's --order, innermost dimension first: a permutation of ep, dp, pp
    joined by '-' (ep-dp-pp: EP groups on consecutive ranks, then DP, then PP stages; pp-ep-dp:
    adjacent stages on consecutive ranks). Links are priced from it (k3sched/placement.py) and the
    runtime builds its groups from it. Left out of plan.json's config when ep-dp-pp."""
    world_size: int | None = _int(1, 1 << 40, default=None)
    """Optional: the job's world size; must equal pp * ep * dp."""
    redundant_experts: int = _int(0, 65536, default=0)
    """Extra expert slots per EP rank holding replicas of hot experts (EPLB), 0..65536; needs ep >= 2
    ([Note: expert placement] in k3sched/balance.py). Left out of plan.json's config when 0."""
    seq_chunks: int = _int(1, 4096, default=1)
    """Sequence slices per micro-batch (Seq1F1B), 1..4096: every micro-batch is cut along the
    sequence into this many slices, each a pipeline unit of its own ([Note: sequence slices] in
    k3sched/seqslice.py). Left out of plan.json's config when 1."""
    seq_split: Literal["even", "compute"] = "even"
    """Where slice boundaries go: even (equal token counts; seq_chunks must divide model.seq_len) or
    compute (equal attention + MLP forward cost, causal attention growing with position). Left out
    of plan.json's config when even."""

    @model_serializer(mode="wrap")
    def _drop_defaults(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if self.stage_layers is None:
            out.pop("stage_layers", None)
        if self.order == "ep-dp-pp":
            out.pop("order", None)
        if not self.redundant_experts:
            out.pop("redundant_experts", None)
        if self.seq_chunks == 1:
            out.pop("seq_chunks", None)
        if self.seq_split == "even":
            out.pop("seq_split", None)
        return out

    @property
    def world(self) -> int:
        return self.pp * self.ep * self.dp


class CpuRunnerConfig(_Section):
    """The CPU runner (the gloo runner, lanes are CPU threads): the host's cores the ranks share, what a
    transfer costs the compute beside it and how task times spread ([Note: the CPU-runner model] in
    k3sched/cpurunner.py). ``k3sched probe`` measures every field on CPU. Each default is the value that
    has no effect, so a section of defaults plans as a GPU does."""

    host_cores: int = _int(0, 1 << 20, default=0)
    """CPU cores (0..1048576) the ranks of one node share; compute tasks take ``max(1, ranks per node /
    host_cores)`` times their one-core duration ([Note: CPU sharing] in k3sched/cpurunner.py). Every
    other field acts only where it is set; 0: every rank has its own device, as on GPUs."""
    comm_cpu_ns_per_byte: float = _float(0.0, 1e6, open_low=False, default=0.0)
    """CPU time (ns, 0..1e6) a byte sent or received costs the rank (gloo threads, the kernel's TCP path):
    compute that overlaps a transfer is slowed by it ([Note: CPU cost of communication] in
    k3sched/cpurunner.py). ``k3sched probe`` measures it; 0: transfers cost no CPU."""
    comm_cpu_us_per_call: float = _float(0.0, 1e6, open_low=False, default=0.0)
    """CPU time (µs, 0..1e6) each communication call costs the rank besides its bytes: gloo's and the
    kernel's per-message work, thread wake-ups, the cache the compute thread loses to them. Compute that
    overlaps the call is slowed by it ([Note: CPU cost of communication] in k3sched/cpurunner.py).
    ``k3sched probe`` measures it in the testbed as what concurrent all-to-alls cost a computing thread;
    0: none."""
    comm_wait_us_per_call: float = _float(0.0, 1e6, open_low=False, default=0.0)
    """Time (µs, 0..1e6) each communication call takes longer while the rank's compute lane runs beside it:
    every wake-up of the transfer's threads (gloo's, the lane's) waits for a core the compute thread
    holds. A transfer is lengthened by it times the share of its span that compute overlaps ([Note: a
    transfer beside compute] in k3sched/cpurunner.py). ``k3sched probe`` measures it in the testbed (an
    all-to-all's time beside a GEMM loop less its time alone); 0: transfers do not wait for cores (left
    out of plan.json)."""
    compute_alone_factor: float = _float(0.0, 1.0, default=1.0)
    """A compute task's time while no other rank of the host computes, over its time while every rank
    computes (what the operator profile measures), (0, 1]: the ranks of one host share its caches and
    memory bandwidth, so a pipeline stage computing in another stage's bubble runs faster ([Note:
    compute alone] in k3sched/cpurunner.py). ``k3sched probe`` measures it (the operator profile alone
    against the same with every rank at once); 1: no difference (left out of plan.json)."""
    task_time_cv: float = _float(0.0, 10.0, open_low=False, default=0.0)
    """Spread of a compute task's duration from run to run on this machine, as std / mean (0..10):
    preemption, the transfers beside it, caches. When above 0 (or a profile gives per-kind values)
    the plan also reports the step and overlap it expects with that spread, from a replay of its
    lane orders with sampled durations ([Note: task-time spread] in k3sched/variability.py).
    ``k3sched probe`` measures it beside transfers; 0: durations are exact (left out of plan.json)."""

    @model_serializer(mode="wrap")
    def _drop_unset_cpu_terms(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("task_time_cv", "comm_wait_us_per_call"):
            if not getattr(self, key):
                out.pop(key, None)
        if self.compute_alone_factor == 1.0:
            out.pop("compute_alone_factor", None)
        return out


CPU_RUNNER_FIELDS: tuple[str, ...] = tuple(CpuRunnerConfig.model_fields)
"""The fields of ``hardware.cpu_runner``; a config that spells one flat under ``hardware`` is refused."""


class HardwareConfig(_Section):
    """What the cost model knows of the machine: compute rate, memories, links and, for the CPU runner only,
    its ``cpu_runner`` section (``k3sched probe`` measures these)."""

    name: str = "gpu"
    """Free-form hardware name, shown in reports."""
    peak_tflops: float = _float(0.0, 1e6)
    """Peak dense TFLOP/s of one device at the model dtype, > 0 and <= 1e6."""
    mfu: float = _float(0.0, 1.0, default=0.5)
    """Achievable fraction of peak for GEMM-heavy work, > 0 and <= 1."""
    hbm_gbps: float = _float(0.0, 1e6, default=3000.0)
    """Device memory bandwidth (element-wise kernels such as the gradient add), > 0 and <= 1e6."""
    device_memory_gb: float = _float(0.0, 1e7)
    """Device memory per rank, GiB, > 0 and <= 1e7."""
    host_memory_gb: float = _float(0.0, 1e7, default=256.0)
    """Host memory available to one rank, GiB, > 0 and <= 1e7."""
    gpus_per_node: int = _int(1, 65536, default=8)
    """Ranks per node (EP / DP groups within it use NVLink), 1..65536."""
    nvlink_gbps: float = _float(0.0, 1e6, default=200.0)
    """Intra-node per-GPU bandwidth, GB/s one direction, > 0 and <= 1e6."""
    nvlink_latency_us: float = _float(0.0, 1e6, open_low=False, default=3.0)
    """Intra-node latency per call or ring step, µs, 0..1e6."""
    internode_gbps: float = _float(0.0, 1e6, default=50.0)
    """Inter-node per-GPU bandwidth (NIC), GB/s one direction, > 0 and <= 1e6."""
    internode_latency_us: float = _float(0.0, 1e6, open_low=False, default=10.0)
    """Inter-node latency per call or ring step, µs, 0..1e6."""
    pcie_gbps: float = _float(0.0, 1e6, default=25.0)
    """Host <-> device copy bandwidth per GPU, GB/s, > 0 and <= 1e6."""
    pcie_latency_us: float = _float(0.0, 1e6, open_low=False, default=5.0)
    """Host <-> device copy latency, µs, 0..1e6."""
    launch_us: float = _float(0.0, 1e6, open_low=False, default=5.0)
    """Fixed per-task overhead (kernel launches, Python dispatch), µs, 0..1e6."""
    optim_ns_per_param: float | None = _float(0.0, 1e6, default=None)
    """AdamW step time per parameter, ns, > 0 and <= 1e6 (``k3sched probe`` measures it); default: 28 bytes per
    parameter (fp32 param, grad, two moments read; param, moments written) at ``hbm_gbps``."""
    cpu_runner: CpuRunnerConfig | None = None
    """The CPU runner's model (lanes are CPU threads sharing the host's cores, transfers cost CPU and wait
    for cores, task times spread): a section of its own, ``k3sched probe`` writes it on CPU. Empty (the
    default): the ranks run on GPUs and none of it applies. Left out of plan.json's config when empty."""

    @model_validator(mode="before")
    @classmethod
    def _moved_cpu_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in CPU_RUNNER_FIELDS:
                if key in data:
                    raise ValueError(f"hardware.{key}: moved to hardware.cpu_runner.{key}")
        return data

    @model_serializer(mode="wrap")
    def _drop_gpu_cpu_runner(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if self.cpu_runner is None:
            out.pop("cpu_runner", None)
        return out


STORAGE_OPS: tuple[str, ...] = ("attn", "router", "dispatch", "shared", "expert", "combine", "mlp")
"""Sub-ops whose saved activations have a storage policy (``moe.context.OPS``; a test keeps the two equal).

[Note: storage policies from the config]
``schedule.storage`` sets the policy per sub-op. The planner costs it per forward task kind: a
``keep`` op's saved bytes stay out of its layer's offload set (they stay on the device until the
backward frees them), an ``offload+fp8`` op's bytes are counted block-wise FP8
(:meth:`k3sched.cost.CostModel.saved_bytes`), and the runtime's policy table is built from the same
rules (``offload.PolicyTable.from_config``), so plan and run agree. Patterns are over sub-ops only:
the planner has no per-tensor byte model, so a per-tensor pattern (``attn.q``) is refused."""


class ScheduleConfig(_Section):
    """How one step is scheduled: strategy, pipeline backbone, memory budget and what is done to meet it
    (offload, recompute, FP8), WGrad deferral, look-ahead, gradient handling and measured inputs."""

    strategy: Literal["k3", "serial"] = "k3"
    """k3: five-lane co-schedule; serial: one task at a time (no-overlap baseline)."""
    pipeline: Literal[PIPELINES] = "1f1b"  # type: ignore[valid-type]
    """Pipeline backbone (order of forward / backward chunks per PP rank): a name of
    :data:`k3sched.pipelines.TABLE` ([Note: schedule registry])."""
    warmup_extra: int = _int(0, 65536, default=0)
    """Extra warm-up micro-batches for interleaved 1F1B (Kimi K2 uses them to hide EP a2a), 0..65536."""
    device_memory_budget: float | None = _float(0.0, 1e7, default=None)
    """Device memory the plan may use per rank, GiB, > 0 and <= 1e7 (default: hardware.device_memory_gb;
    a huge budget such as 2^20 means no limit)."""
    offload: Literal["none", "auto", "all", "remote"] = "auto"
    """Activation offload: none; auto (as much as the budget needs); all; remote (like auto, but every
    set a stage offloads goes to the next stage's memory, the last stage's to its host)."""
    remote_offload: bool = False
    """Allow offloading a stage's activations to a later stage's memory (offload_remote lane)."""
    recompute: bool = False
    """Recompute element-wise activations instead of storing them (saves memory, adds compute)."""
    act_quant: Literal["none", "fp8"] = "none"
    """Store saved activations block-wise FP8 (1x128 tiles, fp32 scales): about half of bf16."""
    dispatch_recompute: bool = False
    """EP-DR: keep only the dispatch input and re-run the dispatch a2a in backward."""
    fp8_dispatch: bool = False
    """Send the all-to-all payload that feeds expert GEMMs in FP8 (1 byte per element plus an fp32
    scale per 128, as DeepSeek-V3 does): dispatch, its recompute and the combine's backward; the
    combine and the dispatch's backward stay in the model dtype. Left out of plan.json when false."""
    grad_offload: bool = False
    """K3 Pipeline ZeRO-2: fp32 gradient shards in host memory, two chunk buffers on device."""
    layer_optim: bool = False
    """Step each layer's parameters as soon as its gradients are reduced: one
    ``s{s}/v{c}/L{l}/optim.run`` per layer, on the compute lane beside the reduction of the layers
    after it; the stage's ``optim.run`` then steps only the embedding, head and final norm (their
    reduction included) and runs last ([Note: per-layer optimizer] in k3sched/graph.py). Not with
    ``grad_offload``, pipedream-2bw or the two-copy schedules (dualpipe, chimera). Left out of
    plan.json when false."""
    grad_bucket_mb: float = _float(0.001, 1e6, open_low=False, default=256.0)
    """DP reduce-scatter bucket size, MiB, 0.001 (about 1 KiB)..1e6: one collective-lane task per bucket
    (the buckets count towards ``max_tasks``)."""
    wgrad_lag: int = _int(0, 65536, default=4)
    """How many backward chunks a WGrad task may trail its dX (k3 strategy), 0..65536."""
    lookahead: int = _int(0, 65536, default=1)
    """k3: backbone slots the compute lane may run ahead while the current slot waits on communication
    (1 lets one micro-batch's compute hide another's all-to-all, as DualPipe pairs do); 0..65536. At 0
    a slot without forwards may still start one ahead ([Note: backward look-ahead at look-ahead 0] in
    k3sched/listsched.py)."""
    transfer_slack: float = _float(0.0, 16.0, open_low=False, default=0.0)
    """k3, CPU runner: the lane orders are chosen as if every transfer's wait beside compute
    (``hardware.comm_wait_us_per_call``, [Note: a transfer beside compute] in k3sched/cpurunner.py)
    were ``1 + transfer_slack`` times the modelled one, so compute that needs a transfer's result is
    placed later and other work fills the margin; the plan's times are those of the modelled
    durations in these orders ([Note: transfer slack]). 0..16; 0 (the default) orders by the
    modelled durations; no effect where the plan models no such wait (GPUs, serial). Left out of
    plan.json when 0."""
    storage: dict[str, Literal["keep", "offload", "offload+fp8"]] = Field(default_factory=dict)
    """Storage policy per sub-op ([Note: storage policies from the config]): ``{OP_PATTERN: policy}``,
    a glob over the sub-ops that save activations (:data:`STORAGE_OPS`), first match wins; policy
    ``keep`` (stays on the device, also in a layer the plan offloads), ``offload`` (leaves with its
    layer's set) or ``offload+fp8`` (block-wise FP8, see ``act_quant``). Ops no rule matches get
    ``offload`` (``offload+fp8`` under ``act_quant: fp8``). Left out of plan.json's config when empty."""
    profile: str | None = None
    """Measured profile YAML whose per-kind durations replace the analytic cost model."""
    expert_placement: str | None = None
    """Placement YAML (``k3sched balance`` writes it): the expert of every slot of every EP rank and
    the measured per-expert loads ([Note: expert placement] in k3sched/balance.py); empty: computed
    from the modelled loads. Left out of plan.json's config when unset."""
    seed: int = _int(0, (1 << 63) - 1, default=0)
    """Model and data seed of runs, 0..2^63-1."""
    max_tasks: int = _int(1, MAX_TASKS_LIMIT, default=DEFAULT_MAX_TASKS)
    """Largest plan (tasks in one step, counted before they are built) the planner takes on,
    1..100,000,000; a larger one is refused up front (:mod:`k3sched.limits`). Planning time and
    memory grow with the tasks (k2-like has 38k), so the default 200,000 keeps a plan within seconds
    and well under a GB. Written out (plan.json's config) only when not the default: it bounds the
    planner's work, not what a plan is."""

    @model_serializer(mode="wrap")
    def _drop_default_limit(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if self.max_tasks == DEFAULT_MAX_TASKS:
            out.pop("max_tasks", None)
        if not self.fp8_dispatch:
            out.pop("fp8_dispatch", None)
        if not self.transfer_slack:
            out.pop("transfer_slack", None)
        if not self.layer_optim:
            out.pop("layer_optim", None)
        if self.expert_placement is None:
            out.pop("expert_placement", None)
        if not self.storage:
            out.pop("storage", None)
        return out

    @field_validator("storage")
    @classmethod
    def _storage_ops(cls, rules: dict[str, str]) -> dict[str, str]:
        for pat in rules:
            if "." in pat:
                raise ValueError(f"schedule.storage: {pat!r}: patterns select whole sub-ops (e.g. 'attn', 'expert', 'e*'), whose saved "
                                 f"bytes the planner costs; per-tensor patterns are not modelled")
            if not any(fnmatch.fnmatchcase(op, pat) for op in STORAGE_OPS):
                raise ValueError(f"schedule.storage: {pat!r} matches no sub-op; allowed: globs over {', '.join(STORAGE_OPS)}")
        return rules

    def storage_policy(self, op: str) -> str:
        """The storage policy of sub-op ``op`` ([Note: storage policies from the config])."""
        for pat, policy in self.storage.items():
            if fnmatch.fnmatchcase(op, pat):
                return policy
        return "offload+fp8" if self.act_quant == "fp8" else "offload"


class DataConfig(_Section):
    """Where training tokens come from (``k3sched run``; the planner does not read it, and plan.json
    leaves it out)."""

    path: str | None = None
    """Flat token file read with np.memmap (``k3sched data prepare`` writes one; [Note: token files] in
    runtime/data.py); empty: synthetic tokens (the default)."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Token id type of ``path``."""


class Config(_Section):
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    hardware: HardwareConfig
    schedule: ScheduleConfig = ScheduleConfig()
    data: DataConfig = Field(default_factory=DataConfig, exclude=True)

    @model_validator(mode="after")
    def _check(self) -> "Config":
        m, p = self.model, self.parallel
        if m.hidden % m.heads:
            raise ValueError(f"model.heads: must divide model.hidden ({m.hidden}); got {m.heads}")
        if m.experts % p.ep:
            raise ValueError(f"parallel.ep: must divide model.experts ({m.experts}); got {p.ep}")
        if m.top_k > m.experts:
            raise ValueError(f"model.top_k: must be at most model.experts ({m.experts}); got {m.top_k}")
        if m.max_route_nodes is not None and m.max_route_nodes > m.top_k:
            raise ValueError(f"model.max_route_nodes: must be at most model.top_k ({m.top_k}): a token reaches "
                             f"at most top_k nodes; got {m.max_route_nodes}")
        if p.redundant_experts and p.ep < 2:
            raise ValueError(f"parallel.redundant_experts: replicas live on other EP ranks, so it needs parallel.ep "
                             f">= 2; got ep {p.ep}")
        if p.redundant_experts and m.experts // p.ep + p.redundant_experts > m.experts:
            raise ValueError(f"parallel.redundant_experts: at most experts - experts/ep = "
                             f"{m.experts - m.experts // p.ep} (one replica per rank); got {p.redundant_experts}")
        if (p.redundant_experts or self.schedule.expert_placement) and self.schedule.grad_offload:
            raise ValueError("schedule.grad_offload: not supported with redundant experts or an expert placement "
                             "(the host gradient shards do not sum replicas); set one of them off")
        if self.schedule.layer_optim:
            entry = PIPELINE_TABLE[self.schedule.pipeline]
            why = ("schedule.grad_offload (the host shards are stepped together)" if self.schedule.grad_offload else
                   f"schedule.pipeline {self.schedule.pipeline} (two weight versions)" if entry.steps > 1 else
                   f"schedule.pipeline {self.schedule.pipeline} (two model copies, reduced together)"
                   if entry.copies == 2 else None)
            if why:
                raise ValueError(f"schedule.layer_optim: not with {why}; allowed: layer_optim with plain "
                                 f"gradients on a one-copy, one-version pipeline")
        if m.dense_layers > m.layers:
            raise ValueError(f"model.dense_layers: must be at most model.layers ({m.layers}); got {m.dense_layers}")
        if p.world_size is not None and p.world_size != p.world:
            raise ValueError(f"parallel.world_size: must equal pp*ep*dp = {p.pp}*{p.ep}*{p.dp} = {p.world}; "
                             f"got {p.world_size}")
        from .placement import order_error

        bad_order = order_error(p.order)
        if bad_order:
            raise ValueError(f"parallel.order: {bad_order}")
        chunks = p.pp * p.vpp
        if p.stage_layers is not None:
            sl = p.stage_layers
            if len(sl) != chunks or sum(sl) != m.layers or any(n < 0 for n in sl) or any(n < 1 for n in sl[1:-1]):
                raise ValueError(f"parallel.stage_layers: must be pp*vpp = {chunks} layer counts summing to "
                                 f"model.layers ({m.layers}), inner ones >= 1, first and last >= 0; got "
                                 f"{show_value(sl)}")
        if p.layer_split == "profile" and not self.schedule.profile:
            raise ValueError("parallel.layer_split: profile needs schedule.profile (a profile with layer_us, "
                             "written by k3sched rebalance); got no schedule.profile")
        if m.layers < chunks:
            raise ValueError(f"parallel.pp: pp*vpp = {chunks} model chunks need at least that many layers; "
                             f"model.layers is {m.layers}")
        from .seqslice import seq_error

        bad_seq = seq_error(self)
        if bad_seq:
            raise ValueError(bad_seq)
        bad = PIPELINE_TABLE[self.schedule.pipeline].config_error(p.pp, p.vpp, p.microbatches)
        if bad:  # the schedule's own rules ([Note: schedule registry] in k3sched/pipelines.py)
            raise ValueError(bad)
        return self

    @property
    def budget_bytes(self) -> int:
        gb = self.schedule.device_memory_budget or self.hardware.device_memory_gb
        return int(gb * GiB)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _bounds(meta: list) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in meta:
        for k in ("gt", "ge", "lt", "le"):
            if getattr(m, k, None) is not None:
                out[k] = getattr(m, k)
    return out


def _section_at(loc: tuple) -> type[BaseModel] | None:
    """The section class at a dotted location (``("hardware", "cpu_runner")``), None where there is none."""
    cls: Any = Config
    for part in loc:
        f = cls.model_fields.get(str(part)) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if f is None:
            return None
        cls = next((a for a in (f.annotation, *get_args(f.annotation)) if isinstance(a, type) and issubclass(a, BaseModel)),
                   None)
    return cls


def allowed_values(section: str, name: str) -> str:
    """What field ``section.name`` accepts, in words (for error messages); ``section`` may be dotted
    (``hardware.cpu_runner``)."""
    cls = _section_at(tuple(section.split(".")))
    f = cls.model_fields[name]
    ann = f.annotation
    args = [a for a in get_args(ann) if a is not type(None)] if get_origin(ann) is not Literal else []
    optional = len(args) < len(get_args(ann)) and get_origin(ann) is not Literal
    base = args[0] if optional and len(args) == 1 else ann
    b = _bounds(f.metadata)
    if base is bool:
        text = "true or false"
    elif base is int:
        lo = b["ge"] if "ge" in b else b.get("gt", 0) + 1
        text = f"an integer from {lo} to {b['le']}" if "le" in b else f"an integer >= {lo}"
    elif base is float:
        low = f"> {b['gt']:g}" if "gt" in b else f">= {b.get('ge', 0):g}"
        text = f"a finite number {low} and <= {b['le']:g}" if "le" in b else f"a finite number {low}"
    elif get_origin(base) is Literal:
        text = "one of " + ", ".join(str(a) for a in get_args(base))
    elif base is str:
        text = "a string"
    elif isinstance(base, type) and issubclass(base, BaseModel):
        text = "a mapping with keys " + ", ".join(base.model_fields)
    elif get_origin(base) is dict and get_origin(get_args(base)[1]) is Literal:
        text = "a mapping of names to one of " + ", ".join(str(a) for a in get_args(get_args(base)[1]))
    else:
        text = str(base)
    if optional:
        text += ", or empty (unset)"
    return text


def _format_pydantic_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e["loc"])
    typ = e["type"]
    section = str(e["loc"][0]) if e["loc"] else ""
    if typ == "extra_forbidden":
        sec = ".".join(str(x) for x in e["loc"][:-1]) or None
        allowed = _allowed_keys(sec)
        return f"{loc}: unknown key; allowed: {', '.join(allowed)}"
    if typ == "value_error":  # our own model_validator messages already name the field
        return str(e.get("ctx", {}).get("error", e["msg"]))
    if typ == "missing" and len(e["loc"]) == 1:
        return f"{loc}: required section is missing; allowed: a mapping with keys {', '.join(_allowed_keys(section))}"
    if len(e["loc"]) == 1 and section in _SECTIONS:  # the section itself is not a mapping
        return (f"{section}: must be a mapping of KEY: VALUE (got {show_value(e.get('input'))}); allowed: keys "
                f"{', '.join(_allowed_keys(section))} (leave the section out for its defaults)")
    name = str(e["loc"][-1]) if len(e["loc"]) > 1 else ""
    parent = _section_at(tuple(e["loc"][:-1]))
    allowed = allowed_values(".".join(str(x) for x in e["loc"][:-1]), name) \
        if parent is not None and name in parent.model_fields else ""
    tail = f"; allowed: {allowed}" if allowed else ""
    if typ == "missing":
        return f"{loc}: required field is missing{tail}"
    value = e.get("input")
    got = show_value(value)
    if isinstance(value, bool) and typ in ("int_type", "float_type"):
        got += " (a YAML boolean: yes/no/on/off/true/false)"
    return f"{loc}: {e['msg']} (got {got}){tail}"


def _allowed_keys(section: str | None) -> list[str]:
    cls = _section_at(tuple(section.split("."))) if section else Config
    return list((cls or Config).model_fields)


_SECTIONS: dict[str, type[_Section]] = {"model": ModelConfig, "parallel": ParallelConfig,
                                        "hardware": HardwareConfig, "schedule": ScheduleConfig,
                                        "data": DataConfig}
_SET_FORM = (f"SECTION.KEY=VALUE with SECTION one of {', '.join(Config.model_fields)} (e.g. parallel.pp=4), "
             f"or SECTION.SUBSECTION.KEY=VALUE (e.g. hardware.cpu_runner.host_cores=2)")


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    nested = len(parts) == 3 and _section_at(tuple(parts[:2])) is not None
    if (len(parts) != 2 and not nested) or parts[0] not in Config.model_fields or not all(parts):
        raise ConfigError(f"--set {show_value(dotted)[1:-1]}: expected SECTION.KEY (got {show_value(dotted)}); "
                          f"allowed: {_SET_FORM}")
    for depth in range(1, len(parts)):
        if data.get(parts[depth - 1]) is None and depth > 1:  # an empty sub-section: its defaults
            data[parts[depth - 1]] = {}
        data.setdefault(parts[depth - 1], {})
        where = ".".join(parts[:depth])
        if not isinstance(data[parts[depth - 1]], dict):
            raise ConfigError(f"{where}: must be a mapping to set {dotted} in (got "
                              f"{show_value(data[parts[depth - 1]])}); allowed: a mapping of KEY: VALUE")
        data[parts[depth - 1]] = data = dict(data[parts[depth - 1]])
    data[parts[-1]] = value


def parse_overrides(items: list[str] | None) -> list[tuple[str, Any]]:
    """Parse ``key=value`` strings; values are YAML scalars (``4``, ``1e-3``, ``true``, ``1f1b``)."""
    out = []
    for item in items or []:
        if not isinstance(item, str):
            raise ConfigError(f"--set {show_value(item)}: expected a string KEY=VALUE; allowed: {_SET_FORM}")
        shown = show_value(item)
        if "=" not in item:
            raise ConfigError(f"--set {shown}: expected KEY=VALUE, e.g. parallel.pp=4 (got no '='); "
                              f"allowed: {_SET_FORM}")
        key, raw = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"--set {shown}: empty key before '='; allowed: {_SET_FORM}")
        out.append((key.strip(), yaml_load(raw, f"--set {shown}") if raw.strip() else None))
    return out


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping with sections model, parallel, hardware, schedule "
                          f"(got {show_value(data)}); allowed: a mapping of sections")
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for key, value in parse_overrides(overrides):
        _set_path(data, key, value)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_pydantic_error(err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load and validate a YAML config; ``overrides`` are ``SECTION.KEY=VALUE`` strings."""
    p = Path(path)
    text = read_text_file(p, "config")
    data = yaml_load(text, str(p))
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping with sections model, parallel, hardware, schedule "
                          f"(got {show_value(data)}); allowed: a mapping of sections")
    try:
        return config_from_dict(data, overrides)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None

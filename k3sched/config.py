"""Typed configuration: YAML -> validated pydantic objects.

Four sections: ``model``, ``parallel``, ``hardware``, ``schedule``. Units: memory in GiB,
bandwidth in GB/s (1e9 bytes/s, one direction), latency in microseconds, compute in TFLOP/s.
Invariants are checked where the config is built; a violation raises :class:`ConfigError` whose
message is one line naming the field and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

GiB = 1 << 30

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
PIPELINES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe")
STRATEGIES = ("k3", "serial")


class ConfigError(ValueError):
    """A config is invalid. ``str(err)`` is one line: the field, what is wrong, what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class ModelConfig(_Section):
    name: str = "moe"
    """Free-form model name, shown in reports."""
    layers: int = Field(gt=0)
    """Number of transformer blocks."""
    dense_layers: int = Field(default=0, ge=0)
    """The first ``dense_layers`` blocks use a dense SwiGLU MLP instead of MoE (K2: 1, DSv3: 3)."""
    hidden: int = Field(gt=0)
    """Model (residual stream) width."""
    heads: int = Field(gt=0)
    """Attention heads; must divide ``hidden``."""
    experts: int = Field(gt=0)
    """Routed experts per MoE layer."""
    top_k: int = Field(gt=0)
    """Experts each token is routed to."""
    shared_experts: int = Field(default=1, ge=0)
    """Shared experts, replicated on every EP rank."""
    expert_hidden: int = Field(gt=0)
    """SwiGLU hidden width of one routed (and shared) expert."""
    dense_hidden: int = Field(default=0, ge=0)
    """SwiGLU hidden width of the dense layers (0: 4 x hidden)."""
    vocab: int = Field(default=32000, gt=0)
    """Vocabulary size (embedding and output head)."""
    seq_len: int = Field(gt=0)
    """Sequence length in tokens."""
    micro_batch_size: int = Field(default=1, gt=0)
    """Sequences per micro-batch per rank."""
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Compute and activation dtype."""
    aux_loss_coef: float = Field(default=0.0, ge=0)
    """Load-balancing auxiliary loss coefficient."""

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
    pp: int = Field(default=1, gt=0)
    """Pipeline-parallel degree (physical stages)."""
    vpp: int = Field(default=1, gt=0)
    """Virtual stages (model chunks) per PP rank."""
    ep: int = Field(default=1, gt=0)
    """Expert-parallel degree; must divide model.experts."""
    dp: int = Field(default=1, gt=0)
    """Data-parallel replicas of the PP x EP group (gradients reduce-scattered over dp)."""
    microbatches: int = Field(default=1, gt=0)
    """Micro-batches per training step."""
    layer_split: Literal["balanced", "even"] = "balanced"
    """How layers are split over virtual stages: balanced by compute time (embedding and head
    counted) or even by count."""
    world_size: int | None = Field(default=None, gt=0)
    """Optional: the job's world size; must equal pp * ep * dp."""

    @property
    def world(self) -> int:
        return self.pp * self.ep * self.dp


class HardwareConfig(_Section):
    name: str = "gpu"
    peak_tflops: float = Field(gt=0)
    """Peak dense TFLOP/s of one device at the model dtype."""
    mfu: float = Field(default=0.5, gt=0, le=1)
    """Achievable fraction of peak for GEMM-heavy work."""
    hbm_gbps: float = Field(default=3000.0, gt=0)
    """Device memory bandwidth (element-wise kernels such as the gradient add)."""
    device_memory_gb: float = Field(gt=0)
    """Device memory per rank, GiB."""
    host_memory_gb: float = Field(default=256.0, gt=0)
    """Host memory available to one rank, GiB."""
    gpus_per_node: int = Field(default=8, gt=0)
    nvlink_gbps: float = Field(default=200.0, gt=0)
    """Intra-node per-GPU bandwidth, GB/s one direction."""
    nvlink_latency_us: float = Field(default=3.0, ge=0)
    internode_gbps: float = Field(default=50.0, gt=0)
    """Inter-node per-GPU bandwidth (NIC), GB/s one direction."""
    internode_latency_us: float = Field(default=10.0, ge=0)
    pcie_gbps: float = Field(default=25.0, gt=0)
    """Host <-> device copy bandwidth per GPU, GB/s."""
    pcie_latency_us: float = Field(default=5.0, ge=0)
    launch_us: float = Field(default=5.0, ge=0)
    """Fixed per-task overhead (kernel launches, Python dispatch)."""
    optim_ns_per_param: float | None = Field(default=None, gt=0)
    """AdamW step time per parameter, ns (``k3sched probe`` measures it); default: 28 bytes per
    parameter (fp32 param, grad, two moments read; param, moments written) at ``hbm_gbps``."""
    comm_cpu_ns_per_byte: float = Field(default=0.0, ge=0)
    """CPU time a byte sent or received costs the rank (gloo threads, the kernel's TCP path) when
    lanes are CPU threads (``host_cores`` set); compute that overlaps a transfer is slowed by it.
    ``k3sched probe`` measures it; 0: transfers cost no CPU (NIC DMA, GPUs)."""
    host_cores: int = Field(default=0, ge=0)
    """CPU cores the ranks of one node share when lanes are CPU threads (the gloo runner); 0: every
    rank has its own device (GPU streams). Compute tasks then take ``max(1, ranks per node /
    host_cores)`` times their one-core duration ([Note: CPU sharing] in k3sched/cost.py)."""


class ScheduleConfig(_Section):
    strategy: Literal["k3", "serial"] = "k3"
    """k3: five-lane co-schedule; serial: one task at a time (no-overlap baseline)."""
    pipeline: Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe"] = "1f1b"
    """Pipeline backbone (order of forward / backward chunks per PP rank)."""
    warmup_extra: int = Field(default=0, ge=0)
    """Extra warm-up micro-batches for interleaved 1F1B (Kimi K2 uses them to hide EP a2a)."""
    device_memory_budget: float | None = Field(default=None, gt=0)
    """Device memory the plan may use per rank, GiB (default: hardware.device_memory_gb)."""
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
    grad_offload: bool = False
    """K3 Pipeline ZeRO-2: fp32 gradient shards in host memory, two chunk buffers on device."""
    grad_bucket_mb: float = Field(default=256.0, gt=0)
    """DP reduce-scatter bucket size, MiB: one collective-lane task per bucket."""
    wgrad_lag: int = Field(default=4, ge=0)
    """How many backward chunks a WGrad task may trail its dX (k3 strategy)."""
    lookahead: int = Field(default=1, ge=0)
    """k3: backbone slots the compute lane may run ahead while the current slot waits on communication
    (1 lets one micro-batch's compute hide another's all-to-all, as DualPipe pairs do)."""
    profile: str | None = None
    """Measured profile YAML whose per-kind durations replace the analytic cost model."""
    seed: int = 0


class Config(_Section):
    model: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    hardware: HardwareConfig
    schedule: ScheduleConfig = ScheduleConfig()

    @model_validator(mode="after")
    def _check(self) -> "Config":
        m, p = self.model, self.parallel
        if m.hidden % m.heads:
            raise ValueError(f"model.heads: must divide model.hidden ({m.hidden}); got {m.heads}")
        if m.experts % p.ep:
            raise ValueError(f"parallel.ep: must divide model.experts ({m.experts}); got {p.ep}")
        if m.top_k > m.experts:
            raise ValueError(f"model.top_k: must be at most model.experts ({m.experts}); got {m.top_k}")
        if m.dense_layers > m.layers:
            raise ValueError(f"model.dense_layers: must be at most model.layers ({m.layers}); got {m.dense_layers}")
        if p.world_size is not None and p.world_size != p.world:
            raise ValueError(f"parallel.world_size: must equal pp*ep*dp = {p.pp}*{p.ep}*{p.dp} = {p.world}; "
                             f"got {p.world_size}")
        chunks = p.pp * p.vpp
        if m.layers < chunks:
            raise ValueError(f"parallel.pp: pp*vpp = {chunks} model chunks need at least that many layers; "
                             f"model.layers is {m.layers}")
        if self.schedule.pipeline in ("interleaved-1f1b",) and p.vpp < 2:
            raise ValueError("schedule.pipeline: interleaved-1f1b needs parallel.vpp >= 2; got vpp 1")
        if self.schedule.pipeline in ("zb-v", "dualpipev") and p.vpp != 2:
            raise ValueError(f"parallel.vpp: {self.schedule.pipeline} places 2 chunks per rank (V shape); "
                             f"set vpp 2, got {p.vpp}")
        if self.schedule.pipeline in ("interleaved-1f1b",) and p.microbatches % p.pp:
            raise ValueError(f"parallel.microbatches: interleaved-1f1b needs a multiple of pp ({p.pp}); "
                             f"got {p.microbatches}")
        if self.schedule.pipeline in ("dualpipe",) and (p.pp % 2 or p.microbatches < 2 * p.pp):
            raise ValueError(f"schedule.pipeline: dualpipe needs an even pp and microbatches >= 2*pp; got "
                             f"pp {p.pp}, microbatches {p.microbatches}")
        if self.schedule.pipeline in ("dualpipev",) and p.microbatches < 2 * p.pp:
            raise ValueError(f"parallel.microbatches: dualpipev needs at least 2*pp = {2 * p.pp}; "
                             f"got {p.microbatches}")
        return self

    @property
    def budget_bytes(self) -> int:
        gb = self.schedule.device_memory_budget or self.hardware.device_memory_gb
        return int(gb * GiB)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _format_pydantic_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e["loc"])
    typ = e["type"]
    if typ == "extra_forbidden":
        section = e["loc"][0] if len(e["loc"]) > 1 else None
        allowed = _allowed_keys(section)
        return f"{loc}: unknown key; allowed: {', '.join(allowed)}"
    if typ == "missing":
        return f"{loc}: required field is missing"
    if typ == "value_error":  # our own model_validator messages already name the field
        return str(e.get("ctx", {}).get("error", e["msg"]))
    return f"{loc}: {e['msg']} (got {e.get('input')!r})"


def _allowed_keys(section: str | None) -> list[str]:
    cls = {"model": ModelConfig, "parallel": ParallelConfig, "hardware": HardwareConfig,
           "schedule": ScheduleConfig}.get(section or "", Config)
    return list(cls.model_fields)


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) != 2 or parts[0] not in Config.model_fields:
        raise ConfigError(f"--set {dotted}: expected SECTION.KEY with SECTION one of "
                          f"{', '.join(Config.model_fields)}")
    data.setdefault(parts[0], {})
    if not isinstance(data[parts[0]], dict):
        raise ConfigError(f"{parts[0]}: must be a mapping")
    data[parts[0]][parts[1]] = value


def parse_overrides(items: list[str] | None) -> list[tuple[str, Any]]:
    """Parse ``key=value`` strings; values are YAML scalars (``4``, ``true``, ``1f1b``)."""
    out = []
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. parallel.pp=4")
        key, raw = item.split("=", 1)
        out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
    return out


def config_from_dict(data: dict[str, Any], overrides: list[str] | None = None) -> Config:
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
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping with sections model, parallel, hardware, schedule")
    try:
        return config_from_dict(data, overrides)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None

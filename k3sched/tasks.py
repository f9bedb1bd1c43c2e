"""Task model: the five lanes, task kinds and stable task ids.

[Note: task id grammar]
A task id names one task of one training step and is the join key between plan files, NVTX
range names, recorded traces and validation reports. Grammar (EBNF)::

    task_id  = stage "/" scope "/" op "." phase [ ".b" INT ]     (".bN": bucket N of a collective)
    stage    = "s" INT                       PP rank (physical stage)
    scope    = mb "/" "L" INT                per micro-batch, per layer  (L: global layer index)
             | mb "/" "v" INT                per micro-batch, per virtual chunk (P2P, embed, head)
             | "v" INT "/" "L" INT           per step, per layer (gradient reduction w/o sharding;
                                             optim.run with ``schedule.layer_optim``)
             | "step" [ INT ]                per step (optimizer); "stepN" (N >= 1): step N of a
                                             plan that spans several steps ([Note: pipedream-2bw])
    mb       = "mb" INT [ "q" INT ]          micro-batch, and its sequence slice when
                                             ``parallel.seq_chunks`` > 1 ([Note: sequence slices])
    op       = [a-z_]+                       see OPS
    phase    = "fwd" | "dx" | "dw" | "bwd" | "re" | "send" | "recv" | "offload" | "onload"
             | "roffload" | "ronload" | "rs" | "add" | "run" | "mirror"

Examples: ``s0/mb3/L5/attn.fwd``, ``s1/mb0/L7/expert.dw``, ``s0/mb2/v0/act.send``, ``s0/step/grad.mirror``
(chimera / dualpipe: the all-reduce with the rank holding the other model copy of the same stages,
[Note: replica gradient reduction] in runtime/stage/gradients.py),
``s2/mb1/L9/act.roffload``, ``s3/v1/L12/grad.rs.b0``, ``s0/step/optim.run``, ``s3/v1/L12/optim.run``
(layer 12's AdamW step, [Note: per-layer optimizer] in k3sched/graph.py), ``s1/mb2q3/L4/attn.fwd``
(slice 3 of micro-batch 2), ``s0/step1/optim.run`` (the optimizer of the second step of a
``pipedream-2bw`` plan, whose second step's micro-batches are numbered M..2M-1; [Note:
pipedream-2bw] in k3sched/schedule_generators.py). An id names a slice only when the plan cuts micro-batches into
slices; with one slice per micro-batch (the default) ids carry no ``q``.
``parse_task_id(format_task_id(...))`` round-trips exactly (tested).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

LANES: tuple[str, ...] = ("compute", "ep", "collective", "offload_local", "offload_remote")
LANE_INDEX = {lane: i for i, lane in enumerate(LANES)}
COMM_LANES: tuple[str, ...] = ("ep", "collective")


class Kind(str, Enum):
    """Task kinds. The value is ``op.phase`` as it appears in task ids."""

    # forward, per MoE (or dense) layer and micro-batch
    ATTN_FWD = "attn.fwd"
    ROUTER_FWD = "router.fwd"
    DISPATCH_FWD = "dispatch.fwd"
    SHARED_FWD = "shared.fwd"
    EXPERT_FWD = "expert.fwd"
    COMBINE_FWD = "combine.fwd"
    MLP_FWD = "mlp.fwd"  # dense feed-forward layer (K2 layer 0)
    # backward: input gradients (critical path)
    COMBINE_BWD = "combine.bwd"  # all-to-all of output grads back to the expert ranks
    EXPERT_DX = "expert.dx"
    DISPATCH_RE = "dispatch.re"  # EP dispatch recompute (EP-DR)
    DISPATCH_BWD = "dispatch.bwd"  # all-to-all of input grads back to the token owners
    SHARED_DX = "shared.dx"
    ROUTER_BWD = "router.bwd"  # router dX and dW (tiny)
    ATTN_DX = "attn.dx"
    MLP_DX = "mlp.dx"
    # backward: weight gradients (WGrad, deferrable)
    ATTN_DW = "attn.dw"
    SHARED_DW = "shared.dw"
    EXPERT_DW = "expert.dw"
    MLP_DW = "mlp.dw"
    # first / last stage extras (scope mb/v)
    EMBED_FWD = "embed.fwd"
    EMBED_DW = "embed.dw"
    HEAD_FWD = "head.fwd"  # output head + loss
    HEAD_DX = "head.dx"
    HEAD_DW = "head.dw"
    # pipeline P2P (collective lane, scope mb/v)
    FWD_SEND = "act.send"
    FWD_RECV = "act.recv"
    BWD_SEND = "grad.send"
    BWD_RECV = "grad.recv"
    # activation offload (scope mb/L)
    ACT_OFFLOAD = "act.offload"
    ACT_ONLOAD = "act.onload"
    ACT_ROFFLOAD = "act.roffload"  # sender: device -> peer rank's memory
    ACT_RONLOAD = "act.ronload"  # sender: peer rank's memory -> device
    ACT_RSTORE = "act.rstore"  # peer: receive and keep a remotely offloaded activation
    ACT_RSERVE = "act.rserve"  # peer: send it back when the owner prefetches it
    # gradients
    GRAD_RS = "grad.rs"  # DP reduce-scatter of a layer's gradient
    GRAD_MIRROR = "grad.mirror"  # chimera / dualpipe: all-reduce with the rank holding the other model copy
    GSHARD_ONLOAD = "gshard.onload"
    GSHARD_ADD = "gshard.add"
    GSHARD_OFFLOAD = "gshard.offload"
    OPTIM = "optim.run"

    @property
    def op(self) -> str:
        return self.value.split(".")[0]

    @property
    def phase(self) -> str:
        return self.value.split(".")[1]


LANE_OF: dict[Kind, str] = {
    **{k: "compute" for k in Kind},
    Kind.DISPATCH_FWD: "ep",
    Kind.COMBINE_FWD: "ep",
    Kind.COMBINE_BWD: "ep",
    Kind.DISPATCH_RE: "ep",
    Kind.DISPATCH_BWD: "ep",
    Kind.FWD_SEND: "collective",
    Kind.FWD_RECV: "collective",
    Kind.BWD_SEND: "collective",
    Kind.BWD_RECV: "collective",
    Kind.GRAD_RS: "collective",
    Kind.GRAD_MIRROR: "collective",
    Kind.ACT_OFFLOAD: "offload_local",
    Kind.ACT_ONLOAD: "offload_local",
    Kind.GSHARD_ONLOAD: "offload_local",
    Kind.GSHARD_OFFLOAD: "offload_local",
    Kind.ACT_ROFFLOAD: "offload_remote",
    Kind.ACT_RONLOAD: "offload_remote",
    Kind.ACT_RSTORE: "offload_remote",
    Kind.ACT_RSERVE: "offload_remote",
}

SYNC_KINDS = frozenset(k for k in Kind if LANE_OF[k] == "ep") | {Kind.GRAD_RS, Kind.GRAD_MIRROR}
"""Transfers every rank of a group runs together: none moves a byte before the last rank posts it
(the replay's drift, [Note: task-time spread] in k3sched/variability.py; the measured wait, [Note:
waiting for the last rank] in traces/validate.py)."""
WGRAD_KINDS = frozenset({Kind.ATTN_DW, Kind.SHARED_DW, Kind.EXPERT_DW, Kind.MLP_DW, Kind.HEAD_DW, Kind.EMBED_DW})
FWD_KINDS = frozenset(
    {Kind.ATTN_FWD, Kind.ROUTER_FWD, Kind.DISPATCH_FWD, Kind.SHARED_FWD, Kind.EXPERT_FWD, Kind.COMBINE_FWD,
     Kind.MLP_FWD, Kind.EMBED_FWD, Kind.HEAD_FWD}
)
OFFLOAD_KINDS = frozenset({Kind.ACT_OFFLOAD, Kind.ACT_ONLOAD, Kind.ACT_ROFFLOAD, Kind.ACT_RONLOAD,
                           Kind.ACT_RSTORE, Kind.ACT_RSERVE,
                           Kind.GSHARD_ONLOAD, Kind.GSHARD_OFFLOAD})
EXPERT_KINDS = frozenset({Kind.EXPERT_FWD, Kind.EXPERT_DX, Kind.EXPERT_DW})
"""The routed experts' compute, which the profile may time per expert (``per_expert_us``)."""
P2P_KINDS = frozenset({Kind.FWD_SEND, Kind.FWD_RECV, Kind.BWD_SEND, Kind.BWD_RECV})
SEND_OF: dict[Kind, Kind] = {
    Kind.FWD_RECV: Kind.FWD_SEND,        # activations to the next stage
    Kind.BWD_RECV: Kind.BWD_SEND,        # activation gradients to the previous stage
    Kind.ACT_RSTORE: Kind.ACT_ROFFLOAD,  # remote offload: the peer keeps the activation
    Kind.ACT_RONLOAD: Kind.ACT_RSERVE,   # remote onload: the peer sends it back
}
"""The transfer pairs: receiving kind -> the sending kind at the other end of one transfer between
two stages. Every send/receive pairing (planner, P2P check, runtime groups, trace join) derives
from this table."""
SEND_KINDS = frozenset(SEND_OF.values())
RECV_KINDS = frozenset(SEND_OF)

_ID_RE = re.compile(
    r"^s(?P<stage>\d+)/(?:(?:mb(?P<mb>\d+)(?:q(?P<slice>\d+))?/)?(?:L(?P<layer>\d+)|v(?P<chunk>\d+))|v(?P<vchunk>\d+)/L(?P<vlayer>\d+)"
    r"|(?P<step>step)(?P<stepn>[1-9]\d*)?)/(?P<kind>[a-z_]+\.[a-z]+)(?:\.b(?P<bucket>\d+))?$"
)


@dataclass(frozen=True)
class TaskKey:
    """Parsed form of a task id. ``mb``/``layer``/``chunk``/``slice`` are None where the scope omits
    them; ``step`` is N of a ``stepN`` scope (None: ``step``, a plan's first or only step)."""

    stage: int
    kind: Kind
    mb: int | None = None
    layer: int | None = None
    chunk: int | None = None
    bucket: int | None = None
    slice: int | None = None
    step: int | None = None

    def __str__(self) -> str:
        return format_task_id(self.stage, self.kind, mb=self.mb, layer=self.layer, chunk=self.chunk,
                              bucket=self.bucket, slice=self.slice, step=self.step)


def format_task_id(stage: int, kind: Kind, *, mb: int | None = None, layer: int | None = None,
                   chunk: int | None = None, bucket: int | None = None, slice: int | None = None,
                   step: int | None = None) -> str:
    """Render a task id (see [Note: task id grammar]). ``chunk`` is shown only where the scope
    has no layer (P2P, embed/head) or has no micro-batch (per-step per-layer tasks); ``slice``
    (a sequence slice) only with a micro-batch; ``step`` (N >= 1: the plan's step N) only in the
    per-step scope."""
    if step is not None and (step < 1 or mb is not None or layer is not None or chunk is not None):
        raise ValueError(f"task id: step must be >= 1 and only names a per-step task; got step={step} mb={mb} "
                         f"layer={layer} chunk={chunk}")
    if slice is not None and mb is None:
        raise ValueError(f"task id: a sequence slice needs a micro-batch; got slice={slice} without mb")
    mbs = f"mb{mb}" if slice is None else f"mb{mb}q{slice}"
    if mb is not None and layer is not None:
        scope = f"{mbs}/L{layer}"
    elif mb is not None and chunk is not None:
        scope = f"{mbs}/v{chunk}"
    elif layer is not None and chunk is not None:
        scope = f"v{chunk}/L{layer}"
    elif mb is None and layer is None and chunk is None:
        scope = "step" if step is None else f"step{step}"
    else:
        raise ValueError(f"task id needs (mb, layer), (mb, chunk), (chunk, layer) or none; got mb={mb} "
                         f"layer={layer} chunk={chunk}")
    suffix = "" if bucket is None else f".b{bucket}"
    return f"s{stage}/{scope}/{(kind if isinstance(kind, Kind) else Kind(kind)).value}{suffix}"


def id_bucket(tid: str) -> int | None:
    """The bucket N of a task id that ends in ``.bN``, else None: :func:`parse_task_id`'s bucket
    without parsing the rest ([Note: task id grammar]: a kind's phase is letters, so the last
    ``.b`` followed by digits only is the bucket suffix)."""
    _, dot, n = tid.rpartition(".b")
    return int(n) if dot and n.isdigit() else None


def parse_task_id(task_id: str) -> TaskKey:
    """Parse a task id; raises ValueError naming the id when it does not follow the grammar."""
    m = _ID_RE.match(task_id)
    if not m:
        raise ValueError(f"not a k3sched task id: {task_id!r} (expected e.g. 's0/mb3/L5/attn.fwd')")
    try:
        kind = Kind(m["kind"])
    except ValueError:
        raise ValueError(f"unknown task kind {m['kind']!r} in task id {task_id!r}") from None
    g = m.groupdict()
    as_int = lambda v: None if v is None else int(v)  # noqa: E731
    bucket = as_int(g["bucket"])
    if g["step"]:
        return TaskKey(int(g["stage"]), kind, bucket=bucket, step=as_int(g["stepn"]))
    if g["vlayer"] is not None:
        return TaskKey(int(g["stage"]), kind, layer=int(g["vlayer"]), chunk=int(g["vchunk"]), bucket=bucket)
    if g["mb"] is None:
        raise ValueError(f"task id {task_id!r} lacks its micro-batch ('mbN/')")
    return TaskKey(int(g["stage"]), kind, mb=as_int(g["mb"]), layer=as_int(g["layer"]), chunk=as_int(g["chunk"]),
                   bucket=bucket, slice=as_int(g["slice"]))


@dataclass
class Mem:
    """Bytes by memory space. Applied as +alloc at a task's start and -free at its end."""

    device: int = 0
    host: int = 0
    peer: int = 0

    def to_json(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "peer": self.peer}

    def __bool__(self) -> bool:
        return bool(self.device or self.host or self.peer)


@dataclass
class Task:
    """One task of one training step on one PP stage.

    ``chunk`` is the virtual chunk (model chunk) index local to the stage; ``vstage`` the global
    virtual stage index (chunk * pp + stage for interleaved placements, see the pipeline
    schedules). ``slice`` is the micro-batch's sequence slice (None: the whole sequence, the
    default; [Note: sequence slices]). ``deps`` are task ids (possibly on other stages: P2P).
    ``alloc``/``free`` give the memory effect (``release``: bytes freed on another stage);
    ``peer_stage`` names the rank holding remotely offloaded bytes; ``buffer`` names the
    activation buffer an offload/onload moves (validation joins on it).
    """

    id: str
    kind: Kind
    lane: str
    stage: int
    chunk: int
    mb: int | None
    layer: int | None
    duration_us: float = 0.0
    deps: list[str] = field(default_factory=list)
    alloc: Mem = field(default_factory=Mem)
    free: Mem = field(default_factory=Mem)
    bytes: int = 0  # bytes moved (communication / copies) or 0
    flops: float = 0.0
    peer_stage: int | None = None
    buffer: str | None = None
    release: tuple[int, int] | None = None
    """(stage, device bytes) this task frees on *another* stage when it ends: a P2P receive
    releases its send's buffer (the sender holds it until the transfer is done)."""
    # filled by the planner / simulator
    start_us: float | None = None
    end_us: float | None = None
    slice: int | None = None

    @property
    def is_wgrad(self) -> bool:
        return self.kind in WGRAD_KINDS

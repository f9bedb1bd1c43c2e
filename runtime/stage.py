"""One rank's stage of the MoE model and the handler table the executor interprets.

Shape legend: see :mod:`moe.context` (B batch, S sequence, D hidden, T = B*S tokens).

:class:`StageRunner` holds this rank's layers (its PP stage's chunks, its EP slice of experts),
the micro-batch states of the current step, the process groups and the optimizer, and maps every
task kind to a handler (:meth:`StageRunner.handlers`):

- model sub-ops (attn.fwd ... expert.dw, embed/head) -> ``moe.MoEModel.run`` (``shared.dx`` reads
  the upstream gradient itself, see [Note: shared.dx beside combine.bwd]);
- act.send / grad.send -> ``isend`` on the transfer's own directed group (``groups.p2p``,
  [Note: NCCL-safe P2P] in runtime/groups.py), waited at the end of the step (a send never
  blocks its lane, so a lane's later receive cannot deadlock behind it); act.recv / grad.recv ->
  ``irecv`` + wait inside the task (a receive posted in plan order waits for its send; gloo moves
  the bytes once both are posted, so the transfer time lands in the receive); under
  ``--p2p strict`` both go through :class:`P2PStream` ([Note: strict P2P]);
- grad.rs(.bN) -> all-reduce (sum) of bucket N of the layer's gradients: non-expert weights over
  the dense group (ep*dp replicas), expert weights over the expert group (dp replicas);
- act.offload / act.onload / act.roffload / act.rstore / act.rserve / act.ronload ->
  :class:`offload.ActivationManager` ([Note: activation storage policies]); every task is wrapped
  (:meth:`StageRunner._tracked`): in debug mode a backward task checks its layer's activations are
  resident, the last backward task of an onloaded set releases its device buffer to the pool, and
  the memory tracker samples device / host / peer bytes after each task ([Note: measured memory]);
- ``schedule.act_quant: fp8`` on sets the plan keeps (no plan tasks of their own, [Note: FP8 on
  the device] in ``offload/manager.py``): the layer's last forward task (combine.fwd / mlp.fwd)
  quantizes the set after it ran; each backward task first reads back what it needs (a dX task
  its sub-op's graph-saved tensors, router.bwd / dW tasks / dispatch.re all of its sub-op's);
- grad.rs / gshard.* / optim.run with ``schedule.grad_offload`` -> :class:`offload.GradShards`
  ([Note: sharded gradients]): the layers' dW tasks (and router.bwd) accumulate into the flush
  group's gradient, grad.rs reduce-scatters it into the chunk's device buffer, the host fp32
  shard is onloaded, added to and offloaded, and optim.run steps AdamW on the host shards and
  all-gathers the layers' parameters (optim / optim_expert groups, compute lane);
- optim.run -> reduce embed/head/final-norm gradients (optim group), AdamW step, zero grads.

[Note: shared.dx beside combine.bwd]
The planner lets shared.dx run beside combine.bwd (both wait only for the upstream gradient),
but ``moe``'s combine.bwd is what hands shared.dx its gradient. The shared-expert output enters
``y = h + shared + routed`` with weight 1, so its gradient *is* the upstream gradient: the runtime
keeps a reference to each upstream gradient when it is produced (head.dx, attn.dx, grad.recv) and
shared.dx uses it directly, so it needs nothing from the ep lane. The value is identical.
shared.dx writes its gradient of ``xn`` apart from dispatch.bwd's; router.bwd sums them
([Note: partial input gradients] in moe/context.py).
combine.fwd does need shared.fwd's output: :meth:`StageRunner.extra_deps` adds that edge (and the
other data edges of ``moe.INTRA_LAYER_DEPS``) where the plan leaves them implicit.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k3sched.config import Config
from k3sched.graph import placement_for, split_layers
from k3sched.tasks import LANES, Kind
from moe import handoff
from moe.split import GRAPH_USER
from moe import INTRA_LAYER_DEPS, LayerCtx, MicroBatch, MoEModel, MoEModelArgs, init_full_state

from offload import ActivationManager, MemoryTracker, PolicyTable
from offload.gradshard import GradShards

from .executor import Handler, PlanTask
from .groups import Groups, _wait_bounded

BACKWARD_KINDS = frozenset(k for k in Kind if k.phase in ("dx", "dw", "bwd", "re"))
LAST_FORWARD = frozenset({Kind.COMBINE_FWD, Kind.MLP_FWD})
"""The last forward task of a layer: its saved set is complete ([Note: FP8 on the device])."""
GRAD_WRITERS = frozenset({Kind.ATTN_DW, Kind.SHARED_DW, Kind.EXPERT_DW, Kind.MLP_DW, Kind.ROUTER_BWD})


def model_args(cfg: Config) -> MoEModelArgs:
    """The ``moe`` model arguments of a config (dispatch recompute and element-wise recompute
    follow the schedule)."""
    m = cfg.model
    return MoEModelArgs.from_mapping({**m.model_dump(), "dense_hidden": m.ffn_dense_hidden,
                                      "dispatch_recompute": cfg.schedule.dispatch_recompute,
                                      "recompute": cfg.schedule.recompute})


@dataclass(frozen=True)
class StageSpec:
    """Which chunks (virtual stages) and layers a PP stage holds."""

    stage: int
    num_vstages: int
    chunk_vstage: dict[int, int]  # local chunk -> vstage
    vstage_rank: tuple[int, ...]  # vstage -> PP stage
    vstage_layers: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, cfg: Config, stage: int) -> StageSpec:
        pl = placement_for(cfg)
        nv = pl.num_stages
        located = [pl.locate(v) for v in range(nv)]
        layers = split_layers(cfg)  # the planner's split (a vstage may hold no layer, e.g. head only)
        return cls(stage, nv, {c: v for v, (r, c) in enumerate(located) if r == stage},
                   tuple(r for r, _ in located), tuple(tuple(ls) for ls in layers))

    def input_index(self, v: int) -> int:
        """Index in ``MicroBatch.acts`` / ``grads`` of vstage ``v``'s input (its layers' count before it)."""
        return sum(len(ls) for ls in self.vstage_layers[:v])

    @property
    def layers(self) -> list[int]:
        return sorted(L for v in self.chunk_vstage.values() for L in self.vstage_layers[v])

    @property
    def has_embed(self) -> bool:
        return 0 in self.chunk_vstage.values()

    @property
    def has_head(self) -> bool:
        return self.num_vstages - 1 in self.chunk_vstage.values()

    def p2p_peer(self, t: PlanTask) -> tuple[int, list]:
        """(peer PP stage, pairing key) of a P2P task: the key names the transfer the same way on
        both sides: (direction, mb, from-vstage, to-vstage)."""
        v = self.chunk_vstage[t.chunk]
        if t.kind is Kind.FWD_SEND:
            src, dst, d = v, v + 1, "act"
        elif t.kind is Kind.FWD_RECV:
            src, dst, d = v - 1, v, "act"
        elif t.kind is Kind.BWD_SEND:
            src, dst, d = v, v - 1, "grad"
        else:
            src, dst, d = v + 1, v, "grad"
        peer = self.vstage_rank[dst] if t.kind in (Kind.FWD_SEND, Kind.BWD_SEND) else self.vstage_rank[src]
        return peer, [d, t.mb, src, dst]


def build_stage_model(args: MoEModelArgs, seed: int, spec: StageSpec, *, ep_rank: int, ep_size: int,
                      device: torch.device, slots: tuple[tuple[int, ...], ...] | None = None) -> MoEModel:
    """MoEModel holding only this stage's layers (others are empty placeholders), embedding and
    head only where the stage has them, and this EP rank's slice of experts. Weights come from
    ``init_full_state(args, seed)``: identical to the single-process model of the same seed."""
    with torch.device("meta"):
        model = MoEModel(args, ep_rank=ep_rank, ep_size=ep_size, slots=slots)
    keep = set(spec.layers)
    for i in range(args.layers):
        if i not in keep:
            model.layers[i] = nn.Module()
    if not spec.has_embed:
        del model.embed
    if not spec.has_head:
        del model.final_norm
        del model.head
    model.to_empty(device=device)
    state = init_full_state(args, seed)
    wanted = model.state_dict().keys()
    model.load_state_dict({k: model.shard_of(k, state[k]).to(device) for k in wanted}, strict=True)
    return model


def synthetic_batch(seed: int, step: int, replica: int, mb: int, batch: int, seq: int, vocab: int
                    ) -> tuple[Tensor, Tensor]:
    """Tokens and next-token targets ``[B, S]`` of one micro-batch of one data replica.

    A noisy affine walk over the vocabulary (learnable, so the loss falls), seeded by
    (seed, step, replica, mb): every rank of a replica builds the same tokens."""
    h = hashlib.sha256(f"k3sched/{seed}/{step}/{replica}/{mb}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**62 - 1))
    x = torch.empty(batch, seq + 1, dtype=torch.int64)
    x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    noise = torch.randint(0, 2, (batch, seq), generator=g)
    for i in range(seq):
        x[:, i + 1] = (x[:, i] * 5 + 3 + noise[:, i]) % vocab
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


class PendingSends:
    """P2P sends in flight: (work, buffer) of each ``isend``, so the buffer lives until the
    transfer is done. A reaper thread waits on them in order and drops each once its transfer
    completed (gloo marks a send complete only in ``wait``), so a buffer is freed when its transfer
    is done, as the plan assumes (a send holds its buffer until the matching receive ends:
    ``release`` in plan.json). :meth:`buffers` are what is held; the memory tracker counts them
    ([Note: measured memory]). :meth:`wait_all` (end of step) waits for the rest and re-raises a
    failed send."""

    def __init__(self) -> None:
        self._items: dict[int, tuple] = {}
        self._next = 0
        self._cv = threading.Condition()
        self._queue: list[int] = []
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def add(self, work, buf: Tensor) -> None:
        with self._cv:
            key, self._next = self._next, self._next + 1
            self._items[key] = (work, buf)
            self._queue.append(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._reap, name="k3sched-sends", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _reap(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                key = self._queue.pop(0)
                work = self._items[key][0]
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - re-raised by wait_all
                with self._cv:
                    self._error = self._error or e
            with self._cv:
                self._items.pop(key, None)
                self._cv.notify_all()

    def buffers(self) -> list[Tensor]:
        with self._cv:
            return [b for _, b in self._items.values()]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def wait_all(self, timeout_s: float | None = None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._items and self._error is None:
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"{len(self._items)} P2P send(s) not complete after {timeout_s:.0f} s "
                                       "(the receiving rank stopped?)")
                self._cv.wait(0.05)
            err, self._error = self._error, None
        if err is not None:
            raise err


P2P_MODES = ("buffered", "strict")


class P2PStream:
    """[Note: strict P2P]
    ``--p2p strict`` makes gloo behave like NCCL, so that a CPU run fails where a GPU run would
    hang. Each P2P communicator of this rank gets a stream: a thread that completes its
    operations one at a time in issue order (NCCL runs a communicator's operations in order on one
    stream). A receive, once first on its stream, posts its ``irecv`` and then sends a ready token
    to the sender on the group's ``ready`` twin (``groups.ready``); a send, once first on its
    stream, waits for that token before its ``isend``: a send completes only after the peer's
    matching receive is posted, and holds up every later operation of its communicator meanwhile.
    Tags are 0, so gloo pairs messages by order as NCCL does; the token carries the transfer's
    tag, and a token for another transfer fails the send naming both (the order NCCL would have
    silently mismatched). Every wait is bounded by the run's timeout (a TimeoutError naming the
    communicator and the transfer: where NCCL would hang). The lane waits for its receives, the
    end of the step for the sends (:class:`PendingSends`), as in the default mode."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"k3sched-p2p {name}", daemon=True)
        self._thread.start()

    def submit(self, what: str, fn) -> "_StreamOp":
        op = _StreamOp(f"{what} on communicator {self.name}", self.timeout_s)
        self._q.put((fn, op))
        return op

    def _run(self) -> None:
        while True:
            fn, op = self._q.get()
            if self._failed is not None:  # a communicator that failed stays failed (NCCL aborts it)
                op.error = RuntimeError(f"{op.what}: an earlier operation of the communicator failed: {self._failed}")
            else:
                try:
                    fn(time.monotonic() + self.timeout_s)
                except BaseException as e:  # noqa: BLE001 - re-raised by whoever waits on the op
                    op.error = self._failed = e
            op.done.set()


class _StreamOp:
    """One operation of a :class:`P2PStream`: ``wait`` (bounded) returns once it completed and
    re-raises its error (a stand-in for a torch Work in :class:`PendingSends`)."""

    def __init__(self, what: str, timeout_s: float) -> None:
        self.what, self.timeout_s = what, timeout_s
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout_s: float | None = None) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        if not self.done.wait(t):
            raise TimeoutError(f"{self.what}: not complete after {t:.0f} s (a send waits for its receive to be "
                               "posted, behind every earlier operation of its communicator; NCCL would hang here)")
        if self.error is not None:
            raise self.error


def strict_send(buf: Tensor, dst: int, group, ready, tag: int, deadline: float, what: str) -> None:
    """A send of [Note: strict P2P] (run by the communicator's :class:`P2PStream`): wait for the
    receiver's ready token on ``ready``, check it names this transfer (``tag``), send with tag 0."""
    tok = torch.zeros(1, dtype=torch.int64)
    _wait_bounded(dist.irecv(tok, src=dst, group=ready), deadline, f"{what}: waiting for the receiver's ready token")
    if int(tok.item()) != tag:
        raise RuntimeError(f"{what}: the receiver's next receive is another transfer (ready token {int(tok.item())}, "
                           f"this send {tag}): NCCL pairs by order and would deliver the wrong tensor")
    _wait_bounded(dist.isend(buf, dst=dst, group=group, tag=0), deadline, f"{what}: send")


def strict_recv(buf: Tensor, src: int, group, ready, tag: int, deadline: float, what: str) -> None:
    """A receive of [Note: strict P2P]: post it (tag 0), then send the ready token (``tag``)."""
    work = dist.irecv(buf, src=src, group=group, tag=0)
    tok = dist.isend(torch.tensor([tag], dtype=torch.int64), dst=src, group=ready)
    _wait_bounded(work, deadline, f"{what}: receive")
    _wait_bounded(tok, deadline, f"{what}: ready token")


class StageRunner:
    """This rank's stage: model, micro-batch states, groups, optimizer and task handlers."""

    data = None
    """``runtime.data.TokenData``: micro-batches from a token file (None: synthetic tokens)."""
    step = 0
    """The global index of the step in progress (:meth:`begin_step`)."""
    fail_step: int | None = None
    """With ``fail_task``: fail only in this global step (None: the first)."""
    fail_kill = False
    """With ``fail_task``: SIGKILL this process instead of raising (a rank that dies without a word)."""
    fail_hang = False
    """With ``fail_task``: hang in the task instead of raising: a receive on the world group that no
    rank sends (a rank stuck in a collective whose peer never comes; the executor names it after
    ``--timeout``)."""

    def __init__(self, cfg: Config, spec: StageSpec, groups: Groups, *, seed: int = 0, lr: float = 1e-3,
                 weight_decay: float = 0.01, device: torch.device | None = None, fail_task: str | None = None,
                 remote_group=None, offload_debug: bool = False, copy_delay_s: float = 0.0,
                 p2p: str = "buffered", p2p_timeout_s: float = 120.0, compute_stream=None,
                 unsafe_shared_dx: bool = False) -> None:
        self.cfg, self.spec, self.groups = cfg, spec, groups
        self.args = model_args(cfg)
        self.device = device or torch.device("cpu")
        lo = groups.layout
        self.seed = seed
        from k3sched.balance import placement_for as expert_placement

        self.placement = expert_placement(cfg)  # [Note: expert placement] in k3sched/balance.py
        self._replicated = self.placement.replicated()
        self.model = build_stage_model(self.args, seed, spec, ep_rank=lo.ep_idx, ep_size=lo.ep, device=self.device,
                                       slots=self.placement.slots)
        self.params = [p for p in self.model.parameters()]
        self.acts = ActivationManager(self.device, table=PolicyTable.from_config(cfg), debug=offload_debug,
                                      copy_delay_s=copy_delay_s, remote_group=remote_group,
                                      compute_stream=compute_stream)
        self.unsafe_shared_dx = unsafe_shared_dx  # [Note: runtime options]: K3SCHED_UNSAFE_SHARED_DX
        self.gshards: GradShards | None = None
        opt_params = self.params
        if cfg.schedule.grad_offload:
            chunk_of = {L: c for c, v in spec.chunk_vstage.items() for L in spec.vstage_layers[v]}
            self.gshards = GradShards({L: self.model.layers[L] for L in spec.layers}, chunk_of,
                                      is_expert=MoEModel.is_expert_param, device=self.device,
                                      device_pool=self.acts.device_pool, rs_groups=(groups.dense, groups.expert),
                                      ag_groups=(groups.optim, groups.optim_expert), lr=lr,
                                      weight_decay=weight_decay, copy_delay_s=self.acts.copy_delay_s)
            opt_params = [p for n, p in self.model.named_parameters() if not n.startswith("layers.")]
        # with grad_offload the layers' parameters are stepped by GradShards on host shards
        self.optimizer = torch.optim.AdamW(opt_params, lr=lr, weight_decay=weight_decay) if opt_params else None
        self._bwd_left: dict[tuple[int, int], int] = {}  # (mb, layer) -> backward tasks left this step
        self._bwd_count: dict[tuple[int, int], int] = {}
        self._offloaded: set[tuple[int, int]] = set()  # (mb, layer) sets the plan offloads
        self._quantized: set[tuple[int, int]] = set()  # (mb, layer) sets kept on the device as FP8
        self._mem_lock = threading.Lock()
        self.sends = PendingSends()
        self.memory = MemoryTracker(self._static_tensors, self._saved_tensors, self.acts, self.device,
                                    extra_host=lambda: self.gshards.host_bytes() if self.gshards else 0,
                                    in_flight=self.sends.buffers)
        self.replicas = lo.ep * lo.dp
        self.mbs: dict[int, MicroBatch] = {}
        self._up: dict[tuple[int, int], Tensor] = {}  # (mb, layer index of grads) -> upstream grad
        if p2p not in P2P_MODES:
            raise ValueError(f"p2p: one of {', '.join(P2P_MODES)}; got {p2p!r}")
        self.p2p_timeout_s = p2p_timeout_s
        self.streams: dict[tuple[str, int, int], P2PStream] | None = None  # [Note: strict P2P]
        if p2p == "strict":
            missing = sorted(set(groups.p2p) - set(groups.ready))
            if missing:
                raise ValueError(f"--p2p strict: no ready-token group for {missing[0]} (build_p2p_groups(ready=True))")
            self.streams = {k: P2PStream(f"{k[0]} {k[1]}->{k[2]}", p2p_timeout_s) for k in groups.p2p}
        self.fail_task = fail_task
        self._rs_buckets: dict[tuple[int, int], int] = {}
        m = cfg.model
        self.act_shape = (m.micro_batch_size, m.seq_len, m.hidden)
        self._shared_layers = {L for L in spec.layers if self.args.is_moe_layer(L) and self.args.shared_experts}
        self.capture_grads = False
        self.captured: dict[str, Tensor] | None = None

    # -- plan-dependent set-up -------------------------------------------------------------------
    def bind_plan(self, lanes: Mapping[str, list[PlanTask]]) -> None:
        """Read what the handlers need from the plan: the bucket count of each layer's grad.rs."""
        for t in lanes["collective"]:
            if t.kind is Kind.GRAD_RS:
                key = (t.chunk, t.layer)
                self._rs_buckets[key] = max(self._rs_buckets.get(key, 0), (t.bucket or 0) + 1)
        for ts in lanes.values():
            for t in ts:
                if t.mb is not None and t.layer is not None and t.kind in BACKWARD_KINDS:
                    k = (t.mb, t.layer)
                    self._bwd_count[k] = self._bwd_count.get(k, 0) + 1
                if t.kind in (Kind.ACT_OFFLOAD, Kind.ACT_ROFFLOAD):
                    self._offloaded.add((t.mb, t.layer))
        if self.cfg.schedule.act_quant == "fp8":  # [Note: FP8 on the device]: the sets the plan keeps
            self._quantized = {(t.mb, t.layer) for ts in lanes.values() for t in ts
                               if t.kind in LAST_FORWARD and (t.mb, t.layer) not in self._offloaded}
        if self.gshards is not None:
            self.gshards.bind(lanes)

    @staticmethod
    def extra_deps(lanes: Mapping[str, list[PlanTask]]) -> dict[str, tuple[str, ...]]:
        """Same-(mb, layer) data dependencies of ``moe.INTRA_LAYER_DEPS`` the plan leaves implicit
        (except shared.dx <- combine.bwd, see [Note: shared.dx beside combine.bwd])."""
        ids = {t.id for ts in lanes.values() for t in ts}
        out: dict[str, tuple[str, ...]] = {}
        for ts in lanes.values():
            for t in ts:
                if t.mb is None or t.layer is None:
                    continue
                prefix = t.id.rsplit("/", 1)[0]
                extra = []
                for k in INTRA_LAYER_DEPS.get(t.kind, ()):
                    if t.kind is Kind.SHARED_DX and k is Kind.COMBINE_BWD:
                        continue
                    d = f"{prefix}/{k.value}"
                    if d in ids and d not in t.deps:
                        extra.append(d)
                if extra:
                    out[t.id] = tuple(extra)
        return out

    # -- steps -----------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Fresh micro-batch states with this replica's tokens for global step ``step`` (synthetic, or
        from :attr:`data` at its position)."""
        cfg, lo = self.cfg, self.groups.layout
        self.step = step
        M = cfg.parallel.microbatches
        self.mbs.clear()
        self._up.clear()
        self._bwd_left = dict(self._bwd_count)
        self.memory.begin_step()
        for m in range(M):
            if self.data is not None:
                tokens, targets = self.data.batch(m)
            else:
                tokens, targets = synthetic_batch(self.seed, step, lo.replica, m, cfg.model.micro_batch_size,
                                                  cfg.model.seq_len, cfg.model.vocab)
            mb = self.model.new_microbatch(tokens.to(self.device), targets.to(self.device), index=m,
                                           loss_scale=1.0 / (M * self.replicas))
            mb.layers = [LayerCtx(i, self.args.is_moe_layer(i), label=f"mb{m}/L{i}") for i in range(self.args.layers)]
            self.mbs[m] = mb

    def end_step(self) -> float:
        """Wait for outstanding sends; return this rank's loss contribution (sum over its
        micro-batches of cross-entropy if it holds the head, plus aux-loss terms of its layers)."""
        self.sends.wait_all(self.p2p_timeout_s)
        self.acts.end_step()
        if self.gshards is not None:
            self.gshards.end_step()
        coef = self.args.aux_loss_coef
        total = 0.0
        for mb in self.mbs.values():
            if mb.ce is not None:
                total += float(mb.ce)
            for L in self.spec.layers:
                aux = mb.layers[L].aux
                if aux is not None:
                    total += coef * float(aux)
        self.mbs.clear()
        self._up.clear()
        return total

    # -- handlers --------------------------------------------------------------------------------
    def handlers(self) -> dict[Kind, Handler]:
        table: dict[Kind, Handler] = {}
        for k in Kind:
            if k.op in {"attn", "router", "dispatch", "shared", "expert", "combine", "mlp", "embed", "head"}:
                table[k] = self._model_task
        table[Kind.SHARED_DX] = self._shared_dx
        table[Kind.FWD_SEND] = self._send
        table[Kind.BWD_SEND] = self._send
        table[Kind.FWD_RECV] = self._recv
        table[Kind.BWD_RECV] = self._recv
        table[Kind.GRAD_RS] = self._grad_rs
        table[Kind.ACT_OFFLOAD] = self._offload
        table[Kind.ACT_ONLOAD] = self._onload
        table[Kind.ACT_ROFFLOAD] = self._roffload
        table[Kind.ACT_RSTORE] = self._rstore
        table[Kind.ACT_RSERVE] = self._rserve
        table[Kind.ACT_RONLOAD] = self._ronload
        table[Kind.OPTIM] = self._optim
        if self.gshards is not None:
            table.update(self.gshards.handlers())
        table = {k: self._tracked(h) for k, h in table.items()}
        if self.fail_task is not None:
            table = {k: self._maybe_fail(h) for k, h in table.items()}
        return table

    def _maybe_fail(self, h: Handler) -> Handler:
        def run(task: PlanTask) -> None:
            if self.fail_task in ("*", task.id, task.kind.value) and self.fail_step in (None, self.step):
                self.fail_task = None
                if self.fail_kill:
                    import os
                    import signal

                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fail_hang:
                    self._hang()
                raise RuntimeError(f"injected failure (K3SCHED_FAIL_RANK={self.groups.layout.rank})")
            h(task)
        return run

    def _hang(self) -> None:
        lo = self.groups.layout
        if dist.is_initialized() and dist.get_world_size() > 1:
            peer = (lo.rank + 1) % dist.get_world_size()
            dist.recv(torch.zeros(1, device=self.device), src=peer, tag=0x4B3)  # never sent
        while True:  # one rank: nothing to wait on; block like one
            time.sleep(1.0)

    def _tracked(self, h: Handler) -> Handler:
        """Run ``h`` with the activation bookkeeping around it (see the module docstring)."""
        def run(t: PlanTask) -> None:
            key = (t.mb, t.layer)
            bwd = t.kind in BACKWARD_KINDS and t.mb is not None and t.layer is not None
            quantized = key in self._quantized
            names = None
            if bwd and quantized:  # an FP8 set: what this task reads back in full precision
                lc = self.mbs[t.mb].layers[t.layer]
                names = self._reads(t, lc)
                self.acts.dequantize_resident(self._buffer(t), lc, t.id, t.kind.op, names)
            if bwd and self.acts.debug and (key in self._offloaded or quantized) \
                    and not self.acts.resident_for(self._buffer(t), t.kind.op, names):
                raise RuntimeError(f"reads layer {t.layer} of micro-batch {t.mb} before its onload finished")
            h(t)
            if quantized and t.kind in LAST_FORWARD:
                self.acts.quantize_resident(self._buffer(t), self.mbs[t.mb].layers[t.layer], t.id)
            if bwd and (key in self._offloaded or quantized):
                with self._mem_lock:
                    self._bwd_left[key] -= 1
                    last = self._bwd_left[key] == 0
                if last:
                    self.acts.release(self._buffer(t), self.mbs[t.mb].layers[t.layer], self._lane_fence())
            with self._mem_lock:
                self.memory.sample()
        return run

    @staticmethod
    def _reads(t: PlanTask, lc: LayerCtx) -> set[str] | None:
        """Saved names a backward task reads: a dX-only task (dx; combine.bwd, dispatch.bwd) its
        sub-op's graph-saved tensors; router.bwd (dX and dW), dW tasks and dispatch.re every
        tensor of their sub-op (None)."""
        if t.kind.phase in ("dw", "re") or t.kind is Kind.ROUTER_BWD:
            return None
        c = lc.sub_ops().get(t.kind.op)
        return c.store.names_of(GRAPH_USER) if c is not None else set()

    def _buffer(self, t: PlanTask) -> str:
        return f"s{self.spec.stage}/mb{t.mb}/L{t.layer}/act"

    def _lane_fence(self):
        """GPU: events on every lane stream that may still read a released buffer."""
        if self.device.type != "cuda":
            return None
        evs = []
        for s in self._streams():
            ev = torch.cuda.Event()
            ev.record(s)
            evs.append(ev)
        return evs

    def _streams(self) -> list:
        return self.lane_streams or [torch.cuda.current_stream(self.device)]

    lane_streams: list = []

    def bind_streams(self, streams: Mapping[str, object]) -> None:
        """The executor's lane streams (GPU; empty on CPU): fences of released buffers cover them
        all, and the device pool allocates on the compute stream ([Note: pools and fences])."""
        self.lane_streams = list(streams.values())
        self.acts.bind_compute_stream(streams.get("compute"))

    def _static_tensors(self) -> list[Tensor]:
        out = list(self.params)
        out += [p.grad for p in self.params if p.grad is not None]
        for st in (self.optimizer.state.values() if self.optimizer is not None else ()):
            out += [v for v in st.values() if isinstance(v, Tensor) and v.dim() > 0]
        if self.gshards is not None:
            out += self.gshards.device_tensors()
        return out

    def _saved_tensors(self) -> list[Tensor]:
        out: list[Tensor] = []
        for mb in list(self.mbs.values()):
            for L in self.spec.layers:
                out += list(mb.layers[L].saved_tensors().values())
            for c in (mb.embed, mb.head):
                if c is not None:
                    out += list(c.saved_tensors().values())
        return out

    def _model_task(self, t: PlanTask) -> None:
        mb = self.mbs[t.mb]
        if t.kind is Kind.ROUTER_BWD:  # after shared.dx and dispatch.bwd: [Note: partial input gradients]
            mb.layers[t.layer].fold_grad_xn_shared()
        if self.gshards is not None and t.kind in GRAD_WRITERS:
            with self.gshards.accumulating(t.mb, t.layer):
                self.model.run(t.kind, mb, t.layer, self.groups.ep)
        else:
            self.model.run(t.kind, mb, t.layer, self.groups.ep)
        if t.kind is Kind.HEAD_DX:
            self._keep_up(t.mb, self.args.layers, mb.grads[self.args.layers])
        elif t.kind is Kind.ATTN_DX:
            self._keep_up(t.mb, t.layer, mb.grads[t.layer])

    def _keep_up(self, mb: int, idx: int, g: Tensor) -> None:
        """Keep the gradient of layer ``idx``'s input for shared.dx of layer ``idx - 1`` (if here)."""
        below = idx - 1
        if below in self._shared_layers:
            self._up[(mb, idx)] = g
            handoff.cell(self._up, (mb, idx), True, f"mb{mb}.grads[{idx}] (kept for shared.dx)")

    def _shared_dx(self, t: PlanTask) -> None:
        lc = self.mbs[t.mb].layers[t.layer]
        if lc.shared is None:
            return
        key = (t.mb, t.layer + 1)
        handoff.cell(self._up, key, False, f"mb{t.mb}.grads[{t.layer + 1}] (kept for shared.dx)", key in self._up)
        grad_y = self._up.pop(key)
        handoff.cell(self._up, key, True, f"mb{t.mb}.grads[{t.layer + 1}] (kept for shared.dx)")
        handoff.handoff(grad_y)  # made on the compute or collective lane: [Note: cross-lane handoff]
        handoff.read(grad_y, f"mb{t.mb}.grads[{t.layer + 1}]")
        g = lc.shared.backward_dx({"out": grad_y.reshape(-1, grad_y.shape[-1])})["xn"]
        if self.unsafe_shared_dx:
            lc.add_grad_xn(g)
        else:
            lc.grad_xn_shared_TD = g

    def _boundaries(self, t: PlanTask) -> tuple[int, int]:
        """(input index, output index) in acts/grads of the task's chunk."""
        v = self.spec.chunk_vstage[t.chunk]
        return self.spec.input_index(v), self.spec.input_index(v + 1)

    def _tag(self, key: list) -> int:
        d, mb, src, dst = key
        return ((mb * self.spec.num_vstages + dst) * 2 + (d == "grad")) * self.spec.num_vstages + src

    def _p2p_group(self, key: tuple[str, int, int]):
        g = self.groups.p2p.get(key)
        if g is None:
            raise RuntimeError(f"no P2P group for {key[0]} {key[1]}->{key[2]} (runtime.groups.build_p2p_groups)")
        return g

    def _send(self, t: PlanTask) -> None:
        peer, key = self.spec.p2p_peer(t)
        mb = self.mbs[t.mb]
        first, out = self._boundaries(t)
        idx = out if t.kind is Kind.FWD_SEND else first
        buf = mb.acts[idx] if t.kind is Kind.FWD_SEND else mb.grads[idx]
        if buf is None:
            raise RuntimeError(f"nothing to send: {'acts' if t.kind is Kind.FWD_SEND else 'grads'}[{idx}] is empty")
        buf = buf.contiguous()
        ck = (key[0], self.spec.stage, peer)
        group, dst, tag = self._p2p_group(ck), self.groups.pp_rank(peer), self._tag(key)
        if self.streams is None:
            work = dist.isend(buf, dst=dst, group=group, tag=tag)
        else:  # [Note: strict P2P]
            ready = self.groups.ready[ck]
            work = self.streams[ck].submit(t.id, lambda deadline: strict_send(buf, dst, group, ready, tag, deadline,
                                                                              f"{t.id} (to stage {peer})"))
        self.sends.add(work, buf)
        if t.kind is Kind.FWD_SEND:
            mb.acts[idx] = None
        else:
            mb.grads[idx] = None

    def _recv(self, t: PlanTask) -> None:
        peer, key = self.spec.p2p_peer(t)
        mb = self.mbs[t.mb]
        first, out = self._boundaries(t)
        buf = torch.empty(self.act_shape, dtype=self.args.torch_dtype, device=self.device)
        ck = (key[0], peer, self.spec.stage)
        group, src, tag = self._p2p_group(ck), self.groups.pp_rank(peer), self._tag(key)
        if self.streams is None:
            dist.irecv(buf, src=src, group=group, tag=tag).wait()
        else:  # [Note: strict P2P]
            ready = self.groups.ready[ck]
            self.streams[ck].submit(t.id, lambda deadline: strict_recv(buf, src, group, ready, tag, deadline,
                                                                       f"{t.id} (from stage {peer})")).wait()
        if t.kind is Kind.FWD_RECV:
            mb.acts[first] = buf
        else:
            mb.grads[out] = buf
            self._keep_up(t.mb, out, buf)

    def _layer_buckets(self, t: PlanTask) -> list[list[tuple[str, nn.Parameter]]]:
        block = self.model.layers[t.layer]
        named = sorted(block.named_parameters(), key=lambda kv: kv[0])
        nb = self._rs_buckets.get((t.chunk, t.layer), 1)
        size = -(-len(named) // nb)
        return [named[i * size:(i + 1) * size] for i in range(nb)]

    def _grad_rs(self, t: PlanTask) -> None:
        bucket = self._layer_buckets(t)[t.bucket or 0]
        dense = [p for n, p in bucket if not MoEModel.is_expert_param(n)]
        expert = [p for n, p in bucket if MoEModel.is_expert_param(n)]
        _allreduce_grads(dense, self.groups.dense)
        _allreduce_grads(expert, self.groups.expert)
        if self._replicated and expert:
            self._sum_replicas(expert, self.model.layers[t.layer].local_experts)
        for n, p in bucket:
            handoff.write(p.grad, f"L{t.layer}.{n}.grad")

    def _sum_replicas(self, params: list[nn.Parameter], local_experts: tuple[int, ...]) -> None:
        """[Note: expert placement] (k3sched/balance.py) Sum the gradients of every replicated expert's replicas (after
        the DP reduction, so each replica holds its dp-summed slice) over the stage's EP x DP ranks
        and give each replica the sum: one gradient per expert, as without replicas. Only the dp-0
        replica contributes, so the DP sum is not counted twice; identical gradients and identical
        initial weights keep the replicas identical under AdamW."""
        rep = {e: i for i, e in enumerate(self._replicated)}
        mine = [(s, rep[e]) for s, e in enumerate(local_experts) if e in rep]
        contribute = self.groups.layout.dp_idx == 0
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buf = p.grad.new_zeros((len(rep),) + tuple(p.shape[1:]))
            if contribute:
                for s_, i in mine:
                    buf[i] += p.grad[s_]
            if self.groups.dense is not None:
                dist.all_reduce(buf, group=self.groups.dense)
            for s_, i in mine:
                p.grad[s_].copy_(buf[i])

    def routing_counts(self) -> dict[int, tuple[list[int], list[int]]]:
        """This rank's routed slots since the last call, per MoE layer of the stage: (per expert,
        per global slot); the counters restart."""
        out = {}
        for L in self.spec.layers:
            block = self.model.layers[L]
            if getattr(block, "is_moe", False):
                out[L] = (block.routed_E.tolist(), block.routed_G.tolist())
                block.reset_routing_counts()
        return out

    def _offload(self, t: PlanTask) -> None:
        self.acts.offload_local(self._buffer(t), self.mbs[t.mb].layers[t.layer], t.id)

    def _onload(self, t: PlanTask) -> None:
        self.acts.onload_local(self._buffer(t), self.mbs[t.mb].layers[t.layer], t.id)

    def _roffload(self, t: PlanTask) -> None:
        self.acts.offload_remote(self._buffer(t), self.mbs[t.mb].layers[t.layer], self.groups.pp_rank(t.peer_stage),
                                 t.mb, t.layer, t.id)

    def _ronload(self, t: PlanTask) -> None:
        self.acts.onload_remote(self._buffer(t), self.mbs[t.mb].layers[t.layer], self.groups.pp_rank(t.peer_stage),
                                t.mb, t.layer, t.id)

    def _rstore(self, t: PlanTask) -> None:
        self.acts.store_remote(t.buffer, self.groups.pp_rank(t.peer_stage), t.mb, t.layer, t.id)

    def _rserve(self, t: PlanTask) -> None:
        self.acts.serve_remote(t.buffer, self.groups.pp_rank(t.peer_stage), t.mb, t.layer, t.id)

    def _optim(self, t: PlanTask) -> None:
        rest = [p for n, p in self.model.named_parameters() if not n.startswith("layers.")]
        _allreduce_grads(rest, self.groups.optim)
        stepped = rest if self.gshards is not None else self.params
        for p in stepped:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            handoff.write(p.grad, "param grad (optim.run)")
        if self.capture_grads:
            self.captured, self.capture_grads = self.grads(), False
            if self.gshards is not None:  # the layers' gradients live in the host shards
                self.captured.update({f"layers.{L}.{n}": g for (L, n), g in self.gshards.full_grads().items()})
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.gshards is not None:
            self.gshards.step()

    def grads(self) -> dict[str, Tensor]:
        """Current gradients by full parameter name (this rank's slices)."""
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def _allreduce_grads(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat buffer (no-op without a group)."""
    if group is None or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    off = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[off:off + n].view_as(p.grad))
        off += n


__all__ = ["LANES", "StageRunner", "StageSpec", "build_stage_model", "model_args", "synthetic_batch"]


REMOTE_KINDS = (Kind.ACT_ROFFLOAD, Kind.ACT_RSTORE, Kind.ACT_RSERVE, Kind.ACT_RONLOAD)


def build_remote_group(groups: Groups, plan: Mapping, timeout=None):
    """The offload_remote lane's own communicator: the ranks of this rank's (dp, ep) column across
    PP stages (the pp group's members, a separate process group), created on every rank when the
    plan has remote offload tasks (every rank plans the same, so all create it or none does).
    ``timeout`` (a timedelta: the run's ``--timeout``) bounds its operations like every other group's."""
    kinds = {t["kind"] for st in plan["stages"] for t in st["lanes"].get("offload_remote", [])}
    lo = groups.layout
    if not kinds or lo.pp < 2:
        return None
    mine = None
    for d in range(lo.dp):
        for e in range(lo.ep):
            pg = dist.new_group([lo.rank_of(s, d, e) for s in range(lo.pp)], timeout=timeout)
            if (d, e) == (lo.dp_idx, lo.ep_idx):
                mine = pg
    return mine


def remote_order(lanes: Mapping[str, list[PlanTask]], stage: int) -> dict[str, dict[int, list]]:
    """Transfers of the offload_remote lane by peer stage, in lane order: ``send`` (roffload,
    rserve) and ``recv`` (rstore, ronload) keys ``(direction, mb, layer)``."""
    out: dict[str, dict[int, list]] = {"send": {}, "recv": {}}
    for t in lanes.get("offload_remote", []):
        d = "out" if t.kind in (Kind.ACT_ROFFLOAD, Kind.ACT_RSTORE) else "back"
        side = "send" if t.kind in (Kind.ACT_ROFFLOAD, Kind.ACT_RSERVE) else "recv"
        out[side].setdefault(t.peer_stage, []).append([d, t.mb, t.layer])
    return out


def verify_remote_orders(groups: Groups, lanes: Mapping[str, list[PlanTask]], stage: int) -> None:
    """Start-up check: the remote sends of stage a to stage b are, in order, b's receives from a
    (else the offload_remote lanes would deadlock)."""
    from .groups import verify_pairing

    verify_pairing(groups, "offload_remote", remote_order(lanes, stage), stage)

"""Measured activation bytes: what the ``moe`` code really saves, per task kind, in the form the
planner's cost model reads (``saved_bytes`` of a profile YAML, see :mod:`k3sched.cost`).

[Note: measured saved bytes]
One micro-batch of the config's model runs in this process (EP size 1, so every routed slot is
local: a rank of an EP group receives ``T * top_k`` slots on average, the same count). After the
layer's forward, and after each op's input-gradient task, the op's saved store is measured
(each storage counted once). The planner frees a forward kind's ``(w, x)`` bytes at fixed tasks
([Note: layer task graph]: x at the op's dX task, w at its dW task; shared / expert keep nothing
past dX in the graph, their dW inputs are counted with the dX task's saved grad_output, which the
dW task frees), so the measured bytes are folded onto those free points:

  attn.fwd  (w, x) = (kept after attn.dx, rest)      attn.dx  = grad_outputs kept for attn.dw
  router.fwd (0, all)                                (router.bwd applies its dW itself)
  shared.fwd (0, all)                                shared.dx = grad_outputs + inputs kept for dW
  expert.fwd (0, all)                                expert.dx = grad_outputs + inputs kept for dW
  dispatch.fwd (all, 0)   (freed with expert.dw; with dispatch recompute (0, 0), its bytes go to
                           combine.fwd's x, freed at expert.dx, next to where dispatch.re drops them)
  combine.fwd (0, all)    mlp.fwd / head.fwd like attn.fwd;  embed.fwd (0, 0) (token ids only)
"""

from __future__ import annotations

from typing import Any

import torch

from k3sched.config import Config
from k3sched.tasks import Kind


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: set[tuple] = set()
    total = 0
    for t in tensors:
        k = (t.device, t.untyped_storage().data_ptr())
        if k not in seen:
            seen.add(k)
            total += t.untyped_storage().nbytes()
    return total


def _split(ctx) -> tuple[int, int]:
    """(bytes of grad_output entries, bytes of the others) of a sub-op context's store."""
    if ctx is None:
        return 0, 0
    saved = ctx.saved_tensors()
    g = storage_bytes(t for n, t in saved.items() if n.endswith(".grad_out"))
    rest = storage_bytes(t for n, t in saved.items() if not n.endswith(".grad_out"))
    return g, rest


def _total(ctx) -> int:
    return 0 if ctx is None else storage_bytes(ctx.saved_tensors().values())


def saved_bytes_profile(cfg: Config, seed: int = 0) -> dict[str, Any]:
    """Measure the saved-activation bytes of one micro-batch per task kind (see [Note: measured
    saved bytes]); returns ``{fwd kind: [w, x], dx kind: n}`` averaged over the config's MoE
    (resp. dense) layers, ready to be written as ``saved_bytes:`` of a profile YAML."""
    from moe import MoEModel
    from .stage import model_args, synthetic_batch

    args = model_args(cfg)
    torch.manual_seed(seed)
    model = MoEModel.build(args, seed)
    m = cfg.model
    tokens, targets = synthetic_batch(seed, 0, 0, 0, m.micro_batch_size, m.seq_len, m.vocab)
    mb = model.new_microbatch(tokens, targets, index=0, loss_scale=1.0)
    from moe import microbatch_tasks

    tasks = microbatch_tasks(args)
    for kind, layer in tasks.forward:
        model.run(kind, mb, layer, None)
    totals = {L: {op: _total(c) for op, c in mb.layers[L].sub_ops().items()} for L in range(args.layers)}
    head_total = _total(mb.head)
    after_dx: dict[int, dict[str, tuple[int, int]]] = {L: {} for L in range(args.layers)}
    dx_of = {Kind.ATTN_DX: "attn", Kind.SHARED_DX: "shared", Kind.EXPERT_DX: "expert", Kind.MLP_DX: "mlp"}
    head_after = (0, 0)
    for kind, layer in tasks.backward_dx:
        model.run(kind, mb, layer, None)
        if kind in dx_of:
            after_dx[layer][dx_of[kind]] = _split(getattr(mb.layers[layer], dx_of[kind]))
        elif kind is Kind.HEAD_DX:
            head_after = _split(mb.head)
    for kind, layer in tasks.wgrad:
        model.run(kind, mb, layer, None)
    dr = cfg.schedule.dispatch_recompute

    acc: dict[str, list] = {}

    def put(kind: Kind, value) -> None:
        acc.setdefault(kind.value, []).append(value)

    for L in range(args.layers):
        t, a = totals[L], after_dx[L]
        g, w = a.get("attn", (0, 0))
        put(Kind.ATTN_FWD, (w, t.get("attn", 0) - w))
        put(Kind.ATTN_DX, g)
        if args.is_moe_layer(L):
            put(Kind.ROUTER_FWD, (0, t.get("router", 0)))
            for op, fk, dk in (("shared", Kind.SHARED_FWD, Kind.SHARED_DX), ("expert", Kind.EXPERT_FWD, Kind.EXPERT_DX)):
                g, w = a.get(op, (0, 0))
                put(fk, (0, t.get(op, 0)))
                put(dk, g + w)
            disp = t.get("dispatch", 0)
            put(Kind.DISPATCH_FWD, (0, 0) if dr else (disp, 0))
            put(Kind.COMBINE_FWD, (0, t.get("combine", 0) + (disp if dr else 0)))
        else:
            g, w = a.get("mlp", (0, 0))
            put(Kind.MLP_FWD, (w, t.get("mlp", 0) - w))
            put(Kind.MLP_DX, g)
    g, w = head_after
    put(Kind.HEAD_FWD, (w, head_total - w))
    put(Kind.HEAD_DX, g)
    put(Kind.EMBED_FWD, (0, 0))
    out: dict[str, Any] = {}
    for k, vals in acc.items():
        if isinstance(vals[0], tuple):
            out[k] = [int(round(sum(v[0] for v in vals) / len(vals))), int(round(sum(v[1] for v in vals) / len(vals)))]
        else:
            out[k] = int(round(sum(vals) / len(vals)))
    return out


def write_profile(cfg: Config, path, seed: int = 0) -> dict[str, Any]:
    """Write a profile YAML holding ``saved_bytes`` measured for ``cfg``; returns the mapping."""
    import yaml

    data = {"format": "k3sched.profile/1", "source": "runtime.measure.saved_bytes_profile",
            "saved_bytes": saved_bytes_profile(cfg, seed)}
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=True)
    return data

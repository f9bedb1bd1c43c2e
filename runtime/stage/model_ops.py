"""Model sub-op handlers of a stage: attn.fwd ... expert.dw, embed/head -> ``moe.MoEModel.run``;
shared.dx reads the upstream gradient itself ([Note: shared.dx beside combine.bwd]).

[Note: shared.dx beside combine.bwd]
The planner lets shared.dx run beside combine.bwd (both wait only for the upstream gradient),
but ``moe``'s combine.bwd is what hands shared.dx its gradient. The shared-expert output enters
``y = h + shared + routed`` with weight 1, so its gradient *is* the upstream gradient: the runtime
keeps a reference to each upstream gradient when it is produced (head.dx, attn.dx, grad.recv) and
shared.dx uses it directly, so it needs nothing from the ep lane. The value is identical.
shared.dx writes its gradient of ``xn`` apart from dispatch.bwd's; router.bwd sums them
([Note: partial input gradients] in moe/context.py).
The step table marks moe's shared.dx <- combine.bwd edge ``serial`` (moe's own execution only), so
:func:`k3sched.lowering.implied_edges` leaves it out ([Note: step table] in k3sched/steptable.py).
"""

from __future__ import annotations

from torch import Tensor

from k3sched.tasks import Kind
from moe import MoEModel, handoff
from offload.gradshard import GradShards

from ..executor import PlanTask

GRAD_WRITERS = frozenset({Kind.ATTN_DW, Kind.SHARED_DW, Kind.EXPERT_DW, Kind.MLP_DW, Kind.ROUTER_BWD})


def state_key(t: PlanTask) -> int | tuple[int, int]:
    """The key of task ``t``'s state in the stage's micro-batch states (:attr:`StageRunner.mbs`):
    its micro-batch, or (micro-batch, slice)."""
    return t.mb if t.slice is None else (t.mb, t.slice)


class ModelOps:
    """The stage's handlers of the model's forward, dX and dW tasks. Owns the upstream gradients
    kept for shared.dx (:meth:`keep_up`; the P2P family's grad.recv keeps its gradient here too).
    ``mbs`` is the stage's micro-batch states (the runner's, filled by its ``begin_step``);
    ``gshards`` (``schedule.grad_offload``) the sharded gradients the dW tasks accumulate into."""

    def __init__(self, model: MoEModel, mbs: dict, ep_group, *, shared_layers: set[int], head_index: int,
                 gshards: GradShards | None = None, unsafe_shared_dx: bool = False) -> None:
        self.model, self.mbs, self.ep_group = model, mbs, ep_group
        self.shared_layers, self.head_index = shared_layers, head_index
        self.gshards, self.unsafe_shared_dx = gshards, unsafe_shared_dx
        self._up: dict[tuple, Tensor] = {}  # (state key, layer index of grads) -> upstream grad

    def clear(self) -> None:
        """Drop the kept upstream gradients (the step's start and end)."""
        self._up.clear()

    def run(self, t: PlanTask) -> None:
        """A model sub-op task: ``moe.MoEModel.run`` on its state and layer."""
        key = state_key(t)
        mb = self.mbs[key]
        if t.kind is Kind.ROUTER_BWD:  # after shared.dx and dispatch.bwd: [Note: partial input gradients]
            mb.layers[t.layer].fold_grad_xn_shared()
        if self.gshards is not None and t.kind in GRAD_WRITERS:
            with self.gshards.accumulating(t.mb, t.layer):
                self.model.run(t.kind, mb, t.layer, self.ep_group)
        else:
            self.model.run(t.kind, mb, t.layer, self.ep_group)
        if t.kind is Kind.HEAD_DX:
            self.keep_up(key, self.head_index, mb.grads[self.head_index])
        elif t.kind is Kind.ATTN_DX:
            self.keep_up(key, t.layer, mb.grads[t.layer])

    def keep_up(self, state, idx: int, g: Tensor) -> None:
        """Keep the gradient of layer ``idx``'s input for shared.dx of layer ``idx - 1`` (if here);
        ``state`` is the task state's key (:func:`state_key`)."""
        below = idx - 1
        if below in self.shared_layers:
            self._up[(state, idx)] = g
            handoff.cell(self._up, (state, idx), True, f"{self.mbs[state].label}.grads[{idx}] (kept for shared.dx)")

    def shared_dx(self, t: PlanTask) -> None:
        """shared.dx on the kept upstream gradient ([Note: shared.dx beside combine.bwd])."""
        state = state_key(t)
        mb = self.mbs[state]
        lc = mb.layers[t.layer]
        if lc.shared is None:
            return
        key, what = (state, t.layer + 1), f"{mb.label}.grads[{t.layer + 1}]"
        handoff.cell(self._up, key, False, f"{what} (kept for shared.dx)", key in self._up)
        grad_y = self._up.pop(key)
        handoff.cell(self._up, key, True, f"{what} (kept for shared.dx)")
        handoff.handoff(grad_y)  # made on the compute or collective lane: [Note: cross-lane handoff]
        handoff.read(grad_y, what)
        g = lc.shared.backward_dx({"out": grad_y.reshape(-1, grad_y.shape[-1])})["xn"]
        if self.unsafe_shared_dx:
            lc.add_grad_xn(g)
        else:
            lc.grad_xn_shared_TD = g

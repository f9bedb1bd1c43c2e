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
from moe import handoff

from ..executor import PlanTask

GRAD_WRITERS = frozenset({Kind.ATTN_DW, Kind.SHARED_DW, Kind.EXPERT_DW, Kind.MLP_DW, Kind.ROUTER_BWD})


class ModelOps:
    """:class:`~runtime.stage.StageRunner` handlers of the model's forward, dX and dW tasks."""

    def _model_task(self, t: PlanTask) -> None:
        key = self.state_key(t)
        mb = self.mbs[key]
        if t.kind is Kind.ROUTER_BWD:  # after shared.dx and dispatch.bwd: [Note: partial input gradients]
            mb.layers[t.layer].fold_grad_xn_shared()
        if self.gshards is not None and t.kind in GRAD_WRITERS:
            with self.gshards.accumulating(t.mb, t.layer):
                self.model.run(t.kind, mb, t.layer, self.groups.ep)
        else:
            self.model.run(t.kind, mb, t.layer, self.groups.ep)
        if t.kind is Kind.HEAD_DX:
            self._keep_up(key, self.args.layers, mb.grads[self.args.layers])
        elif t.kind is Kind.ATTN_DX:
            self._keep_up(key, t.layer, mb.grads[t.layer])

    def _keep_up(self, state, idx: int, g: Tensor) -> None:
        """Keep the gradient of layer ``idx``'s input for shared.dx of layer ``idx - 1`` (if here);
        ``state`` is the task state's key (:meth:`StageRunner.state_key`)."""
        below = idx - 1
        if below in self._shared_layers:
            self._up[(state, idx)] = g
            handoff.cell(self._up, (state, idx), True, f"{self.mbs[state].label}.grads[{idx}] (kept for shared.dx)")

    def _shared_dx(self, t: PlanTask) -> None:
        state = self.state_key(t)
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

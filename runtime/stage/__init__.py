"""One rank's stage of the MoE model and the handler table the executor interprets.

Shape legend: see :mod:`moe.context` (B batch, S sequence, D hidden, T = B*S tokens).

:class:`StageRunner` (``runner.py``) holds this rank's layers (its PP stage's chunks, its EP slice
of experts) and the micro-batch states of the current step, builds one object per handler family
(each owning its state, its collaborators passed to it) and maps every task kind to the handler of
its family (:meth:`StageRunner.handlers`). The families, one module each:

- ``model_ops.py`` (:class:`ModelOps`, ``runner.model_ops``): model sub-ops (attn.fwd ...
  expert.dw, embed/head) -> ``moe.MoEModel.run`` (``shared.dx`` reads the upstream gradient
  itself, kept by this family, see [Note: shared.dx beside combine.bwd]);
- ``p2p.py`` (:class:`P2P`, ``runner.p2p``): act.send / grad.send -> ``isend`` on the transfer's
  own directed group, waited at the end of the step (:class:`PendingSends`); act.recv /
  grad.recv -> ``irecv`` + wait inside the task; under ``--p2p strict`` both go through
  :class:`P2PStream` ([Note: strict P2P]);
- ``gradients.py`` (:class:`Gradients`, ``runner.gradients``): grad.rs(.bN) -> all-reduce (sum) of
  bucket N of the layer's gradients: non-expert weights over the dense group (ep*dp replicas),
  expert weights over the expert group (dp replicas);
- ``offloading.py`` (:class:`Offloading`, ``runner.offload``): act.offload / act.onload /
  act.roffload / act.rstore / act.rserve / act.ronload -> :class:`offload.ActivationManager`
  ([Note: activation storage policies]), and the bookkeeping around every task (residency checks
  in debug mode, the release of onloaded sets, FP8 quantize / read-back with
  ``schedule.act_quant: fp8``, memory samples);
- ``optimizer.py`` (:class:`Optimizer`, ``runner.optim``): optim.run -> reduce embed/head/final-norm
  gradients (optim group), AdamW step, zero grads;
- grad.rs / gshard.* / optim.run with ``schedule.grad_offload`` -> :class:`offload.GradShards`
  ([Note: sharded gradients]): the layers' dW tasks (and router.bwd) accumulate into the flush
  group's gradient, grad.rs reduce-scatters it into the chunk's device buffer, the host fp32
  shard is onloaded, added to and offloaded, and optim.run steps AdamW on the host shards and
  all-gathers the layers' parameters (optim / optim_expert groups, compute lane); the runner builds
  it (``runner.gshards``) and hands it to the model, gradient, optimizer and memory families;
- ``memory.py`` (:class:`MemorySampler`, ``runner.sampler``; its tracker is ``runner.memory``): the
  tensors the memory tracker counts ([Note: measured memory]); ``faults.py`` (:class:`Faults`,
  ``runner.faults``): fault injection (``K3SCHED_FAIL_*``).

``spec.py`` holds what the runner is built from: :class:`StageSpec`, the stage's model slice and
the synthetic token batches.
"""

from k3sched.tasks import LANES

from .gradients import allreduce_grads
from .model_ops import GRAD_WRITERS
from .offloading import (BACKWARD_KINDS, LAST_FORWARD, REMOTE_KINDS, build_remote_group, remote_order,
                         verify_remote_orders)
from .p2p import P2P_MODES, P2PStream, PendingSends, strict_recv, strict_send
from .runner import StageRunner
from .spec import StageSpec, build_stage_model, model_args, synthetic_batch

__all__ = ["LANES", "StageRunner", "StageSpec", "build_stage_model", "model_args", "synthetic_batch"]
__all__ += ["BACKWARD_KINDS", "GRAD_WRITERS", "LAST_FORWARD", "P2P_MODES", "P2PStream", "PendingSends",
            "REMOTE_KINDS", "build_remote_group", "remote_order", "strict_recv", "strict_send",
            "verify_remote_orders", "allreduce_grads"]

"""MoE transformer with task-level sub-ops (fwd / dX / dW split) for the k3sched executor.

Entry points: :class:`MoEModelArgs`, :class:`MoEModel` (``build``, ``new_microbatch``, ``run``,
``reference_loss``), :func:`run_microbatch_in_order`, :func:`microbatch_tasks`. See
[Note: split backward] in :mod:`moe.split` and [Note: sub-op graph of one layer] in
:mod:`moe.taskgraph`.
"""

from moe.config import MoEModelArgs
from moe.context import LayerCtx, MicroBatch, RoutingPlan, SequenceState
from moe.functional import init_full_state
from moe.model import Block, MoEModel
from moe.split import SavedStore, SubOpCtx, WGradSlot
from moe.taskgraph import (INTRA_LAYER_DEPS, LAYER_KINDS, MICROBATCH_KINDS, MicroBatchTasks, microbatch_tasks,
                           run_microbatch_in_order, run_slices_in_order, run_tasks)

__all__ = [
    "INTRA_LAYER_DEPS", "LAYER_KINDS", "MICROBATCH_KINDS", "Block", "LayerCtx", "MicroBatch", "MicroBatchTasks",
    "MoEModel", "MoEModelArgs", "RoutingPlan", "SavedStore", "SequenceState", "SubOpCtx", "WGradSlot",
    "init_full_state", "microbatch_tasks", "run_microbatch_in_order", "run_slices_in_order", "run_tasks",
]

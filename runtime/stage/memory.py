"""What the memory tracker of a stage is told about ([Note: measured memory] in offload/memory.py):
the static tensors (parameters, gradients, optimizer state, gradient shard buffers) and the saved
activations of the micro-batches in flight, its *tracked* figure. Its *allocated* figure needs no
list: the allocator sees every live allocation of the rank, so a tensor missing here shows as
untracked bytes. The samples themselves are taken after each task
(:meth:`~runtime.stage.offloading.Offloading.tracked`)."""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from offload import ActivationManager, MemoryTracker
from offload.gradshard import GradShards

from .optimizer import Optimizer
from .p2p import PendingSends
from .spec import StageSpec


class MemorySampler:
    """The stage's memory tracker (:attr:`tracker`) and the tensors it is told about: those of
    ``optim`` (parameters, gradients, AdamW state, weight versions), ``gshards``' device buffers,
    the saved tensors of the stage's micro-batch states ``mbs``, ``acts``' stores and ``sends``'
    buffers in flight."""

    def __init__(self, optim: Optimizer, spec: StageSpec, mbs: dict, acts: ActivationManager, sends: PendingSends, *,
                 device: torch.device, gshards: GradShards | None = None) -> None:
        self.optim, self.spec, self.mbs, self.gshards = optim, spec, mbs, gshards
        self.tracker = MemoryTracker(self._static_tensors, self._saved_tensors, acts, device,
                                     extra_host=lambda: gshards.host_bytes() if gshards else 0,
                                     in_flight=sends.buffers)
        self._lock = threading.Lock()

    def sample(self, *, read_static: bool) -> None:
        """One sample after a task; ``read_static`` on the compute lane only ([Note: static tensors
        read by one thread] in offload/memory.py)."""
        with self._lock:
            self.tracker.sample(read_static=read_static)

    def _static_tensors(self) -> list[Tensor]:
        params, optimizer, versions = self.optim.params, self.optim.optimizer, self.optim.versions
        out = list(params)
        out += [p.grad for p in params if p.grad is not None]
        for st in (optimizer.state.values() if optimizer is not None else ()):
            out += [v for v in st.values() if isinstance(v, Tensor) and v.dim() > 0]
        if self.gshards is not None:
            out += self.gshards.device_tensors()
        if versions is not None:  # pipedream-2bw: both weight versions (the parameters use one)
            out += [w for version in versions for w in version]
        return out

    def _saved_tensors(self) -> list[Tensor]:
        out: list[Tensor] = []
        seqs = {id(mb.seq): mb.seq for mb in list(self.mbs.values()) if mb.seq is not None}
        for seq in seqs.values():  # sequence slices: the K / V kept for later slices, once per micro-batch
            out += seq.tensors()
        for mb in list(self.mbs.values()):
            for L in self.spec.layers:
                out += list(mb.layers[L].saved_tensors().values())
            for c in (mb.embed, mb.head):
                if c is not None:
                    out += list(c.saved_tensors().values())
        return out

"""What the memory tracker of a stage is told about ([Note: measured memory] in offload/memory.py):
the static tensors (parameters, gradients, optimizer state, gradient shard buffers) and the saved
activations of the micro-batches in flight, its *tracked* figure. Its *allocated* figure needs no
list: the allocator sees every live allocation of the rank, so a tensor missing here shows as
untracked bytes. The samples themselves are taken after each task
(:meth:`~runtime.stage.offloading.OffloadOps._tracked`)."""

from __future__ import annotations

from torch import Tensor


class MemorySampling:
    """:class:`~runtime.stage.StageRunner`'s tensors as the memory tracker sees them."""

    def _static_tensors(self) -> list[Tensor]:
        out = list(self.params)
        out += [p.grad for p in self.params if p.grad is not None]
        for st in (self.optimizer.state.values() if self.optimizer is not None else ()):
            out += [v for v in st.values() if isinstance(v, Tensor) and v.dim() > 0]
        if self.gshards is not None:
            out += self.gshards.device_tensors()
        if self.versions is not None:  # pipedream-2bw: both weight versions (the parameters use one)
            out += [w for version in self.versions for w in version]
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

"""Cross-lane tensor hand-off (CUDA stream bookkeeping) and the race detector's recording points.

[Note: cross-lane handoff]
The executor runs each lane on its own CUDA stream and orders the lanes with events
(runtime/executor.py), which orders the *kernels*. It does not order the caching allocator: a
tensor allocated on stream A and read on stream B may be freed by Python (its last reference
dropped) while B's kernels still read it, and A's next allocation then reuses the memory. Every
place where a tensor crosses lanes therefore calls :func:`handoff` with the consuming stream
(``record_stream``: the allocator waits for the work that stream has queued when the tensor is
freed). It is a no-op on CPU, and cheap on the stream that allocated the tensor. The places:

- a task reads a tensor another task published: the boundary tensors of ``LayerCtx`` (all-to-all
  outputs such as ``recv_ND``, the routing indices of ``RoutingPlan`` made on the ep stream and
  saved by compute, the shared-expert output ``shared_TD`` read and dropped on the ep lane),
  ``MicroBatch.acts`` / ``grads`` (P2P receive buffers, layer outputs), saved tensors read back
  (``SavedStore.get``: onloaded and FP8-dequantized tensors, tensors saved by another lane);
- a sub-op's store drops a tensor right after ``backward()`` queued the kernels that read it
  (``SavedStore.release``: the kernels are on the current stream);
- the runtime's own hand-offs (``runtime.stage``: the upstream gradient shared.dx reads).

[Note: race detector hooks]
The recording points below are no-ops unless the race detector (``runtime.racecheck``, ``k3sched
run --racecheck``) installed :data:`HOOK`. They mark where tasks hand data to each other:
*cells* (a named slot: a ``LayerCtx`` boundary field, a ``MicroBatch.acts`` index, a saved-tensor
entry) are written by the task that fills or clears them and read by the tasks that take from
them; *storages* (``untyped_storage`` identity, byte range) are written by the task that creates
or fills them (:func:`publish` counts a storage's first sighting in a step as its creation) and
read by the tasks that use them. ``fresh`` starts a new life of a pool buffer (the pool's fence
orders it after the previous one); ``sync_from`` records an ordering the runtime enforces
outside the plan (a buffer fence a task waited on); ``acting_as`` attributes accesses to the
task that owns the data (FP8 read-back, serialised by the manager's lock and fences).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

HOOK = None
"""The race detector recording this process's accesses (``runtime.racecheck.RaceChecker``), or None."""


def handoff(t, streams: Iterable | None = None) -> int:
    """``t`` (produced on one lane) is used on ``streams`` (default: the current CUDA stream): on
    CUDA, ``record_stream`` each, so freeing ``t`` waits for what they queued; no-op on CPU and for
    None. Returns how many streams were recorded."""
    if t is None or not getattr(t, "is_cuda", False):
        return 0
    if streams is None:
        import torch

        streams = (torch.cuda.current_stream(t.device),)
    n = 0
    seen = set()
    for s in streams:
        if s is None or id(s) in seen:
            continue
        seen.add(id(s))
        t.record_stream(s)
        n += 1
    return n


# -- recording points of the race detector (no-ops without it) --------------------------------------
def read(t, what: str, handed: bool = False) -> None:
    """The current task reads ``t``'s bytes (``handed``: ``t`` was handed to it whole, so an
    in-place write to it during the task, seen through ``t._version``, counts as the task's)."""
    h = HOOK
    if h is not None and t is not None:
        h.access(t, "r", what, handed)


def write(t, what: str) -> None:
    """The current task writes ``t``'s bytes (in place, or fills a buffer it took)."""
    h = HOOK
    if h is not None and t is not None:
        h.access(t, "w", what)


def publish(t, what: str) -> None:
    """The current task hands ``t`` on: a write if the detector has not seen its storage this step
    (the task created it), a read otherwise (it passes on someone else's tensor)."""
    h = HOOK
    if h is not None and t is not None:
        h.access(t, "p", what, True)


def fresh(t, what: str) -> None:
    """``t``'s storage starts a new life (a pool buffer handed out again after its fence)."""
    h = HOOK
    if h is not None and t is not None:
        h.fresh(t, what)


def cell(owner, key, write: bool, what: str, present: bool = True) -> None:
    """The current task reads (``write`` False) or fills / clears a hand-off cell ``(owner, key)``;
    ``present``: a read found something there."""
    h = HOOK
    if h is not None:
        h.cell(owner, key, write, what, present)


def sync_from(task_id: str | None) -> None:
    """The current task waited on something ``task_id`` signalled at its end (a buffer fence)."""
    h = HOOK
    if h is not None and task_id is not None:
        h.sync_from(task_id)


def current_task() -> str | None:
    """The task the calling lane thread runs (None without the detector, or outside a task)."""
    h = HOOK
    return h.current() if h is not None else None


@contextlib.contextmanager
def acting_as(task_id: str | None) -> Iterator[None]:
    """Attribute the accesses inside to ``task_id`` (None: to the current task)."""
    h = HOOK
    if h is None or task_id is None:
        yield
        return
    with h.acting_as(task_id):
        yield


__all__ = ["HOOK", "acting_as", "cell", "current_task", "fresh", "handoff", "publish", "read", "sync_from",
           "write"]

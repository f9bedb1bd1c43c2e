"""Pipeline P2P of a stage: act.send / grad.send -> ``isend`` on the transfer's own directed group
(``groups.p2p``, [Note: NCCL-safe P2P] in runtime/groups.py), waited at the end of the step
(:class:`PendingSends`: a send never blocks its lane, so a lane's later receive cannot deadlock
behind it); act.recv / grad.recv -> ``irecv`` + wait inside the task (a receive posted in plan
order waits for its send; gloo moves the bytes once both are posted, so the transfer time lands in
the receive); under ``--p2p strict`` both go through :class:`P2PStream` ([Note: strict P2P]).
A sliced micro-batch sends and receives per slice: a slice's tensor holds its token range of each
sequence (``[B, end - start, D]``, the receive's shape from its state's bounds, i.e.
``k3sched.seqslice.slice_bounds``) and its tag names the slice."""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist
from torch import Tensor

from k3sched.tasks import Kind

from ..executor import PlanTask
from ..groups import Groups, wait_bounded
from .model_ops import state_key
from .spec import StageSpec


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
    wait_bounded(dist.irecv(tok, src=dst, group=ready), deadline, f"{what}: waiting for the receiver's ready token")
    if int(tok.item()) != tag:
        raise RuntimeError(f"{what}: the receiver's next receive is another transfer (ready token {int(tok.item())}, "
                           f"this send {tag}): NCCL pairs by order and would deliver the wrong tensor")
    wait_bounded(dist.isend(buf, dst=dst, group=group, tag=0), deadline, f"{what}: send")


def strict_recv(buf: Tensor, src: int, group, ready, tag: int, deadline: float, what: str) -> None:
    """A receive of [Note: strict P2P]: post it (tag 0), then send the ready token (``tag``)."""
    work = dist.irecv(buf, src=src, group=group, tag=0)
    tok = dist.isend(torch.tensor([tag], dtype=torch.int64), dst=src, group=ready)
    wait_bounded(work, deadline, f"{what}: receive")
    wait_bounded(tok, deadline, f"{what}: ready token")


class P2P:
    """The stage's handlers of act/grad.send and act/grad.recv. Owns the sends in flight
    (:attr:`sends`) and, under ``--p2p strict``, a :class:`P2PStream` per communicator. ``mbs`` is
    the stage's micro-batch states; ``keep_up`` the model family's keeper of upstream gradients
    (:meth:`~runtime.stage.model_ops.ModelOps.keep_up`), handed each received gradient."""

    def __init__(self, spec: StageSpec, groups: Groups, mbs: dict, keep_up, *, seq_chunks: int,
                 act_shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, mode: str = "buffered",
                 timeout_s: float = 120.0) -> None:
        if mode not in P2P_MODES:
            raise ValueError(f"p2p: one of {', '.join(P2P_MODES)}; got {mode!r}")
        self.spec, self.groups, self.mbs, self.keep_up = spec, groups, mbs, keep_up
        self.seq_chunks, self.act_shape, self.dtype, self.device = seq_chunks, act_shape, dtype, device
        self.timeout_s = timeout_s
        self.sends = PendingSends()
        self.streams: dict[tuple[str, int, int], P2PStream] | None = None  # [Note: strict P2P]
        if mode == "strict":
            missing = sorted(set(groups.p2p) - set(groups.ready))
            if missing:
                raise ValueError(f"--p2p strict: no ready-token group for {missing[0]} (build_p2p_groups(ready=True))")
            self.streams = {k: P2PStream(f"{k[0]} {k[1]}->{k[2]}", timeout_s) for k in groups.p2p}

    def wait_all(self) -> None:
        """The end of the step: wait for the outstanding sends (bounded by the P2P timeout)."""
        self.sends.wait_all(self.timeout_s)


    def _boundaries(self, t: PlanTask) -> tuple[int, int]:
        """(input index, output index) in acts/grads of the task's chunk."""
        v = self.spec.chunk_vstage[t.chunk]
        return self.spec.input_index(v), self.spec.input_index(v + 1)

    def _tag(self, key: list, slice: int | None = None) -> int:
        """The transfer's tag: unique per (direction, micro-batch, slice, from-vstage, to-vstage)."""
        d, mb, src, dst = key
        unit = mb * self.seq_chunks + (slice or 0)  # = mb without slices
        return ((unit * self.spec.num_vstages + dst) * 2 + (d == "grad")) * self.spec.num_vstages + src

    def _p2p_group(self, key: tuple[str, int, int]):
        g = self.groups.p2p.get(key)
        if g is None:
            raise RuntimeError(f"no P2P group for {key[0]} {key[1]}->{key[2]} (runtime.groups.build_p2p_groups)")
        return g

    def send(self, t: PlanTask) -> None:
        peer, key = self.spec.p2p_peer(t)
        mb = self.mbs[state_key(t)]
        first, out = self._boundaries(t)
        idx = out if t.kind is Kind.FWD_SEND else first
        buf = mb.acts[idx] if t.kind is Kind.FWD_SEND else mb.grads[idx]
        if buf is None:
            raise RuntimeError(f"nothing to send: {'acts' if t.kind is Kind.FWD_SEND else 'grads'}[{idx}] is empty")
        buf = buf.contiguous()
        ck = (key[0], self.spec.stage, peer)
        group, dst, tag = self._p2p_group(ck), self.groups.pp_rank(peer), self._tag(key, t.slice)
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

    def recv(self, t: PlanTask) -> None:
        peer, key = self.spec.p2p_peer(t)
        state = state_key(t)
        mb = self.mbs[state]
        first, out = self._boundaries(t)
        shape = self.act_shape
        if mb.slice is not None:  # a slice's rows: its token range of each sequence
            start, end = mb.bounds
            shape = (shape[0], end - start, shape[2])
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        ck = (key[0], peer, self.spec.stage)
        group, src, tag = self._p2p_group(ck), self.groups.pp_rank(peer), self._tag(key, t.slice)
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
            self.keep_up(state, out, buf)

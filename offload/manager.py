"""Unified activation manager: a storage policy per saved tensor, executed by planned tasks.

[Note: activation storage policies]
Every tensor a task saves for backward (``moe`` lists them per layer: ``LayerCtx.saved_tensors()``,
named ``<op>.<entry>``) gets a policy, declared here and not in the model code
(:class:`PolicyTable`). Policies compose per tensor:

- ``keep``: stays on the device (also for a layer the plan offloads);
- ``offload``: leaves the device with its layer's activation set; *where* is the plan's choice
  per set (``act.offload`` -> local host pool, ``act.roffload`` -> a peer rank's pool);
- ``fp8`` (modifier of ``offload``): block-wise FP8 (1x128 tiles, fp32 scales, lossy) on the way
  out, dequantized on the way back;
- ``recompute``: not stored at all; ``moe`` evicts the expert input under dispatch recompute
  (EP-DR) and ``dispatch.re`` rebuilds it, so such entries never reach the manager.

The table from a config (:meth:`PolicyTable.from_config`) has ``schedule.storage``'s rules, one
per sub-op pattern, first; the default after them offloads everything with the plan and adds
``fp8`` when ``schedule.act_quant`` is ``fp8``. Tensors are moved per *storage*: names that alias
one storage (e.g. ``shared`` and ``dispatch`` both keep xn) are copied once and come back as views
of one restored storage, so aliasing survives the round trip.

Life of an offloaded set (one (micro-batch, layer)):
  act.offload / act.roffload  (plan: right after the layer's last forward task)
      pack every storage into one pool buffer (host pool; for a peer, a device-pool send buffer),
      swap each saved name for a zero-stride placeholder (same shape and dtype, one element), so
      the device memory is released; a premature read would see zeros (the bitwise tests and the
      debug residency check catch it).
  act.rstore / act.rserve (peer rank): receive into the peer pool and keep; send back.
  act.onload / act.ronload   (plan: prefetched before the layer's first backward task)
      copy into one device-pool buffer, put views of it back under every name.
  last backward task of the set -> :meth:`ActivationManager.release` returns the device buffer
      to the pool (fenced by the lanes' streams on GPU).

[Note: FP8 on the device]
Under ``schedule.act_quant: fp8`` the planner stores *every* saved activation as FP8, not only
offloaded ones, so the runtime quantizes the sets the plan keeps on the device as well, without
plan tasks of their own (``runtime.stage.offloading.Offloading.tracked``):
  quantize_resident   (inside the layer's last forward task: combine.fwd / mlp.fwd, after it ran)
      every floating-point storage of the set -> one device-pool buffer (FP8 payload + fp32
      scales, the same packed layout as an FP8 offload), placeholders under its names; integer /
      bool storages (routing indices) stay untouched, exact.
  dequantize_resident (before the set's first backward task: combine.bwd, shared.dx or mlp.dx,
      whichever lane gets there first; the other waits)
      -> one device-pool buffer in the unpacked layout, views restored; the FP8 buffer goes back
      to the pool; the full-precision buffer is released after the set's last backward task,
      as an onloaded set's is.
Debug checksums cover the FP8 payload (taken on quantize, verified on dequantize), and the
residency check treats a quantized set as not resident.

Streams and the race detector. The device pool allocates on the compute stream
(:meth:`ActivationManager.bind_compute_stream`; the other lanes get its buffers through the
fences). Every copy reports what it reads and writes to the race detector ([Note: race
detector hooks] in moe/handoff.py): the set's storages read by an offload or quantize, the pool
buffer each copy fills (a new life of the buffer), the saved names it empties or refills. An
FP8 read-back is attributed to the task that quantized the set: it only materialises that
task's data, one lane at a time under the manager's lock, each lane's stream waiting for the
read-backs before it; its outputs reach the reading lanes' streams through
``SavedStore.get`` ([Note: cross-lane handoff]).

Debug (``debug=True``; ``K3SCHED_OFFLOAD_DEBUG=1`` in a run, [Note: runtime options]): every storage gets a checksum when it
leaves (of its FP8 payload when quantized) that is verified when it returns; a mismatch raises
naming the task and the tensor. ``copy_delay_s`` (``K3SCHED_OFFLOAD_DELAY_S`` in a run) sleeps inside
each copy task after the copy was issued: a test hook that slows the copy lanes.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from moe import handoff

from .pool import BufferPool, fence_wait
from .quant import FP8, TILE, Quantized, dequantize, quantize, quantized_nbytes

ALIGN = 256


class OffloadCorruption(RuntimeError):
    """A checksum of an onloaded tensor differs from the one taken when it was offloaded."""


@dataclass(frozen=True)
class Policy:
    """Storage policy of one saved tensor (see [Note: activation storage policies])."""

    offload: bool = True
    fp8: bool = False

    def __str__(self) -> str:
        return ("offload" + ("+fp8" if self.fp8 else "")) if self.offload else "keep"


KEEP = Policy(offload=False)
OFFLOAD = Policy()
OFFLOAD_FP8 = Policy(fp8=True)


@dataclass
class PolicyTable:
    """Ordered ``(glob pattern over '<op>.<entry>' names, Policy)`` rules; first match wins."""

    rules: list[tuple[str, Policy]] = field(default_factory=lambda: [("*", OFFLOAD)])

    @classmethod
    def from_config(cls, cfg) -> "PolicyTable":
        """``schedule.storage``'s rules, one per sub-op pattern, then the default (``act_quant``):
        the policies the planner costs ([Note: storage policies from the config] in
        k3sched/config.py)."""
        by_name = {"keep": KEEP, "offload": OFFLOAD, "offload+fp8": OFFLOAD_FP8}
        rules = [(f"{pat}.*", by_name[policy]) for pat, policy in cfg.schedule.storage.items()]
        return cls(rules + [("*", OFFLOAD_FP8 if cfg.schedule.act_quant == "fp8" else OFFLOAD)])

    def policy(self, name: str) -> Policy:
        for pat, pol in self.rules:
            if fnmatch.fnmatchcase(name, pat):
                return pol
        return KEEP


@dataclass
class _Storage:
    """One storage of a set: its bytes, where it sits in the packed buffer, the names viewing it."""

    nbytes: int
    offset: int  # in the unpacked (device) layout
    pack_offset: int  # in the packed layout
    pack_nbytes: int
    fp8: torch.dtype | None  # element dtype when stored as FP8, else None
    views: list[tuple[str, torch.dtype, int, tuple, tuple]]  # name, dtype, elem offset, shape, stride
    checksum: int | None = None
    restored: bool = False  # FP8 on the device: read back by dequantize_resident

    def wanted(self, op: str | None, names=None) -> bool:
        """Whether one of ``names`` (when given), else a name of sub-op ``op`` (``<op>.<entry>``;
        any when None), views this storage."""
        if names is not None:
            return any(v[0] in names for v in self.views)
        return op is None or any(v[0].split(".", 1)[0] == op for v in self.views)


@dataclass
class _Set:
    buffer: str
    storages: list[_Storage]
    nbytes: int  # unpacked
    pack_nbytes: int
    where: str  # "host" | "peer" | "fp8" (quantized on the device) | "device"
    host: Tensor | None = None
    device: Tensor | None = None
    fence: object = None
    packed: Tensor | None = None  # "fp8": the device-pool buffer holding payload + scales
    owner: str | None = None  # "fp8": the task that quantized the set (its read-backs act for it)


def _checksum(t: Tensor) -> int:
    """Order-sensitive checksum of a byte tensor (cheap, exact)."""
    b = t.reshape(-1).view(torch.uint8)
    n = b.numel()
    pad = (-n) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = b.view(torch.int64)
    idx = torch.arange(1, w.numel() + 1, dtype=torch.int64, device=w.device)
    return int(((w * idx) ^ (w >> 7)).sum()) ^ n


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _byte_view(t: Tensor) -> Tensor:
    """The whole storage of ``t`` as a flat uint8 tensor."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


class ActivationManager:
    """Moves saved activation sets between the device, the host pool and peer ranks' pools."""

    def __init__(self, device: torch.device | str = "cpu", *, table: PolicyTable | None = None,
                 debug: bool = False, copy_delay_s: float = 0.0, remote_group=None,
                 compute_stream=None) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.table = table or PolicyTable()
        self.debug, self.copy_delay_s = debug, copy_delay_s
        self.device_pool = BufferPool("device", self.device, alloc_stream=compute_stream)
        self.host_pool = BufferPool("host", "cpu", pin=cuda)
        self.peer_pool = BufferPool("peer", self.device)
        self.remote_group = remote_group
        self._sets: dict[str, _Set] = {}  # offloaded (host/peer) or onloaded (device, until released)
        self._held: dict[str, _Set] = {}  # peer side: sets kept for other ranks
        self._placeholders: dict[torch.dtype, Tensor] = {}
        self._lock = threading.Lock()
        self._quant_lock = threading.Lock()  # one dequantize at a time (two lanes may ask for one set)
        self._pending: list = []  # (work, tensor) of isends, waited at the end of the step
        self.log: list[tuple[str, str]] = []  # (task id, event) in debug mode

    def bind_compute_stream(self, stream) -> None:
        """Allocate the device pool's buffers on ``stream`` (the compute lane's; None: current)."""
        self.device_pool.alloc_stream = stream

    def _took(self, buf: Tensor, what: str) -> None:
        """A pool buffer handed to this task, which fills it (race detector)."""
        handoff.fresh(buf, what)

    # -- set layout ------------------------------------------------------------------------------
    def _layout(self, saved: dict[str, Tensor], fp8_only: bool = False
                ) -> tuple[list[_Storage], list[tuple[_Storage, Tensor]], int, int]:
        """Storages of ``saved`` to move (packed layout); ``fp8_only``: only those stored as FP8
        (the others, e.g. integer indices, stay where they are, exact)."""
        by_storage: dict[int, tuple[Tensor, list[str]]] = {}
        for name, t in saved.items():
            pol = self.table.policy(name)
            if not pol.offload or t.untyped_storage().nbytes() <= t.element_size():
                continue  # kept, or already a placeholder
            ptr = t.untyped_storage().data_ptr()
            by_storage.setdefault(ptr, (t, []))[1].append(name)
        out, srcs = [], []
        off = pack = 0
        for t0, names in by_storage.values():
            nbytes = t0.untyped_storage().nbytes()
            dtypes = {saved[n].dtype for n in names}
            fp8 = None
            if all(self.table.policy(n).fp8 for n in names) and len(dtypes) == 1:
                dt = next(iter(dtypes))
                if dt.is_floating_point and dt != FP8 and nbytes % torch.empty((), dtype=dt).element_size() == 0:
                    fp8 = dt
            if fp8_only and fp8 is None:
                continue
            pn = quantized_nbytes(nbytes // torch.empty((), dtype=fp8).element_size()) if fp8 else nbytes
            views = [(n, saved[n].dtype, saved[n].storage_offset(), tuple(saved[n].shape), tuple(saved[n].stride()))
                     for n in names]
            s = _Storage(nbytes, off, pack, pn, fp8, views)
            out.append(s)
            srcs.append((s, t0))
            off += _align(nbytes)
            pack += _align(pn)
        return out, srcs, off, pack

    def _placeholder(self, dtype: torch.dtype, shape: tuple) -> Tensor:
        z = self._placeholders.get(dtype)
        if z is None:
            z = self._placeholders[dtype] = torch.zeros((), dtype=dtype, device=self.device)
        return z.expand(shape)

    def _pack(self, srcs: list[tuple[_Storage, Tensor]], dst: Tensor, task: str) -> None:
        """Copy (or quantize) each storage into its packed slot of ``dst`` (a flat uint8 buffer)."""
        nb = self.device.type == "cuda"
        for s, t in srcs:
            src = _byte_view(t)
            slot = dst[s.pack_offset:s.pack_offset + s.pack_nbytes]
            handoff.read(t, f"{task}: saved {s.views[0][0]}")
            handoff.write(slot, f"{task}: packed {s.views[0][0]}")
            if s.fp8 is None:
                slot.copy_(src, non_blocking=nb)
            else:
                n = s.nbytes // torch.empty((), dtype=s.fp8).element_size()
                tiles = -(-n // TILE)
                q = quantize(src.view(s.fp8))
                slot[:tiles * TILE].copy_(q.q.reshape(-1).view(torch.uint8), non_blocking=nb)
                slot[tiles * TILE:tiles * TILE + tiles * 4].copy_(q.scale.view(torch.uint8), non_blocking=nb)
            if nb:
                t.record_stream(torch.cuda.current_stream(self.device))  # source memory lives until the copy ran

    def _checksums(self, st: list[_Storage], packed: Tensor) -> None:
        for s in st:
            s.checksum = _checksum(packed[s.pack_offset:s.pack_offset + s.pack_nbytes])

    def _verify(self, st: list[_Storage], packed: Tensor, task: str) -> None:
        for s in st:
            got = _checksum(packed[s.pack_offset:s.pack_offset + s.pack_nbytes])
            if got != s.checksum:
                raise OffloadCorruption(f"task {task}: onloaded tensor {s.views[0][0]} differs from what was "
                                        f"offloaded (checksum {got:#x} != {s.checksum:#x}, {s.nbytes} bytes)")

    def _evict(self, lc, st: list[_Storage]) -> None:
        for s in st:
            for name, dtype, _, shape, _ in s.views:
                lc.replace(name, self._placeholder(dtype, shape))

    def _unpack(self, rec: _Set, packed: Tensor, lc, task: str) -> Tensor:
        """Device tensors back under every name; returns the device buffer now holding them."""
        if self.debug:
            self._verify(rec.storages, packed, task)
        if any(s.fp8 for s in rec.storages) or packed.device != self.device or packed.device.type != self.device.type:
            dev = self.device_pool.acquire(rec.nbytes)
            self._took(dev, f"{rec.buffer} (device)")
            for s in rec.storages:
                slot = packed[s.pack_offset:s.pack_offset + s.pack_nbytes]
                out = dev[s.offset:s.offset + s.nbytes]
                handoff.read(slot, f"{rec.buffer} (packed)")
                handoff.write(out, f"{rec.buffer}: {s.views[0][0]}")
                if s.fp8 is None:
                    out.copy_(slot, non_blocking=self.device.type == "cuda")
                else:
                    n = s.nbytes // torch.empty((), dtype=s.fp8).element_size()
                    tiles = -(-n // TILE)
                    q = slot[:tiles * TILE].to(self.device, non_blocking=True).view(FP8)
                    scale = slot[tiles * TILE:tiles * TILE + tiles * 4].to(self.device, non_blocking=True).view(torch.float32)
                    dequantize(Quantized(q, scale, n, s.fp8), out.view(s.fp8))
        else:
            dev = packed  # same layout, already on the device
        self._restore(rec, dev, lc)
        return dev

    @staticmethod
    def _restore(rec: _Set, dev: Tensor, lc) -> None:
        """Views of ``dev`` (flat uint8, storage offset 0) back under every saved name."""
        assert dev.storage_offset() == 0
        for s in rec.storages:
            for name, dtype, eoff, shape, stride in s.views:
                es = torch.empty((), dtype=dtype).element_size()
                lc.replace(name, dev.view(dtype).as_strided(shape, stride, s.offset // es + eoff))

    def _delay(self) -> None:
        if self.copy_delay_s > 0:
            time.sleep(self.copy_delay_s)

    def _fence(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return None

    # -- local host offload --------------------------------------------------------------------
    def offload_local(self, buffer: str, lc, task: str = "?") -> int:
        """act.offload: move the set's storages to one host-pool buffer; returns bytes moved."""
        st, srcs, nbytes, pack = self._layout(lc.saved_tensors())
        host = self.host_pool.acquire(pack)
        self._took(host, f"{buffer} (host)")
        self._pack(srcs, host, task)
        fence = self._fence()
        if self.debug:
            fence_wait(fence)
            self._checksums(st, host)
        self._evict(lc, st)
        del srcs
        self._delay()
        with self._lock:
            if buffer in self._sets:
                raise RuntimeError(f"task {task}: activation set {buffer} is already offloaded")
            self._sets[buffer] = _Set(buffer, st, nbytes, pack, "host", host=host, fence=fence)
        return pack

    def onload_local(self, buffer: str, lc, task: str = "?") -> int:
        """act.onload: copy the set back into a device-pool buffer and restore every name."""
        with self._lock:
            rec = self._sets[buffer]
        if rec.where != "host":
            raise RuntimeError(f"task {task}: activation set {buffer} is not in the host pool (it is {rec.where})")
        fence_wait(rec.fence)  # the offload copy must have landed (its lane's event)
        dev = self.device_pool.acquire(rec.nbytes)
        self._took(dev, f"{buffer} (device)")
        nb = self.device.type == "cuda"
        if any(s.fp8 for s in rec.storages):
            self.device_pool.release(dev)
            dev = self._unpack(rec, rec.host, lc, task)
        else:
            dev[:rec.pack_nbytes].copy_(rec.host[:rec.pack_nbytes], non_blocking=nb)
            handoff.read(rec.host[:rec.pack_nbytes], f"{buffer} (host)")
            handoff.write(dev[:rec.pack_nbytes], f"{buffer} (device)")
            if self.debug:
                fence_wait(self._fence())
                self._verify(rec.storages, dev, task)
            self._restore(rec, dev, lc)
        self.host_pool.release(rec.host, self._fence())  # reusable once the H2D copy finished
        self._delay()
        with self._lock:
            rec.host, rec.device, rec.where = None, dev, "device"
        return rec.pack_nbytes

    # -- FP8 on the device (sets the plan keeps) -----------------------------------------------
    def _stream_wait(self, fence) -> None:
        """GPU: make the current stream wait for ``fence`` (an event of another lane's stream)."""
        if fence is not None and self.device.type == "cuda":
            for ev in fence if isinstance(fence, (list, tuple)) else (fence,):
                torch.cuda.current_stream(self.device).wait_event(ev)

    def quantize_resident(self, buffer: str, lc, task: str = "?") -> int:
        """``act_quant: fp8`` for a set the plan does not offload (see [Note: FP8 on the device]):
        quantize every floating-point storage of the set into one device-pool buffer (payload +
        fp32 scales) and put placeholders under its names; integer / bool storages stay as they
        are (exact). Returns the bytes of the quantized buffer (0: nothing to quantize)."""
        st, srcs, nbytes, pack = self._layout(lc.saved_tensors(), fp8_only=True)
        if not st:
            return 0
        buf = self.device_pool.acquire(pack)
        self._took(buf, f"{buffer} (fp8)")
        self._pack(srcs, buf, task)
        fence = self._fence()
        if self.debug:
            fence_wait(fence)
            self._checksums(st, buf)
        self._evict(lc, st)
        del srcs
        with self._lock:
            if buffer in self._sets:
                raise RuntimeError(f"task {task}: activation set {buffer} is already offloaded or quantized")
            self._sets[buffer] = _Set(buffer, st, nbytes, pack, "fp8", fence=fence, packed=buf, owner=task)
        return pack

    def dequantize_resident(self, buffer: str, lc, task: str = "?", op: str | None = None,
                            names=None) -> int:
        """Before a backward task reads a set quantized by :meth:`quantize_resident`: dequantize
        the storages viewed by one of ``names`` (when given: what a dX task's graph reads, so the
        WGrad inputs stay FP8 until the dW task), else by a name of sub-op ``op`` (``<op>.<entry>``;
        all when None) into fresh
        device tensors and restore their names (each storage's views come back aliased). Each
        storage is freed, as without FP8, when the store drops it (graph tensors after the op's dX
        task, WGrad inputs after its dW task), so at no point of the backward pass does the set hold
        more than it would unquantized; the FP8 buffer goes back to the pool once every storage was
        read back. Safe from two lanes at once (one dequantizes at a time; on GPU a lane's stream
        waits for the events of earlier dequantizes of the set). Returns the bytes restored."""
        with self._quant_lock:
            with self._lock:
                rec = self._sets.get(buffer)
            if rec is None or rec.where not in ("fp8", "device"):
                return 0
            self._stream_wait(rec.fence)  # the quantize / earlier dequantizes ran on other lanes' streams
            if rec.where == "device":
                return 0
            todo = [s for s in rec.storages if not s.restored and s.wanted(op, names)]
            if not todo:
                return 0
            if self.debug:
                self._verify(todo, rec.packed, task)
            moved = 0
            with handoff.acting_as(rec.owner):
                for s in todo:
                    n = s.nbytes // torch.empty((), dtype=s.fp8).element_size()
                    tiles = -(-n // TILE)
                    slot = rec.packed[s.pack_offset:s.pack_offset + s.pack_nbytes]
                    out = torch.empty(s.nbytes, dtype=torch.uint8, device=self.device)
                    dequantize(Quantized(slot[:tiles * TILE].view(FP8), slot[tiles * TILE:tiles * TILE + tiles * 4]
                                         .view(torch.float32), n, s.fp8), out.view(s.fp8))
                    handoff.read(slot, f"{buffer} (fp8)")
                    handoff.write(out, f"{buffer}: {s.views[0][0]}")
                    for name, dtype, eoff, shape, stride in s.views:
                        lc.replace(name, out.view(dtype).as_strided(shape, stride, eoff))
                    s.restored = True
                    moved += s.nbytes
            fence = self._fence()
            left = any(not s.restored for s in rec.storages)
            with self._lock:
                rec.fence = [f for f in (rec.fence if isinstance(rec.fence, list) else [rec.fence]) if f is not None]
                if fence is not None:
                    rec.fence.append(fence)
                if not left:
                    self.device_pool.release(rec.packed, fence)
                    rec.packed, rec.where = None, "device"
            return moved

    def resident_for(self, buffer: str, op: str | None, names=None) -> bool:
        """Whether the saved tensors named ``names`` (when given), else those of sub-op ``op``, are
        on the device (not offloaded, not FP8): what a backward task may read."""
        with self._lock:
            rec = self._sets.get(buffer)
        if rec is None or rec.where == "device":
            return True
        if rec.where != "fp8":
            return False
        return not any(not s.restored and s.wanted(op, names) for s in rec.storages)

    # -- remote (peer) offload -----------------------------------------------------------------
    @staticmethod
    def _tags(mb: int, layer: int) -> tuple[int, int]:
        base = (mb * 4096 + layer) * 4
        return base, base + 2  # (to the peer, back to the owner); +1: payload

    def _isend(self, t: Tensor, dst: int, tag: int):
        """Asynchronous send, waited (once: a gloo Work must not be waited twice) at the step end."""
        work = dist.isend(t, dst=dst, group=self.remote_group, tag=tag)
        with self._lock:
            self._pending.append((work, t))
        return work

    def _recv(self, t: Tensor, src: int, tag: int) -> None:
        dist.irecv(t, src=src, group=self.remote_group, tag=tag).wait()

    def offload_remote(self, buffer: str, lc, peer_rank: int, mb: int, layer: int, task: str = "?") -> int:
        """act.roffload: pack the set into a device-pool buffer and send it to ``peer_rank``."""
        st, srcs, nbytes, pack = self._layout(lc.saved_tensors())
        buf = self.device_pool.acquire(pack)
        self._took(buf, f"{buffer} (send)")
        self._pack(srcs, buf, task)
        if self.debug:
            fence_wait(self._fence())
            self._checksums(st, buf)
        self._evict(lc, st)
        del srcs
        to_peer, _ = self._tags(mb, layer)
        self._isend(torch.tensor([pack], dtype=torch.int64, device=self.device), peer_rank, to_peer)
        work = dist.isend(buf[:pack], dst=peer_rank, group=self.remote_group, tag=to_peer + 1)
        # The task ends when the peer holds the set (as the plan frees the device bytes at its end);
        # the peer's matching act.rstore comes in the same order (checked at start-up), and every
        # other send is asynchronous, so this wait cannot close a cycle.
        work.wait()
        self.device_pool.release(buf, self._fence())
        self._delay()
        with self._lock:
            self._sets[buffer] = _Set(buffer, st, nbytes, pack, "peer")
        return pack

    def store_remote(self, buffer: str, owner_rank: int, mb: int, layer: int, task: str = "?") -> int:
        """act.rstore (peer): receive a set into the peer pool and keep it."""
        to_peer, _ = self._tags(mb, layer)
        hdr = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._recv(hdr, owner_rank, to_peer)
        n = int(hdr.item())
        buf = self.peer_pool.acquire(n)
        self._took(buf, f"{buffer} (peer)")
        self._recv(buf[:n], owner_rank, to_peer + 1)
        handoff.write(buf[:n], f"{buffer} (peer)")
        with self._lock:
            self._held[buffer] = _Set(buffer, [], n, n, "held", device=buf)
        return n

    def serve_remote(self, buffer: str, owner_rank: int, mb: int, layer: int, task: str = "?") -> int:
        """act.rserve (peer): send a kept set back to its owner (the task ends when the owner's
        act.ronload received it); the buffer returns to the pool."""
        with self._lock:
            rec = self._held.pop(buffer)
        _, back = self._tags(mb, layer)
        self._isend(torch.tensor([rec.nbytes], dtype=torch.int64, device=self.device), owner_rank, back)
        handoff.read(rec.device[:rec.nbytes], f"{buffer} (peer)")
        work = dist.isend(rec.device[:rec.nbytes], dst=owner_rank, group=self.remote_group, tag=back + 1)
        # held until the owner has it (a gloo Work reports completion only once waited, so the
        # pool is given the finished send, not the Work)
        work.wait()
        self.peer_pool.release(rec.device, self._fence())
        return rec.nbytes

    def onload_remote(self, buffer: str, lc, peer_rank: int, mb: int, layer: int, task: str = "?") -> int:
        """act.ronload: receive the set back from ``peer_rank`` into a device-pool buffer."""
        with self._lock:
            rec = self._sets[buffer]
        _, back = self._tags(mb, layer)
        hdr = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._recv(hdr, peer_rank, back)
        n = int(hdr.item())
        if n != rec.pack_nbytes:
            raise RuntimeError(f"task {task}: peer returned {n} bytes for {buffer}, expected {rec.pack_nbytes}")
        buf = self.device_pool.acquire(n)
        self._took(buf, f"{buffer} (received)")
        self._recv(buf[:n], peer_rank, back + 1)
        handoff.write(buf[:n], f"{buffer} (received)")
        dev = self._unpack(rec, buf, lc, task)
        if dev is not buf:
            self.device_pool.release(buf, self._fence())
        self._delay()
        with self._lock:
            rec.device, rec.where = dev, "device"
        return n

    # -- life cycle ------------------------------------------------------------------------------
    def is_resident(self, buffer: str) -> bool:
        with self._lock:
            rec = self._sets.get(buffer)
        return rec is None or rec.where == "device"

    def release(self, buffer: str, lc=None, fence=None) -> None:
        """The set's backward tasks all ran: its device buffer goes back to the pool (after
        ``fence``). In debug mode, checks that no saved tensor still views the buffer."""
        with self._lock:
            rec = self._sets.pop(buffer, None)
        if rec is not None and rec.packed is not None:  # quantized and never read back
            self.device_pool.release(rec.packed, fence)
        if rec is None or rec.device is None:
            return
        if self.debug and lc is not None:
            ptr = rec.device.untyped_storage().data_ptr()
            left = [n for n, t in lc.saved_tensors().items() if t.untyped_storage().data_ptr() == ptr]
            if left:
                raise RuntimeError(f"activation set {buffer}: released while {left[0]} still uses its buffer")
        self.device_pool.release(rec.device, fence)

    def end_step(self) -> None:
        """Wait for outstanding sends. Every set must be back on the device and released."""
        with self._lock:
            pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()
        with self._lock:
            left = [b for b, r in self._sets.items() if r.where != "device"]
            held = list(self._held)
        if left or held:
            raise RuntimeError(f"activation sets not returned at the end of the step: {(left + held)[:3]}")
        with self._lock:
            stale = list(self._sets)
        for b in stale:
            self.release(b)

    def memory(self) -> dict[str, int]:
        """Pool bytes: device (reserved by the device pool), host (reserved), peer (held)."""
        return {"device": self.device_pool.reserved, "host": self.host_pool.reserved, "peer": self.peer_pool.held()}

"""Buffer pools: size-class free lists keyed by (size class, dtype), with accounting and fences.

[Note: pools and fences]
A pool hands out flat 1-D buffers. ``acquire(nbytes, dtype)`` rounds the request up to a size
class (4 KiB minimum, then eight classes per power of two: at most 12.5% slack), takes a free
buffer of that class whose *fence* has completed, or allocates a new one (counted in
``stats.allocs``; the hot path of a steady step allocates nothing). ``release(buf, fence)``
returns a buffer with the fence of the last asynchronous operation that reads or writes it (a
CUDA event recorded after the copy, a ``torch.distributed`` Work of an isend, a
``threading.Event``, or None when the operation already finished): the pool never hands the
buffer out again before that fence completed, so a buffer whose copy is in flight is never reused.

Three pools per rank: ``device`` (onloaded activations, packed sends, gradient-shard temporaries;
on GPU the pool allocates on the compute stream, other lanes receive buffers through the fence
events), ``host`` (offloaded activations: pinned on GPU, an explicit host pool on CPU) and ``peer``
(activations this rank keeps for other ranks). Their ``reserved`` bytes are what the runtime's
memory accounting reports.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

MIN_CLASS = 4096


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its size class (>= 4 KiB; 8 classes per power of two)."""
    n = max(int(nbytes), MIN_CLASS)
    top = 1 << (n - 1).bit_length()  # next power of two >= n
    step = max(MIN_CLASS, top // 16)  # 8 classes between top/2 and top
    return -(-n // step) * step


def fence_done(fence) -> bool:
    """Whether an asynchronous operation's fence has completed (None: already done)."""
    if fence is None:
        return True
    if isinstance(fence, (list, tuple)):
        return all(fence_done(f) for f in fence)
    if isinstance(fence, threading.Event):
        return fence.is_set()
    if hasattr(fence, "query"):  # torch.cuda.Event
        return bool(fence.query())
    if hasattr(fence, "is_completed"):  # torch.distributed Work
        return bool(fence.is_completed())
    raise TypeError(f"not a fence: {type(fence).__name__}")


def fence_wait(fence, timeout_s: float = 300.0) -> None:
    """Block the calling thread until ``fence`` completed."""
    if fence is None:
        return
    if isinstance(fence, (list, tuple)):
        for f in fence:
            fence_wait(f, timeout_s)
        return
    if isinstance(fence, threading.Event):
        if not fence.wait(timeout_s):
            raise TimeoutError(f"buffer fence not signalled after {timeout_s:.0f} s")
    elif hasattr(fence, "synchronize"):
        fence.synchronize()
    elif hasattr(fence, "wait"):
        fence.wait()


@dataclass
class PoolStats:
    reserved: int = 0  # bytes of every buffer the pool owns
    in_use: int = 0  # bytes handed out and not released
    peak_reserved: int = 0
    peak_in_use: int = 0
    allocs: int = 0  # fresh allocations
    reuses: int = 0  # requests served from a free list
    fenced_skips: int = 0  # free buffers passed over because their fence was still pending


class BufferPool:
    """A pool of flat buffers on one device (see [Note: pools and fences]).

    ``pin``: allocate pinned host memory (the host pool of a CUDA rank). ``alloc_stream``: on
    CUDA, fresh buffers are allocated with this stream current (the compute stream), so the
    caching allocator ties them to one stream whatever lane asks."""

    def __init__(self, name: str, device: torch.device | str = "cpu", *, pin: bool = False, alloc_stream=None) -> None:
        self.name = name
        self.device = torch.device(device)
        self.pin = pin
        self.alloc_stream = alloc_stream
        self.stats = PoolStats()
        self._free: dict[tuple[int, torch.dtype], list[tuple[Tensor, object]]] = defaultdict(list)
        self._out: dict[int, int] = {}  # id(buffer) -> class bytes
        self.ptrs: set[int] = set()  # data pointers of every buffer this pool allocated
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, dtype: torch.dtype = torch.uint8) -> Tensor:
        """A flat buffer of at least ``nbytes`` bytes (``dtype`` elements); contents undefined."""
        cls = size_class(nbytes)
        key = (cls, dtype)
        with self._lock:
            free = self._free.get(key)
            buf = None
            if free:
                for i, (b, fence) in enumerate(free):
                    if fence_done(fence):
                        buf = free.pop(i)[0]
                        self.stats.reuses += 1
                        break
                    self.stats.fenced_skips += 1
            if buf is None:
                buf = self._allocate(cls, dtype)
                self.ptrs.add(buf.untyped_storage().data_ptr())
                self.stats.allocs += 1
                self.stats.reserved += cls
                self.stats.peak_reserved = max(self.stats.peak_reserved, self.stats.reserved)
            self._out[id(buf)] = cls
            self.stats.in_use += cls
            self.stats.peak_in_use = max(self.stats.peak_in_use, self.stats.in_use)
            return buf

    def _allocate(self, cls: int, dtype: torch.dtype) -> Tensor:
        n = cls // torch.empty((), dtype=dtype).element_size()
        if self.device.type == "cuda" and self.alloc_stream is not None:
            with torch.cuda.stream(self.alloc_stream):
                return torch.empty(n, dtype=dtype, device=self.device)
        return torch.empty(n, dtype=dtype, device=self.device, pin_memory=self.pin)

    def release(self, buf: Tensor, fence=None) -> None:
        """Give ``buf`` back; it is handed out again only once ``fence`` completed."""
        with self._lock:
            cls = self._out.pop(id(buf), None)
            if cls is None:
                raise ValueError(f"{self.name} pool: release of a buffer it did not hand out (or released twice)")
            self.stats.in_use -= cls
            self._free[(cls, buf.dtype)].append((buf, fence))

    @property
    def reserved(self) -> int:
        return self.stats.reserved

    def held(self) -> int:
        """Bytes handed out plus free bytes whose fence is still pending (memory in use)."""
        with self._lock:
            pending = sum(k[0] for k, free in self._free.items() for _, f in free if not fence_done(f))
            return self.stats.in_use + pending

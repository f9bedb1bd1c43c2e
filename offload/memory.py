"""Memory accounting of one rank over a step: device, host and peer bytes, sampled after every task.

[Note: measured memory]
On GPU, ``device`` is ``torch.cuda.memory_allocated`` (and the peak ``max_memory_allocated``).
On CPU, where "device" and "host" are the same RAM, the accounting is the pools' and the model's:
``device`` = parameters + gradients + optimizer state + gradient-shard device buffers (distinct
storages) + saved activations resident on the device (distinct storages of every live saved
tensor; placeholders of offloaded tensors and device-pool buffers are not counted twice) +
P2P send buffers until their send completed (``in_flight``; the plan holds a send's buffer until
its receive ends) + the device pool's held bytes (handed out, or free with a copy still in flight: like
``memory_allocated``, cached free buffers are not counted; ``stats.reserved`` has them);
``host`` = the host pool's reserved bytes (+ host gradient shards); ``peer`` = bytes the peer pool holds for other ranks. These are the quantities the
planner's memory model predicts (``peak_device_bytes`` includes bytes held for peers, so the
comparable measured peak is ``device + peer``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor


def _distinct_bytes(tensors: Iterable[Tensor], skip: set[int] | None = None) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in seen or (skip and ptr in skip):
            continue
        seen.add(ptr)
        n = st.nbytes()
        if n > t.element_size():  # a one-element storage is an offload placeholder
            total += n
    return total


class MemoryTracker:
    """Samples (time µs, device, host, peer) bytes; see [Note: measured memory].

    ``static``: callable -> tensors resident on the device besides activations (parameters, their
    gradients, optimizer state, gradient buffers); ``saved``: callable -> the live saved tensors;
    ``pools``: the activation manager (``device_pool`` / ``host_pool`` / ``peer_pool``);
    ``extra_host``: callable -> more host bytes (gradient shards); ``in_flight``: callable -> device
    buffers of transfers not yet complete (P2P sends), counted once with the saved tensors."""

    def __init__(self, static: Callable[[], Iterable[Tensor]], saved: Callable[[], Iterable[Tensor]], pools,
                 device: torch.device, extra_host: Callable[[], int] | None = None,
                 in_flight: Callable[[], Iterable[Tensor]] | None = None) -> None:
        self.static, self.saved, self.pools = static, saved, pools
        self.device = device
        self.extra_host = extra_host or (lambda: 0)
        self.in_flight = in_flight or (lambda: ())
        self.samples: list[tuple[float, int, int, int]] = []
        self.peak_device = 0  # device + peer (what the plan's peak_device_bytes counts)
        self.peak_host = 0
        self.peak_peer = 0
        self.missed_samples = 0  # samples not taken (the stores kept changing while read)

    def begin_step(self) -> None:
        self.samples = []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def sample(self) -> tuple[float, int, int, int]:
        now = time.monotonic_ns() / 1e3
        pools = self.pools
        peer = pools.peer_pool.held()
        host = pools.host_pool.reserved + self.extra_host()
        if self.device.type == "cuda":
            dev = torch.cuda.memory_allocated(self.device) - peer
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            for _ in range(8):  # another lane may change a store while it is read: read again
                try:
                    saved = list(self.saved()) + list(self.in_flight())
                    break
                except RuntimeError:
                    continue
            else:  # pragma: no cover - a sample without the saved tensors would read low: none, counted
                self.missed_samples += 1
                return self.samples[-1] if self.samples else (now, 0, 0, 0)
            skip = pools.device_pool.ptrs | pools.peer_pool.ptrs
            dev = _distinct_bytes(self.static()) + _distinct_bytes(saved, skip) + pools.device_pool.held()
            peak = dev + peer
        s = (now, dev, host, peer)
        self.samples.append(s)
        self.peak_device = max(self.peak_device, peak)
        self.peak_host = max(self.peak_host, host)
        self.peak_peer = max(self.peak_peer, peer)
        return s

    def counter_events(self, pid: int, t0_us: float) -> list[dict]:
        """Chrome-trace counter events (``ph: "C"``, name ``memory``; docs/formats.md)."""
        return [{"ph": "C", "name": "memory", "pid": pid, "ts": round(t - t0_us, 3),
                 "args": {"device": d, "host": h, "peer": p}} for t, d, h, p in self.samples]

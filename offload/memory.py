"""Memory accounting of one rank over a step: device, host and peer bytes, sampled after every task,
and beside them what the allocator says every live allocation of the rank holds.

[Note: measured memory]
Two figures are sampled after every task: what the code's own bookkeeping knows (*tracked*) and
what the allocator has handed out (*allocated*); their difference is the bytes nobody told the
bookkeeping about (*untracked*: a handler stashing a buffer, a leak, a communication library's
buffers, the transient tensors of a task running on another lane at that instant).

Device / host / peer counters. On GPU, ``device`` is ``torch.cuda.memory_allocated`` (and the
peak ``max_memory_allocated``). On CPU, where "device" and "host" are the same RAM, the accounting is
the pools' and the model's: ``device`` = parameters + gradients + optimizer state + gradient-shard
device buffers (distinct storages) + saved activations resident on the device (distinct storages
of every live saved tensor; placeholders of offloaded tensors and device-pool buffers are not
counted twice) + P2P send buffers until their send completed (``in_flight``; the plan holds a
send's buffer until its receive ends) + the device pool's held bytes (handed out, or free with a
copy still in flight: like ``memory_allocated``, cached free buffers are not counted;
``stats.reserved`` has them); ``host`` = the host pool's reserved bytes (+ host gradient shards);
``peer`` = bytes the peer pool holds for other ranks. These are the quantities the planner's
memory model predicts (``peak_device_bytes`` includes bytes held for peers, so the comparable
measured peak is ``device + peer``). Tracked: what the bookkeeping knows in the allocator's
memory, summed for the comparison with the allocator: on CPU the distinct storages above (pool
buffers once, a storage both static and saved once) + every pool's reserved bytes (cached free
buffers are allocated) + the host gradient shards; on GPU the same restricted to the device.

Allocated. On GPU, ``torch.cuda.memory_allocated``: every live tensor on the device, whoever
allocated it; not the caching allocator's free blocks, NCCL's own buffers or the CUDA context.
On CPU, glibc's ``mallinfo2()`` (read through ctypes, cheap enough that every sample takes
it): ``uordblks`` (bytes in use in every arena's heap) + ``hblkhd`` (bytes in mmapped chunks).
torch's CPU allocator takes every tensor from malloc (``posix_memalign``; large ones are mmapped
chunks), so this counts every live tensor of the process: the tracked ones, a handler's stash,
gloo's buffers, a leak. It also counts what is not a tensor's data: tensor and other C++ objects,
Python objects above pymalloc's 512-byte limit, malloc's chunk headers and the small free chunks
glibc keeps in its per-thread caches (tcache, at most 1 KiB each). It does not count memory mapped
outside malloc (pymalloc's arenas of small Python objects, thread stacks, library code), and it
does not count allocator caching: freed bytes kept in an arena are not in use. The heap holds the
whole process (interpreter, libraries, data loaders), so the figure is taken relative to a
baseline at step start: ``allocated = tracked0 + (heap - heap0)``, with ``tracked0`` and
``heap0`` read together in :meth:`MemoryTracker.begin_step`: the bookkeeping's total at step start
plus every byte malloc handed out and did not get back since. ``untracked`` is the largest
``allocated - tracked`` over the samples (at one instant, not the difference of two peaks; the
two reads of a sample are not atomic, so a lane allocating between them adds to it). Bytes
a rank already held untracked at step start are not in it (the baseline hides them): those are
``untracked_growth``, the growth of ``heap0 - tracked0`` from the second step's start to each later
one (the first step's lazy set-up, e.g. autograd's and gloo's, is behind the second step's
start), so a tensor kept from one step to the next adds its bytes once per step it is kept. A run
of one or two steps has no such figure (``None``).

Before it is used the meter is checked on a real 4 MiB tensor: a libc without ``mallinfo2``
(not glibc, or glibc before 2.33), or a process whose tensors come from another malloc (jemalloc,
tcmalloc preloaded), leaves the allocator figure unavailable with a one-line reason
(:attr:`MemoryTracker.allocator_note`) that the run prints and writes into its summary; the
allocated and untracked figures are then ``None``, never zero.

Lost samples. A lane may add to a saved-tensor store while another lane's sample reads it (a
Python dict iterated while it changes size). The read is retried, yielding the interpreter between
tries; a sample whose tracked read still fails records the allocated figure alone and is counted
in :attr:`MemoryTracker.missed_samples`, which the run's trace, summary and closing line report.
Any other error of the read propagates.

[Note: static tensors read by one thread]
The static tensors (parameters, their ``.grad``, optimizer state, weight versions) are changed by
one lane only, the compute lane (backward, WGrad, the optimizer), and some of those changes are
not safe to watch from another thread: ``optimizer.zero_grad(set_to_none=True)`` frees a gradient
whose Python object torch tears down with the interpreter lock released part-way, so another
lane's ``p.grad`` read in that window increfs a dying object (a SIGSEGV seen in a pipedream-2bw
run, where the optimizer runs mid-plan while other lanes sample), and autograd sets ``.grad``
without the lock at all. So only samples taken on the compute lane walk the static tensors
(``read_static=True``; also :meth:`MemoryTracker.begin_step`, before the lanes run); samples of the
other lanes count the table of the compute lane's last walk, which is exact between compute tasks
and misses at most what the compute task in progress has changed.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

MiB = 2**20
RETRIES = 64
"""Tries of a tracked read that races a store changing size ([Note: measured memory])."""
PROBE_BYTES = 4 * MiB


class MeterUnavailable(RuntimeError):
    """The allocator figure cannot be measured here; the message is the one-line reason."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


class HeapMeter:
    """Bytes glibc's malloc has handed out and not taken back (``mallinfo2``: ``uordblks +
    hblkhd``), see [Note: measured memory]. ``libc``: the C library to read it from (default:
    the process's own); raises :class:`MeterUnavailable` with the reason when it has no
    ``mallinfo2`` or does not see torch's CPU tensors."""

    name = "glibc mallinfo2"

    def __init__(self, libc: str | None = None) -> None:
        lib_name = libc or "this process's C library"
        try:
            lib = ctypes.CDLL(libc)  # None: the symbols the process already has (its malloc)
            fn = lib.mallinfo2
        except (OSError, AttributeError):
            raise MeterUnavailable(f"{lib_name} has no mallinfo2 (glibc >= 2.33 only): allocator-measured memory "
                                   f"unavailable, tracked bytes only") from None
        fn.restype, fn.argtypes = _MallInfo2, []
        self._fn = fn
        before = self.read()
        probe = torch.empty(PROBE_BYTES, dtype=torch.uint8)
        grew = self.read() - before
        del probe
        if grew < PROBE_BYTES:
            raise MeterUnavailable(f"mallinfo2 of {lib_name} saw {grew} of a {PROBE_BYTES}-byte tensor (torch's "
                                   f"memory comes from another allocator?): allocator-measured memory unavailable, "
                                   f"tracked bytes only")

    def read(self) -> int:
        m = self._fn()
        return m.uordblks + m.hblkhd


class CudaMeter:
    """``torch.cuda.memory_allocated`` of one device (absolute: no baseline needed)."""

    name = "torch.cuda.memory_allocated"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> int:
        return torch.cuda.memory_allocated(self.device)


def allocator_meter(device: torch.device, libc: str | None = None) -> tuple[HeapMeter | CudaMeter | None, str]:
    """(meter, its name) for ``device``, or (None, the one-line reason it is unavailable)."""
    if device.type == "cuda":
        return CudaMeter(device), CudaMeter.name
    try:
        return HeapMeter(libc), HeapMeter.name
    except MeterUnavailable as e:
        return None, str(e)


def _storage_table(tensors: Iterable[Tensor], cuda_only: bool = False) -> dict[int, int]:
    """Data pointer -> bytes of each distinct storage behind ``tensors`` (0 for a one-element
    storage: an offload placeholder); ``cuda_only``: leave out tensors not on a CUDA device."""
    out: dict[int, int] = {}
    for t in tensors:
        if cuda_only and not t.is_cuda:
            continue
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in out:
            n = st.nbytes()
            out[ptr] = n if n > t.element_size() else 0
    return out


def _changed_size(e: RuntimeError) -> bool:
    return "changed size during iteration" in str(e)


class MemoryTracker:
    """Samples (time µs, device, host, peer) bytes and (time µs, allocated, tracked) bytes; see
    [Note: measured memory].

    ``static``: callable -> tensors resident on the device besides activations (parameters, their
    gradients, optimizer state, gradient buffers); ``saved``: callable -> the live saved tensors;
    ``pools``: the activation manager (``device_pool`` / ``host_pool`` / ``peer_pool``);
    ``extra_host``: callable -> more host bytes (gradient shards); ``in_flight``: callable -> device
    buffers of transfers not yet complete (P2P sends), counted once with the saved tensors.
    ``libc``: where to read ``mallinfo2`` on CPU (default: the process's C library)."""

    def __init__(self, static: Callable[[], Iterable[Tensor]], saved: Callable[[], Iterable[Tensor]], pools,
                 device: torch.device, extra_host: Callable[[], int] | None = None,
                 in_flight: Callable[[], Iterable[Tensor]] | None = None, libc: str | None = None) -> None:
        self.static, self.saved, self.pools = static, saved, pools
        self.device = device
        self.extra_host = extra_host or (lambda: 0)
        self.in_flight = in_flight or (lambda: ())
        self.meter, self.allocator_note = allocator_meter(device, libc)
        self.samples: list[tuple[float, int, int, int]] = []
        self.alloc_samples: list[tuple[float, int | None, int | None]] = []  # (µs, allocated, tracked)
        self.peak_device = 0  # device + peer (what the plan's peak_device_bytes counts)
        self.peak_host = 0
        self.peak_peer = 0
        self.peak_tracked = 0  # the bookkeeping's bytes in the allocator's memory
        self.peak_allocated: int | None = None if self.meter is None else 0
        self.untracked: int | None = None if self.meter is None else 0
        self.missed_samples = 0  # samples whose tracked read lost to stores changing size (allocated kept)
        self._base: tuple[int, int] | None = None  # (tracked, heap) at step start (CPU)
        self._starts: list[tuple[int, int]] = []  # (tracked, meter reading) at the first two step starts
        self.untracked_growth: int | None = None
        self._static_table: dict[int, int] | None = None  # [Note: static tensors read by one thread]

    def begin_step(self) -> None:
        self.samples = []
        self.alloc_samples = []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.meter is None:
            return
        read = self._read_tracked()
        if read is None:
            raise RuntimeError("memory tracker: the saved-tensor stores kept changing at step start")
        start = (read[3], self.meter.read())
        if self.device.type != "cuda":
            self._base = start
        if len(self._starts) < 2:
            self._starts.append(start)
        else:  # untracked bytes held at step start, beyond those at the second step's start
            ref = self._starts[1]
            grown = (start[1] - ref[1]) - (start[0] - ref[0])
            self.untracked_growth = max(self.untracked_growth or 0, grown)

    def _read_tracked(self, read_static: bool = True) -> tuple[int, int, int, int] | None:
        """(device, host, peer, tracked) bytes, or None when every try lost to a store changing size.
        ``read_static``: walk the static tensors now (only on the thread that changes them, see
        [Note: static tensors read by one thread]); otherwise count the table of its last walk."""
        pools = self.pools
        cpu = self.device.type == "cpu"
        for _ in range(RETRIES):
            try:
                if read_static or self._static_table is None:
                    self._static_table = _storage_table(list(self.static()), not cpu)
                saved = list(self.saved()) + list(self.in_flight())
                extra_host = self.extra_host()
                skip = pools.device_pool.ptrs | pools.peer_pool.ptrs
            except RuntimeError as e:
                if not _changed_size(e):
                    raise
                time.sleep(0)  # let the lane that is changing the store finish
                continue
            st, sv = self._static_table, _storage_table(saved, not cpu)
            peer = pools.peer_pool.held()
            host = pools.host_pool.reserved + extra_host
            static_b = own = 0  # own: distinct storages outside the pools, static and saved once
            for p, n in st.items():
                static_b += n
                if p not in skip:
                    own += n
            saved_b = 0
            for p, n in sv.items():
                if p not in skip:
                    saved_b += n
                    if p not in st:
                        own += n
            dev = static_b + saved_b + pools.device_pool.held()
            tracked = own + pools.device_pool.reserved + pools.peer_pool.reserved + (host if cpu else 0)
            return dev, host, peer, tracked
        return None

    def sample(self, read_static: bool = True) -> tuple[float, int, int, int]:
        """Take a sample; ``read_static`` as in :meth:`_read_tracked` (False on every thread but
        the one that changes the static tensors: [Note: static tensors read by one thread])."""
        now = time.monotonic_ns() / 1e3
        read = self._read_tracked(read_static)
        heap = self.meter.read() if self.meter is not None else None
        allocated = heap
        if heap is not None and self.device.type != "cuda":  # CPU: relative to the step's start
            if self._base is None and read is not None:  # no step began: from this sample on
                self._base = (read[3], heap)
            allocated = None if self._base is None else self._base[0] + heap - self._base[1]
        if read is None:
            self.missed_samples += 1
            self.alloc_samples.append((now, allocated, None))
            if allocated is not None:
                self.peak_allocated = max(self.peak_allocated, allocated)
            return self.samples[-1] if self.samples else (now, 0, 0, 0)
        dev, host, peer, tracked = read
        if self.device.type == "cuda":
            dev = torch.cuda.memory_allocated(self.device) - peer
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = dev + peer
        s = (now, dev, host, peer)
        self.samples.append(s)
        self.alloc_samples.append((now, allocated, tracked))
        self.peak_device = max(self.peak_device, peak)
        self.peak_host = max(self.peak_host, host)
        self.peak_peer = max(self.peak_peer, peer)
        self.peak_tracked = max(self.peak_tracked, tracked)
        if allocated is not None:
            self.peak_allocated = max(self.peak_allocated, allocated)
            self.untracked = max(self.untracked, allocated - tracked)
        return s

    def totals(self) -> list[int]:
        """Peak device, host, peer, allocated, tracked bytes, untracked bytes, lost samples and
        untracked growth across steps, as numbers to gather over ranks (-1: not measured); see
        :func:`memory_report`."""
        return [self.peak_device, self.peak_host, self.peak_peer,
                -1 if self.peak_allocated is None else self.peak_allocated, self.peak_tracked,
                -1 if self.untracked is None else self.untracked, self.missed_samples,
                -1 if self.untracked_growth is None else self.untracked_growth]

    def report(self) -> dict:
        """This rank's memory figures (``None`` where unavailable)."""
        return self.reports([self.totals()])[0]

    def trace_fields(self) -> dict:
        """A rank trace's ``otherData`` memory fields: ``memory_samples_missed`` and ``memory``
        (:meth:`report`; docs/formats.md)."""
        return {"memory_samples_missed": self.missed_samples, "memory": self.report()}

    def reports(self, rows: list[list[int]]) -> list[dict]:
        """Each rank's figures from its gathered :meth:`totals` rows, the allocator named as this
        rank measures it."""
        name = self.allocator_note if self.meter is not None else None
        return [memory_report(r, name, self.allocator_note) for r in rows]

    def summary_fields(self, rows: list[list[int]]) -> dict:
        """summary.json's allocator-measured fields from the gathered :meth:`totals` rows (per
        rank; null where unavailable; docs/formats.md)."""
        reports = self.reports(rows)
        return {"memory_allocator": reports[0]["allocator"],
                "memory_allocator_unavailable": reports[0]["allocator_unavailable"],
                "peak_allocated_bytes_measured": [m["peak_allocated_bytes"] for m in reports],
                "peak_tracked_bytes_measured": [m["peak_tracked_bytes"] for m in reports],
                "untracked_bytes_measured": [m["untracked_bytes"] for m in reports],
                "untracked_growth_bytes_measured": [m["untracked_growth_bytes"] for m in reports],
                "memory_samples_missed": [m["samples_missed"] for m in reports]}

    def closing_line(self, rows: list[list[int]]) -> str:
        """The run's closing line on memory (:func:`format_memory`) from the gathered rows."""
        return format_memory(self.reports(rows))

    def counter_events(self, pid: int, t0_us: float) -> list[dict]:
        """Chrome-trace counter events (``ph: "C"``): ``memory`` (device / host / peer) and, where
        the allocator is measured, ``memory.allocator`` (allocated / tracked); docs/formats.md."""
        out = [{"ph": "C", "name": "memory", "pid": pid, "ts": round(t - t0_us, 3),
                "args": {"device": d, "host": h, "peer": p}} for t, d, h, p in self.samples]
        out += [{"ph": "C", "name": "memory.allocator", "pid": pid, "ts": round(t - t0_us, 3),
                 "args": {"allocated": a} if r is None else {"allocated": a, "tracked": r}}
                for t, a, r in self.alloc_samples if a is not None]
        return out


def memory_report(totals: list[int], allocator: str | None, note: str) -> dict:
    """The memory figures of one rank from its :meth:`MemoryTracker.totals`: ``allocator`` the
    meter's name (None: unavailable, ``note`` says why)."""
    def opt(x: int) -> int | None:
        return None if allocator is None or x < 0 else int(x)

    return {"allocator": allocator, "allocator_unavailable": None if allocator is not None else note,
            "peak_allocated_bytes": opt(totals[3]), "peak_tracked_bytes": int(totals[4]),
            "untracked_bytes": opt(totals[5]), "samples_missed": int(totals[6]),
            "untracked_growth_bytes": opt(totals[7])}


def format_memory(reports: list[dict]) -> str:
    """One line for a run's end: each rank's allocated / tracked / untracked peak in MiB, the
    allocator's name or why it is unavailable, untracked bytes kept across steps where a rank's
    reach 1 MiB, and lost tracked samples when there were any."""
    first = reports[0] if reports else {}
    if first.get("allocator") is None:
        line = (f"memory: {first.get('allocator_unavailable') or 'no ranks'}; tracked peak per rank (MiB): "
                + ", ".join(f"r{r} {m['peak_tracked_bytes'] / MiB:.2f}" for r, m in enumerate(reports)))
    else:
        line = (f"memory per rank, allocated / tracked / untracked (MiB, {first['allocator']}): "
                + ", ".join(f"r{r} {m['peak_allocated_bytes'] / MiB:.2f}/{m['peak_tracked_bytes'] / MiB:.2f}/"
                            f"{m['untracked_bytes'] / MiB:.2f}" for r, m in enumerate(reports)))
    grown = [(r, g) for r, m in enumerate(reports) if (g := m.get("untracked_growth_bytes")) and g >= MiB]
    if grown:
        line += "; untracked bytes kept across steps (growth since step 2's start): " + ", ".join(
            f"r{r} {g / MiB:.2f}" for r, g in grown)
    missed = [(r, m["samples_missed"]) for r, m in enumerate(reports) if m["samples_missed"]]
    if missed:
        line += "; tracked samples lost to stores changing while read: " + ", ".join(f"r{r} {n}" for r, n in missed)
    return line

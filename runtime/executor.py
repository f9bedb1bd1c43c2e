"""Five-lane executor: runs one rank's part of a plan (its PP stage's entry of plan.json).

[Note: lane execution]
The executor runs a :class:`~k3sched.lowering.LaneProgram`: the rank's stage of plan.json lowered
by the passes of [Note: lowering] in k3sched/lowering.py (which the P2P check replays too); it
adds no ordering of its own. Every lane (compute, ep, collective, offload_local, offload_remote)
has a dedicated worker thread (and, on GPU, a dedicated CUDA stream that thread makes current). A
lane runs its tasks strictly in the program's order, one at a time. A task waits for the
program's dependencies (same-rank tasks that must have finished, and its ``start_deps``: tasks
that must have *started*) through threading events and, on GPU, CUDA events recorded on the
producing lane's stream. Dependencies on other stages' tasks are satisfied by the P2P task itself
(the recv waits for the matching send).

One interpreter touches the hardware: :class:`Executor` maps a task's kind to a handler (a dict
kind -> callable) and enters the lane through :meth:`Executor._lane` (wait on input events, open
the NVTX range named by the task id on the issuing thread, run, record start/end and the done
event). CUDA objects are created lazily, so this module imports and runs on CPU.

[Note: serial execution]
With ``serial=True`` (the ``serial`` strategy) the stage runs one task at a time, as the plan's
baseline says: every task also waits for the task before it in the token order (a stage-wide
token passed along one linear extension of the lane orders and dependencies, earliest planned
start first: :func:`k3sched.lowering.serial_tokens`). Lane threads stay, so the trace format and
the handlers are the same, but no two tasks of a rank ever overlap. One thing stays asynchronous by construction: a P2P send task
posts its ``isend`` and ends; gloo and NCCL move the bytes once the receiver has posted the matching
receive, inside the receiver's ``recv`` task (where the cost model puts the transfer). A send that
waited for its bytes to leave would wait for the receiver, and deadlock plans whose stages both
send before they receive (gloo's send is a rendezvous too).

A failing task aborts the step: the other lanes stop at their next wait and :meth:`run_step`
re-raises the first error, naming the task. A wait longer than ``dep_timeout_s`` raises too
(naming the task and the dependency), so a plan the runtime cannot follow never hangs silently.

With a race detector (``racecheck``, [Note: race detector] in runtime/racecheck.py) every task is
entered and left on it around its body, so the accesses it records are the task's; its
happens-before order is this executor's: :meth:`Executor.dependencies` plus lane order.

No wait is unbounded: lane start-up (a lane that fails before it is ready is reported, not waited
for), dependency waits, a task that runs longer than ``dep_timeout_s`` (a handler stuck in a
collective whose peer died: named by :meth:`Executor._stuck`) and, on GPU, the end of a step
(lane-stream events polled up to ``dep_timeout_s`` instead of ``torch.cuda.synchronize``; after an
abort nothing waits for the GPU: the caller aborts the communicators, runtime/train.py).

[Note: NVTX fallback]
Task ranges go through the ``nvtx`` package (domain ``k3sched``); without it, through
``torch.cuda.nvtx`` when CUDA is present (no domain); on CPU without it they are no-ops and the
first executor that wants ranges prints one notice line.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from k3sched.lowering import LaneProgram, PlanTask, lower
from k3sched.tasks import LANES, Kind


class _TorchNvtx:
    """``torch.cuda.nvtx`` behind the ``nvtx`` package's calls (it has no domains: the ranges land
    in the default domain; traces/nsys.py reads ranges by name, so they are taken all the same)."""

    def __init__(self, tn) -> None:
        self._tn = tn

    def push_range(self, message: str, domain: str | None = None) -> None:
        self._tn.range_push(message)

    def pop_range(self, domain: str | None = None) -> None:
        self._tn.range_pop()

    def mark(self, message: str, domain: str | None = None) -> None:
        self._tn.mark(message)


def load_nvtx():
    """The NVTX API this process uses ([Note: NVTX fallback]): the ``nvtx`` package; without it
    ``torch.cuda.nvtx`` where CUDA is present; else None (ranges are no-ops; one notice line on
    stderr, once, the first time an executor wants ranges)."""
    try:
        import nvtx

        return nvtx
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return _TorchNvtx(torch.cuda.nvtx)
    except Exception:  # noqa: BLE001 - no torch, or a CUDA build that cannot load NVTX
        pass
    return None


_nvtx = load_nvtx()
_nvtx_notice = [False]


def _nvtx_missing_notice() -> None:
    if not _nvtx_notice[0]:
        _nvtx_notice[0] = True
        import sys

        print("k3sched: NVTX ranges off (no nvtx package and no CUDA torch.cuda.nvtx); pip install nvtx to "
              "record them", file=sys.stderr, flush=True)

NVTX_DOMAIN = "k3sched"
TRACE_FORMAT = "k3sched.trace/1"
PERTURB_ENV = "K3SCHED_PERTURB"


def parse_perturb(spec: str | None, rank: int | None = None) -> tuple[str, int | None] | None:
    """``LANE[:I][@RANK]`` -> (lane, i): swap tasks i and i+1 of the lane (the first independent
    pair without ``:I``), on rank RANK only when given. None/'' (or another rank) -> None."""
    if not spec:
        return None
    spec, _, only = spec.partition("@")
    lane, _, idx = spec.partition(":")
    if lane not in LANES:
        raise ValueError(f"{PERTURB_ENV}={spec!r}: lane must be one of {', '.join(LANES)}")
    if only and rank is not None and int(only) != rank:
        return None
    return lane, (int(idx) if idx else None)


def perturb_lanes(lanes: dict[str, list[PlanTask]], lane: str, index: int | None) -> tuple[str, str] | None:
    """Swap two adjacent tasks of ``lane`` (debug switch for trace-validation tests).

    With ``index`` None, the first adjacent pair whose second task does not (transitively, on this
    stage) depend on the first is swapped, so the perturbed run still completes. Returns the
    swapped ids, or None when the lane has no such pair."""
    tasks = lanes[lane]
    by_id = {t.id: t for ts in lanes.values() for t in ts}

    def depends(a: PlanTask, b: PlanTask) -> bool:  # does a (transitively) depend on b?
        seen, todo = set(), list(a.deps) + list(a.start_deps)
        while todo:
            d = todo.pop()
            if d == b.id:
                return True
            if d in seen or d not in by_id:
                continue
            seen.add(d)
            todo.extend(by_id[d].deps)
            todo.extend(by_id[d].start_deps)
        return False

    candidates = [index] if index is not None else range(len(tasks) - 1)
    for i in candidates:
        if 0 <= i < len(tasks) - 1 and (index is not None or not depends(tasks[i + 1], tasks[i])):
            tasks[i], tasks[i + 1] = tasks[i + 1], tasks[i]
            return tasks[i + 1].id, tasks[i].id
    return None


Handler = Callable[[PlanTask], None]


class TaskError(RuntimeError):
    """A task failed; ``task_id`` names it. The message is one line."""

    def __init__(self, task_id: str, msg: str):
        super().__init__(f"task {task_id}: {msg}")
        self.task_id = task_id


class _Aborted(Exception):
    """Raised in a lane when another lane failed (not reported on its own)."""


@dataclass
class TaskTiming:
    id: str
    lane: str
    start_us: float
    end_us: float


@dataclass
class StepRecord:
    """What one executed step left: per task start/end (µs, monotonic clock), and lane thread ids."""

    step: int
    timings: list[TaskTiming]
    lane_tid: dict[str, int]
    wall_s: float


@dataclass
class _StepState:
    step: int
    done: dict[str, threading.Event]
    started: dict[str, threading.Event]
    abort: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    timings: dict[str, list] = field(default_factory=dict)
    cuda_events: dict[str, tuple] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: dict[str, tuple[str, float]] = field(default_factory=dict)  # lane -> (task id, monotonic start)


class _CudaLanes:
    """Lazily created CUDA streams (one per lane) and events (start/done per task)."""

    def __init__(self, device) -> None:
        import torch

        self.torch = torch
        if getattr(device, "index", None) is None:  # "cuda" without an index: the current device
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.streams: dict[str, object] = {}

    def stream(self, lane: str):
        s = self.streams.get(lane)
        if s is None:
            s = self.streams[lane] = self.torch.cuda.Stream(device=self.device)
        return s

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)


class Executor:
    """Runs the lane program of one stage (see [Note: lane execution]).

    ``program``: a :class:`~k3sched.lowering.LaneProgram` ([Note: lowering] in k3sched/lowering.py):
    what each lane runs, in order, and what each task waits for. A mapping lane -> ordered tasks
    (:func:`stage_lanes`) is lowered here with :func:`k3sched.lowering.lower`: ``perturb`` (lane,
    index or None) first swaps two tasks of that lane (``K3SCHED_PERTURB`` in a run, [Note: runtime
    options]); ``extra_deps``: task id -> more same-rank data dependencies the plan leaves implicit;
    ``serial``: one task at a time on this stage ([Note: serial execution]); ``shared_links``:
    groups of lanes whose tasks run one at a time in planned order (plan.json ``shared_links``).
    ``stage``: the stage of ``lanes`` (default 0). A program is run as it is: those stay unset.
    ``handlers``: kind -> callable(task). ``device``: a torch device; CUDA streams are used when it
    is a CUDA device. ``nvtx``: push an NVTX range per task. ``racecheck``: a
    :class:`runtime.racecheck.RaceChecker` (or anything with ``enter(id)`` / ``leave(id)``) told
    which task each lane thread runs (settable after construction: ``racecheck`` attribute).
    """

    def __init__(self, program: LaneProgram | Mapping[str, list[PlanTask]], handlers: Mapping[Kind, Handler], *,
                 rank: int = 0, stage: int | None = None, device=None, perturb: tuple[str, int | None] | None = None,
                 extra_deps: Mapping[str, tuple[str, ...]] | None = None, dep_timeout_s: float = 300.0,
                 nvtx: bool = True, serial: bool = False, shared_links: list | tuple = (), racecheck=None) -> None:
        self.perturbed = None
        if isinstance(program, LaneProgram):
            if perturb or extra_deps or serial or shared_links or stage not in (None, program.stage):
                raise ValueError("Executor: a LaneProgram runs as lowered; perturb, extra_deps, serial, "
                                 "shared_links and another stage belong to k3sched.lowering.lower")
        else:
            lanes = {lane: list(program.get(lane, [])) for lane in LANES}
            self.perturbed = perturb_lanes(lanes, *perturb) if perturb else None
            program = lower(lanes, stage or 0, extra=extra_deps, serial=serial, shared_links=shared_links)
        self.rank, self.stage = rank, program.stage
        self.lanes = {lane: list(ts) for lane, ts in program.lanes.items()}
        self.tasks = program.tasks()
        self._deps: dict[str, tuple[str, ...]] = dict(program.deps)
        self.handlers = dict(handlers)
        self.dep_timeout_s = dep_timeout_s
        self.abort_grace_s = 2.0
        self.use_nvtx = nvtx and _nvtx is not None
        if nvtx and _nvtx is None:
            _nvtx_missing_notice()
        unknown = sorted({t.kind.value for t in self.tasks.values() if t.kind not in self.handlers})
        if unknown:
            raise ValueError(f"no handler for task kind(s) {', '.join(unknown)} (stage {self.stage})")
        self.racecheck = racecheck
        self._cuda = None
        if device is not None and getattr(device, "type", str(device)) == "cuda":
            self._cuda = _CudaLanes(device)
        self._state: _StepState | None = None
        self._threads: dict[str, threading.Thread] = {}
        self._go: dict[str, threading.Semaphore] = {}
        self._finished = threading.Semaphore(0)
        self._tid: dict[str, int] = {}
        self._closed = False

    # -- lanes -----------------------------------------------------------------------------------
    def _start_threads(self) -> None:
        if self._threads:
            return
        ready = threading.Barrier(len(LANES) + 1)
        self._init_error: BaseException | None = None
        for lane in LANES:
            self._go[lane] = threading.Semaphore(0)
            th = threading.Thread(target=self._lane_main, args=(lane, ready), name=f"k3sched-{lane}", daemon=True)
            self._threads[lane] = th
            th.start()
        try:  # bounded: a lane that fails (or hangs) before the barrier must not hang the caller
            ready.wait(timeout=self.dep_timeout_s)
        except threading.BrokenBarrierError:
            self._closed = True
            err = self._init_error
            why = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}" if err \
                else f"not ready within {self.dep_timeout_s:.0f} s"
            raise RuntimeError(f"rank {self.rank}: a lane thread failed to start ({why})") from err

    def _lane_main(self, lane: str, ready: threading.Barrier) -> None:
        self._tid[lane] = threading.get_native_id()
        try:
            if self._cuda is not None:
                import torch

                torch.cuda.set_device(self._cuda.device)
                torch.cuda.set_stream(self._cuda.stream(lane))
        except BaseException as e:  # noqa: BLE001 - reported by _start_threads
            self._init_error = self._init_error or e
            ready.abort()
            return
        try:
            ready.wait(timeout=self.dep_timeout_s)
        except threading.BrokenBarrierError:
            return
        while True:
            self._go[lane].acquire()
            st = self._state
            if st is None or self._closed:
                return
            try:
                for task in self.lanes[lane]:
                    if st.abort.is_set():
                        break
                    with self._lane(lane, task, st):
                        self.handlers[task.kind](task)
            except _Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - reported by run_step
                with st.lock:
                    if st.error is None:
                        st.error = e if isinstance(e, TaskError) else _as_task_error(e, getattr(e, "_k3_task", "?"))
                st.abort.set()
            finally:
                self._finished.release()

    def _wait(self, st: _StepState, task: PlanTask, dep: str, events: dict[str, threading.Event], what: str) -> None:
        ev = events[dep]
        if ev.is_set():
            return
        deadline = time.monotonic() + self.dep_timeout_s
        while not ev.wait(0.05):
            if st.abort.is_set():
                raise _Aborted()
            if time.monotonic() > deadline:
                raise TaskError(task.id, f"waited {self.dep_timeout_s:.0f} s for {dep} to {what} (lane {task.lane}; "
                                         "a plan order the runtime cannot follow, or a stuck peer)")

    @contextlib.contextmanager
    def _lane(self, lane: str, task: PlanTask, st: _StepState) -> Iterator[None]:
        """Enter ``lane`` for ``task``: wait on its input events, open its NVTX range, time it,
        record its done event: every task enters its lane here, so they are kept in one place
        (docs/design.md, section 1, rules 1 and 2)."""
        for d in task.start_deps:
            self._wait(st, task, d, st.started, "start")
        for d in self._deps[task.id]:
            self._wait(st, task, d, st.done, "finish")
        cuda = self._cuda
        if cuda is not None:
            stream = cuda.stream(lane)
            for d in self._deps[task.id]:
                ev = st.cuda_events[d][1]
                stream.wait_event(ev)
            ev_start, ev_end = cuda.event(), cuda.event()
            ev_start.record(stream)
        if self.use_nvtx:
            _nvtx.push_range(message=task.id, domain=NVTX_DOMAIN)
        rc = self.racecheck
        if rc is not None:
            rc.enter(task.id)
        t0 = time.monotonic_ns()
        st.running[lane] = (task.id, t0 / 1e9)
        st.started[task.id].set()
        try:
            yield
        except _Aborted:
            raise
        except BaseException as e:  # noqa: BLE001
            raise _as_task_error(e, task.id) from e
        finally:
            st.running.pop(lane, None)
            if rc is not None:
                rc.leave(task.id)
            if self.use_nvtx:
                _nvtx.pop_range(domain=NVTX_DOMAIN)
        t1 = time.monotonic_ns()
        if cuda is not None:
            ev_end.record(cuda.stream(lane))
            st.cuda_events[task.id] = (ev_start, ev_end)
        st.timings[task.id] = [lane, t0 / 1e3, t1 / 1e3]
        st.done[task.id].set()

    def dependencies(self) -> dict[str, tuple[str, ...]]:
        """Task id -> the same-stage tasks it waits to finish (the program's: plan deps, extra deps,
        serial and shared-link tokens; not ``start_deps``, which order starts only). With lane
        order, this is the happens-before order of the stage ([Note: race detector] in
        runtime/racecheck.py)."""
        return dict(self._deps)

    def lane_streams(self) -> dict[str, object]:
        """Lane -> its CUDA stream (created now if need be); empty on CPU."""
        if self._cuda is None:
            return {}
        return {lane: self._cuda.stream(lane) for lane in LANES}

    # -- steps -----------------------------------------------------------------------------------
    def run_step(self, step: int = 0) -> StepRecord:
        """Run every lane's tasks once; return the timings. Raises the first task error."""
        if self._closed:
            raise RuntimeError("executor is closed")
        self._start_threads()
        st = _StepState(step, {t: threading.Event() for t in self.tasks}, {t: threading.Event() for t in self.tasks})
        self._state = st
        cuda = self._cuda
        base = None
        if cuda is not None:
            import torch

            self._gpu_drain(f"step {step} start")  # bounded, unlike torch.cuda.synchronize
            base = cuda.event()
            base.record(torch.cuda.current_stream(cuda.device))
            base_cpu_us = time.monotonic_ns() / 1e3
        t0 = time.perf_counter()
        for lane in LANES:
            self._go[lane].release()
        pending = len(LANES)
        abort_deadline = None
        while pending:
            if self._finished.acquire(timeout=0.05):
                pending -= 1
            elif not st.abort.is_set() and self._stuck(st):
                continue  # _stuck set the error and the abort
            elif st.abort.is_set():
                # a lane failed; the others stop at their next wait, but one may sit in a collective
                # that will never finish (its peer failed too): give up on it after a grace period
                abort_deadline = abort_deadline or time.monotonic() + self.abort_grace_s
                if time.monotonic() > abort_deadline:
                    self._closed = True  # lane threads are daemons; this executor is done
                    break
        if cuda is not None and not st.abort.is_set():
            # never torch.cuda.synchronize here: after an abort a collective kernel may wait on a
            # dead peer forever (the caller aborts the communicators instead, runtime/train.py);
            # otherwise wait for the lanes' streams, bounded by dep_timeout_s
            try:
                self._gpu_drain(f"step {step}")
            except TaskError as e:
                st.error = e
        wall = time.perf_counter() - t0
        self._state = None
        if st.error is not None:
            raise st.error
        if cuda is not None:  # GPU: the stream's start/end times, on the CPU clock of the step start
            for tid, (a, b) in st.cuda_events.items():
                lane = st.timings[tid][0]
                st.timings[tid] = [lane, base_cpu_us + base.elapsed_time(a) * 1e3, base_cpu_us + base.elapsed_time(b) * 1e3]
        timings = [TaskTiming(tid, v[0], v[1], v[2]) for tid, v in st.timings.items()]
        timings.sort(key=lambda t: (t.start_us, t.id))
        return StepRecord(step, timings, dict(self._tid), wall)

    def _stuck(self, st: _StepState) -> bool:
        """A task that has run well past ``dep_timeout_s`` (a handler stuck in a collective or a
        transfer whose peer never comes) aborts the step, naming it; True when it did. The margin
        lets a task waiting on it report first (that names the dependency too)."""
        now = time.monotonic()
        limit = self.dep_timeout_s * 1.25 + 1.0
        for lane, (tid, started) in list(st.running.items()):
            if now - started > limit:
                with st.lock:
                    if st.error is None:
                        st.error = TaskError(tid, f"still running after {limit:.0f} s (lane {lane}; "
                                                  "stuck in a collective or transfer whose peer never came?)")
                st.abort.set()
                return True
        return False

    def _gpu_drain(self, what: str) -> None:
        """Wait until the work queued on every lane stream and the current stream has finished,
        polling events (bounded by ``dep_timeout_s``; raises TaskError naming ``what``)."""
        import torch

        cuda = self._cuda
        evs = []
        for s in [torch.cuda.current_stream(cuda.device), *cuda.streams.values()]:
            ev = torch.cuda.Event()
            ev.record(s)
            evs.append(ev)
        deadline = time.monotonic() + self.dep_timeout_s
        while not all(ev.query() for ev in evs):
            if time.monotonic() > deadline:
                raise TaskError(what, f"GPU work not finished after {self.dep_timeout_s:.0f} s (a collective "
                                      "waiting on a dead peer?)")
            time.sleep(0.0005)

    def close(self) -> None:
        """Stop the lane threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._state = None
        for lane, sem in self._go.items():
            sem.release()
        deadline = time.monotonic() + 2.0  # a lane stuck in a dead collective is a daemon: leave it
        for th in self._threads.values():
            th.join(timeout=max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- trace -----------------------------------------------------------------------------------
    def lane_ids(self, record: StepRecord) -> dict[str, int]:
        """Trace ``tid`` per lane: the lane thread's native id (CPU) or its CUDA stream id (GPU)."""
        if self._cuda is not None:
            return {lane: int(self._cuda.stream(lane).stream_id) for lane in LANES}
        return dict(record.lane_tid)

    def chrome_trace(self, record: StepRecord, *, plan_step_time_us: float | None = None,
                     t0_us: float | None = None) -> dict:
        """The per-rank runtime trace (docs/formats.md, ``k3sched.trace/1``) of one step."""
        tids = self.lane_ids(record)
        events: list[dict] = [{"ph": "M", "name": "process_name", "pid": self.rank, "tid": 0,
                               "args": {"name": f"rank {self.rank} (stage {self.stage})"}}]
        for lane in LANES:
            events.append({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tids[lane],
                           "args": {"name": lane}})
        base = 0.0 if t0_us is None else t0_us
        for t in record.timings:
            task = self.tasks[t.id]
            events.append({"ph": "X", "name": t.id, "cat": t.lane, "ts": round(t.start_us - base, 3),
                           "dur": round(max(0.0, t.end_us - t.start_us), 3), "pid": self.rank, "tid": tids[t.lane],
                           "args": {"lane": t.lane, "stage": self.stage, "step": record.step, "bytes": task.bytes}})
        other = {"format": TRACE_FORMAT, "rank": self.rank, "stage": self.stage, "step": record.step,
                 "clock": "cuda-events" if self._cuda is not None else "monotonic", "host": socket.gethostname(),
                 "plan_step_time_us": plan_step_time_us, "measured_step_time_us": record.wall_s * 1e6}
        if self.perturbed:
            other["perturbed"] = list(self.perturbed)
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _as_task_error(e: BaseException, task_id: str) -> TaskError:
    if isinstance(e, TaskError):
        return e
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    err = TaskError(task_id, f"{type(e).__name__}: {msg}" if msg else type(e).__name__)
    err.__cause__ = e
    return err


def noop_handlers() -> dict[Kind, Handler]:
    """A handler table of no-ops (to measure the executor's own per-task overhead)."""
    def nothing(task: PlanTask) -> None:
        return None

    return {k: nothing for k in Kind}

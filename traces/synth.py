"""Synthetic plans and ideal traces, for tests and the seeded-fault suite.

``small_plan()`` builds, by hand, a valid ``k3sched.plan/1`` dict (2 stages, 2 micro-batches, one
MoE layer per stage, every lane used, an offload/onload pair on each offload lane, cross-lane and
cross-stage deps), with start/end from a tiny list scheduler. ``trace_from_plan`` turns any plan
(the planner's included) into the Chrome events a conforming runtime would record. The mutation
helpers each seed one fault into a copy of such a list.
"""

from __future__ import annotations

import copy
import random

from k3sched.planfile import PLAN_FORMAT
from k3sched.tasks import LANE_OF, LANES, Kind, format_task_id

LANE_TID_BASE = 100  # tid of lane i is LANE_TID_BASE + i in synthetic traces

_DUR = {"compute": 100.0, "ep": 40.0, "collective": 30.0, "offload_local": 50.0, "offload_remote": 60.0}


def lane_tid(lane: str) -> int:
    return LANE_TID_BASE + LANES.index(lane)


def _task(stage, kind, *, mb=None, layer=None, chunk=0, deps=(), buffer=None, peer_stage=None, nbytes=0):
    kind = Kind(kind)
    tid = format_task_id(stage, kind, mb=mb, layer=layer, chunk=chunk if layer is None or mb is None else None)
    lane = LANE_OF[kind]
    return {"id": tid, "kind": kind.value, "lane": lane, "stage": stage, "chunk": chunk, "mb": mb, "layer": layer,
            "start_us": 0.0, "end_us": 0.0, "deps": list(deps),
            "mem": {"alloc": {"device": 0, "host": 0, "peer": 0}, "free": {"device": 0, "host": 0, "peer": 0}},
            "bytes": nbytes, "buffer": buffer, "peer_stage": peer_stage}


def small_plan(n_mb: int = 2) -> dict:
    """A hand-built 2-stage plan in the docs/formats.md format (see module docstring)."""
    I = lambda s, k, **kw: format_task_id(s, Kind(k), **kw)  # noqa: E731
    lanes = {s: {lane: [] for lane in LANES} for s in (0, 1)}

    def add(t):
        lanes[t["stage"]][t["lane"]].append(t)

    for s in (0, 1):
        L = s
        # forward
        for m in range(n_mb):
            first = [I(1, "act.recv", mb=m, chunk=0)] if s == 1 else []
            if s == 1:
                add(_task(1, "act.recv", mb=m, chunk=0, deps=[I(0, "act.send", mb=m, chunk=0)], nbytes=1 << 20))
            add(_task(s, "attn.fwd", mb=m, layer=L, deps=first))
            add(_task(s, "dispatch.fwd", mb=m, layer=L, deps=[I(s, "attn.fwd", mb=m, layer=L)], nbytes=1 << 22))
            add(_task(s, "expert.fwd", mb=m, layer=L, deps=[I(s, "dispatch.fwd", mb=m, layer=L)]))
            add(_task(s, "combine.fwd", mb=m, layer=L, deps=[I(s, "expert.fwd", mb=m, layer=L)], nbytes=1 << 22))
            buf = f"s{s}/mb{m}/L{L}/attn.in"
            if s == 0:
                add(_task(0, "act.offload", mb=m, layer=L, deps=[I(0, "attn.fwd", mb=m, layer=L)], buffer=buf,
                          nbytes=1 << 24))
                add(_task(0, "act.send", mb=m, chunk=0, deps=[I(0, "combine.fwd", mb=m, layer=L)], nbytes=1 << 20))
            else:
                add(_task(1, "act.roffload", mb=m, layer=L, deps=[I(1, "attn.fwd", mb=m, layer=L)], buffer=buf,
                          peer_stage=0, nbytes=1 << 24))
        # backward
        for m in range(n_mb):
            buf = f"s{s}/mb{m}/L{L}/attn.in"
            if s == 0:
                add(_task(0, "grad.recv", mb=m, chunk=0, deps=[I(1, "grad.send", mb=m, chunk=0)], nbytes=1 << 20))
                start_dep = I(0, "grad.recv", mb=m, chunk=0)
                add(_task(0, "act.onload", mb=m, layer=L, deps=[I(0, "act.offload", mb=m, layer=L)], buffer=buf,
                          nbytes=1 << 24))
                on = I(0, "act.onload", mb=m, layer=L)
            else:
                start_dep = I(1, "combine.fwd", mb=m, layer=L)
                add(_task(1, "act.ronload", mb=m, layer=L, deps=[I(1, "act.roffload", mb=m, layer=L)], buffer=buf,
                          peer_stage=0, nbytes=1 << 24))
                on = I(1, "act.ronload", mb=m, layer=L)
            add(_task(s, "combine.bwd", mb=m, layer=L, deps=[start_dep], nbytes=1 << 22))
            add(_task(s, "expert.dx", mb=m, layer=L, deps=[I(s, "combine.bwd", mb=m, layer=L)]))
            add(_task(s, "dispatch.bwd", mb=m, layer=L, deps=[I(s, "expert.dx", mb=m, layer=L)], nbytes=1 << 22))
            add(_task(s, "attn.dx", mb=m, layer=L, deps=[I(s, "dispatch.bwd", mb=m, layer=L), on]))
            if s == 1:
                add(_task(1, "grad.send", mb=m, chunk=0, deps=[I(1, "attn.dx", mb=m, layer=L)], nbytes=1 << 20))
        for m in range(n_mb):
            add(_task(s, "expert.dw", mb=m, layer=L, deps=[I(s, "expert.dx", mb=m, layer=L)]))
            add(_task(s, "attn.dw", mb=m, layer=L, deps=[I(s, "attn.dx", mb=m, layer=L)]))
        add(_task(s, "grad.rs", layer=L, chunk=0,
                  deps=[I(s, k, mb=m, layer=L) for m in range(n_mb) for k in ("expert.dw", "attn.dw")],
                  nbytes=1 << 26))
    # lane order: the order tasks were added, except the collective lane of stage 0 and the
    # offload lanes, which run their items in dependency order as added (already so)
    plan = {"format": PLAN_FORMAT, "config": {"synthetic": "traces.synth.small_plan", "n_mb": n_mb},
            "strategy": "k3", "pipeline": "gpipe", "lanes": list(LANES),
            "stages": [{"stage": s, "lanes": lanes[s]} for s in (0, 1)], "metrics": {}}
    schedule(plan)
    return plan


def schedule(plan: dict, durations: dict | None = None) -> dict:
    """Fill start_us/end_us of every task: each lane runs its tasks in order, a task starts when
    its lane is free and its deps have ended (a list scheduler; deps may cross stages). Also
    fills ``metrics.step_time_us``. Raises ValueError on a dependency cycle or unknown dep."""
    durations = durations or _DUR
    queues = [(st["stage"], lane, st["lanes"][lane]) for st in plan["stages"] for lane in plan["lanes"]]
    pos = {(s, lane): 0 for s, lane, _ in queues}
    free = {(s, lane): 0.0 for s, lane, _ in queues}
    end: dict[str, float] = {}
    ids = {t["id"] for _, _, q in queues for t in q}
    total = len(ids)
    while len(end) < total:
        progressed = False
        for s, lane, q in queues:
            while pos[(s, lane)] < len(q):
                t = q[pos[(s, lane)]]
                missing = [d for d in t["deps"] if d not in ids]
                if missing:
                    raise ValueError(f"task {t['id']} depends on unknown {missing[0]}")
                if any(d not in end for d in t["deps"]):
                    break
                start = max([free[(s, lane)]] + [end[d] for d in t["deps"]])
                t["start_us"], t["end_us"] = start, start + durations[lane]
                end[t["id"]] = t["end_us"]
                free[(s, lane)] = t["end_us"]
                pos[(s, lane)] += 1
                progressed = True
        if not progressed:
            raise ValueError("dependency cycle in plan")
    plan.setdefault("metrics", {})["step_time_us"] = max(end.values()) - min(
        t["start_us"] for _, _, q in queues for t in q)
    return plan


def plan_tasks(plan: dict) -> list[dict]:
    return [t for st in plan["stages"] for lane in plan["lanes"] for t in st["lanes"].get(lane, [])]


def trace_from_plan(plan: dict, rank_of_stage: dict | None = None, jitter: float = 0.0, *, seed: int = 0,
                    t0_us: float = 1_000_000.0) -> list[dict]:
    """The Chrome events (runtime format, docs/formats.md) of an ideal run of ``plan``: one ``X``
    event per task per rank at its planned time + ``t0_us``, ``tid`` = ``lane_tid(lane)``, plus
    ``thread_name`` metadata. ``rank_of_stage`` maps stage -> rank or list of ranks (default:
    rank = stage). ``jitter`` in [0, 1) shortens each duration by a random fraction up to it, so the
    trace still conforms (starts, order and deps are kept)."""
    rng = random.Random(seed)
    rank_of_stage = rank_of_stage or {st["stage"]: st["stage"] for st in plan["stages"]}
    out: list[dict] = []
    for st in plan["stages"]:
        ranks = rank_of_stage[st["stage"]]
        for rank in ranks if isinstance(ranks, (list, tuple)) else [ranks]:
            for lane in plan["lanes"]:
                out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": lane_tid(lane),
                            "args": {"name": lane}})
                for t in st["lanes"].get(lane, []):
                    dur = (t["end_us"] - t["start_us"]) * (1.0 - jitter * rng.random())
                    out.append({"ph": "X", "name": t["id"], "cat": lane, "ts": t["start_us"] + t0_us, "dur": dur,
                                "pid": rank, "tid": lane_tid(lane),
                                "args": {"lane": lane, "stage": st["stage"], "step": 0, "bytes": t.get("bytes", 0)}})
    return out


def runtime_trace_files(events: list[dict], plan: dict) -> dict[int, dict]:
    """Split events by rank into runtime trace objects (``trace_rank{R}.json`` contents)."""
    by_rank: dict[int, list] = {}
    for e in events:
        by_rank.setdefault(e["pid"], []).append(e)
    step = (plan.get("metrics") or {}).get("step_time_us", 0.0)
    stage_of = {}
    for e in events:
        if e["ph"] == "X":
            stage_of.setdefault(e["pid"], e["args"]["stage"])
    return {r: {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": {"format": "k3sched.trace/1", "rank": r, "stage": stage_of.get(r), "plan_step_time_us": step}}
            for r, ev in sorted(by_rank.items())}


# ---- seeded faults (each returns a mutated deep copy) -----------------------------------

def _find(events, task_id, rank=None):
    hits = [e for e in events if e.get("ph") == "X" and e["name"] == task_id and (rank is None or e["pid"] == rank)]
    if not hits:
        raise KeyError(f"{task_id} not in trace" + ("" if rank is None else f" on rank {rank}"))
    return hits[0]


def swap_tasks(events, a: str, b: str, rank=None) -> list[dict]:
    """Swap the start times of two tasks (same lane): the lane runs them in the other order."""
    ev = copy.deepcopy(events)
    ea, eb = _find(ev, a, rank), _find(ev, b, rank)
    ea["ts"], eb["ts"] = eb["ts"], ea["ts"]
    return ev


def move_to_tid(events, task_id: str, tid: int, rank=None) -> list[dict]:
    ev = copy.deepcopy(events)
    _find(ev, task_id, rank)["tid"] = tid
    return ev


def start_before_end_of(events, task_id: str, other: str, by_us: float = 25.0, rank=None) -> list[dict]:
    """Move ``task_id`` so it starts ``by_us`` before ``other`` ends (a consumer before its
    producer's end, an onload before its offload's end)."""
    ev = copy.deepcopy(events)
    e, o = _find(ev, task_id, rank), _find(ev, other, rank)
    e["ts"] = o["ts"] + o["dur"] - by_us
    return ev


def post_early(events, task_id: str, other: str, by_us: float = 25.0, rank=None) -> list[dict]:
    """Start ``task_id`` ``by_us`` before ``other`` starts, keeping its end (a receive posted
    before its send, waiting for the data: legal, see [Note: validation rules])."""
    ev = copy.deepcopy(events)
    e, o = _find(ev, task_id, rank), _find(ev, other)
    end = e["ts"] + e["dur"]
    e["ts"] = o["ts"] - by_us
    e["dur"] = end - e["ts"]
    return ev


def end_before_start_of(events, task_id: str, other: str, by_us: float = 25.0, rank=None) -> list[dict]:
    """Move ``task_id`` so it ends ``by_us`` before ``other`` starts (a receive that completed
    before its send began: impossible on a real link)."""
    ev = copy.deepcopy(events)
    e, o = _find(ev, task_id, rank), _find(ev, other)
    e["ts"] = o["ts"] - by_us - e["dur"]
    return ev


def with_remote_peer_tasks(plan: dict) -> dict:
    """A copy of ``plan`` (e.g. :func:`small_plan`) in which every act.roffload of stage s to
    ``peer_stage`` p has the peer-side tasks the real planner emits: act.rstore on p (deps: the
    roffload) and act.rserve on p (deps: the rstore), and the owner's act.ronload depends on the
    rserve; rescheduled."""
    plan = copy.deepcopy(plan)
    by_stage = {st["stage"]: st for st in plan["stages"]}
    for st in list(plan["stages"]):
        for off in [t for t in st["lanes"]["offload_remote"] if t["kind"] == "act.roffload"]:
            peer = off["peer_stage"]
            kw = dict(mb=off["mb"], layer=off["layer"], buffer=off["buffer"], peer_stage=st["stage"],
                      nbytes=off["bytes"])
            store = _task(peer, "act.rstore", deps=[off["id"]], **kw)
            serve = _task(peer, "act.rserve", deps=[store["id"]], **kw)
            by_stage[peer]["lanes"]["offload_remote"] += [store, serve]
            ron = format_task_id(st["stage"], Kind.ACT_RONLOAD, mb=off["mb"], layer=off["layer"])
            for t in st["lanes"]["offload_remote"]:
                if t["id"] == ron:
                    t["deps"] = [serve["id"]]
    return schedule(plan)


def drop_task(events, task_id: str, rank=None) -> list[dict]:
    ev = copy.deepcopy(events)
    victim = _find(ev, task_id, rank)
    return [e for e in ev if e is not victim]


def add_task(events, name: str, rank: int, tid: int, ts: float, dur: float = 10.0) -> list[dict]:
    ev = copy.deepcopy(events)
    ev.append({"ph": "X", "name": name, "cat": "x", "ts": ts, "dur": dur, "pid": rank, "tid": tid, "args": {}})
    return ev


# --- Nsight Systems SQLite and Kineto JSON of an ideal run (tests, fuzzing, benchmarks/bench_validate.py)

NSYS_TABLES = ["StringIds", "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "META_DATA_EXPORT"]
NSYS_SCHEMA = {  # the columns of the real export (schema 3.25) that the reader uses
    "StringIds": "CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL)",
    "NVTX_EVENTS": "CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, "
                   "rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, "
                   "endGlobalTid INTEGER, textId INTEGER, domainId INTEGER)",
    "CUPTI_ACTIVITY_KIND_KERNEL": "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT "
                                  "NULL, deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT "
                                  "NULL, correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL, "
                                  "shortName INTEGER NOT NULL, gridX INTEGER NOT NULL)",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT "
                                   "NULL, eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, "
                                   "nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL, callchainId INTEGER)",
    "META_DATA_EXPORT": "CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT)",
}


def _insert(con, table: str, cols: dict, n: int) -> None:
    """Insert n rows: given columns (arrays or scalars); other NOT NULL columns get 0 / ''."""
    import numpy as np

    info = con.execute(f"PRAGMA table_info({table})").fetchall()
    names = [r[1] for r in info]
    data = []
    for name, typ, notnull in ((r[1], r[2], r[3]) for r in info):
        v = cols.get(name, None if not notnull else ("" if typ == "TEXT" else 0))
        data.append(v.tolist() if isinstance(v, np.ndarray) else [v] * n)
    con.executemany(f"INSERT INTO {table} ({','.join(names)}) VALUES ({','.join('?' * len(names))})", zip(*data))


def nsys_sqlite(path, plan: dict, n_kernels: int = 0, ddl: dict | None = None, seed: int = 0, *,
                kernels_per_task: int | None = None, kernel_shift_us: dict | None = None,
                kernel_lane: dict | None = None) -> None:
    """Write an Nsight Systems SQLite export of an ideal run of ``plan``: one process per stage
    (= rank), one thread per lane, one NVTX push/pop range per task at its planned time, and
    ``n_kernels`` kernels launched from inside the ranges (runtime rows with correlation ids), each
    lane's kernels on its own stream. ``ddl``: CREATE TABLE statements per table (default
    :data:`NSYS_SCHEMA`).

    ``kernels_per_task=K`` replaces the random kernels by K kernels per task that cover its
    range on the device (kernel i of a task spanning [s, e] runs [s + 2 + i(e-s)/K, s + 2 +
    (i+1)(e-s)/K - gap] µs, launched inside the range; ep / collective kernels are named like NCCL
    kernels), so the device timeline follows the plan like the host one. Then
    ``kernel_shift_us`` {task id: µs} moves a task's kernels on the device (not its launches:
    the host order stays right) and ``kernel_lane`` {task id: lane} puts a task's kernels on
    another lane's stream."""
    import sqlite3

    import numpy as np

    ddl = ddl or NSYS_SCHEMA
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=OFF")
    con.execute("PRAGMA synchronous=OFF")
    for t in NSYS_TABLES:
        con.execute(ddl[t])
    tasks = plan_tasks(plan)
    ids = [t["id"] for t in tasks]
    n = len(tasks)
    _insert(con, "StringIds", {"id": np.arange(n + 3), "value": np.array(
        ids + ["gemm_kernel", "cudaLaunchKernel", "ncclDevKernel_SendRecv"], dtype=object)}, n + 3)
    stage = np.array([t["stage"] for t in tasks])
    lane = np.array([LANES.index(t["lane"]) for t in tasks])
    pid = 1000 + 1000 * stage
    gtid = (pid << 24) | (pid + 1 + lane)
    t0 = 10**9
    start = t0 + (np.array([t["start_us"] for t in tasks]) * 1e3).astype(np.int64)
    end = t0 + (np.array([t["end_us"] for t in tasks]) * 1e3).astype(np.int64)
    _insert(con, "NVTX_EVENTS", {"start": start, "end": end, "eventType": 59, "globalTid": gtid,
                                 "textId": np.arange(n), "domainId": 0}, n)
    if kernels_per_task is None:
        # kernels: spread over the task ranges, launched inside each range
        owner = np.sort(np.random.default_rng(seed).integers(0, n, n_kernels))
        first = np.searchsorted(owner, np.arange(n))
        k_in = np.arange(n_kernels) - first[owner]
        per = np.bincount(owner, minlength=n)
        span = (end - start)[owner]
        launch = start[owner] + (k_in + 1) * span // (per[owner] + 2)
        kstart, kend, kname = launch + 2000, launch + 2500, np.full(n_kernels, n)
        kstream = 7 + lane[owner]
    else:
        k = int(kernels_per_task)
        n_kernels = n * k
        owner = np.repeat(np.arange(n), k)
        k_in = np.tile(np.arange(k), n)
        span = (end - start)[owner]
        launch = start[owner] + k_in * span // (k + 1) + 500
        kstart = start[owner] + 2000 + k_in * span // k
        kend = np.maximum(kstart + 1, start[owner] + 2000 + (k_in + 1) * span // k - np.minimum(1000, span // (4 * k)))
        shift = np.array([int(round((kernel_shift_us or {}).get(i, 0.0) * 1e3)) for i in ids], np.int64)[owner]
        kstart, kend = kstart + shift, kend + shift
        comm = np.isin(lane, [LANES.index("ep"), LANES.index("collective")])[owner]
        kname = np.where(comm, n + 2, n)
        klane = np.array([LANES.index((kernel_lane or {}).get(i, t["lane"])) for i, t in zip(ids, tasks)])
        kstream = 7 + klane[owner]
    corr = np.arange(1, n_kernels + 1)
    kpid = pid[owner]
    _insert(con, "CUPTI_ACTIVITY_KIND_RUNTIME", {"start": launch, "end": launch + 50, "eventClass": 1,
                                                 "globalTid": gtid[owner], "correlationId": corr, "nameId": n + 1,
                                                 "returnValue": 0}, n_kernels)
    _insert(con, "CUPTI_ACTIVITY_KIND_KERNEL", {"start": kstart, "end": kend, "deviceId": stage[owner],
                                                "contextId": 1, "streamId": kstream, "correlationId": corr,
                                                "globalPid": kpid << 24, "demangledName": kname, "shortName": kname,
                                                "gridX": 1, "tensorSizeMinusOneElements": "[]"}, n_kernels)
    _insert(con, "META_DATA_EXPORT", {"name": np.array(["EXPORT_SCHEMA_VERSION"], dtype=object),
                                      "value": np.array(["3.25.0"], dtype=object)}, 1)
    con.commit()
    con.close()


def kineto_trace(plan: dict, stage: int, rank: int | None = None, t0_us: float = 1_000_000.0, *,
                 kernels_per_task: int = 1, kernel_shift_us: dict | None = None,
                 kernel_lane: dict | None = None) -> dict:
    """A PyTorch-profiler (Kineto) JSON of one rank's ideal run of ``plan``'s ``stage``: one
    ``user_annotation`` range per task on its lane's thread, one ``cuda_runtime`` launch inside it
    and one ``kernel`` on the lane's stream, joined by correlation id.

    ``kernels_per_task=K`` launches K kernels per task (in [0.2, 0.8] of its range; ep /
    collective kernels named like NCCL kernels, offload lanes' as ``gpu_memcpy`` when K > 1),
    ``kernel_shift_us`` {task id: µs} moves a task's GPU events (not its launches) and
    ``kernel_lane`` {task id: lane} puts them on another lane's stream."""
    ev: list[dict] = []
    corr = 0
    st = next(s for s in plan["stages"] if s["stage"] == stage)
    k = int(kernels_per_task)
    for lane in plan["lanes"]:
        tid = lane_tid(lane)
        for t in st["lanes"].get(lane, []):
            ts, dur = t["start_us"] + t0_us, t["end_us"] - t["start_us"]
            ev.append({"ph": "X", "cat": "user_annotation", "name": t["id"], "pid": 1, "tid": tid, "ts": ts,
                       "dur": dur})
            shift = (kernel_shift_us or {}).get(t["id"], 0.0)
            stream = 7 + LANES.index((kernel_lane or {}).get(t["id"], lane))
            part = 0.6 * dur / k
            for i in range(k):
                corr += 1
                cat, name = "kernel", "gemm_kernel"
                if k > 1 and lane in ("ep", "collective"):
                    name = "ncclDevKernel_SendRecv"
                elif k > 1 and lane.startswith("offload"):
                    cat, name = "gpu_memcpy", "Memcpy DtoH (Device -> Pinned)"
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid,
                           "ts": ts + dur * 0.1 + i * 0.05 * dur / k, "dur": dur * 0.05 / k,
                           "args": {"correlation": corr}})
                ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream,
                           "ts": ts + dur * 0.2 + i * part + shift, "dur": part * 5 / 6,
                           "args": {"correlation": corr, "stream": stream, "device": 0}})
    return {"schemaVersion": 1, "distributedInfo": {"rank": stage if rank is None else rank},
            "traceEvents": ev, "displayTimeUnit": "ms"}

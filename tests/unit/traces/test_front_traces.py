"""Hardened front doors of the trace readers (issue 15): every bad input is one TraceError line
naming the file and what is wrong / allowed; malformed events are counted, never dropped silently
([Note: malformed events] in traces/events.py)."""

import copy
import gzip
import json
import math
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from traces import synth
from traces.chrome import read_kineto, read_trace, read_traces, table_from_runtime
from traces.cli import validate_main
from traces.events import MAX_RANK, EventTable, TraceError
from traces.nsys import read_nsys_sqlite

PLAN = synth.small_plan()
REAL = (Path(__file__).resolve().parents[3] / ".." / "shared" / "traces" / "real").resolve()


def _runtime(rank=0) -> dict:
    return copy.deepcopy(synth.runtime_trace_files(synth.trace_from_plan(PLAN), PLAN)[rank])


def _xs(obj) -> list[int]:
    """Positions of the X events in traceEvents."""
    return [i for i, e in enumerate(obj["traceEvents"]) if e.get("ph") == "X"]


def _write(tmp_path, obj, name="trace.json") -> Path:
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def _err(path, **kw) -> str:
    with pytest.raises(TraceError) as ei:
        read_trace(path, **kw)
    msg = str(ei.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def _one_bad(tmp_path, mutate, reason: str, n_bad: int = 1):
    """Mutate the first X event (``mutate(event)``): one malformed event, named with its position
    and ``reason``; with skip_bad_events it is dropped and counted."""
    obj = _runtime()
    n = len(_xs(obj))
    pos = _xs(obj)[0]
    mutate(obj["traceEvents"][pos])
    p = _write(tmp_path, obj)
    msg = _err(p)
    assert f"{n_bad} malformed event" in msg and f"(first: event {pos}: " in msg, msg
    assert reason in msg and "--skip-bad-events" in msg, msg
    t = read_trace(p, skip_bad_events=True)
    assert t.bad_events == n_bad and len(t) == n - n_bad
    return msg


# ---- Chrome / runtime trace: per-event values ---------------------------------------------------

@pytest.mark.parametrize("mutate, reason", [
    (lambda e: e.__setitem__("args", [1, 2]), "args is a list [1, 2] (allowed: an object, or absent)"),
    (lambda e: e.__setitem__("args", "x"), "args is a string"),
    (lambda e: e.__setitem__("tid", math.inf), "tid Infinity is not a thread id"),
    (lambda e: e.__setitem__("tid", [3]), "tid [3] is not a thread id"),
    (lambda e: e.__setitem__("ts", 2 ** 63), "ts 9223372036854775808 is too large"),
    (lambda e: e.__setitem__("ts", 10 ** 400), "is too large"),
    (lambda e: e.__setitem__("ts", math.nan), "ts NaN is not finite"),
    (lambda e: e.__setitem__("dur", math.inf), "dur Infinity is not finite"),
    (lambda e: e.__setitem__("dur", -5), "dur -5 is negative"),
    (lambda e: e.__setitem__("ts", -1.5), "ts -1.5 is negative"),
    (lambda e: e.__setitem__("ts", "12"), 'ts "12" is not a number'),
    (lambda e: e.__setitem__("ts", True), "ts true is not a number"),
    (lambda e: e.pop("ts"), "ts is missing"),
    (lambda e: e.pop("dur"), "dur is missing"),
    (lambda e: e.__setitem__("name", 17), "name 17 is not a string"),
    (lambda e: e.pop("name"), "name is missing"),
    (lambda e: e.pop("ph"), "ph is missing"),
    (lambda e: e.__setitem__("ph", 88), "ph 88 is not a string"),
    (lambda e: e["args"].__setitem__("bytes", -1), "args.bytes -1 is not a byte count"),
    (lambda e: e["args"].__setitem__("bytes", "lots"), 'args.bytes "lots" is not a byte count'),
])
def test_runtime_event_value_is_malformed(tmp_path, mutate, reason):
    msg = _one_bad(tmp_path, mutate, reason)
    assert "allowed" in msg


def test_end_before_start_is_malformed_not_negative_busy_time(tmp_path):
    """Negative durations used to validate as CONFORMS with busy time -77,000 µs."""
    obj = _runtime()
    for i in _xs(obj):
        obj["traceEvents"][i]["dur"] = -77.0
    p = _write(tmp_path, obj)
    for skip in (False, True):  # nothing valid left: an error either way
        msg = _err(p, skip_bad_events=skip)
        assert f"{len(_xs(obj))} malformed events and no valid event to read" in msg and "dur -77.0 is negative" in msg
    plan_p = _write(tmp_path, PLAN, "plan.json")
    assert validate_main(str(plan_p), [str(p)], only_traced_stages=True) == 2


def test_all_nan_timestamps_are_an_error_even_when_skipping(tmp_path):
    obj = _runtime()
    for i in _xs(obj):
        obj["traceEvents"][i]["ts"] = math.nan
    msg = _err(_write(tmp_path, obj), skip_bad_events=True)
    assert "no valid event to read" in msg and "ts NaN is not finite" in msg


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize("key", ["ts", "dur"])
def test_json_nan_and_infinity_literals(tmp_path, key, literal):
    obj = _runtime()
    pos = _xs(obj)[0]
    obj["traceEvents"][pos][key] = "@@"
    p = _write(tmp_path, json.dumps(obj).replace('"@@"', literal))
    msg = _err(p)
    assert f"event {pos}: {key} " in msg and ("not finite" in msg or "negative" in msg), msg


def test_non_objects_in_trace_events_are_counted(tmp_path):
    obj = _runtime()
    obj["traceEvents"][3:3] = [5, "x", None, [1]]
    msg = _err(_write(tmp_path, obj))
    assert "4 malformed events (first: event 3: is a number 5 (allowed: an event object))" in msg
    t = read_trace(_write(tmp_path, obj), skip_bad_events=True)
    assert t.bad_events == 4 and len(t) == len(_xs(_runtime()))


@pytest.mark.parametrize("content, expect", [
    ("[1, 2, 3]", "3 malformed events and no valid event to read (first: event 0: is a number 1"),
    ('[{"ph": 3}]', "1 malformed event and no valid event to read"),
    ('{"traceEvents": {"a": 1}}', "'traceEvents' is an object, expected a list of event objects"),
    ('{"traceEvents": 5}', "'traceEvents' is a number"),
    ('{"events": []}', "not a Chrome trace (no 'traceEvents' list"),
    ("42", "not a Chrome trace (the file holds a number"),
    ('"hello"', "not a Chrome trace (the file holds a string"),
])
def test_not_a_trace_is_an_error_even_when_skipping(tmp_path, content, expect):
    p = _write(tmp_path, content)
    for skip in (False, True):
        assert expect in _err(p, skip_bad_events=skip)


@pytest.mark.parametrize("other, expect", [
    ([1], "'otherData' is a list [1], expected an object"),
    ("k3sched.trace/1", "'otherData' is a string"),
    ({"format": "k3sched.trace/1", "rank": "abc"}, 'otherData.rank "abc" is not a rank'),
    ({"format": "k3sched.trace/1", "rank": 10 ** 12}, "otherData.rank 1000000000000 is not a rank"),
    ({"format": "k3sched.trace/1", "rank": MAX_RANK}, f"otherData.rank {MAX_RANK} is not a rank"),
    ({"format": "k3sched.trace/1", "rank": -1}, "otherData.rank -1 is not a rank"),
    ({"format": "k3sched.trace/1", "rank": 1.5}, "otherData.rank 1.5 is not a rank"),
    ({"format": "k3sched.trace/1", "rank": math.inf}, "otherData.rank Infinity is not a rank"),
])
def test_bad_other_data_is_one_line(tmp_path, other, expect):
    obj = _runtime()
    obj["otherData"] = other
    msg = _err(_write(tmp_path, obj), skip_bad_events=True)
    assert expect in msg
    if "rank" in expect:
        assert "allowed: an integer 0 <= rank < 2^20" in msg


@pytest.mark.parametrize("pid, reason", [("rank0", 'pid "rank0" is not a rank'), (10 ** 12, "pid 1000000000000"),
                                         (-3, "pid -3 is not a rank"), (None, "pid null"), (2.5, "pid 2.5")])
def test_pid_read_as_rank_must_be_a_rank(tmp_path, pid, reason):
    obj = _runtime()
    del obj["otherData"]["rank"]
    pos = _xs(obj)[0]
    obj["traceEvents"][pos]["pid"] = pid
    msg = _err(_write(tmp_path, obj))
    assert f"event {pos}: {reason}" in msg


def test_string_thread_labels_and_rank_zero_pid_read(tmp_path):
    obj = {"traceEvents": [{"ph": "X", "name": "s0/mb0/L0/attn.fwd", "ts": 1, "dur": 2, "pid": 0, "tid": "stream 7"}]}
    t = read_trace(_write(tmp_path, obj))
    assert t.tid.tolist() == [7] and t.rank.tolist() == [0] and t.bad_events == 0


def test_legitimate_non_task_events_are_not_malformed(tmp_path):
    ev = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": ["odd", "but unread"]},
          {"ph": "C", "name": "cpu", "ts": "whenever", "args": {"load": "high"}},
          {"ph": "C", "name": "memory", "pid": 0, "ts": -2.5, "args": {"device": 0, "host": 1.5e9, "peer": 0}},
          {"ph": "i", "name": "mark", "ts": math.nan},
          {"ph": "B", "name": "begin", "ts": 1}, {"ph": "E", "ts": 2},
          {"ph": "s", "id": 1}, {"ph": "f", "id": 1},
          {"ph": "X", "name": "s0/mb0/L0/attn.fwd", "ts": 0, "dur": 0, "pid": 0, "tid": 1}]
    t = read_trace(_write(tmp_path, {"traceEvents": ev, "otherData": {"format": "k3sched.trace/1", "rank": 2}}))
    assert len(t) == 1 and t.bad_events == 0 and t.rank.tolist() == [2]


@pytest.mark.parametrize("content", ['{"traceEvents": []}', "[]", '{"traceEvents": [{"ph": "M", "name": "x"}]}'])
def test_empty_trace_reads_as_an_empty_table(tmp_path, content):
    t = read_trace(_write(tmp_path, content))
    assert len(t) == 0 and t.bad_events == 0


@pytest.mark.parametrize("value, reason", [("lots", 'memory counter device "lots" is not a byte count'),
                                           (-1, "memory counter device -1 is not a byte count"),
                                           (math.nan, "memory counter device NaN"),
                                           (math.inf, "memory counter device Infinity"),
                                           (None, "memory counter device null"),
                                           (True, "memory counter device true")])
def test_bad_memory_counter_values_are_malformed(tmp_path, value, reason):
    obj = _runtime()
    obj["traceEvents"].append({"ph": "C", "name": "memory", "pid": 0, "ts": 5.0,
                               "args": {"device": value, "host": 0, "peer": 0}})
    pos = len(obj["traceEvents"]) - 1
    p = _write(tmp_path, obj)
    msg = _err(p)
    assert f"(first: event {pos}: {reason}" in msg and "allowed: a finite number >= 0" in msg
    t = read_trace(p, skip_bad_events=True)
    assert t.bad_events == 1 and len(t) == len(_xs(obj))


def test_memory_counter_args_must_be_an_object(tmp_path):
    obj = _runtime()
    obj["traceEvents"].append({"ph": "C", "name": "memory", "pid": 0, "ts": 5.0, "args": [1, 2]})
    assert "memory counter args is a list" in _err(_write(tmp_path, obj))


def test_first_bad_event_is_the_earliest_and_count_is_per_event(tmp_path):
    obj = _runtime()
    xs = _xs(obj)
    obj["traceEvents"][xs[5]]["dur"] = -1          # later
    obj["traceEvents"][xs[2]]["ts"] = "soon"        # earliest, two broken values: counted once
    obj["traceEvents"][xs[2]]["tid"] = math.inf
    obj["traceEvents"].append({"ph": "C", "name": "memory", "ts": 0, "args": {"device": -5}})
    msg = _err(_write(tmp_path, obj))
    assert f"3 malformed events (first: event {xs[2]}: ts \"soon\" is not a number" in msg


def test_bad_events_survive_concat_and_row_selection(tmp_path):
    paths = []
    for r in (0, 1):
        obj = _runtime(r)
        for i in _xs(obj)[: r + 1]:
            obj["traceEvents"][i]["dur"] = -1
        paths.append(_write(tmp_path, obj, f"t{r}.json"))
    t = read_traces(paths, skip_bad_events=True)
    assert t.bad_events == 3
    assert t.sorted().bad_events == 3 and t.take(t.rank == 0).bad_events == 3
    assert EventTable.concat([t, EventTable.empty()]).bad_events == 3 and EventTable.empty().bad_events == 0
    with pytest.raises(TraceError, match="1 malformed event .*--skip-bad-events"):
        read_traces(paths)


def test_validate_exit_code_2_not_1_for_a_broken_trace(tmp_path, capsys):
    """A reader crash used to be a traceback with exit 1, read as 'violations'."""
    plan_p = _write(tmp_path, PLAN, "plan.json")
    obj = _runtime()
    obj["traceEvents"][_xs(obj)[0]]["args"] = [1]
    assert validate_main(str(plan_p), [str(_write(tmp_path, obj))], only_traced_stages=True) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "args is a list" in err


def test_table_from_runtime_on_an_event_list_checks_too():
    ev = synth.trace_from_plan(PLAN)
    ev[1]["dur"] = -2.0
    with pytest.raises(TraceError, match=r"<memory>: 1 malformed event \(first: event 1: dur -2.0 is negative"):
        table_from_runtime(ev)
    assert table_from_runtime(ev, skip_bad_events=True).bad_events == 1


# ---- Kineto ----------------------------------------------------------------------------------

def _kineto() -> dict:
    return {"schemaVersion": 1, "distributedInfo": {"rank": 1}, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "s0/mb0/L0/attn.fwd", "ts": 100, "dur": 50, "pid": 9, "tid": 9},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 110, "dur": 2, "pid": 9, "tid": 9,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 120, "dur": 5, "pid": 0, "tid": 7,
         "args": {"device": 0, "stream": 7, "correlation": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 130, "dur": 5, "pid": 0, "tid": 7,
         "args": {"device": 0, "stream": 7, "correlation": 8, "bytes": 64}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 140, "dur": 1, "pid": 9, "tid": 9},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": "unread", "pid": 9, "tid": 9},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler", "ts": 0, "dur": 999, "pid": "Spans",
         "tid": "PyTorch Profiler"},
    ]}


def test_kineto_sample_reads_clean(tmp_path):
    t = read_kineto(_write(tmp_path, _kineto()))
    assert t.kind.tolist() == ["range", "kernel", "memcpy"] and t.bad_events == 0
    assert t.parent.tolist() == ["", "s0/mb0/L0/attn.fwd", ""] and set(t.rank.tolist()) == {1}


@pytest.mark.parametrize("pos, key, value, reason", [
    (2, "args", [1], "args is a list [1] (allowed: an object, or absent)"),
    (2, "ts", -4, "ts -4 is negative"),
    (2, "dur", math.nan, "dur NaN is not finite"),
    (2, "name", None, "name null is not a string"),
    (2, "cat", ["kernel"], 'cat ["kernel"] is not a string'),
    (3, "args", {"device": 0, "stream": math.inf, "correlation": 8}, "stream Infinity is not a stream id"),
    (3, "args", {"device": 10 ** 12, "stream": 7}, "device 1000000000000 is not a device"),
    (3, "args", {"device": 0, "stream": 7, "correlation": [8]}, "args.correlation [8] is not a correlation id"),
    (0, "pid", None, "pid null is not a process id"),
    (0, "tid", math.inf, "tid Infinity is not a thread id"),
    (1, "args", {"correlation": {"id": 7}}, "args.correlation {\"id\": 7} is not a correlation id"),
    (1, "ts", "late", 'ts "late" is not a number'),
])
def test_kineto_event_value_is_malformed(tmp_path, pos, key, value, reason):
    obj = _kineto()
    obj["traceEvents"][pos][key] = value
    p = _write(tmp_path, obj)
    msg = _err(p)
    assert f"1 malformed event (first: event {pos}: {reason}" in msg, msg
    t = read_trace(p, skip_bad_events=True)
    assert t.bad_events == 1 and len(t) >= 2


@pytest.mark.parametrize("info, expect", [([0], "'distributedInfo' is a list"),
                                          ({"rank": "zero"}, 'distributedInfo.rank "zero" is not a rank'),
                                          ({"rank": 2 ** 40}, "distributedInfo.rank 1099511627776 is not a rank")])
def test_kineto_bad_distributed_info(tmp_path, info, expect):
    obj = _kineto()
    obj["distributedInfo"] = info
    assert expect in _err(_write(tmp_path, obj), skip_bad_events=True)


# ---- nsys SQLite -----------------------------------------------------------------------------

def _nsys(path, nvtx=(), kernels=(), strings=((1, "s0/mb0/L0/attn.fwd"), (2, "gemm"))) -> Path:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL)")
    con.execute("CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, "
                "text TEXT, globalTid INTEGER, textId INTEGER)")
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, "
                "streamId INTEGER, correlationId INTEGER, globalPid INTEGER, demangledName INTEGER, "
                "shortName INTEGER)")
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, "
                "globalTid INTEGER, correlationId INTEGER)")
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", strings)
    con.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, ?, ?)", nvtx)
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?, ?, ?, ?, ?)", kernels)
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?)",
                    [(1500, 1600, G, 1), (2500, 2600, G, 2)])
    con.commit()
    con.close()
    return path


PID = 4242
G = (PID << 24) | 17  # globalTid of thread 17 in process 4242
GOOD_NVTX = [(1000, 9000, 59, None, G, 1), (500, None, 34, "k3sched.rank=3", G, None)]
GOOD_KERNELS = [(2000, 2100, 0, 7, 1, PID << 24, 2, 2), (3000, 3100, 0, 7, 2, PID << 24, 2, 2)]


def test_nsys_sample_reads_clean(tmp_path):
    t = read_nsys_sqlite(_nsys(tmp_path / "ok.sqlite", GOOD_NVTX, GOOD_KERNELS))
    assert t.kind.tolist() == ["range", "kernel", "kernel"] and t.bad_events == 0
    assert set(t.rank.tolist()) == {3} and t.parent.tolist() == ["", "s0/mb0/L0/attn.fwd", "s0/mb0/L0/attn.fwd"]


@pytest.mark.parametrize("nvtx_row, reason", [
    ((1000, "soon", 59, "r", G, None), "end 'soon' is not a number"),
    (("x", 2000, 59, "r", G, None), "start 'x' is not a number"),
    ((1000, None, 59, "r", G, None), "end NULL is not a number"),
    ((1000, 2000, 59, "r", None, None), "globalTid NULL is not a thread id"),
    ((1000, 2000, 59, "r", "main", None), "globalTid 'main' is not a thread id"),
    ((3000, 2000, 59, "r", G, None), "end 2000 is before start 3000"),
    ((-5, 2000, 59, "r", G, None), "start -5 is negative"),
    ((1000, 2000, 59, b"\xff", G, None), "text <1-byte blob> is not a string"),
    ((1, None, 34, "k3sched.rank=" + "9" * 20, G, None), "rank mark 'k3sched.rank=99999999999999999999' names no rank"),
    ((1, None, 34, "k3sched.rank=two", G, None), "rank mark 'k3sched.rank=two' names no rank"),
    ((1, None, 34, "k3sched.rank=1", None, None), "globalTid NULL is not a thread id"),
])
def test_nsys_nvtx_row_is_malformed(tmp_path, nvtx_row, reason):
    p = _nsys(tmp_path / "t.sqlite", GOOD_NVTX + [nvtx_row], GOOD_KERNELS)
    msg = _err(p)
    assert f"1 malformed event (first: NVTX_EVENTS row 3: {reason}" in msg and "--skip-bad-events" in msg, msg
    t = read_nsys_sqlite(p, skip_bad_events=True)
    assert t.bad_events == 1 and len(t) == 3 and set(t.rank.tolist()) == {3}


@pytest.mark.parametrize("kernel_row, reason", [
    ((2000, 2100, None, 7, 1, PID << 24, 2, 2), "deviceId NULL is not a device"),
    ((2000, 2100, "gpu0", 7, 1, PID << 24, 2, 2), "deviceId 'gpu0' is not a device"),
    ((2000, 2100, 0, "s7", 1, PID << 24, 2, 2), "streamId 's7' is not a stream id"),
    ((None, 2100, 0, 7, 1, PID << 24, 2, 2), "start NULL is not a number"),
    ((2000, None, 0, 7, 1, PID << 24, 2, 2), "end NULL is not a number"),
    ((2000, 1000, 0, 7, 1, PID << 24, 2, 2), "end 1000 is before start 2000"),
    ((2000, 2100, 0, 7, 1, "pid", 2, 2), "globalPid 'pid' is not a process id"),
    ((2000, 2100, 0, 7, 1, PID << 24, None, 2), "demangledName NULL is not a StringIds id"),
    ((2000, 2100, 0, 7, 1, PID << 24, 2.5, 2), "demangledName 2.5 is not a StringIds id"),
])
def test_nsys_kernel_row_is_malformed(tmp_path, kernel_row, reason):
    p = _nsys(tmp_path / "t.sqlite", GOOD_NVTX, GOOD_KERNELS + [kernel_row])
    msg = _err(p)
    assert f"1 malformed event (first: CUPTI_ACTIVITY_KIND_KERNEL row 3: {reason}" in msg, msg
    t = read_trace(p, skip_bad_events=True)
    assert t.bad_events == 1 and len(t) == 3


def test_nsys_all_rows_malformed_is_an_error_even_when_skipping(tmp_path):
    p = _nsys(tmp_path / "t.sqlite", [(1000, None, 59, "r", G, None)], [])
    assert "1 malformed event and no valid event to read" in _err(p, skip_bad_events=True)


def test_nsys_empty_export_reads_as_an_empty_table(tmp_path):
    t = read_nsys_sqlite(_nsys(tmp_path / "t.sqlite"))
    assert len(t) == 0 and t.bad_events == 0


# ---- real recorded traces: no malformed events ---------------------------------------------------

@pytest.mark.skipif(not REAL.is_dir(), reason=f"real traces folder {REAL} absent")
@pytest.mark.parametrize("sub, name", [("nsys", "h100_2gpu_1s.sqlite"), ("nsys", "mfu_2gpu_before.sqlite"),
                                       ("kineto", "hta_nccl_data_rank0.json.gz"),
                                       ("kineto", "hta_sampled_rank-0.json.gz")])
def test_real_traces_have_no_malformed_events(sub, name):
    t = read_trace(REAL / sub / name)  # strict: any malformed event would raise
    assert t.bad_events == 0 and len(t) > 1000
    assert np.all(np.isfinite(t.start_us)) and np.all(t.start_us >= 0) and np.all(t.end_us >= t.start_us)


# ---- fuzz: any value anywhere is a table or one TraceError line ----------------------------------

WEIRD = [None, True, -1, 0, 2 ** 63, 10 ** 400, -0.0, 1.5, math.nan, math.inf, -math.inf, "", "12", "x\ny", [],
         [1], {}, {"a": 1}]


def test_fuzz_values_read_or_raise_one_line(tmp_path):
    rng = np.random.default_rng(15)
    base = _runtime()
    base["traceEvents"].append({"ph": "C", "name": "memory", "pid": 0, "ts": 1.0,
                                "args": {"device": 1, "host": 2, "peer": 3}})
    kin = _kineto()
    for trial in range(300):
        obj = copy.deepcopy(base if trial % 2 else kin)
        ev = obj["traceEvents"]
        for _ in range(int(rng.integers(1, 4))):
            e = ev[int(rng.integers(len(ev)))]
            key = ["ts", "dur", "pid", "tid", "name", "ph", "args", "cat"][int(rng.integers(8))]
            if key == "args" and isinstance(e.get("args"), dict) and rng.random() < 0.6:
                e["args"][["bytes", "device", "stream", "correlation", "host"][int(rng.integers(5))]] = \
                    WEIRD[int(rng.integers(len(WEIRD)))]
            else:
                e[key] = WEIRD[int(rng.integers(len(WEIRD)))]
        if trial % 7 == 0:
            obj[["distributedInfo", "otherData"][trial % 2]] = WEIRD[int(rng.integers(len(WEIRD)))]
        p = tmp_path / "f.json.gz"
        p.write_bytes(gzip.compress(json.dumps(obj).encode()))
        for skip in (False, True):
            try:
                t = read_trace(p, skip_bad_events=skip)
            except TraceError as err:
                assert "\n" not in str(err) and str(p) in str(err)
                continue
            assert np.all(np.isfinite(t.start_us)) and np.all(t.start_us >= 0) and np.all(t.end_us >= t.start_us)
            assert np.all((t.rank >= 0) & (t.rank < MAX_RANK))
            assert all(type(n) is str for n in t.name.tolist())
            assert skip or t.bad_events == 0


# ---- found by the fuzz suite (tests/e2e/test_fuzz.py) -------------------------------------------

def _nsys_with(tmp_path, sql: str) -> Path:
    p = tmp_path / "run.sqlite"
    synth.nsys_sqlite(p, PLAN, 50)
    con = sqlite3.connect(p)
    con.execute(sql)
    con.commit()
    con.close()
    return p


@pytest.mark.parametrize("sql, says", [
    ("UPDATE NVTX_EVENTS SET textId = 'abc' WHERE rowid = 1", "textId 'abc'"),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET correlationId = 'abc' WHERE rowid = 3", "correlationId 'abc'"),
    ("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET correlationId = 1e300 WHERE rowid = 3", "correlationId"),
    ("UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET globalTid = 'abc' WHERE rowid = 2", "CUPTI_ACTIVITY_KIND_RUNTIME row 2"),
    ("UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET start = 99999999999999999999 WHERE rowid = 2",
     "CUPTI_ACTIVITY_KIND_RUNTIME row 2"),
])
def test_nsys_columns_the_projection_joins_on_are_checked(tmp_path, sql, says):
    """The kernels' projection joins NVTX text ids, kernel correlation ids and the runtime calls'
    thread and start: a bad value there used to leave a kernel silently without its task."""
    p = _nsys_with(tmp_path, sql)
    with pytest.raises(TraceError) as e:
        read_nsys_sqlite(p)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "1 malformed event" in msg and says in msg, msg
    assert read_nsys_sqlite(p, skip_bad_events=True).bad_events == 1


def test_runtime_trace_checks_pid_and_format_even_with_otherdata_rank(tmp_path):
    obj = _runtime()
    obj["traceEvents"][_xs(obj)[0]]["pid"] = [1]
    with pytest.raises(TraceError, match="pid"):
        read_trace(_write(tmp_path, obj))
    obj = _runtime()
    obj["otherData"]["format"] = {"s": "k3sched.trace/1"}
    with pytest.raises(TraceError, match="otherData.format"):
        read_trace(_write(tmp_path, obj))


def test_kineto_gpu_event_pid_is_checked(tmp_path):
    obj = synth.kineto_trace(PLAN, 0)
    k = next(i for i, e in enumerate(obj["traceEvents"]) if e.get("cat") == "kernel")
    obj["traceEvents"][k]["pid"] = True
    with pytest.raises(TraceError, match="pid true is not a process id"):
        read_kineto(_write(tmp_path, obj, "k.json"))
    obj["traceEvents"][k]["pid"] = "GPU 0"  # a label, as Kineto writes for some devices
    assert len(read_kineto(_write(tmp_path, obj, "k.json")))

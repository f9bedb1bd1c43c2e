"""Bad and extreme inputs for every front door of the ``k3sched`` command line, and the judge of
what the command did with them ([Note: CLI error boundary] in k3sched/cli.py).

A case is a mutation of a valid input (a config, a ``--set`` value, a profile, a plan.json, a
runtime, Kineto or nsys trace, a run's summary.json) plus the command that reads it. A mutation
is *garbage* when the format forbids what it makes: a wrong type or a non-finite number in a field
the format defines, an unknown key where keys are closed, a file that is not the format at all.
Garbage must be refused: exit 2 with one line on stderr. Other mutations (a number changed within
its type, an optional key removed, a truncated YAML that may still parse) may be accepted (exit
0, or 1 for ``validate`` when the mutated trace no longer follows the plan) or refused. Never: a
traceback, exit 3 (an internal error), or more than ``SLOW_S`` seconds.

Used by tests/e2e/test_fuzz.py (hypothesis drives the random choices, a few minutes in CI) and by
benchmarks/fuzz_campaign.py (thousands of seeded cases, a table of outcomes).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"
SLOW_S = 20.0
FAMILIES = ("config", "set", "profile", "plan", "trace", "kineto", "nsys", "summary")


@dataclass
class Case:
    family: str
    what: str                      # the mutation, for the report
    argv: list[str]                # k3sched arguments; {dir} is replaced by the case directory
    garbage: bool                  # must be refused with exit 2
    files: dict[str, bytes] = field(default_factory=dict)  # name -> content, written into the case directory
    exit_ok: tuple[int, ...] = (0, 2)  # outcomes allowed when not garbage


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float


# ---------------------------------------------------------------------------------------------
# valid inputs, built once per process


@dataclass
class _Base:
    config: dict
    plan: dict
    traces: dict[int, dict]        # rank -> runtime trace object
    summary: dict
    profile: dict
    kineto: dict
    kineto1: dict                  # stage 1's rank (rank 2), unmutated beside a mutated stage 0
    nsys: bytes


_BASE: _Base | None = None


def base() -> _Base:
    global _BASE
    if _BASE is None:
        import tempfile

        from k3sched.config import load_config
        from k3sched.planner import plan as make_plan
        from k3sched.planfile import plan_to_json
        from traces import synth

        cfg = load_config(TINY, ["model.layers=2", "parallel.microbatches=2", "schedule.offload=none"])
        pj = json.loads(json.dumps(plan_to_json(make_plan(cfg))))
        ranks = {0: [0, 1], 1: [2, 3]}
        traces = synth.runtime_trace_files(synth.trace_from_plan(pj, rank_of_stage=ranks), pj)
        summary = {"format": "k3sched.run/1", "config": str(TINY), "overrides": [], "strategy": "k3",
                   "pipeline": pj["pipeline"], "world": 4, "device": "cpu", "pp": 2, "dp": 1, "ep": 2,
                   "microbatches": 2, "steps": 2, "seed": 0, "losses": [6.3, 6.2],
                   "predicted_step_time_us": pj["metrics"]["step_time_us"],
                   "measured_step_time_us": pj["metrics"]["step_time_us"] * 1.1}
        profile = {"format": "k3sched.profile/1", "source": "fuzz",
                   "durations_us": {"attn.fwd": 120.0, "expert.fwd": 200.0},
                   "bandwidth_gbps": {"offload_local": 3.0}, "latency_us": {"ep": 20.0},
                   "link_efficiency": {"ep": 0.8}, "overhead_us": {"dispatch.fwd": 15.0},
                   "comm_cpu_ns_per_byte": 1.5}
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "t.sqlite"
            synth.nsys_sqlite(p, pj, 200)
            nsys = p.read_bytes()
        _BASE = _Base(config=yaml.safe_load(TINY.read_text()), plan=pj, traces=traces, summary=summary,
                      profile=profile, kineto=synth.kineto_trace(pj, 0, rank=0),
                      kineto1=synth.kineto_trace(pj, 1, rank=2), nsys=nsys)
    return _BASE


# ---------------------------------------------------------------------------------------------
# mutations of JSON-like documents

NONFINITE = (math.nan, math.inf, -math.inf)


def _paths(doc, prefix=(), keep=lambda p: True, limit: int = 200000) -> list[tuple]:
    """Every path to a value in ``doc`` (dict keys and list indices) that ``keep`` accepts."""
    out = []
    stack = [(prefix, doc)]
    while stack and len(out) < limit:
        p, v = stack.pop()
        if p and keep(p):
            out.append(p)
        if isinstance(v, dict):
            stack.extend((p + (k,), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((p + (i,), x) for i, x in enumerate(v))
    return out


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def _set(doc, path, value):
    _get(doc, path[:-1])[path[-1]] = value


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def wrong_value(rnd: random.Random, old) -> tuple[object, bool, str]:
    """A replacement for ``old``: (value, garbage?, description). Garbage: the type or finiteness
    is wrong for what ``old`` was."""
    if _is_number(old):
        menu = [("nan", math.nan, True), ("inf", math.inf, True), ("-inf", -math.inf, True),
                ("bool", rnd.choice([True, False]), True), ("string", rnd.choice(["abc", "", "1e3x"]), True),
                ("list", [old], True), ("dict", {"v": old}, True), ("null", None, False),
                ("huge", rnd.choice([10**30, 2**63, 1e300, -(2**70)]), False),
                ("negative", -abs(old) - 1, False), ("zero", 0, False),
                ("other number", rnd.choice([1, 3, 7, 0.5, 1e-9, 123456]), False)]
    elif isinstance(old, str):
        menu = [("number", rnd.choice([0, 17, 2.5]), True), ("list", [old], True), ("dict", {"s": old}, True),
                ("bool", True, True), ("null", None, False), ("other string", rnd.choice(["", "x", old + "?"]), False)]
    elif isinstance(old, bool):
        menu = [("number", rnd.choice([0, 1, 2]), False), ("string", "yes", True), ("list", [old], True),
                ("null", None, False)]
    elif isinstance(old, list):
        menu = [("number", 5, True), ("string", "xyz", True), ("dict", {"a": 1}, True), ("null", None, False),
                ("empty list", [], False), ("list of junk", [math.nan, "x", None, [1]], False)]
    elif isinstance(old, dict):
        menu = [("number", 1, True), ("string", "xyz", True), ("list", [1], True), ("null", None, False),
                ("empty map", {}, False)]
    else:  # None
        menu = [("number", rnd.choice([1, -1, math.nan]), False), ("string", "x", False), ("list", [1], False)]
    name, value, garbage = rnd.choice(menu)
    return value, garbage, name


def mutate_doc(rnd: random.Random, doc, *, strict=lambda path: True, closed=lambda path: False,
               keep=lambda path: True, string_ok=lambda path: False) -> tuple[object, bool, str]:
    """One mutation of a copy of ``doc``: replace a value, delete a key, or add an unknown key.
    ``strict(path)``: the format defines and checks this value (a wrong type there is garbage);
    ``closed(path)``: the mapping at ``path`` takes no unknown keys; ``string_ok(path)``: a string
    is a valid value there. Returns (doc, garbage, what)."""
    doc = copy.deepcopy(doc)
    paths = _paths(doc, keep=keep)
    op = rnd.random()
    if op < 0.75 or not paths:
        p = rnd.choice(paths)
        value, garbage, name = wrong_value(rnd, _get(doc, p))
        if isinstance(value, str) and string_ok(p):
            garbage = False
        _set(doc, p, value)
        return doc, garbage and strict(p), f"{'.'.join(map(str, p))} -> {name} {_short(value)}"
    if op < 0.88:
        p = rnd.choice([q for q in paths if isinstance(q[-1], str)] or paths)
        parent = _get(doc, p[:-1])
        if isinstance(parent, dict):
            del parent[p[-1]]
            return doc, False, f"{'.'.join(map(str, p))} deleted"
        return doc, False, "nothing deleted"
    maps = [()] + [q for q in paths if isinstance(_get(doc, q), dict)]
    p = rnd.choice(maps)
    _get(doc, p)["zz_unknown"] = 1
    return doc, closed(p), f"unknown key under {'.'.join(map(str, p)) or 'top'}"


def _short(v) -> str:
    s = repr(v)
    return s if len(s) < 40 else s[:37] + "..."


def file_mutation(rnd: random.Random, text: bytes) -> tuple[bytes, bool, str]:
    """Whole-file damage: (bytes, garbage?, what). Truncation is not always garbage (a YAML or a
    JSON cut at the end of a value may still parse); the others are."""
    choice = rnd.randrange(6)
    if choice == 0:
        return b"", True, "empty file"
    if choice == 1:
        return b"\xff\xfe\x00bad" + text[:50], True, "not UTF-8"
    if choice == 2:
        n = rnd.choice([200, 20000])
        return (b"[" * n + b"]" * n), True, f"nested {n} deep"
    if choice == 3:
        return b"just a string\n", True, "a scalar, not a mapping"
    if choice == 4:
        return b"- 1\n- 2\n" if rnd.random() < 0.5 else b"[1, 2, 3]", True, "a list of numbers"
    cut = rnd.randrange(1, max(2, len(text)))
    return text[:cut], False, f"truncated at byte {cut}"


# ---------------------------------------------------------------------------------------------
# the case families

def _yaml(doc) -> bytes:
    return yaml.safe_dump(doc, sort_keys=False).encode()


def _json(doc) -> bytes:
    return json.dumps(doc).encode()  # NaN and Infinity are written as JSON's non-standard literals


def case_config(rnd: random.Random) -> Case:
    b = base()
    if rnd.random() < 0.2:
        data, garbage, what = file_mutation(rnd, _yaml(b.config))
    else:
        doc, garbage, what = mutate_doc(rnd, b.config, closed=lambda p: True,
                                        keep=lambda p: not (len(p) == 2 and p[1] == "name"))
        data = _yaml(doc)
    return Case("config", what, ["plan", "{dir}/config.yaml"], garbage, {"config.yaml": data})


_SET_VALUES = [("[", True), ("{a: 1", True), ("yes", True), ("no", True), (".inf", True), ("-.inf", True),
               (".nan", True), ("1e300", True), ("1e30", True), ("abc", True), ("[1, 2]", True), ("{a: 1}", True),
               ("null", False), ("-1", False), ("0", False), ("2", False), ("0.5", False), ("'3'", True),
               ("999999999999999999999999", True), ("1e-9", False)]


def case_set(rnd: random.Random) -> Case:
    b = base()
    leaves = [p for p in _paths(b.config) if not isinstance(_get(b.config, p), (dict, list))]
    p = rnd.choice(leaves + [("model", "nosuch"), ("nosuch", "x"), ("model",), ("model", "layers", "x")])
    value, garbage = rnd.choice(_SET_VALUES)
    key = ".".join(map(str, p))
    if p[-1] == "name" and value in ("abc", "'3'"):
        garbage = False  # a name is a free-form string
    if p[-1] in ("nosuch", "x") or len(p) == 1:
        garbage = True
    if value == "null" and rnd.random() < 0.5:
        return Case("set", f"--set {key} (no '=')", ["plan", str(TINY), "--set", key], True)
    return Case("set", f"--set {key}={value}", ["plan", str(TINY), "--set", f"{key}={value}"], garbage)


_PROFILE_KEYS = {"durations_us", "bandwidth_gbps", "latency_us", "link_efficiency", "overhead_us",
                 "comm_cpu_ns_per_byte", "saved_bytes", "format", "source"}


def case_profile(rnd: random.Random) -> Case:
    b = base()
    if rnd.random() < 0.2:
        data, garbage, what = file_mutation(rnd, _yaml(b.profile))
    else:
        doc, garbage, what = mutate_doc(rnd, b.profile, strict=lambda p: p[0] != "source",
                                        closed=lambda p: len(p) <= 1)
        data = _yaml(doc)
    return Case("profile", what, ["plan", str(TINY), "--set", "schedule.profile={dir}/profile.yaml"], garbage,
                {"profile.yaml": data})


def _trace_files(b: _Base, skip: int | None = None) -> dict[str, bytes]:
    return {f"trace_rank{r}.json": _json(t) for r, t in b.traces.items() if r != skip}


def _plan_strict(p) -> bool:
    """Values of plan.json the schema defines (docs/formats.md); the config copy is checked as a
    config, metrics beyond the documented ones are free."""
    if p[0] in ("format", "strategy", "pipeline", "lanes"):
        return True
    if p[0] == "stages":  # ("stages", i, "lanes", lane, j, field[, k])
        if len(p) <= 5:
            return len(p) != 3 or p[2] in ("stage", "lanes")
        return p[2] == "lanes" and ((len(p) == 6 and p[5] in ("id", "kind", "lane", "stage", "start_us", "end_us",
                                                                "deps", "bytes"))
                                     or (len(p) == 7 and p[5] == "deps"))
    if p[0] == "metrics":
        return len(p) >= 2 and p[1] in ("step_time_us", "lower_bound_us") and len(p) == 2
    return False


def case_plan(rnd: random.Random) -> Case:
    b = base()
    cmd = rnd.choice(["validate", "calibrate"])
    if rnd.random() < 0.15:
        data, garbage, what = file_mutation(rnd, _json(b.plan))
    else:
        # mutate a task of the plan more often than the config copy
        keep = (lambda p: p[0] != "config") if rnd.random() < 0.8 else (lambda p: True)
        doc, garbage, what = mutate_doc(rnd, b.plan, strict=_plan_strict, keep=keep)
        data = _json(doc)
    files = {"plan.json": data, **_trace_files(b)}
    return Case("plan", what, _cmd(cmd, files), garbage, files, exit_ok=(0, 1, 2))


def _cmd(cmd: str, files: dict[str, bytes]) -> list[str]:
    traces = sorted(f"{{dir}}/{n}" for n in files if n.startswith("trace") or n.endswith((".sqlite", ".kineto.json")))
    if cmd == "validate":
        return ["validate", "--plan", "{dir}/plan.json", *traces]
    return ["calibrate", *traces, "--plan", "{dir}/plan.json", "-o", "{dir}/out/profile.yaml"]


def _event_strict(p) -> bool:
    """Runtime-trace values the reader consumes: an event's ph, name, ts, dur, pid, tid, the type
    of args, otherData's type and rank."""
    if p[0] == "traceEvents":
        return len(p) == 2 or (len(p) == 3 and p[2] in ("ph", "name", "ts", "dur", "pid", "tid", "args"))
    if p[0] == "otherData":
        return len(p) == 1 or p[1] in ("rank", "format")
    return False


def case_trace(rnd: random.Random) -> Case:
    b = base()
    rank = rnd.randrange(len(b.traces))
    cmd = rnd.choice(["validate", "calibrate"])
    if rnd.random() < 0.15:
        data, garbage, what = file_mutation(rnd, _json(b.traces[rank]))
    else:
        events = b.traces[rank]["traceEvents"]
        x = [i for i, e in enumerate(events) if e.get("ph") == "X"]
        i = rnd.choice(x)
        doc = copy.deepcopy(b.traces[rank])
        if rnd.random() < 0.3:  # the value rules: time and order
            e = doc["traceEvents"][i]
            name, garbage = rnd.choice([("dur negative", True), ("ts NaN", True), ("ts >= 2^63", True),
                                        ("dur Infinity", True), ("ts negative", True)])
            if name == "dur negative":
                e["dur"] = -abs(e["dur"]) - 5
            elif name == "ts NaN":
                e["ts"] = math.nan
            elif name == "ts >= 2^63":
                e["ts"] = 2**63 + 5
            elif name == "dur Infinity":
                e["dur"] = math.inf
            else:
                e["ts"] = -1e6
            what = f"event {i}: {name}"
        else:
            doc, garbage, what = mutate_doc(rnd, doc, strict=_event_strict,
                                            keep=lambda p: p[0] != "traceEvents" or len(p) == 1 or p[1] == i)
        data = _json(doc)
    files = {"plan.json": _json(b.plan), **_trace_files(b, skip=rank), f"trace_rank{rank}.json": data}
    return Case("trace", what, _cmd(cmd, files), garbage, files, exit_ok=(0, 1, 2))


def case_kineto(rnd: random.Random) -> Case:
    b = base()
    if rnd.random() < 0.15:
        data, garbage, what = file_mutation(rnd, _json(b.kineto))
    else:
        ev = b.kineto["traceEvents"]
        i = rnd.randrange(len(ev))
        fields = ("ph", "ts", "pid", "tid", "args")  # read from every event the reader reads
        if ev[i].get("cat") != "cuda_runtime":
            fields += ("name", "dur")  # a launch's name and duration are not read; a range's or a kernel's are
        doc, garbage, what = mutate_doc(
            rnd, b.kineto, string_ok=lambda p: p[-1] in ("pid", "tid"),  # Kineto writes "stream 7" and the like
            strict=lambda p: (p[0] == "traceEvents" and (len(p) == 2 or (len(p) == 3 and p[2] in fields)))
            or (p[0] == "distributedInfo" and (len(p) == 1 or p[1] == "rank")),
            keep=lambda p: p[0] != "traceEvents" or len(p) == 1 or p[1] == i)
        data = _json(doc)
    files = {"plan.json": _json(b.plan), "rank0.kineto.json": data, "rank2.kineto.json": _json(b.kineto1)}
    return Case("kineto", what, _cmd("validate", files), garbage, files, exit_ok=(0, 1, 2))


_NSYS_COLUMNS = [("NVTX_EVENTS", "start"), ("NVTX_EVENTS", "end"), ("NVTX_EVENTS", "globalTid"),
                 ("NVTX_EVENTS", "textId"), ("CUPTI_ACTIVITY_KIND_KERNEL", "start"),
                 ("CUPTI_ACTIVITY_KIND_KERNEL", "end"), ("CUPTI_ACTIVITY_KIND_KERNEL", "deviceId"),
                 ("CUPTI_ACTIVITY_KIND_KERNEL", "streamId"), ("CUPTI_ACTIVITY_KIND_KERNEL", "correlationId"),
                 ("CUPTI_ACTIVITY_KIND_RUNTIME", "globalTid"), ("CUPTI_ACTIVITY_KIND_RUNTIME", "start"),
                 ("StringIds", "value")]


def case_nsys(rnd: random.Random) -> Case:
    import sqlite3
    import tempfile

    b = base()
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.sqlite"
        p.write_bytes(b.nsys)
        con = sqlite3.connect(p)
        table, col = rnd.choice(_NSYS_COLUMNS)
        value, garbage = rnd.choice([("'abc'", True), ("NULL", col not in ("end", "textId", "correlationId")),
                                     ("-5", col in ("start", "end")), ("99999999999999999999", True),
                                     ("1e300", True)])
        if table == "StringIds":
            value, garbage = rnd.choice([("12345", False), ("'s0/mb0/L0/x.fwd'", False), ("''", False)])
        where = rnd.choice(["rowid = 1", "rowid % 7 = 0", "1"])
        try:
            con.execute(f"UPDATE {table} SET {col} = {value} WHERE {where}")
        except sqlite3.Error:  # a NOT NULL column: the real export can't hold that either
            con.execute(f"UPDATE {table} SET {col} = 'x' WHERE {where}")
        con.commit()
        con.close()
        data = p.read_bytes()
    what = f"{table}.{col} = {value} where {where}"
    if rnd.random() < 0.1:
        cut = rnd.randrange(100, len(data))
        data, garbage, what = data[:cut], True, f"sqlite truncated at byte {cut}"
    files = {"plan.json": _json(b.plan), "run.sqlite": data}
    return Case("nsys", what, _cmd(rnd.choice(["validate", "calibrate"]), files), garbage, files, exit_ok=(0, 1, 2))


def case_summary(rnd: random.Random) -> Case:
    b = base()
    if rnd.random() < 0.2:
        data, garbage, what = file_mutation(rnd, _json(b.summary))
    else:
        doc, garbage, what = mutate_doc(rnd, b.summary,
                                        strict=lambda p: p[0] in ("format", "measured_step_time_us"),
                                        keep=lambda p: p[0] in ("format", "measured_step_time_us", "losses", "steps"))
        data = _json(doc)
    files = {"plan.json": _json(b.plan), **_trace_files(b), "summary.json": data}
    return Case("summary", what, _cmd("calibrate", files), garbage, files)


def control(family: str) -> Case:
    """The family's command on its unmutated input: what every mutation starts from. It must
    succeed (exit 0), or the family's mutations would be refused for a reason of their own."""
    b = base()
    if family in ("config", "set"):
        return Case(family, "unmutated", ["plan", "{dir}/config.yaml"], False, {"config.yaml": _yaml(b.config)})
    if family == "profile":
        return Case(family, "unmutated", ["plan", str(TINY), "--set", "schedule.profile={dir}/profile.yaml"], False,
                    {"profile.yaml": _yaml(b.profile)})
    if family == "kineto":
        files = {"plan.json": _json(b.plan), "rank0.kineto.json": _json(b.kineto),
                 "rank2.kineto.json": _json(b.kineto1)}
        return Case(family, "unmutated", _cmd("validate", files), False, files)
    if family == "nsys":
        files = {"plan.json": _json(b.plan), "run.sqlite": b.nsys}
        return Case(family, "unmutated", _cmd("validate", files), False, files)
    files = {"plan.json": _json(b.plan), **_trace_files(b)}
    if family == "summary":
        files["summary.json"] = _json(b.summary)
        return Case(family, "unmutated", _cmd("calibrate", files), False, files)
    return Case(family, "unmutated", _cmd("validate", files), False, files)


MAKERS = {"config": case_config, "set": case_set, "profile": case_profile, "plan": case_plan,
          "trace": case_trace, "kineto": case_kineto, "nsys": case_nsys, "summary": case_summary}


# ---------------------------------------------------------------------------------------------
# running and judging

def run_case(case: Case, workdir: Path) -> Outcome:
    """Write the case's files into ``workdir`` and run ``k3sched`` in this process (its ``main``,
    the same error boundary as the installed command)."""
    from k3sched.cli import main

    workdir.mkdir(parents=True, exist_ok=True)
    for name, data in case.files.items():
        (workdir / name).write_bytes(data)
    argv = [a.replace("{dir}", str(workdir)) for a in case.argv]
    out, err = io.StringIO(), io.StringIO()
    old = sys.argv
    sys.argv = ["k3sched", *argv]
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old
    return Outcome(code, out.getvalue(), err.getvalue(), time.perf_counter() - t0)


def judge(case: Case, o: Outcome) -> str | None:
    """None when the outcome is allowed, else the problem: 'traceback', 'internal error',
    'slow', 'accepted garbage', 'not one line', 'exit N'."""
    text = o.out + o.err
    if "Traceback (most recent call last)" in text:
        return "traceback"
    if o.code == 3:
        return "internal error"
    if o.seconds > SLOW_S:
        return "slow"
    if case.garbage and o.code != 2:
        return "accepted garbage"
    if o.code == 2 and len([ln for ln in o.err.splitlines() if ln.strip()]) != 1:
        return "not one line"
    if o.code not in case.exit_ok:
        return f"exit {o.code}"
    return None

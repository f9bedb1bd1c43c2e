"""Calibrate the cost model from a measured run: ``k3sched calibrate TRACE... --plan plan.json -o
profile.yaml`` writes the profile YAML :func:`k3sched.cost.load_profile` reads.

[Note: calibration]
The measured instances of the plan's tasks (runtime traces ``trace_rank*.json``: the last step; an
nsys SQLite: every step, the first dropped as warm-up when there are several) are joined to the plan
by task id. What a task *costs* is not always its measured span:

- compute and local-copy tasks (``compute`` lane, ``offload_local``): end - start.
- collectives on the ``ep`` and ``collective`` lanes (all-to-alls, ``grad.rs``): every rank of the
  stage runs the same task id; a rank that arrives early waits for the last one, which the plan
  does not model (its stages' ranks are identical). Cost = end - (latest start of that task over
  the stage's ranks, same step).
- transfers between stages (``act.send``/``act.recv``, ``grad.send``/``grad.recv``, ``act.roffload``
  /``act.rstore``, ``act.rserve``/``act.ronload``): a receive is posted early and waits for its send.
  The planner starts a receive when its send ends, so a receive's cost = its end - max(its start, its
  send's end) (at least 1 us), the send found by the plan's dependency on the replica-matched rank
  ([Note: validation rules]); a send's cost is its own span.

These need comparable clocks across ranks: one host (runtime traces are aligned to one t0, nsys
records one clock). ``durations_us[kind]`` is the median cost over a kind's instances, for every
kind whose tasks all move the same bytes. Kinds whose payload varies between tasks (``grad.rs`` of
dense vs MoE layers, offload copies of different activation sets) get no per-kind duration: their
lane's ``bandwidth_gbps`` carries them, fitted so the cost model's own formula (fixed part =
launch + latency at infinite bandwidth, plus bytes / bandwidth) matches: bw = sum(bytes) /
sum(cost - fixed). For every lane with byte-moving tasks, ``bandwidth_gbps`` is written (from the
variable kinds when there are some, else from all of them) so the profile also describes the link.
``saved_bytes`` of the plan's own profile (``schedule.profile``) are kept.

Contention factor. The planner treats each rank's lanes as its own hardware (GPU streams). On the
CPU runner, 4 ranks x 5 lane threads share 2 cores: the tiny config burns ~0.58 s of CPU per
~0.41 s step, so ranks slow each other beyond what per-task medians show (heavy-tailed durations:
a task's mean is up to 2x its median when other ranks compute at the same time; all-to-alls wait
for the slower EP rank; lane hand-offs wait for the GIL). Planning with the raw medians predicts
about 0.4x the measured step there. When the calibration run's measured step time is known (its
``summary.json``: median of the steps after the first), every duration and 1/bandwidth is scaled
by one factor so that planning the same config with the profile predicts that step time
(``contention_factor`` = measured / predicted-with-raw-medians, refined twice because fixed
latencies do not scale). The factor is a property of the machine and the config's concurrency:
it carries to a new run of the same config on the same runner, not to another machine.

k3sched imports no torch; the trace readers (``traces``) are imported lazily by
:func:`calibrate_files`, and :func:`fit_profile` takes any EventTable-like object with columns
``name``, ``rank``, ``start_us``, ``end_us``, ``kind``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .config import ConfigError, config_from_dict
from .cost import CostModel, Profile, load_profile
from .tasks import Kind

PROFILE_FORMAT = "k3sched.profile/1"
COLLECTIVE_LANES = ("ep", "collective")
BYTE_LANES = ("ep", "collective", "offload_local", "offload_remote")
# receiving kind -> sending kind (one transfer between two stages)
PAIRS = {"act.recv": "act.send", "grad.recv": "grad.send", "act.rstore": "act.roffload", "act.ronload": "act.rserve"}
P2P_KINDS = frozenset(PAIRS) | frozenset(PAIRS.values())
UNIFORM_BYTES_RTOL = 0.05
MIN_COST_US = 1.0


@dataclass
class Fit:
    """A fitted profile and what it was fitted from."""

    durations_us: dict[str, float] = field(default_factory=dict)
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    saved_bytes: dict = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)          # kind -> instances used
    raw_median_us: dict[str, float] = field(default_factory=dict)  # kind -> median end - start
    by_bandwidth: list[str] = field(default_factory=list)          # kinds left to the bandwidth
    task_cost_us: dict[str, float] = field(default_factory=dict)   # task id -> median cost (ranks, steps)
    steps_used: int = 0
    ranks: int = 0
    contention_factor: float = 1.0
    measured_step_us: float | None = None
    predicted_raw_us: float | None = None   # planned step with the unscaled medians
    predicted_us: float | None = None       # planned step with the written profile

    def to_yaml_doc(self, source: str = "") -> dict:
        doc = {"format": PROFILE_FORMAT,
               "source": source + (f"; durations x{self.contention_factor:.4g} (contention factor: measured step "
                                   f"{self.measured_step_us:.0f} us / raw-median plan {self.predicted_raw_us:.0f} us)"
                                   if self.contention_factor != 1.0 else ""),
               "durations_us": {k: round(v, 3) for k, v in sorted(self.durations_us.items())},
               "bandwidth_gbps": {k: float(f"{v:.6g}") for k, v in sorted(self.bandwidth_gbps.items())}}
        if self.saved_bytes:
            doc["saved_bytes"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(self.saved_bytes.items())}
        return doc


def _tasks(plan: dict) -> dict[str, dict]:
    return {t["id"]: t for st in plan["stages"] for ts in st["lanes"].values() for t in ts}


def fit_profile(plan: dict, events, *, skip_first_step: bool | None = None) -> Fit:
    """Fit per-kind durations and per-lane bandwidths of ``plan`` from measured ``events``
    (see [Note: calibration]). ``skip_first_step``: drop each task's first instance (warm-up);
    default: when some task has more than one instance. Raises ValueError (one line) when no
    event matches a planned task."""
    tasks = _tasks(plan)
    # instances: (rank, id) -> [(start, end)] in time order
    inst: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    names = events.name
    kinds = getattr(events, "kind", None)
    for i in range(len(names)):
        if kinds is not None and kinds[i] != "range":
            continue
        n = str(names[i])
        if n in tasks:
            inst[(int(events.rank[i]), n)].append((float(events.start_us[i]), float(events.end_us[i])))
    if not inst:
        raise ValueError("no trace event names a task of the plan (wrong plan, or traces of another run?)")
    for v in inst.values():
        v.sort()
    most = max(len(v) for v in inst.values())
    skip = (most > 1) if skip_first_step is None else skip_first_step
    first = 1 if skip and most > 1 else 0
    # step k of (rank, id) = its k-th instance
    occ: dict[tuple[int, str, int], tuple[float, float]] = {}
    for (r, tid), v in inst.items():
        for k, se in enumerate(v[first:]):
            occ[(r, tid, k)] = se
    ranks = sorted({r for r, _ in inst})
    stage_votes: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for (r, tid) in inst:
        stage_votes[r][int(tasks[tid]["stage"])] += 1
    stage_of = {r: max(v, key=v.get) for r, v in stage_votes.items()}
    ranks_of_stage: dict[int, list[int]] = defaultdict(list)
    for r in ranks:
        ranks_of_stage[stage_of[r]].append(r)

    def peer_rank(r: int, other_stage: int) -> int | None:
        mine, theirs = ranks_of_stage[stage_of[r]], ranks_of_stage.get(other_stage, [])
        if len(theirs) == 1:
            return theirs[0]
        if len(theirs) == len(mine) and r in mine:
            return theirs[mine.index(r)]
        return None

    # the transfer partner of each P2P task: receive -> its send (a plan dep), send -> its receive
    partner: dict[str, str] = {}
    for tid, t in tasks.items():
        if t["kind"] in PAIRS:
            for d in t.get("deps") or []:
                if d in tasks and tasks[d]["kind"] == PAIRS[t["kind"]]:
                    partner[tid] = d
                    partner.setdefault(d, tid)
    costs: dict[str, list[float]] = defaultdict(list)
    raw: dict[str, list[float]] = defaultdict(list)
    per_task: list[tuple[str, float, int, str, int | None]] = []  # (kind, cost, bytes, id, layer)
    group_start: dict[tuple[int, str, int], float] = {}
    for (r, tid, k), (s, e) in occ.items():
        t = tasks[tid]
        if t["lane"] in COLLECTIVE_LANES and t["kind"] not in P2P_KINDS:
            key = (stage_of[r], tid, k)
            group_start[key] = max(group_start.get(key, s), s)
    for (r, tid, k), (s, e) in occ.items():
        t = tasks[tid]
        kind = t["kind"]
        raw[kind].append(e - s)
        if kind in PAIRS:  # a receive: from its send's end (the planner's dependency)
            other = partner.get(tid)
            pr = peer_rank(r, int(tasks[other]["stage"])) if other else None
            o = occ.get((pr, other, k)) if pr is not None else None
            begin = max(s, o[1]) if o else s
        elif kind in P2P_KINDS:
            begin = s
        elif t["lane"] in COLLECTIVE_LANES:
            begin = group_start[(stage_of[r], tid, k)]
        else:
            begin = s
        c = max(e - begin, MIN_COST_US)
        costs[kind].append(c)
        per_task.append((kind, c, int(t.get("bytes") or 0), tid, t.get("layer")))

    fit = Fit(steps_used=max(k for _, _, k in occ) + 1, ranks=len(ranks))
    by_id: dict[str, list[float]] = defaultdict(list)
    for _, c, _, tid, _ in per_task:
        by_id[tid].append(c)
    fit.task_cost_us = {tid: statistics.median(cs) for tid, cs in by_id.items()}
    # kinds whose tasks move different byte counts are left to the lane bandwidth
    nbytes: dict[str, set[int]] = defaultdict(set)
    for t in tasks.values():
        nbytes[t["kind"]].add(int(t.get("bytes") or 0))
    variable = {k for k, b in nbytes.items() if max(b) > 0 and (max(b) - min(b)) > UNIFORM_BYTES_RTOL * max(b)}
    for kind, cs in sorted(costs.items()):
        fit.samples[kind] = len(cs)
        fit.raw_median_us[kind] = statistics.median(raw[kind])
        if kind in variable:
            fit.by_bandwidth.append(kind)
        else:
            fit.durations_us[kind] = statistics.median(cs)
    # bandwidths: bytes / (cost - the cost model's fixed part at infinite bandwidth)
    cfg = _plan_config(plan)
    fixed_model = CostModel(cfg, Profile(bandwidth_gbps={ln: 1e12 for ln in BYTE_LANES})) if cfg else None
    lane_of = {k.value: _lane(k) for k in Kind}
    for lane in BYTE_LANES:
        rows = [(k, c, b, tid, layer) for k, c, b, tid, layer in per_task if lane_of.get(k) == lane and b > 0]
        if any(k in variable for k, *_ in rows):
            rows = [row for row in rows if row[0] in variable]
        if not rows:
            continue
        tot_b = sum(b for _, _, b, _, _ in rows)
        tot_t = 0.0
        for k, c, b, tid, layer in rows:
            fx = _fixed_us(fixed_model, k, layer, b) if fixed_model else 0.0
            tot_t += max(c - fx, MIN_COST_US * 0.1)
        fit.bandwidth_gbps[lane] = tot_b / tot_t / 1e3  # bytes/us -> GB/s
    fit.saved_bytes = _plan_saved_bytes(plan)
    return fit


def scale(fit: Fit, factor: float) -> None:
    """Scale every duration by ``factor`` and every bandwidth by 1 / ``factor`` (in place)."""
    fit.durations_us = {k: v * factor for k, v in fit.durations_us.items()}
    fit.bandwidth_gbps = {k: v / factor for k, v in fit.bandwidth_gbps.items()}
    fit.contention_factor *= factor


def predict_step_us(plan: dict, fit: Fit) -> float:
    """Step time the planner predicts for ``plan``'s config with ``fit`` as its profile."""
    import tempfile

    from .planner import plan as make_plan

    data = dict(plan["config"])
    with tempfile.TemporaryDirectory() as d:
        path = write_profile(fit, Path(d) / "profile.yaml")
        data["schedule"] = {**data["schedule"], "profile": str(path)}
        cfg = config_from_dict(data)
        return float(make_plan(cfg, plan.get("strategy")).metrics["step_time_us"])


def fit_contention(plan: dict, fit: Fit, measured_step_us: float, rounds: int = 3) -> Fit:
    """Scale ``fit`` so that planning with it predicts ``measured_step_us`` (see [Note: calibration])."""
    fit.measured_step_us = float(measured_step_us)
    fit.predicted_raw_us = predicted = predict_step_us(plan, fit)
    for _ in range(rounds):
        if predicted <= 0:
            break
        scale(fit, measured_step_us / predicted)
        predicted = predict_step_us(plan, fit)
    fit.predicted_us = predicted
    return fit


def _lane(kind: Kind) -> str:
    from .tasks import LANE_OF

    return LANE_OF[kind]


def _plan_config(plan: dict):
    data = dict(plan.get("config") or {})
    if not {"model", "parallel", "hardware", "schedule"} <= set(data):
        return None
    sched = dict(data["schedule"])
    sched["profile"] = None  # the fixed part is the analytic model's
    data["schedule"] = sched
    try:
        return config_from_dict(data)
    except ConfigError:
        return None


def _fixed_us(model: CostModel, kind: str, layer, nbytes: int) -> float:
    try:
        return model.duration_us(Kind(kind), layer=layer, nbytes=nbytes)
    except (ValueError, AssertionError, TypeError):
        return 0.0


def _plan_saved_bytes(plan: dict) -> dict:
    path = ((plan.get("config") or {}).get("schedule") or {}).get("profile")
    if not path:
        return {}
    try:
        return dict(load_profile(path).saved_bytes)
    except ConfigError:
        return {}


def write_profile(fit: Fit, path: str | Path, source: str = "") -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    head = ("# k3sched measured profile (k3sched calibrate): per-kind durations (us per task, median of the\n"
            "# measured cost) and per-lane bandwidths (GB/s); plan with --set schedule.profile=THIS_FILE\n")
    p.write_text(head + yaml.safe_dump(fit.to_yaml_doc(source), sort_keys=False))
    return p


def measured_step_from_summary(path: str | Path) -> float | None:
    """``measured_step_time_us`` of a run's summary.json (None when absent or unreadable)."""
    import json

    try:
        v = json.loads(Path(path).read_text()).get("measured_step_time_us")
    except (OSError, ValueError, AttributeError):
        return None
    return float(v) if v else None


def calibrate_files(trace_paths: list[str | Path], plan_path: str | Path, out_path: str | Path, *,
                    summary: str | Path | None = None, contention: bool = True) -> Fit:
    """Read the traces (any format ``traces.read_trace`` reads) and the plan, fit, write the
    profile. ``summary``: the run's summary.json (default: one beside the first trace, if any)
    whose measured step time fits the contention factor; ``contention=False`` writes the raw
    medians. Raises ``traces.TraceError`` for unreadable input and ValueError when nothing matches."""
    from traces.chrome import read_trace
    from traces.events import EventTable, TraceError
    from traces.validate import load_plan

    plan = load_plan(plan_path)
    if not trace_paths:
        raise TraceError("no trace files given")
    events = EventTable.concat([read_trace(p) for p in trace_paths])
    fit = fit_profile(plan, events)
    if contention:
        if summary is None and (Path(trace_paths[0]).parent / "summary.json").exists():
            summary = Path(trace_paths[0]).parent / "summary.json"
        measured = measured_step_from_summary(summary) if summary is not None else None
        if summary is not None and measured is None:
            raise TraceError(f"{summary}: no measured_step_time_us (not a k3sched run summary.json)")
        if measured:
            fit_contention(plan, fit, measured)
    write_profile(fit, out_path, source=f"{len(trace_paths)} trace file(s) of the run planned in {plan_path}")
    return fit


def render(fit: Fit) -> str:
    lines = [f"calibrated from {fit.ranks} rank(s), {fit.steps_used} step(s) per task"]
    lines.append("kind               samples   cost us  (measured span us)")
    for k in sorted(fit.samples):
        cost = fit.durations_us.get(k)
        lines.append(f"  {k:<16} {fit.samples[k]:>7}  {('%9.1f' % cost) if cost is not None else '  (bw)   '}  "
                     f"({fit.raw_median_us[k]:.1f})")
    if fit.bandwidth_gbps:
        lines.append("bandwidth GB/s: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(fit.bandwidth_gbps.items())))
    if fit.measured_step_us:
        lines.append(f"step: measured {fit.measured_step_us / 1e3:.1f} ms; planned with the raw medians "
                     f"{fit.predicted_raw_us / 1e3:.1f} ms; contention factor x{fit.contention_factor:.3f} applied to "
                     f"every duration, planned with the profile {fit.predicted_us / 1e3:.1f} ms")
    else:
        lines.append("no measured step time (no summary.json): raw medians written, no contention factor")
    return "\n".join(lines)

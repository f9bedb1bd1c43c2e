"""Calibrate the cost model from a measured run: ``k3sched calibrate TRACE... --plan plan.json -o
profile.yaml`` writes the profile YAML :func:`k3sched.profile.load_profile` reads.

[Note: calibration]
The measured instances of the plan's tasks (runtime traces ``trace_rank*.json``: the last step;
``trace_steps_rank*.json``, ``k3sched run --trace-steps``: every step from the last warm-up step on;
an nsys SQLite: every step; the first dropped as warm-up when there are several) are joined to the
plan by task id. What a task *costs* is not always its measured span:

- compute and local-copy tasks (``compute`` lane, ``offload_local``): end - start.
- collectives on the ``ep`` and ``collective`` lanes (all-to-alls, ``grad.rs``): every rank of the
  stage runs the same task id, and a rank that arrives early waits for the last one. The plan's
  ranks of a stage are identical, so it cannot see that wait, but every synchronising collective
  pays it: the slower rank of the moment sets the pace (on a shared machine, which one changes
  from task to task). Cost = end - start on each rank, so the median over the ranks and steps
  carries the typical wait beside the transfer.
- transfers between stages (``act.send``/``act.recv``, ``grad.send``/``grad.recv``, ``act.roffload``
  /``act.rstore``, ``act.rserve``/``act.ronload``): a receive is posted early and waits for its send.
  The planner starts a receive when its send ends, so a receive's cost = its end - max(its start, its
  send's end) (at least 1 us), the send found by the plan's dependency on the replica-matched rank
  ([Note: trace join] in traces/join.py); a send's cost is its own span.

These need comparable clocks across ranks: one host (runtime traces are aligned to one t0, nsys
records one clock). ``durations_us[kind]`` is the mean cost over a kind's instances, for every
kind whose tasks all move the same bytes ([Note: mean, not median]). Kinds whose payload varies between tasks (``grad.rs`` of
dense vs MoE layers, offload copies of different activation sets) get no per-kind duration: their
lane's ``bandwidth_gbps`` carries them, fitted so the cost model's own formula (fixed part =
launch + latency at infinite bandwidth, plus bytes / bandwidth) matches: bw = sum(bytes) /
sum(cost - fixed). For every lane with byte-moving tasks, ``bandwidth_gbps`` is written (from the
variable kinds when there are some, else from all of them) so the profile also describes the link.
``saved_bytes`` of the plan's own profile (``schedule.profile``) are kept.

What transfers to other configs. Compute and local-copy kinds get per-kind durations on one core:
the mean cost divided by the source config's [Note: CPU sharing] factor (``hardware.cpu_runner.host_cores``),
so a config with more or fewer ranks per node is charged its own sharing, less the CPU time the
rank's transfers took from each instance at a cost per byte fitted from the run, at most what
leaves the ops together no faster than the probe's operator profile, at least the source plan's
(``k3sched probe`` measures it beside a GEMM loop; ``_cpu_steal``). Communication kinds
(all-to-alls, P2P receives, gradient reductions, remote offload) get no per-kind duration: per
lane, a least-squares fit of cost - overhead = steps x latency + (bytes / link rate) / efficiency
over the lane's tasks ([Note: wire model] in k3sched/cost.py) gives ``latency_us[lane]`` and
``link_efficiency[lane]`` (achieved / configured rate), so halving the config's link rate halves
the modeled rate. optim.run is left to the cost model (it depends on the stage's parameters).
No factor is fitted to the source run's step time: the residual on that run is reported beside,
and predictions for other configs are checked by running them (tests/unit/traces/test_calibrate.py,
benchmarks/bench_overlap.py).

[Note: mean, not median] A step is a sum of task durations along its paths, and the expected
value of a sum is the sum of the means. On a shared CPU a kind's costs are skewed to the right
(an op that a transfer's wake-ups or another process preempted runs several times its usual
time), so their median sits below their mean and a profile of medians predicts every step short,
its own source run included; a profile of means follows both the source run and the targets
closer. The cost of a mean: one outlier moves its kind (a 100 ms stall among 96 samples of 10 ms
adds 10%), which is also what such a stall does to the steps it falls in; the first step
(warm-up) is dropped before either.

Calibration lives in ``traces`` because it reads traces and writes what the planner reads: it
imports the config, the cost model, its profile format and the planner from ``k3sched``, beyond
the plan format the other trace tools need (tests/test_layering.py lists them), and nothing in
``k3sched`` imports it but the CLI (docs/design.md, section 2). It needs no torch. :func:`fit_profile` takes
any EventTable-like object with columns ``name``, ``rank``, ``start_us``, ``end_us``, ``kind``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from k3sched.config import ConfigError, config_from_dict
from k3sched.cost import CostModel
from k3sched.profile import Profile, load_profile
from k3sched.tasks import EXPERT_KINDS, Kind
from traces.join import SEND_OF, RankStages, ranges_by_name, send_of

PROFILE_FORMAT = "k3sched.profile/1"
COLLECTIVE_LANES = ("ep", "collective")
WIRE_LANES = ("ep", "collective", "offload_remote")
BYTE_LANES = ("ep", "collective", "offload_local", "offload_remote")
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
    latency_us: dict[str, float] = field(default_factory=dict)       # lane -> µs per call / ring step
    link_efficiency: dict[str, float] = field(default_factory=dict)  # lane -> achieved / configured rate
    overhead_us: dict[str, float] = field(default_factory=dict)      # kept from the plan's profile
    per_expert_us: dict[str, float] = field(default_factory=dict)    # kept from the plan's profile
    comm_cpu_ns_per_byte: float | None = None  # CPU cost of a transferred byte (CPU runner)
    comm_cpu_fitted: bool = False           # fitted from the run (else the source plan's: the least slope)
    time_cv: dict[str, float] = field(default_factory=dict)  # compute kind -> spread beside transfers
    share: float = 1.0                      # [Note: CPU sharing] factor of the source config's compute
    steps_used: int = 0
    ranks: int = 0
    measured_step_us: float | None = None   # the source run's measured step (its summary.json)
    predicted_us: float | None = None       # the source config planned with the written profile
    expected_us: float | None = None        # ... its expected step with the fitted time spread

    @property
    def residual(self) -> float | None:
        """measured / predicted - 1 on the run the profile was fitted from (not a prediction)."""
        if self.measured_step_us and self.predicted_us:
            return self.measured_step_us / self.predicted_us - 1
        return None

    @property
    def expected_residual(self) -> float | None:
        """measured / expected - 1 on the source run, the expected step being the plan's replay with
        the fitted task-time spread ([Note: task-time spread] in k3sched/variability.py)."""
        if self.measured_step_us and self.expected_us:
            return self.measured_step_us / self.expected_us - 1
        return None

    def to_yaml_doc(self, source: str = "") -> dict:
        doc = {"format": PROFILE_FORMAT, "source": source,
               "durations_us": {k: round(v, 3) for k, v in sorted(self.durations_us.items())},
               "bandwidth_gbps": {k: float(f"{v:.6g}") for k, v in sorted(self.bandwidth_gbps.items())}}
        if self.latency_us:
            doc["latency_us"] = {k: round(v, 3) for k, v in sorted(self.latency_us.items())}
        if self.link_efficiency:
            doc["link_efficiency"] = {k: float(f"{v:.6g}") for k, v in sorted(self.link_efficiency.items())}
        if self.overhead_us:
            doc["overhead_us"] = {k: round(v, 3) for k, v in sorted(self.overhead_us.items())}
        if self.comm_cpu_ns_per_byte is not None:
            doc["comm_cpu_ns_per_byte"] = float(f"{self.comm_cpu_ns_per_byte:.4g}")
        if self.time_cv:
            doc["time_cv"] = {k: round(v, 4) for k, v in sorted(self.time_cv.items())}
        if self.per_expert_us:
            doc["per_expert_us"] = {k: round(v, 3) for k, v in sorted(self.per_expert_us.items())}
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
    occ, recorded = _occurrences(tasks, events, skip_first_step)
    cfg = _plan_config(plan)
    model = CostModel(cfg, Profile(overhead_us=_plan_profile(plan, "overhead_us"),
                                   per_expert_us=_plan_profile(plan, "per_expert_us"))) if cfg else None
    cpu_ns = None
    steal: dict = {}
    known = None
    if model is not None and model.cpu is not None and model.cpu.rc.host_cores:
        known = _plan_cpu_ns(plan, model) or None  # measured (the probe) or fitted before: the least slope
        floor = {k: model.at_local_experts(Kind(k), d) * model.share(Kind(k))
                 for k, d in _plan_profile(plan, "durations_us").items() if k in Kind._value2member_map_}
        cpu_ns, steal = _cpu_steal(occ, tasks, model, floor, known)
        steal.update(_waits_beside_compute(occ, tasks, model))
        steal.update(_alone_back(occ, tasks, model, steal))
    stages = RankStages.by_majority([r for r, _ in recorded], [int(tasks[tid]["stage"]) for _, tid in recorded])
    per_task, raw = _costs(tasks, occ, stages, steal)
    fit = Fit(steps_used=max(k for _, _, k in occ) + 1, ranks=len(stages.stage_of), comm_cpu_ns_per_byte=cpu_ns,
              comm_cpu_fitted=cpu_ns is not None and cpu_ns != (known or 0.0))
    by_id: dict[str, list[float]] = defaultdict(list)
    for _, c, _, tid, _ in per_task:
        by_id[tid].append(c)
    fit.task_cost_us = {tid: statistics.median(cs) for tid, cs in by_id.items()}
    variable = _variable_kinds(tasks)
    if model is not None:
        fit.share = max(model.share(Kind(t["kind"])) for t in tasks.values())
    wired = _fit_durations(fit, per_task, raw, variable, model)
    if model is not None:
        _fit_wires(fit, model, [row for row in per_task if row[0] in wired])
        fit.overhead_us = dict(model.profile.overhead_us)
        fit.per_expert_us = dict(model.profile.per_expert_us)
    _fit_bandwidths(fit, cfg, per_task, variable, model)
    fit.saved_bytes = _plan_profile(plan, "saved_bytes")
    fit.time_cv = _spread_beside_transfers(tasks, occ)
    return fit


SPREAD_MIN_BESIDE = 0.5
"""A compute instance counts towards its kind's spread when transfers of its rank cover at least
this share of its span."""


def _spread_beside_transfers(tasks: dict, occ: dict) -> dict[str, float]:
    """Per compute kind, std / mean of the measured spans of its instances that ran beside their
    rank's transfers (``ep`` / ``collective`` lanes over at least ``SPREAD_MIN_BESIDE`` of the
    span), kinds with two or more such instances: the spread the plan's replay gives a task beside
    a transfer ([Note: task-time spread] in k3sched/variability.py)."""
    import numpy as np

    from k3sched.intervals import covered_each, merge

    comm: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    comp: dict[tuple[int, int], list[tuple[str, float, float]]] = defaultdict(list)
    for (r, tid, k), (s, e) in occ.items():
        t = tasks[tid]
        if e <= s:
            continue
        if t["lane"] in COLLECTIVE_LANES:
            comm[(r, k)].append((s, e))
        elif t["lane"] == "compute" and t["kind"] != Kind.OPTIM.value:
            comp[(r, k)].append((t["kind"], s, e))
    spans: dict[str, list[float]] = defaultdict(list)
    for key, rows in comp.items():
        if key not in comm:
            continue
        iv = np.array([(s, e) for _, s, e in rows])
        cov = covered_each(iv, merge(np.array(comm[key], dtype=float)))
        for (kind, s, e), c in zip(rows, cov):
            if c >= SPREAD_MIN_BESIDE * (e - s):
                spans[kind].append(e - s)
    return {k: min(10.0, statistics.pstdev(v) / statistics.fmean(v)) for k, v in sorted(spans.items())
            if len(v) > 1 and statistics.fmean(v) > 0}


def _occurrences(tasks: dict, events, skip_first_step: bool | None) -> tuple[dict, list[tuple[int, str]]]:
    """(rank, task id, step k) -> (start, end) of the task's k-th measured instance on the rank
    (its first dropped as warm-up when ``skip_first_step``, by default when some task has more
    than one); and every (rank, task id) recorded. Raises ValueError when no range names a
    planned task."""
    rows, names, inv = ranges_by_name(events)
    known = [n in tasks for n in names.tolist()]
    inst: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for row, ni in zip(rows.tolist(), inv.tolist()):
        if known[ni]:
            inst[(int(events.rank[row]), str(names[ni]))].append((float(events.start_us[row]), float(events.end_us[row])))
    if not inst:
        raise ValueError("no trace event names a task of the plan (wrong plan, or traces of another run?)")
    for v in inst.values():
        v.sort()
    most = max(len(v) for v in inst.values())
    skip = (most > 1) if skip_first_step is None else skip_first_step
    first = 1 if skip and most > 1 else 0
    return {(r, tid, k): se for (r, tid), v in inst.items() for k, se in enumerate(v[first:])}, list(inst)


def _costs(tasks: dict, occ: dict, stages: RankStages, steal: dict) -> tuple[list, dict[str, list[float]]]:
    """Each instance's cost ([Note: calibration]) as (kind, cost, bytes, task id, layer) rows, and
    per kind the measured spans. A receive's cost starts at the end of its send ([Note: trace
    join]: the send is the receive's plan dependency, on the replica-matched rank)."""
    kind_of = lambda d: tasks[d]["kind"] if d in tasks else None  # noqa: E731
    send = {tid: send_of(t["kind"], t.get("deps") or [], kind_of) for tid, t in tasks.items() if t["kind"] in SEND_OF}
    raw: dict[str, list[float]] = defaultdict(list)
    per_task: list[tuple[str, float, int, str, int | None]] = []
    for (r, tid, k), (s, e) in occ.items():
        t = tasks[tid]
        kind = t["kind"]
        raw[kind].append(e - s)
        if kind in SEND_OF:  # a receive: from its send's end (the planner's dependency)
            other = send.get(tid)
            pr = stages.peer(r, int(tasks[other]["stage"])) if other else None
            o = occ.get((pr, other, k)) if pr is not None else None
            begin = max(s, o[1]) if o else s
        else:
            begin = s
        # compute: the transfers' CPU share taken out; a transfer: its wait for cores beside compute
        took = steal.get((r, tid, k), 0.0)
        per_task.append((kind, max(e - begin - took, MIN_COST_US), int(t.get("bytes") or 0), tid, t.get("layer")))
    return per_task, raw


def _variable_kinds(tasks: dict) -> set[str]:
    """Kinds whose tasks move different byte counts (left to the lane bandwidth)."""
    nbytes: dict[str, set[int]] = defaultdict(set)
    for t in tasks.values():
        nbytes[t["kind"]].add(int(t.get("bytes") or 0))
    return {k for k, b in nbytes.items() if max(b) > 0 and (max(b) - min(b)) > UNIFORM_BYTES_RTOL * max(b)}


def _fit_durations(fit: Fit, per_task: list, raw: dict, variable: set[str], model: CostModel | None) -> set[str]:
    """Per-kind samples, raw medians and one-core durations; returns the kinds the wire model
    carries ([Note: wire model]: per-lane latency and link efficiency, fitted after)."""
    costs: dict[str, list[float]] = defaultdict(list)
    for kind, c, *_ in per_task:
        costs[kind].append(c)
    wired = {k for k in costs if model is not None and _wire(model, k, None, 0) is not None}
    wired |= {k for k in costs if model is not None and k in variable and _lane(Kind(k)) in WIRE_LANES}
    for kind, cs in sorted(costs.items()):
        fit.samples[kind] = len(cs)
        fit.raw_median_us[kind] = statistics.median(raw[kind])
        if kind in wired or (model is not None and kind == Kind.OPTIM.value):
            continue  # left to the wire fit / the cost model (optim.run depends on the stage's parameters)
        if kind in variable:
            fit.by_bandwidth.append(kind)
        else:  # one core's duration: the source config's CPU sharing (and busiest-rank factor) divided out
            share = model.share(Kind(kind)) if model is not None else 1.0
            one = statistics.fmean(cs) / share
            if model is not None and Kind(kind) in EXPERT_KINDS:
                # back to the profile's terms: all experts on one rank, balanced ([Note: per-expert cost])
                fixed = model.per_expert_us(Kind(kind))
                one = max(0.0, one - fixed * model.local_experts()) / model.skew_factors()[0] \
                    + fixed * model.cfg.model.experts
            fit.durations_us[kind] = one
    return wired


def _fit_bandwidths(fit: Fit, cfg, per_task: list, variable: set[str], model: CostModel | None) -> None:
    """Per byte lane not left to the wire fit: bytes / (cost - the cost model's fixed part at
    infinite bandwidth), over the variable kinds when the lane has some, else over all."""
    fixed_model = CostModel(cfg, Profile(bandwidth_gbps={ln: 1e12 for ln in BYTE_LANES})) if cfg else None
    lane_of = {k.value: _lane(k) for k in Kind}
    for lane in BYTE_LANES:
        if model is not None and lane in WIRE_LANES:
            continue
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


def _cpu_steal(occ: dict, tasks: dict, model: CostModel, floor: dict | None = None,
               known_ns: float | None = None) -> tuple[float, dict]:
    """Fit the CPU cost of a transferred byte from the run, and return it with, per compute-task
    instance, the CPU time the rank's overlapping transfers took from it ([Note: CPU cost of
    communication] in k3sched/cpurunner.py applied to the measured spans), so that the fitted
    durations are those of an uncontended core.

    Each compute instance's span is regressed on the bytes its rank's transfers moved during it
    (each transfer's bytes spread evenly over its span): span - EP host overhead overlapped =
    base[kind] + ns_per_byte x bytes (least squares, ns_per_byte >= 0). Transfers that overlap
    more compute in one config than another then cost what they cost here.

    ``floor``: kind -> µs of the op measured with every core computing and nothing transferred (the
    plan's own profile: ``k3sched probe``'s operator profile, times the source's CPU sharing). The
    slope is identified only by how much the overlapped bytes vary within a kind, which on a noisy
    shared machine can be little, so a least-squares slope can charge transfers with slowdowns they
    did not cause and leave the ops faster than they ever ran alone. The slope is lowered until the
    compute instances' bases together are no less than their floors together: (sum of spans - sum
    of floors) / sum of overlapped bytes (for a fixed slope the best base of a kind is its mean
    residual); together, not per kind: an expert op's work depends on the routing of the moment;
    over the kinds that have a floor (``optim.run``, in no operator profile, has none and is left out
    of both sums, so it does not switch the bound off).

    ``known_ns``: the cost per byte the source plan already has (``hardware.cpu_runner.comm_cpu_ns_per_byte``,
    which ``k3sched probe`` measures in the testbed as what concurrent all-to-alls cost a GEMM loop,
    or a profile's): the least slope, also against the floor. The model's ops are shorter and many,
    with Python between them, and lose more to a transfer's threads than the probe's GEMM, so the
    probe's cost per byte alone explains only part of how much slower they run beside transfers;
    the run's own regression carries the rest.

    Of the three choices (how the re-planned targets' steps follow each is in docs/results.md),
    the probe's slope alone predicts targets with fewer transferred bytes too slow; the regression
    alone can charge transfers with stalls they did not cause and predict a target with fewer
    transferred bytes too fast; the regression bounded by the floors and raised to the probe's, as
    here, keeps both errors small."""
    import numpy as np

    comm: dict[tuple[int, int], list[tuple[float, float, float, float]]] = defaultdict(list)
    for (r, tid, k), (s, e) in occ.items():
        t = tasks[tid]
        if e <= s:
            continue
        moved, over = model.cpu.comm_cpu_load(Kind(t["kind"]), int(t.get("bytes") or 0))
        if moved or over:
            comm[(r, k)].append((s, e, moved / (e - s), min(1.0, over / (e - s))))
    keys, kinds, xb, xo, y = [], [], [], [], []
    for (r, tid, k), (s, e) in occ.items():
        if tasks[tid]["lane"] != "compute":
            continue
        b = o = 0.0
        for cs, ce, brate, orate in comm.get((r, k), ()):
            ov = max(0.0, min(ce, e) - max(cs, s))
            b += ov * brate
            o += ov * orate
        keys.append((r, tid, k))
        kinds.append(tasks[tid]["kind"])
        xb.append(b)
        xo.append(o)
        y.append(e - s - o)
    if not keys:
        return (known_ns or 0.0), {}
    names = sorted(set(kinds))
    X = np.zeros((len(keys), len(names) + 1))
    for i, kd in enumerate(kinds):
        X[i, names.index(kd)] = 1.0
    X[:, -1] = xb
    coef, *_ = np.linalg.lstsq(X, np.array(y), rcond=None)
    us_per_byte = max(0.0, float(coef[-1]))
    floored = [i for i, kd in enumerate(kinds) if floor and kd in floor]
    moved = sum(xb[i] for i in floored)
    if moved > 0:
        us_per_byte = min(us_per_byte, sum(y[i] - floor[kinds[i]] for i in floored) / moved)
    us_per_byte = max(us_per_byte, (known_ns or 0.0) / 1e3, 0.0)
    steal = {key: us_per_byte * b + o for key, b, o in zip(keys, xb, xo)}
    return us_per_byte * 1e3, steal


def _alone_back(occ: dict, tasks: dict, model: CostModel, steal: dict) -> dict:
    """Per compute instance of a source whose ranks can compute alone ([Note: compute alone] in
    k3sched/cpurunner.py: one rank per pipeline stage), the amount to take from its span so that what
    remains is its cost with every rank computing, as the operator profile and the planner count
    it: (span - what ``steal`` already takes) / (1 - (1 - factor) x the share of its span no other
    rank computed), subtracted from the span. Empty where the factor does not act (EP or DP stages,
    GPUs)."""
    import numpy as np

    from k3sched.intervals import alone_shares

    f = model.cpu.compute_alone_factor()
    if f >= 1.0:
        return {}
    comp: dict[int, dict[int, list[tuple[float, float, tuple]]]] = defaultdict(lambda: defaultdict(list))
    for (r, tid, k), (s, e) in occ.items():
        if tasks[tid]["lane"] == "compute" and e > s:
            comp[k][r].append((s, e, (r, tid, k)))
    out = {}
    for by_rank in comp.values():
        shares = alone_shares({r: np.array([(s, e) for s, e, _ in rows], dtype=float) for r, rows in by_rank.items()})
        for r, rows in by_rank.items():
            for (s, e, key), alone in zip(rows, shares[r]):
                took = steal.get(key, 0.0)
                out[key] = (e - s) - (e - s - took) / (1.0 - (1.0 - f) * float(alone))
    return out


def _waits_beside_compute(occ: dict, tasks: dict, model: CostModel) -> dict:
    """Per transfer instance, the time it waited for cores because its rank computed beside it
    ([Note: a transfer beside compute] in k3sched/cpurunner.py applied to the measured spans): the
    plan's ``hardware.cpu_runner.comm_wait_us_per_call`` per call or ring step, times the share of its span
    the rank's compute covered. Taken out of its cost before the wire fit, so the fitted latency is
    the link's and a serial target (no compute beside a transfer) is not charged the wait."""
    import numpy as np

    from k3sched.intervals import covered_each, merge

    if not model.cpu.rc.comm_wait_us_per_call:
        return {}
    busy: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    spans: dict[tuple[int, int], list[tuple[tuple, float, float, float]]] = defaultdict(list)
    for (r, tid, k), (s, e) in occ.items():
        t = tasks[tid]
        if e <= s:
            continue
        if t["lane"] == "compute":
            busy[(r, k)].append((s, e))
            continue
        try:
            wait = model.cpu.comm_wait_us(Kind(t["kind"]), t.get("layer"), int(t.get("bytes") or 0))
        except (ValueError, AssertionError, TypeError):
            wait = 0.0
        if wait:
            spans[(r, k)].append(((r, tid, k), s, e, wait))
    out = {}
    for key, rows in spans.items():
        if key not in busy:
            continue
        share = covered_each(np.array([(s, e) for _, s, e, _ in rows]), merge(np.array(busy[key], dtype=float)))
        for (inst, s, e, wait), cov in zip(rows, share):
            out[inst] = wait * float(cov) / (e - s)
    return out


def _wire(model: CostModel, kind: str, layer, nbytes: int):
    try:
        return model.wire(Kind(kind), layer=layer, nbytes=nbytes)
    except (ValueError, AssertionError, TypeError):
        return None


def _fit_wires(fit: Fit, model: CostModel, rows: list) -> None:
    """Least squares per lane of cost - overhead = steps x latency + (bytes / link rate) / efficiency
    over the lane's communication tasks ([Note: calibration]). When every task has the same
    shape (one size, one step count) latency and efficiency cannot be told apart: the link's
    configured latency is kept and the efficiency alone is fitted. An efficiency above 1 (faster
    than the configured rate) is taken as 1 and the latency alone refitted."""
    import numpy as np

    by_lane: dict[str, list[tuple[float, float, float, float]]] = defaultdict(list)
    for kind, cost, nbytes, _tid, layer in rows:
        w = _wire(model, kind, layer, nbytes)
        if w is None or not w.terms:
            continue
        t1 = max(b / (g * 1e3) for b, g in w.terms)  # µs at the configured rate
        by_lane[_lane(Kind(kind))].append((float(w.steps), t1, cost - model.overhead_us(Kind(kind)), w.latency_us))
    for lane, pts in by_lane.items():
        X = np.array([[p[0], p[1]] for p in pts])
        y = np.array([p[2] for p in pts])
        lat0 = statistics.median(p[3] for p in pts)
        distinct = len({(round(p[0], 6), round(p[1], 3)) for p in pts})
        lat, k = lat0, None
        if distinct >= 2:
            (lat_f, k_f), *_ = np.linalg.lstsq(X, y, rcond=None)
            if lat_f >= 0 and k_f > 0:
                lat, k = float(lat_f), float(k_f)
        if k is None:  # latency fixed, efficiency alone
            k = float(max(np.sum(X[:, 1] * (y - X[:, 0] * lat)) / np.sum(X[:, 1] ** 2), 1e-6))
        if k < 1.0:  # faster than the link's rate is not a link property: rate as configured, latency alone
            k = 1.0
            lat = float(max(0.0, np.sum(X[:, 0] * (y - X[:, 1])) / np.sum(X[:, 0] ** 2)))
        fit.latency_us[lane] = lat
        fit.link_efficiency[lane] = 1.0 / k


def predict_step_us(plan: dict, fit: Fit) -> tuple[float, float | None]:
    """Step time the planner predicts for ``plan``'s config with ``fit`` as its profile, and the
    step it expects with the fitted task-time spread (None without one)."""
    import tempfile

    from k3sched.planner import plan as make_plan

    data = dict(plan["config"])
    with tempfile.TemporaryDirectory() as d:
        path = write_profile(fit, Path(d) / "profile.yaml")
        data["schedule"] = {**data["schedule"], "profile": str(path)}
        cfg = config_from_dict(data)
        m = make_plan(cfg, plan.get("strategy")).metrics
        return float(m.step_time_us), m.expected_step_us


def _lane(kind: Kind) -> str:
    from k3sched.tasks import LANE_OF

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


def _plan_cpu_ns(plan: dict, model: CostModel) -> float:
    """The CPU cost per transferred byte the plan was made with: its profile's (a calibration's)
    when it has one, else ``hardware.cpu_runner.comm_cpu_ns_per_byte`` (``k3sched probe``'s); 0: none."""
    own = _own_profile(plan)
    fitted = own.comm_cpu_ns_per_byte if own is not None else None
    return float(fitted) if fitted is not None else model.cpu.comm_cpu_ns_per_byte()


def _own_profile(plan: dict) -> Profile | None:
    """The plan's own profile (``schedule.profile``); None without one or when it does not load."""
    path = ((plan.get("config") or {}).get("schedule") or {}).get("profile")
    try:
        return load_profile(path) if path else None
    except ConfigError:
        return None


def _plan_profile(plan: dict, field_name: str) -> dict:
    """One field of the plan's own profile (``schedule.profile``) as a dict: ``overhead_us``
    (kept in the fitted profile: they are what the wire fit's fixed part subtracts),
    ``durations_us`` (the floors of the CPU-steal fit) or ``saved_bytes`` (kept); {} without a
    profile or when it does not load."""
    own = _own_profile(plan)
    return dict(getattr(own, field_name)) if own is not None else {}


def write_profile(fit: Fit, path: str | Path, source: str = "") -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    head = ("# k3sched measured profile (k3sched calibrate): per-kind durations (us per task, mean of the\n"
            "# measured cost) and per-lane bandwidths (GB/s); plan with --set schedule.profile=THIS_FILE\n")
    p.write_text(head + yaml.safe_dump(fit.to_yaml_doc(source), sort_keys=False))
    return p


def measured_step_from_summary(path: str | Path) -> float:
    """``measured_step_time_us`` of a run's summary.json, the file checked against its schema
    (``traces.schema.RunSummary``: format ``k3sched.run/1``, a finite positive step). Raises
    ``traces.TraceError`` (one line: file, field, value, what is allowed) for a missing,
    unreadable or malformed summary."""
    from traces.schema import load_summary

    return float(load_summary(path).measured_step_time_us)


def calibrate_files(trace_paths: list[str | Path], plan_path: str | Path, out_path: str | Path, *,
                    summary: str | Path | None = None, skip_bad_events: bool = False) -> Fit:
    """Read the traces (any format ``traces.read_trace`` reads) and the plan, fit, write the
    profile. ``summary``: the run's summary.json (default: one beside the first trace, if any):
    its measured step gives the fit's residual on the run it came from (reported, never used to
    scale the profile). Every input is checked before the fit (the plan and the summary against
    their schemas, ``traces.schema``). ``skip_bad_events``: drop malformed trace events (their
    count is said on stderr) instead of refusing the file. Raises ``traces.TraceError`` (one
    line) for unreadable or malformed input and ValueError when nothing matches."""
    from traces.cli import read_trace_files
    from traces.validate import load_plan

    plan = load_plan(plan_path)
    if summary is None and trace_paths and (Path(trace_paths[0]).parent / "summary.json").exists():
        summary = Path(trace_paths[0]).parent / "summary.json"
    measured = measured_step_from_summary(summary) if summary is not None else None
    events = read_trace_files(trace_paths, skip_bad_events=skip_bad_events, prog="k3sched calibrate")
    fit = fit_profile(plan, events)
    fit.measured_step_us = measured
    write_profile(fit, out_path, source=f"{len(trace_paths)} trace file(s) of the run planned in {plan_path}")
    if {"model", "parallel", "hardware", "schedule"} <= set(plan.get("config") or {}):  # a planner's plan
        fit.predicted_us, fit.expected_us = predict_step_us(plan, fit)
    return fit


def render(fit: Fit) -> str:
    lines = [f"calibrated from {fit.ranks} rank(s), {fit.steps_used} step(s) per task"
             + (f"; compute durations divided by the source's CPU sharing x{fit.share:.3g}" if fit.share != 1 else "")]
    lines.append("kind               samples   cost us  (measured span us)")
    for k in sorted(fit.samples):
        cost = fit.durations_us.get(k)
        how = ('%9.1f' % cost) if cost is not None else ("  (wire) " if k not in fit.by_bandwidth else "  (bw)   ")
        lines.append(f"  {k:<16} {fit.samples[k]:>7}  {how}  ({fit.raw_median_us[k]:.1f})")
    if fit.comm_cpu_ns_per_byte is not None:
        how = "fitted from the compute spans" if fit.comm_cpu_fitted else "the source plan's, the least the fit allows"
        lines.append(f"CPU per transferred byte ({how}): {fit.comm_cpu_ns_per_byte:.3g} ns")
    for lane in sorted(fit.latency_us):
        lines.append(f"{lane} wire: latency {fit.latency_us[lane]:.1f} us per call, link efficiency "
                     f"{fit.link_efficiency[lane]:.3f} of the configured rate")
    if fit.bandwidth_gbps:
        lines.append("bandwidth GB/s: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(fit.bandwidth_gbps.items())))
    if fit.residual is not None:
        lines.append(f"fit residual on the source run: measured {fit.measured_step_us / 1e3:.1f} ms, planned with the "
                     f"profile {fit.predicted_us / 1e3:.1f} ms ({fit.residual * 100:+.1f}%); a prediction for other "
                     "configs is only checked by running them")
    if fit.expected_residual is not None:
        lines.append(f"with the fitted task-time spread (cv per kind, [Note: task-time spread] in k3sched/variability.py) "
                     f"the plan expects {fit.expected_us / 1e3:.1f} ms ({fit.expected_residual * 100:+.1f}%)")
    return "\n".join(lines)

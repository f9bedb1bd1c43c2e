"""Overlap on shaped links: does the five-lane co-schedule buy the time the planner predicts?

Measured side by side in one run, on the shaped-link testbed (``runtime/testbed.py``: one network
namespace per rank, each rank's NIC rate-limited with tc to ``hardware.internode_gbps``; every
rank its own emulated node), for an EP-bound config (pp 1 x ep 2: all-to-alls) and a PP-bound
config (pp 2 x ep 1: activation / gradient send-recv), each at three link rates chosen so that
the planned communication : compute time per rank is about 0.5, 1 and 2:

- k3 and serial runs in the order k3, serial, serial, k3 (``ORDER``; ``--once``: one each), each
  strategy's measured figures the mean of its runs, DeepSpeed's run in the middle;
- k3 (the co-schedule, at the look-ahead, WGrad lag and transfer slack of ``KNOBS`` whose plan is fastest, chosen
  from the plans alone, by their expected steps; ``--config-knobs``: the config's own) and serial (one task at a time per
  rank, [Note: serial execution] in runtime/executor.py), both executed by the runtime; for the
  EP-bound config also the DeepSpeed-MoE model of ``bench_runtime.py`` (plain autograd, same
  shapes, same shaped links);
- predicted and measured step time, k3 / serial predicted vs measured, planned vs measured
  comm/compute overlap of the k3 runs (share of communication-lane time that overlaps compute,
  stage 0 / rank 0: planned from ``traces.validate``, measured each run's median steady step, the
  runs' mean); beside each prediction the one the plan expects with the probe's task-time spread
  (``metrics.expected``, [Note: task-time spread] in k3sched/variability.py).

Predictions are uncalibrated: compute, launch, AdamW and copy rates and the router's imbalance
(``model.routing_imbalance``) come from ``k3sched probe`` run once at the start (no testbed), the
links from the shaped rates and the probe's per-call latency and CPU cost of communication inside
the testbed, how much longer an all-to-all takes beside compute (``hardware.cpu_runner.comm_wait_us_per_call``,
[Note: a transfer beside compute] in k3sched/cpurunner.py) and its spread of compute beside
all-to-alls (``hardware.cpu_runner.task_time_cv``). Nothing is fitted to these runs.

Then the calibration transfer (``runtime/transfer.py``): a profile fitted from one k3 run of the
EP-bound config (at the knobs the plans pick, as its k3 row) predicts four other configs, each
then run at the same knobs: twice the micro-batches, serial, PP 2 x EP 1, half the link rate. The
source runs again after each target ([Note: bracketed transfer] in runtime/transfer.py): beside each
target's measured / expected, its prediction against the source's with the source runs just before
and after it as the machine of the moment (on the shared 2-core machines the same run has measured
1.25x slower within minutes); the last source run over the first says how far the machine moved
while the targets ran. The targets run ``TRANSFER_REPEATS`` rounds, each its measured step the median
of its runs ([Note: interleaved repeats] in runtime/transfer.py; ``--once``: one round).

Usage: ``.venv/bin/python benchmarks/bench_overlap.py [--steps 6] [--quick] [--out DIR]``
(root, ip and tc needed; about 20 minutes on 2 cores, ``--quick``: one rate per config, ``--once``: one
k3 and one serial run per row and one round of the calibration targets, about 10 minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TINY = REPO / "configs" / "tiny-cpu.yaml"
from k3sched.tune import TRANSFER_SLACKS  # noqa: E402  (after the path: the bench runs from a checkout)
MODEL = ["model.hidden=256", "model.expert_hidden=512", "model.dense_hidden=1024", "model.seq_len=128",
         "model.micro_batch_size=4", "parallel.microbatches=4", "hardware.gpus_per_node=1", "schedule.offload=none",
         "hardware.device_memory_gb=2"]
CONFIGS = {
    "ep-bound (pp 1 x ep 2)": ["parallel.pp=1", "parallel.ep=2"],
    "pp-bound (pp 2 x ep 1)": ["parallel.pp=2", "parallel.ep=1"],
}
RATIOS = (0.5, 1.0, 2.0)
WARMUP = 2
"""Steps of each run left out of its measured step (the median of the rest): on the testbed the
second step still ran 10-40% slower than the ones after it (an 8-step k3 run: 3338, 2231, 1688,
1821, 1730, ... ms)."""
PROBED = ("peak_tflops", "mfu", "hbm_gbps", "pcie_gbps", "pcie_latency_us", "launch_us", "optim_ns_per_param")
# and hardware.cpu_runner.host_cores (compute_alone_factor too); from the probe inside the testbed:
# internode_latency_us and cpu_runner's comm_cpu_ns_per_byte, comm_cpu_us_per_call, comm_wait_us_per_call, task_time_cv


CONTENDED_REPS = 9
"""Samples per size of the probe's contended measurement inside the testbed (the quick probe's 3
gave 0.17-1.6 ns per byte on one machine within minutes; [Note: what a call costs a computing
thread] in runtime/probe/collectives.py)."""


def probe_hardware(work: Path) -> dict:
    """Compute-side numbers of this machine and the model's operator profile (``k3sched probe``,
    no testbed; [Note: operator profile] in runtime/probe/inprocess.py), and the per-call latency of gloo
    inside the testbed (two ranks, one per emulated node)."""
    from k3sched.config import load_config
    from runtime.probe import Knobs, probe, write_ops_profile
    from runtime.testbed import Testbed

    cfg = load_config(TINY, MODEL + list(CONFIGS.values())[0])
    res = probe(cfg, nproc=2, quick=True, work_dir=work / "probe")
    out = {f"hardware.{k}": res.hardware[k] for k in PROBED}
    own = res.hardware["cpu_runner"]
    out["hardware.cpu_runner.host_cores"] = own["host_cores"]
    if "compute_alone_factor" in own:  # [Note: compute alone] in k3sched/cpurunner.py
        out["hardware.cpu_runner.compute_alone_factor"] = own["compute_alone_factor"]
    out["schedule.profile"] = str(write_ops_profile(res.ops_us, work / "ops.yaml", res.per_expert_us))
    out["model.routing_imbalance"] = res.routing_imbalance
    tb = Testbed(cfg.hardware, 2, internode_gbps=0.05, gpus_per_node=1)
    knobs = dataclasses.replace(Knobs.of(True), contended_reps=CONTENDED_REPS)
    shaped = probe(None, nproc=2, quick=True, testbed=tb, work_dir=work / "probe_tb", knobs=knobs).hardware
    out["hardware.internode_latency_us"] = shaped["internode_latency_us"]
    shaped = shaped["cpu_runner"]
    out["hardware.cpu_runner.comm_cpu_ns_per_byte"] = shaped["comm_cpu_ns_per_byte"]
    out["hardware.cpu_runner.comm_cpu_us_per_call"] = shaped["comm_cpu_us_per_call"]
    if shaped.get("comm_wait_us_per_call"):
        out["hardware.cpu_runner.comm_wait_us_per_call"] = shaped["comm_wait_us_per_call"]
    if shaped.get("task_time_cv"):
        out["hardware.cpu_runner.task_time_cv"] = shaped["task_time_cv"]
    return out


def overrides_for(base: list[str], hw: dict, gbps: float) -> list[str]:
    return base + MODEL + [f"{k}={v}" for k, v in hw.items()] + [f"hardware.internode_gbps={gbps:.6g}"]


ORDER = ("k3", "serial", "serial", "k3")
"""Run order of a row's k3 and serial runs (each strategy's figures the mean of its two): a drift of
the machine's speed that is linear over the row cancels in the k3 / serial ratio (the shared 2-core
machines have measured the same run 1.25x slower within minutes)."""


TRANSFER_REPEATS = 3
"""Rounds of the calibration targets: each target runs once a round, its measured step the median
of its runs ([Note: interleaved repeats] in runtime/transfer.py); one run each in the README's
runs up to c4e77b6."""


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _mean_run(done: list[dict]) -> dict:
    """One strategy's runs of a row as one: measured step, measured compute ratios the means; the
    prediction is the same plan's."""
    out = dict(done[0])
    out["measured_us"] = _mean([d["measured_us"] for d in done])
    out["runs_us"] = [d["measured_us"] for d in done]
    if all(d.get("compute") for d in done):
        out["compute"] = tuple(_mean([d["compute"][i] for d in done]) for i in range(2))
    return out


KNOBS = tuple((la, lag, slack) for la in (1, 2, 4) for lag in (4, 8, 16) for slack in TRANSFER_SLACKS)
"""(schedule.lookahead, schedule.wgrad_lag, schedule.transfer_slack) the bench plans for each row
(the config's own is (1, 4, 0)): knobs of when work runs, not of what is computed, so k3, serial and
DeepSpeed still run the same model on the same micro-batches."""


def fastest_knobs(overrides: list[str], max_slack: float | None = None) -> list[str]:
    """The look-ahead, WGrad lag and transfer slack of ``KNOBS`` whose k3 plan has the shortest
    expected step (the planner's own prediction with the probed task-time spread, [Note: ranking
    with a task-time spread] in k3sched/compare.py; the planned step without one; the runs are not
    consulted; the first of equals, so a slack only where it is expected to pay). ``max_slack``:
    only slacks up to it (``benchmarks/bench_slack.py``)."""
    from k3sched.config import load_config
    from k3sched.planner import plan

    best: tuple[float, list[str]] | None = None
    for la, lag, slack in KNOBS:
        if max_slack is not None and slack > max_slack:
            continue
        knobs = [f"schedule.lookahead={la}", f"schedule.wgrad_lag={lag}", f"schedule.transfer_slack={slack}"]
        m = plan(load_config(TINY, overrides + knobs), "k3").metrics
        step = m.ranking_step_us
        if best is None or step < best[0]:
            best = (step, knobs)
    return best[1]


def lane_busy_us(plan, stage: int = 0) -> tuple[float, float]:
    """(compute, communication) busy time of one stage in a plan (sum of task durations)."""
    comp = comm = 0.0
    for t in plan.tasks.values():
        if t.stage == stage:
            if t.lane == "compute":
                comp += t.duration_us
            elif t.lane in ("ep", "collective"):
                comm += t.duration_us
    return comp, comm


def rate_for_ratio(base: list[str], hw: dict, ratio: float) -> float | None:
    """Link rate (GB/s) at which the serial plan's comm : compute time of stage 0 is ``ratio``:
    comm(r) = A + B / r, fitted from two rates."""
    from k3sched.config import load_config
    from k3sched.planner import plan

    pts = []
    for r in (0.05, 0.1):
        comp, comm = lane_busy_us(plan(load_config(TINY, overrides_for(base, hw, r)), "serial"))
        pts.append((r, comp, comm))
    (r1, comp, c1), (r2, _, c2) = pts
    B = (c1 - c2) / (1 / r1 - 1 / r2)
    A = c1 - B / r1
    need = ratio * comp - A
    return B / need if need > 0 and B > 0 else None


def run(name: str, overrides: list[str], strategy: str, steps: int, out: Path) -> dict:
    from runtime.launch import run_command
    from runtime.transfer import compute_ratios

    rc = run_command(TINY, overrides, steps, None, out, False, strategy, timeout_s=900, quiet=True, emulate_links=True,
                     warmup_steps=WARMUP)
    if rc != 0:
        raise SystemExit(f"bench_overlap: {name} {strategy} failed with exit {rc}")
    s = json.loads((out / "summary.json").read_text())
    return {"measured_us": s["measured_step_time_us"], "predicted_us": s["predicted_step_time_us"],
            "expected_us": s.get("expected_step_time_us"), "losses": s["losses"],
            "compute": compute_ratios(s, WARMUP)}


def overlap(out: Path) -> tuple[tuple[float | None, float | None, float | None], tuple[float | None, float | None]]:
    """(planned, expected with the task-time spread, measured) comm/compute overlap of stage 0 /
    rank 0: planned and expected from the validation report, measured the median over the steps
    after the warm-up (``summary.json``'s ``comm_overlap_ratio``; the traced last step's alone moved
    by up to 12 points between two runs of one row), and (measured, expected) rank 0's wait for
    the last rank at the all-to-alls and reductions in the traced step (µs; [Note: waiting for the
    last rank] in traces/validate.py)."""
    from traces.chrome import read_trace
    from traces.events import EventTable
    from traces.validate import load_plan, validate

    plan = load_plan(out / "plan.json")
    ev = EventTable.concat([read_trace(p) for p in sorted(out.glob("trace_rank*.json"))])
    m = validate(plan, ev, cross_rank_clocks=True).metrics
    pl = m["planned_by_stage"][0]
    m0 = m["measured_by_rank"][0]
    steps = (json.loads((out / "summary.json").read_text()).get("comm_overlap_ratio") or [[]])[0]
    steady = [x for x in steps[WARMUP:] if x is not None]
    measured = statistics.median(steady) if steady else m0["comm_overlap_ratio"]
    return ((pl["comm_overlap_ratio"], pl.get("expected_comm_overlap_ratio"), measured),
            (m0.get("sync_wait_us"), pl.get("expected_sync_wait_us")))


def deepspeed(overrides: list[str], steps: int, out: Path) -> float:
    """Median step (µs) of bench_runtime's DeepSpeed-MoE model on the same shaped links."""
    import os
    import subprocess

    from k3sched.config import load_config
    from runtime.launch import kill_group
    from runtime.testbed import Testbed

    cfg = load_config(TINY, overrides)
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(REPO / "benchmarks" / "bench_runtime.py"), "--ds-worker", str(out), "--steps",
            str(steps)] + [a for o in overrides for a in ("--set", o)]
    with Testbed(cfg.hardware, cfg.parallel.world) as tb:
        env = {**os.environ, **tb.env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
               "TORCH_CPP_LOG_LEVEL": "ERROR"}
        proc = subprocess.Popen(tb.torchrun_command(argv), env=env, cwd=REPO, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=900)
        finally:
            kill_group(proc)
    if proc.returncode != 0:
        raise SystemExit(f"bench_overlap: deepspeed run failed (exit {proc.returncode}): {err[-2000:]}")
    times = json.loads((out / "ds_summary.json").read_text())["step_time_s"]
    return statistics.median(times[WARMUP:] or times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="one link rate (comm:compute 1) per config")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-transfer", action="store_true", help="skip the calibration-transfer rows")
    ap.add_argument("--transfer-only", action="store_true", help="only the calibration-transfer rows")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--once", action="store_true",
                    help="one k3 and one serial run per row (default: k3, serial, serial, k3, each pair's mean) "
                         "and one round of the calibration targets (default: TRANSFER_REPEATS)")
    ap.add_argument("--config-knobs", action="store_true",
                    help="run the config's own look-ahead and WGrad lag instead of the fastest planned of KNOBS")
    a = ap.parse_args()
    from runtime.testbed import testbed_available

    why = testbed_available()
    if why:
        raise SystemExit(f"bench_overlap: the shaped-link testbed is not available: {why}")
    import torch

    torch.set_num_threads(1)
    base = a.out or Path(tempfile.mkdtemp(prefix="bench_overlap_"))
    base.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    hw = probe_hardware(base)
    print("bench_overlap: probed " + ", ".join(f"{k.split('.')[1]} {v}" for k, v in hw.items()), flush=True)
    rows = []
    for cname, cbase in ({} if a.transfer_only else CONFIGS).items():
        for ratio in ((1.0,) if a.quick else RATIOS):
            gbps = rate_for_ratio(cbase, hw, ratio)
            if gbps is None:
                print(f"  {cname}: comm:compute {ratio} not reachable (latency alone exceeds it); skipped")
                continue
            ov = overrides_for(cbase, hw, gbps)
            knobs = [] if a.config_knobs else fastest_knobs(ov)
            ov += knobs
            tag = f"{cname.split()[0]}_{ratio:g}"
            r = {"config": cname, "ratio": ratio, "gbps": gbps, "knobs": knobs}
            runs = {"k3": [], "serial": []}
            ds = cname.startswith("ep") and not a.no_deepspeed
            for i, strategy in enumerate(("k3", "serial") if a.once else ORDER):
                runs[strategy].append(run(cname, ov, strategy, a.steps, base / tag / f"{strategy}{i or ''}"))
                if ds and i == (1 if a.once else len(ORDER) // 2 - 1):  # DeepSpeed at the middle of the order
                    r["deepspeed_us"] = deepspeed(ov, a.steps, base / tag / "deepspeed")
            for strategy, done in runs.items():
                r[strategy] = _mean_run(done)
            ovl = [overlap(base / tag / name) for name in (["k3"] if a.once else ["k3", f"k3{len(ORDER) - 1}"])]
            r["overlap"] = (ovl[0][0][0], ovl[0][0][1], _mean([o[0][2] for o in ovl]))
            r["sync_wait_us"] = (_mean([o[1][0] for o in ovl]), ovl[0][1][1])
            rows.append(r)
            k3, se = r["k3"], r["serial"]
            print(f"  {cname} link {gbps * 1e3:.1f} MB/s (comm:compute {ratio:g}"
                  + (f"; {' '.join(k.split('.')[1] for k in knobs)}" if knobs else "") + "): "
                  f"k3 {k3['measured_us'] / 1e3:.1f} ms ({_pred(k3)}) | serial {se['measured_us'] / 1e3:.1f} ms "
                  f"({_pred(se)}) | k3/serial measured {k3['measured_us'] / se['measured_us']:.3f} predicted "
                  f"{k3['predicted_us'] / se['predicted_us']:.3f}"
                  + (f" expected {k3['expected_us'] / se['expected_us']:.3f}" if k3["expected_us"] and se["expected_us"]
                     else "")
                  + (f" | DeepSpeed {r['deepspeed_us'] / 1e3:.1f} ms, k3/DeepSpeed {k3['measured_us'] / r['deepspeed_us']:.3f}"
                     if "deepspeed_us" in r else "")
                  + f" | overlap planned {_pct(r['overlap'][0])} expected {_pct(r['overlap'][1])} "
                    f"measured {_pct(r['overlap'][2])}"
                  + (f" | rank 0 waited {r['sync_wait_us'][0] / 1e3:.0f} ms for the last rank"
                     + (f" (expected {r['sync_wait_us'][1] / 1e3:.0f})" if r["sync_wait_us"][1] is not None else "")
                     if r["sync_wait_us"][0] is not None else ""), flush=True)
    transfer = None
    if not a.no_transfer:
        transfer = calibration_transfer(hw, base / "transfer", a.steps, a.config_knobs,
                                        1 if a.once else TRANSFER_REPEATS)
    (base / "bench_overlap.json").write_text(json.dumps({"hardware": hw, "rows": rows, "transfer": transfer},
                                                        indent=1))
    print(f"  (outputs under {base}; bench took {time.perf_counter() - t0:.0f} s)")


def calibration_transfer(hw: dict, out: Path, steps: int, config_knobs: bool = False,
                         repeats: int = TRANSFER_REPEATS) -> dict:
    """Calibrate from one run of the EP-bound config (link at comm:compute 1, the k3 row's knobs
    unless ``config_knobs``), predict four others (``runtime/transfer.py``): twice the micro-batches,
    serial, PP 2 x EP 1, half the link rate; each target keeps the source's knobs and runs
    ``repeats`` times, interleaved with the others."""
    from runtime.transfer import SOURCE_AGAIN, transfer_check

    base = list(CONFIGS.values())[0]
    gbps = rate_for_ratio(base, hw, 1.0)
    source = overrides_for(base, hw, gbps)
    knobs = [] if config_knobs else fastest_knobs(source)
    source += knobs
    targets = {"microbatches x2": ["parallel.microbatches=8"], "serial": ["schedule.strategy=serial"],
               "pp 2 x ep 1": ["parallel.pp=2", "parallel.ep=1"],
               "half link rate": [f"hardware.internode_gbps={gbps / 2:.6g}"]}
    residual, rows, exp_residual = transfer_check(TINY, source, targets, steps, out, WARMUP, bracket=True,
                                                  repeats=repeats)
    again = [r for r in rows if r.name == SOURCE_AGAIN]
    rows = [r for r in rows if r.name != SOURCE_AGAIN]
    print(f"  calibration from ep-bound k3 at {gbps * 1e3:.1f} MB/s"
          + (f" ({' '.join(k.split('.')[1] for k in knobs)})" if knobs else "")
          + f": residual on the source run {residual:+.3f}"
          + (f" (against the expected step with the fitted spread {exp_residual:+.3f})" if exp_residual is not None
             else ""))
    for r in rows:
        print(f"    {r.name:<16} predicted {r.predicted_us / 1e3:8.1f} ms  measured {r.measured_us / 1e3:8.1f} ms  "
              f"measured/predicted {r.ratio:.3f} (x{r.ratio / (1 + residual):.3f} of the source's)"
              + (f" | expected {r.expected_us / 1e3:8.1f} ms, measured/expected {r.expected_ratio:.3f}"
                 if r.expected_us else "")
              + (f" | compute x{r.compute[0]:.2f}-{r.compute[1]:.2f} of planned" if r.compute else "")
              + (f" | against the source runs beside it x{r.bracketed_ratio:.3f}" if r.bracketed_ratio else "")
              + (f" | runs {' '.join(f'{m / 1e3:.0f}' for m in r.runs_us)} ms" if len(r.runs_us) > 1 else ""),
              flush=True)
    for r in again:
        print(f"    the source again after the targets: measured {r.measured_us / 1e3:.1f} ms, "
              f"x{r.ratio / (1 + residual):.3f} of its first run (how far the machine moved while the targets ran)"
              + (f" | compute x{r.compute[0]:.2f}-{r.compute[1]:.2f} of planned" if r.compute else ""), flush=True)
    return {"gbps": gbps, "knobs": knobs, "residual": residual, "expected_residual": exp_residual,
            "source_again_us": again[0].measured_us if again else None,
            "rows": [{"name": r.name, "predicted_us": r.predicted_us, "measured_us": r.measured_us,
                      "expected_us": r.expected_us, "compute": r.compute, "source_around_us": r.source_around_us,
                      "source_predicted_us": r.source_predicted_us, "bracketed_ratio": r.bracketed_ratio,
                      "runs_us": r.runs_us}
                     for r in rows]}


def _pred(r: dict) -> str:
    """'pred P, xM' and, with a task-time spread, 'expected E, xM' (measured over each)."""
    out = f"pred {r['predicted_us'] / 1e3:.1f}, x{r['measured_us'] / r['predicted_us']:.2f}"
    if r.get("expected_us"):
        out += f"; expected {r['expected_us'] / 1e3:.1f}, x{r['measured_us'] / r['expected_us']:.2f}"
    if r.get("compute"):
        out += f"; compute x{r['compute'][0]:.2f}-{r['compute'][1]:.2f} of planned"
    return out


def _pct(x) -> str:
    return "n/a" if x is None else f"{x * 100:.0f}%"


if __name__ == "__main__":
    main()

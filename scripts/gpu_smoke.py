"""GPU smoke check (``make gpu-check``): one process, one device, the five lanes on their own CUDA
streams (threads on CPU), k3 plans against the serial plan.

For every case of the matrix (plain, offload=all, FP8 activations, gradient offload, recompute,
bf16, all of offload + FP8 + grad offload + recompute) a one-rank plan is trained ``--steps`` steps
with the ``serial`` strategy (one task at a time: the reference) and with ``k3`` (lanes overlap),
then with ``k3`` again while a random host delay is injected before every task of one lane at a
time (``ep``, ``compute``, ``offload_local``): that lane's thread issues late, the other lanes run
ahead, so a missing stream wait (a consumer that does not wait for its producer's CUDA event, a
buffer reused before the copy reading it finished) shows up as a different loss or gradient.

Checks per run: losses of every step and the step-0 gradients against the serial run, bitwise
where the math allows (every case on CPU; fp32 cases on CUDA under
``torch.use_deterministic_algorithms(True)``), else within the case's bound (1e-4 relative for
fp32, bf16 and FP8 their own); the run's trace validated against its plan (traces/validate.py).
Prints one line per run and a verdict; exit 0 when every run passed, 1 otherwise, 2 on bad use.

    python scripts/gpu_smoke.py                  # cuda:0 (the default when CUDA is present)
    python scripts/gpu_smoke.py --device cpu     # the same matrix on CPU threads
    python scripts/gpu_smoke.py --device cpu --quick   # the reduced matrix of the CI test
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# before CUDA initialises: deterministic cuBLAS (bitwise comparisons on GPU)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

TINY = REPO / "configs" / "tiny-cpu.yaml"
# One rank, a few layers and micro-batches: enough tasks on every lane, seconds per run on CPU.
ONE_RANK = ["parallel.pp=1", "parallel.ep=1", "parallel.dp=1", "parallel.microbatches=4", "model.layers=2",
            "model.seq_len=32", "model.micro_batch_size=2", "model.vocab=64", "schedule.offload=none",
            "schedule.wgrad_lag=0"]
DELAY_LANES = ("ep", "compute", "offload_local")


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]
    rel: float  # relative bound when not bitwise (per tensor: |a-b| / |b|)
    gpu_exact: bool = True  # bitwise expected on CUDA too (deterministic algorithms)


CASES = [
    Case("plain", (), 1e-4),
    Case("offload", ("schedule.offload=all",), 1e-4),
    Case("fp8", ("schedule.act_quant=fp8",), 5e-2, gpu_exact=False),
    Case("grad_offload", ("schedule.grad_offload=true",), 1e-4),
    Case("recompute", ("schedule.recompute=true",), 1e-4),
    Case("bf16", ("model.dtype=bf16",), 2e-2, gpu_exact=False),
    Case("all", ("schedule.offload=all", "schedule.act_quant=fp8", "schedule.grad_offload=true",
                 "schedule.recompute=true"), 5e-2, gpu_exact=False),
]
QUICK = ("plain", "offload", "fp8")


@dataclass
class Result:
    losses: list[float]
    grads: dict
    trace: dict
    plan: dict
    wall_s: float
    delayed_tasks: int = 0
    notes: list[str] = field(default_factory=list)


def break_waits(lanes: dict, extra: dict, lane: str) -> tuple[dict, dict]:
    """Self-test of the check: drop every dependency of another lane's task on a task of ``lane``
    (plan deps and the runtime's extra deps), as a missing stream wait would."""
    from dataclasses import replace

    of_lane = {t.id for t in lanes.get(lane, [])}
    lanes = {ln: [t if ln == lane else replace(t, deps=tuple(d for d in t.deps if d not in of_lane),
                                                start_deps=tuple(d for d in t.start_deps if d not in of_lane))
                  for t in ts] for ln, ts in lanes.items()}
    lane_of = {t.id: ln for ln, ts in lanes.items() for t in ts}
    extra = {tid: tuple(d for d in ds if lane_of.get(tid) == lane or d not in of_lane) for tid, ds in extra.items()}
    return lanes, extra


def run_once(cfg, steps: int, device, strategy: str, delay_lane: str | None, delay_ms: float, seed: int,
             broken: str | None = None) -> Result:
    """Train ``steps`` steps of a one-rank plan in this process on ``device``; with ``delay_lane``
    sleep a random 0..delay_ms before every task of that lane (on its issuing thread); with
    ``broken`` the other lanes do not wait for that lane (:func:`break_waits`)."""
    import torch

    from k3sched.lowering import implied_edges
    from k3sched.planner import plan
    from k3sched.planfile import plan_to_json
    from k3sched.lowering import stage_lanes
    from runtime.executor import Executor
    from runtime.groups import Layout, build_groups
    from runtime.stage import StageRunner, StageSpec

    doc = plan_to_json(plan(cfg, strategy))
    lanes = stage_lanes(doc, 0)
    runner = StageRunner(cfg, StageSpec.of(cfg, 0), build_groups(Layout(1, 1, 1, 0)), seed=cfg.schedule.seed,
                         device=device)
    runner.bind_plan(lanes)
    rng = random.Random(seed)
    count = [0]
    handlers = runner.handlers()
    extra = implied_edges(lanes)
    if broken is not None:
        lanes, extra = break_waits(lanes, extra, broken)
    if delay_lane is not None:
        def delayed(h):
            def run(task):
                if task.lane == delay_lane:
                    count[0] += 1
                    time.sleep(rng.uniform(0.0, delay_ms) / 1e3)
                h(task)
            return run

        handlers = {k: delayed(h) for k, h in handlers.items()}
    losses, grads, trace = [], None, None
    t0 = time.perf_counter()
    with Executor(lanes, handlers, perturb=None, extra_deps=extra, dep_timeout_s=120.0,
                  serial=doc["strategy"] == "serial", shared_links=doc.get("shared_links", ()), device=device,
                  nvtx=False) as ex:
        cuda = getattr(ex, "_cuda", None)
        streams = {lane: cuda.stream(lane) for lane in ex.lanes} if cuda is not None else {}
        if hasattr(runner, "bind_streams"):
            runner.bind_streams(streams)
        else:  # pragma: no cover - older StageRunner
            runner.lane_streams = list(streams.values())
        for step in range(steps):
            runner.optim.capture_grads = step == 0
            runner.begin_step(step)
            rec = ex.run_step(step)
            losses.append(runner.end_step() / cfg.parallel.microbatches)
            if runner.optim.captured is not None:
                grads = {n: g.detach().float().cpu().clone() for n, g in runner.optim.captured.items()}
                runner.optim.captured = None
            trace = ex.chrome_trace(rec, plan_step_time_us=doc["metrics"]["step_time_us"],
                                    t0_us=min(t.start_us for t in rec.timings))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # no collectives here: nothing can wait on a dead peer
    return Result(losses, grads or {}, trace, doc, time.perf_counter() - t0, count[0])


def compare(ref: Result, got: Result, rel: float, need_exact: bool) -> tuple[bool, str]:
    """(passed, one-line detail): bitwise, or the largest relative difference against ``rel``."""
    import torch

    if ref.grads.keys() != got.grads.keys():
        return False, f"gradient names differ: {sorted(ref.grads.keys() ^ got.grads.keys())[:3]}"
    exact = ref.losses == got.losses and all(torch.equal(ref.grads[n], got.grads[n]) for n in ref.grads)
    if exact:
        return True, "bitwise"
    worst, where = 0.0, ""
    for a, b, n in [(x, y, f"loss[{i}]") for i, (x, y) in enumerate(zip(got.losses, ref.losses))]:
        d = abs(a - b) / max(abs(b), 1e-30)
        if d > worst:
            worst, where = d, n
    for n, b in ref.grads.items():
        a = got.grads[n]
        d = float((a - b).norm() / b.norm().clamp_min(1e-30))
        if not d == d:  # NaN
            return False, f"{n}: NaN"
        if d > worst:
            worst, where = d, n
    ok = worst <= rel and not need_exact
    why = "not bitwise (required here)" if need_exact else f"bound {rel:g}"
    return ok, f"max relative difference {worst:.3g} at {where} ({why})"


def validate_trace(res: Result, tmp: Path, name: str) -> tuple[bool, str]:
    import io

    from traces.cli import validate_main

    plan_p, trace_p = tmp / f"{name}.plan.json", tmp / f"{name}.trace.json"
    plan_p.write_text(json.dumps(res.plan))
    trace_p.write_text(json.dumps(res.trace))
    buf = io.StringIO()
    code = validate_main(str(plan_p), [str(trace_p)], out=buf)
    text = buf.getvalue().strip().splitlines()
    return code == 0, (text[0] if text else f"validate exit {code}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present, else cpu")
    ap.add_argument("--quick", action="store_true", help=f"reduced matrix ({', '.join(QUICK)}; one delayed lane each)")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all; see --list)")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--delay-ms", type=float, default=None, help="largest injected delay (default: 3 on cuda, 2 on cpu)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the injected delays")
    ap.add_argument("--break-waits", choices=DELAY_LANES, default=None, metavar="LANE",
                    help="self-test: the other lanes do not wait for LANE's tasks in the delayed runs of LANE; "
                         "the check must then FAIL (exit 1)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(f"{c.name}: {' '.join(c.overrides) or '(defaults)'}" for c in CASES))
        return 0
    import torch

    from k3sched.config import ConfigError, load_config

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: torch sees no CUDA device here (a CPU build of torch, or no GPU)", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if dev == "cuda" else torch.device("cpu")
    if dev == "cuda":
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True, warn_only=True)  # a kernel without one warns, the compare decides
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    names = args.cases.split(",") if args.cases else [c.name for c in CASES if not args.quick or c.name in QUICK]
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"error: --cases: unknown case {unknown[0]!r} (cases: {', '.join(by_name)})", file=sys.stderr)
        return 2
    delay_ms = args.delay_ms if args.delay_ms is not None else (3.0 if dev == "cuda" else 2.0)
    print(f"gpu_smoke: device {device} | torch {torch.__version__} | cases {', '.join(names)} | "
          f"{args.steps} steps | delays up to {delay_ms:g} ms{' | quick' if args.quick else ''}"
          f"{f' | self-test: waits on {args.break_waits} broken' if args.break_waits else ''}", flush=True)
    rows, failed, t_all = [], 0, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="k3sched-gpu-smoke-") as tmpd:
        tmp = Path(tmpd)
        for ci, name in enumerate(names):
            case = by_name[name]
            try:
                cfg = load_config(TINY, ONE_RANK + list(case.overrides))
            except ConfigError as e:
                print(f"error: case {name}: {e}", file=sys.stderr)
                return 2
            need_exact = dev == "cpu" or case.gpu_exact
            from k3sched.planner import plan
            from k3sched.planfile import plan_to_json

            k3doc = plan_to_json(plan(cfg, "k3"))
            busy = [lane for lane in DELAY_LANES if k3doc["stages"][0]["lanes"].get(lane)]
            skipped = [lane for lane in DELAY_LANES if lane not in busy]
            if skipped:
                print(f"     {name:13s} (no {', '.join(skipped)} tasks in this plan: not delayed)", flush=True)
            lanes_now = (busy[ci % len(busy):] + busy[:ci % len(busy)])[:1] if args.quick and busy else busy
            runs = [("k3", None)] + [("k3", lane) for lane in lanes_now]
            try:
                ref = run_once(cfg, args.steps, device, "serial", None, 0.0, args.seed)
            except Exception as e:  # noqa: BLE001 - one line per failed run
                print(f"FAIL {name:13s} serial                  {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                      flush=True)
                failed += 1
                continue
            for strategy, lane in runs:
                label = f"{strategy}" + (f"+delay:{lane}" if lane else "")
                try:
                    got = run_once(cfg, args.steps, device, strategy, lane, delay_ms, args.seed + ci,
                                   broken=lane if lane is not None and lane == args.break_waits else None)
                    ok, detail = compare(ref, got, case.rel, need_exact)
                    vok, vline = validate_trace(got, tmp, f"{name}-{label.replace(':', '_').replace('+', '_')}")
                    if lane is not None and got.delayed_tasks == 0:
                        ok, detail = False, f"{detail}; no task of lane {lane} ran (nothing delayed)"
                except Exception as e:  # noqa: BLE001
                    ok, vok, detail, vline = False, False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "-"
                    got = None
                passed = ok and vok
                failed += not passed
                rows.append({"case": name, "run": label, "passed": passed, "compare": detail, "trace": vline,
                             "losses": got.losses if got else None, "serial_losses": ref.losses,
                             "wall_s": got.wall_s if got else None})
                print(f"{'ok  ' if passed else 'FAIL'} {name:13s} {label:23s} {detail}; trace: {vline}"
                      f"{'' if got is None else f' ({got.wall_s:.1f} s)'}", flush=True)
    took = time.perf_counter() - t_all
    verdict = "passed" if not failed else f"{failed} run(s) FAILED"
    print(f"gpu_smoke: {len(rows)} runs against serial on {device}: {verdict} in {took:.0f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "runs": rows,
                                         "passed": not failed, "seconds": took}, indent=1))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())

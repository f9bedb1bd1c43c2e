"""The ``k3sched`` command line: plan, compare, tune, run, validate, calibrate, probe.

[Note: CLI error boundary]
Exit codes, every command: 0 success (``validate``: the traces conform), 1 ``validate``: they do
not conform / ``run``: a rank failed or timed out / ``probe``: a measurement failed, 2 a user
error, 3 an internal error (a bug), 130 interrupted. A user error (bad config or option, an
infeasible budget, an unreadable or malformed plan / trace / summary, an output path that cannot
be written, an OSError on a file the user named) prints ONE line on stderr naming what is wrong
and what is allowed; options and output paths are checked before any work. Anything else raised
is a bug: one line with the exception and the path of a file holding the traceback
(``$TMPDIR/k3sched-crash-*.txt``), exit 3, so that ``validate``'s exit 1 always means violations.
Each command runs inside :func:`_guarded`; :func:`main` adds one-line usage errors and catches
whatever escapes. Heavy modules (torch, the runtime, the trace readers) are imported by the
commands that need them, so ``k3sched plan`` starts fast and needs no torch.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import cli_plan
from .cli_plan import summary_table
from .config import ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="k3sched: plan, run and check a five-lane (compute, EP, collective, local and remote "
                       "offload) co-schedule of one MoE training step.")
console = Console(width=max(180, shutil.get_terminal_size((180, 24)).columns))
err_console = Console(stderr=True)


def fail(msg: str, code: int = 2) -> None:
    _say_error(msg)
    raise typer.Exit(code)


def _say_error(msg: str) -> None:
    """``error: MSG`` on one line of stderr (the message is not rich markup: ``stages[0]`` stays)."""
    err_console.print("[bold red]error:[/] ", end="", highlight=False)
    err_console.print(msg, highlight=False, soft_wrap=True, markup=False)


# ---- the error boundary ([Note: CLI error boundary]) -------------------------------------

def _user_error_types() -> tuple[type, ...]:
    """Exception classes that mean bad input, from the modules already loaded (a class whose
    module was never imported cannot have been raised)."""
    types: list[type] = [ConfigError]
    for mod, name in (("k3sched.limits", "InfeasibleBudget"), ("traces.events", "TraceError"),
                      ("runtime.testbed", "TestbedError")):
        cls = getattr(sys.modules.get(mod), name, None)
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


def _named_paths(values) -> list[str]:
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out += _named_paths(v)
        elif isinstance(v, Path):
            out.append(os.path.abspath(v))
    return out


def _on_named_path(e: OSError, named: list[str]) -> str | None:
    for fn in (e.filename, e.filename2):
        if fn is None:
            continue
        f = os.path.abspath(os.fsdecode(fn))
        if any(f == p or f.startswith(p.rstrip(os.sep) + os.sep) for p in named):
            return os.fsdecode(fn)
    return None


def internal_error(exc: BaseException) -> int:
    """One line naming the exception and a file with its traceback (in ``$TMPDIR``); 3."""
    from traces.cli import crash_report

    _say_error(crash_report(exc, "k3sched"))
    return 3


def exit_code_for(exc: BaseException, named: list[str] = ()) -> int:
    """Say ``exc`` as one line; return the exit code: 2 for a user error, 3 for a bug."""
    if isinstance(exc, _user_error_types()):
        _say_error(" ".join(str(exc).split()) or type(exc).__name__)
        return 2
    if isinstance(exc, OSError):
        fn = _on_named_path(exc, list(named))
        if fn is not None:
            _say_error(f"{fn}: {exc.strerror or exc}")
            return 2
    return internal_error(exc)


def _guarded(fn):
    """Run a command inside the error boundary ([Note: CLI error boundary])."""

    @functools.wraps(fn)
    def run_guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.TyperException, KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - the boundary
            raise typer.Exit(exit_code_for(e, _named_paths([*args, *kwargs.values()]))) from None

    return run_guarded


def command(*args, **kwargs):
    """``app.command`` with the error boundary."""
    def deco(fn):
        return app.command(*args, **kwargs)(_guarded(fn))

    return deco


# ---- checks of options and output paths, before any work ---------------------------------

def _number(opt: str, value, *, gt: float | None = None, ge: float | None = None, le: float | None = None,
            unit: str = "") -> None:
    """Refuse a numeric option that is not finite or out of range (one line, exit 2)."""
    if value is None:
        return
    bounds = [f"> {gt:g}" if gt is not None else None, f">= {ge:g}" if ge is not None else None,
              f"<= {le:g}" if le is not None else None]
    allowed = ("an integer" if isinstance(value, int) else "a finite number") \
        + "".join(f" {b}" for b in bounds if b) + (f" ({unit})" if unit else "")
    ok = math.isfinite(value) and (gt is None or value > gt) and (ge is None or value >= ge) \
        and (le is None or value <= le)
    if not ok:
        fail(f"{opt}: must be {allowed}; got {value}")


def _check_out(opt: str, path: Optional[Path], *, directory: bool = False) -> None:
    """Refuse an output path that cannot be written (one line, exit 2), before any work."""
    if path is None:
        return
    why = _writable_target(path, directory=directory)
    if why:
        fail(f"{opt} {path}: {why}")


def _load(config: Path, overrides: Optional[List[str]]):
    try:
        return load_config(config, overrides)
    except ConfigError as e:
        fail(str(e))


def _plan_or_fail(cfg, strategy: Optional[str] = None, schedule=None):
    from .limits import InfeasibleBudget
    from .planner import plan
    from .simulator import DeadlockError

    try:
        return plan(cfg, strategy, schedule)
    except (InfeasibleBudget, ConfigError) as e:
        fail(str(e))
    except DeadlockError as e:
        fail(f"schedule.pipeline: {e}")
    except ValueError as e:  # schedule generators: unsupported shape
        fail(f"schedule.pipeline: {e}")


def write_outputs(p, out: Path, png: bool = True, before=None) -> list[Path]:
    from . import render

    return render.write_outputs(p, out, png, before=before)  # [Note: parallel outputs]


@command()
def plan(
    config: Path = typer.Argument(..., help="YAML config (sections model, parallel, hardware, schedule)."),
    strategy: Optional[str] = typer.Option(None, help="k3 (five-lane co-schedule) or serial (no overlap)."),
    out: Optional[Path] = typer.Option(None, help="Write plan.json, plan.trace.json (Perfetto), timeline.txt, "
                                                  "timeline.png into this directory."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: SECTION.KEY=VALUE (repeatable)."),
    timeline: bool = typer.Option(False, help="Print the ASCII timeline."),
    gap: bool = typer.Option(False, help="Print where each stage's compute idle time goes (warm-up / cool-down, "
                                         "P2P, exposed EP, exposed collective, WGrad placement, offload, waiting "
                                         "on another stage) against the memory-aware bound (k3sched/bound.py)."),
    torch_csv: Optional[Path] = typer.Option(None, help="Also write the compute order as a torch.distributed."
                                                        "pipelining action CSV."),
    from_torch_csv: Optional[Path] = typer.Option(None, help="Plan with this torch pipelining CSV as backbone."),
    exact: bool = typer.Option(False, help="Also solve the lane placement exactly with CP-SAT (small instances: "
                                           "up to ~3000 tasks) and print the heuristic's gap."),
    exact_time_limit: float = typer.Option(20.0, help="CP-SAT time limit for --exact, seconds (with --exact-order "
                                                      "free: CP-SAT deterministic time, one worker)."),
    exact_order: str = typer.Option("backbone", help="--exact: backbone (the plan's compute order kept, memory not "
                                                     "modeled) or free (any order, the device budget and each "
                                                     "activation set's keep / offload / remote / recompute "
                                                     "decided; k3sched/exact/ solve_free)."),
) -> None:
    """Predict step time, bubbles, exposed communication and memory of one training step."""
    cfg = _load(config, set_)
    if strategy is not None and strategy not in ("k3", "serial"):
        fail(f"--strategy: must be k3 or serial; got {strategy!r}")
    _number("--exact-time-limit", exact_time_limit, gt=0, unit="seconds")
    if exact_order not in ("backbone", "free"):
        fail(f"--exact-order: must be backbone or free; got {exact_order!r}")
    _check_out("--out", out, directory=True)
    _check_out("--torch-csv", torch_csv)
    sched = None
    if from_torch_csv is not None:
        try:
            sched = cli_plan.read_torch_csv(cfg, from_torch_csv)
        except ValueError as e:
            fail(f"--from-torch-csv: {e}")
    p = _plan_or_fail(cfg, strategy, sched)
    gc.freeze()  # the plan lives until exit: later collections (the P2P check causes many) need not walk it

    def report() -> None:  # before any output is written, while a child builds the trace ([Note: parallel outputs])
        if (why := cli_plan.p2p_refusal(p)) is not None:  # [Note: NCCL P2P model]: a plan that would hang
            fail(why)
        console.print(summary_table(p))
        cli_plan.print_report(console, p, timeline, gap)

    if out is None:
        report()
    else:
        for path in write_outputs(p, out, before=report):
            console.print(f"wrote {path}", highlight=False)
    if torch_csv is not None:
        cli_plan.write_torch_csv(cfg, sched, torch_csv)
        console.print(f"wrote {torch_csv}", highlight=False)
    if exact:
        try:
            line = cli_plan.exact_line(p, exact_order, exact_time_limit)
        except ValueError as e:
            fail(f"--exact: {e}")
        console.print(line, highlight=False)


@command()
def compare(
    config: Path = typer.Argument(..., help="YAML config."),
    schedules: Optional[str] = typer.Option(None, help="Comma-separated pipelines (default: every one the "
                                                       "config's shape supports)."),
    out: Optional[Path] = typer.Option(None, help="Write each plan.json, compare.json and one PNG with the "
                                                  "timelines stacked."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: SECTION.KEY=VALUE."),
    wide: bool = typer.Option(False, "--wide", help="Every column (per-stage peaks, ms and %, notes in the table); "
                                                    "default: a table within 120 columns."),
    orders: bool = typer.Option(False, "--orders", help="Instead: plan the config under every rank order "
                                                        "(parallel.order) and list each with its predicted step and "
                                                        "the link of each group (k3sched/placement.py)."),
    seq_chunks: Optional[str] = typer.Option(None, "--seq-chunks", help="Instead: plan the config for each of these "
                                                                       "sequence slice counts, e.g. 1,2,4,8 (Seq1F1B, "
                                                                       "parallel.seq_chunks) and list step, peak "
                                                                       "device memory and largest slice time."),
    seq_split: Optional[str] = typer.Option(None, "--seq-split", help="With --seq-chunks: the splits to plan "
                                                                         "(parallel.seq_split), comma-separated; "
                                                                         "default even,compute."),
) -> None:
    """Plan one config under every pipeline schedule (k3) and serial; print a comparison table."""
    from .compare import compare_command

    if seq_split is not None and seq_chunks is None:
        fail("--seq-split: only with --seq-chunks (the slice counts to plan); allowed: e.g. --seq-chunks 1,2,4,8 "
             "--seq-split even,compute")
    splits = [s.strip() for s in (seq_split or "even,compute").split(",")]
    cfg = _load(config, set_)
    if seq_chunks is not None:
        from .compare import compare_slices, parse_int_list, render_slices

        try:
            rows = compare_slices(cfg, parse_int_list("--seq-chunks", seq_chunks), splits)
        except ConfigError as e:
            fail(str(e))
        console.print(render_slices(rows, cfg))
        raise typer.Exit(0 if any(r.step_us is not None for r in rows) else 1)
    if orders:
        from .compare import compare_orders, render_orders

        rows = compare_orders(cfg)
        console.print(render_orders(rows, cfg.parallel.order))
        raise typer.Exit(0 if any(r.step_us is not None for r in rows) else 1)
    _check_out("--out", out, directory=True)
    names = [s.strip() for s in schedules.split(",") if s.strip()] if schedules else None
    cols = shutil.get_terminal_size((120, 24)).columns
    out_console = Console(width=max(200, cols) if wide else min(120, cols))
    raise typer.Exit(compare_command(config, names, out, set_, out_console, wide=wide))


@command()
def tune(
    config: Path = typer.Argument(..., help="YAML config."),
    budget: Optional[float] = typer.Option(None, help="Device memory budget per rank, GiB (default: "
                                                      "schedule.device_memory_budget, else hardware.device_memory_gb)."),
    time_limit: float = typer.Option(600.0, help="Stop after this many seconds with the best found so far."),
    jobs: Optional[int] = typer.Option(None, help="Planning processes (default: one per CPU core)."),
    out: Optional[Path] = typer.Option(None, help="Write best/plan.json, best/overrides.txt, pareto.png, tune.json."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: SECTION.KEY=VALUE."),
) -> None:
    """Search schedule, vpp, micro-batching, offload, recompute, FP8, WGrad lag, look-ahead and gradient
    offload for the fastest step within the budget; print the Pareto front and the gain over the Megatron
    default."""
    from .tune import tune_command

    _load(config, set_)
    _number("--time-limit", time_limit, gt=0, unit="seconds")
    if budget is not None:
        _number("--budget", budget, gt=0, le=1e7, unit="GiB")
    if jobs is not None:
        _number("--jobs", jobs, ge=1)
    _check_out("--out", out, directory=True)
    out_console = Console(width=min(120, shutil.get_terminal_size((120, 24)).columns))
    raise typer.Exit(tune_command(config, set_, budget, time_limit, jobs, out, out_console))


@command()
def run(
    config: Path = typer.Argument(..., help="YAML config (sections model, parallel, hardware, schedule)."),
    out: Path = typer.Option(Path("out/run"), help="Output directory: plan.json, trace_rank{R}.json, summary.json."),
    steps: int = typer.Option(3, help="Training steps."),
    warmup_steps: int = typer.Option(1, help="Steps left out of the summary's measured step time (the median of "
                                             "the rest)."),
    trace_steps: bool = typer.Option(False, help="Also write trace_steps_rank{R}.json: every step from the last "
                                                 "warm-up step on (k3sched calibrate drops the first as warm-up)."),
    nproc: Optional[int] = typer.Option(None, help="Local ranks (default: pp*ep*dp of the config; must match)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: SECTION.KEY=VALUE (repeatable)."),
    strategy: Optional[str] = typer.Option(None, help="k3 (five-lane co-schedule) or serial (no overlap)."),
    nsys: bool = typer.Option(False, help="Record NVTX ranges with Nsight Systems (DIR/profile.*) and validate."),
    timeout: Optional[float] = typer.Option(None, help="Wall-clock limit of the whole run, seconds (the ranks' "
                                                       "waits: half of it, at most 120 s; env K3SCHED_TIMEOUT_S)."),
    device: Optional[str] = typer.Option(None, help="cpu (gloo) or cuda (NCCL, one GPU per rank); default: cuda "
                                                    "when every rank has its own GPU, else cpu."),
    emulate_links: bool = typer.Option(False, help="Run every rank in its own network namespace behind a NIC "
                                                   "shaped to hardware.internode_gbps (across emulated nodes "
                                                   "of gpus_per_node) and nvlink_gbps (within one); needs root."),
    p2p: str = typer.Option("buffered", help="P2P semantics on gloo: buffered, or strict (like NCCL: a send "
                                             "completes once its receive is posted, one stream per communicator)."),
    save_every: int = typer.Option(0, help="Checkpoint every N steps into OUT/checkpoints/step_K (K = steps done; "
                                           "written to a temporary directory, then renamed; 0: never)."),
    save_mode: str = typer.Option("async", help="async (dcp.async_save: training goes on while it writes) or "
                                                "blocking (dcp.save before the next step)."),
    resume: Optional[str] = typer.Option(None, help="Continue from checkpoint DIR, or latest (the newest complete "
                                                    "one under OUT), up to --steps; the layout may differ."),
    racecheck: bool = typer.Option(False, "--racecheck", help="Record which task touches each tensor; fail (exit 1, "
                                                              "one line per race) when two tasks of a rank touch one, "
                                                              "at least one writing, with no happens-before path."),
    drop_dep: Optional[List[str]] = typer.Option(None, "--drop-dep", metavar="CONSUMER=PRODUCER",
                                                 help="Debug: remove this plan dependency before running "
                                                      "(repeatable; proves --racecheck)."),
) -> None:
    """Train STEPS steps of the config for real under torchrun (gloo on CPU, NCCL on GPU), following
    the plan on five lanes; write plan.json, per-rank traces and a summary into OUT."""
    if strategy is not None and strategy not in ("k3", "serial"):
        fail(f"--strategy: must be k3 or serial; got {strategy!r}")
    _number("--steps", steps, ge=1)
    _number("--warmup-steps", warmup_steps, ge=0)
    _number("--nproc", nproc, ge=1)
    _number("--timeout", timeout, gt=0, unit="seconds")
    if p2p not in ("buffered", "strict"):
        fail(f"--p2p: must be buffered or strict; got {p2p!r}")
    if device is not None and device not in ("cpu", "cuda"):
        fail(f"--device: must be cpu or cuda; got {device!r}")
    _check_out("--out", out, directory=True)
    if save_every < 0:
        fail(f"--save-every: must be 0 (never) or a number of steps >= 1; got {save_every}")
    if save_mode not in ("async", "blocking"):
        fail(f"--save-mode: must be async or blocking; got {save_mode!r}")
    from runtime.launch import run_command  # imports torch: only when a run is asked for

    raise typer.Exit(run_command(config, list(set_ or []), steps, nproc, out, nsys, strategy, timeout_s=timeout,
                                 emulate_links=emulate_links,
                                 save_every=save_every, save_mode=save_mode, resume=resume, p2p=p2p,
                                 racecheck=racecheck, drop_deps=list(drop_dep or []), device=device,
                                 warmup_steps=warmup_steps, trace_steps=trace_steps))


@command()
def validate(
    traces: List[Path] = typer.Argument(..., help="Recorded traces: runtime Chrome JSON, Kineto JSON(.gz), nsys "
                                                   "SQLite."),
    plan_path: Path = typer.Option(..., "--plan", help="plan.json the run followed."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON."),
    tolerance_us: float = typer.Option(50.0, help="Dependency slack allowed, microseconds."),
    cross_rank_clocks: bool = typer.Option(False, help="The ranks' clocks are comparable (one machine, or "
                                                       "synchronised): also check dependencies across ranks."),
    skip_bad_events: bool = typer.Option(False, help="Drop malformed trace events (their count is said on "
                                                     "stderr) instead of refusing the file."),
    clock: str = typer.Option("auto", help="auto: check a lane on its GPU events' device times when every task "
                                           "of it has some, else on host ranges; host: host ranges only."),
) -> None:
    """Check recorded traces against a plan; exit 0 conforms, 1 does not, 2 unreadable input or a
    bad option, 3 an internal error."""
    _number("--tolerance-us", tolerance_us, ge=0, unit="microseconds")
    _check_out("--json", json_out)
    from traces.cli import validate_main

    raise typer.Exit(validate_main(str(plan_path), [str(t) for t in traces],
                                   json_out=str(json_out) if json_out else None, tolerance_us=tolerance_us,
                                   cross_rank_clocks=cross_rank_clocks, skip_bad_events=skip_bad_events, clock=clock))


@command()
def calibrate(
    traces: List[Path] = typer.Argument(..., help="Traces of a measured run: runtime trace_rank*.json or nsys "
                                                   "SQLite."),
    plan_path: Path = typer.Option(..., "--plan", help="plan.json the run followed."),
    out: Path = typer.Option(..., "-o", "--out", help="Profile YAML to write (durations_us, bandwidth_gbps)."),
    summary: Optional[Path] = typer.Option(None, help="The run's summary.json (default: beside the first trace); "
                                                      "its measured step gives the fit's residual on that run."),
    skip_bad_events: bool = typer.Option(False, help="Drop malformed trace events (their count is said on "
                                                     "stderr) instead of refusing the file."),
) -> None:
    """Fit per-kind durations and per-lane bandwidths from a measured run; write the profile YAML
    (plan with --set schedule.profile=FILE). See [Note: calibration] in traces/calibrate.py."""
    _check_out("-o", out)
    from traces.events import TraceError

    from traces.calibrate import calibrate_files, render

    try:
        fit = calibrate_files([str(t) for t in traces], str(plan_path), str(out), summary=summary,
                              skip_bad_events=skip_bad_events)
    except (TraceError, ValueError, ConfigError) as e:  # ValueError: no event names a task of the plan
        fail(str(e))
    print(render(fit))
    console.print(f"wrote {out} (plan with --set schedule.profile={out})", highlight=False)


@command()
def rebalance(
    run: Path = typer.Argument(..., help="A run directory (k3sched run --out): plan.json and trace_rank*.json."),
    out: Path = typer.Option(..., "-o", "--out", help="Config YAML to write (parallel.layer_split: profile); the "
                                                      "measured per-layer profile goes beside it "
                                                      "(NAME.profile.yaml)."),
) -> None:
    """Propose a layer split from a recorded run's measured per-layer times ([Note: profile split] in
    k3sched/rebalance.py): print per-stage time before and after and the planner's predicted step;
    write the config (run it to measure the gain)."""
    _check_out("-o", out)
    if not run.is_dir():
        fail(f"{run}: not a run directory; allowed: a directory written by k3sched run --out (plan.json, "
             f"trace_rank*.json)")
    traces = sorted(run.glob("trace_rank*.json"))
    if not (run / "plan.json").is_file() or not traces:
        fail(f"{run}: no plan.json and trace_rank*.json; allowed: a directory written by k3sched run --out")
    from traces.events import TraceError

    from traces.cli import read_trace_files
    from traces.validate import load_plan

    from . import rebalance as rb

    try:
        doc = load_plan(run / "plan.json")
        events = read_trace_files([str(t) for t in traces], prog="k3sched rebalance")
        if not {"model", "parallel", "hardware", "schedule"} <= set(doc.get("config") or {}):
            fail(f"{run / 'plan.json'}: its config has no model/parallel/hardware/schedule sections; allowed: a "
                 f"plan written by k3sched run")
        times = rb.measure(doc, events)
    except (TraceError, ValueError) as e:
        fail(str(e))
    profile = out.with_name(out.stem + ".profile.yaml")
    rb.write_profile(times, profile, str(run))
    prop = rb.propose(doc, times, str(profile))
    rb.write_config(prop, out, str(run))
    for line in rb.render(prop):
        print(line)
    console.print(f"wrote {out} and {profile} (k3sched run {out} to measure the new split)", highlight=False)


@command()
def balance(
    run: Path = typer.Argument(..., help="A run directory (k3sched run --out) or its summary.json."),
    redundant: int = typer.Option(..., "--redundant", help="Extra expert slots per EP rank for replicas of hot "
                                                          "experts (parallel.redundant_experts)."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Placement YAML to write (plan and run with "
                                                                 "--set schedule.expert_placement=FILE)."),
    gpus_per_node: Optional[int] = typer.Option(None, help="Ranks per node (default: the run's config's "
                                                           "hardware.gpus_per_node); splits the EP group "
                                                           "into nodes for hierarchical balancing."),
) -> None:
    """Place redundant experts from a run's measured routing (EPLB-style, [Note: balancing] in
    k3sched/balance.py): replicate the heaviest experts into the extra slots, pack the replicas to
    equalise the EP ranks' loads; print each rank's load before and after."""
    import yaml

    from .balance import Placement, balance as place, imbalance, loads_from_summary

    _number("--redundant", redundant, ge=0)
    _number("--gpus-per-node", gpus_per_node, ge=1)
    _check_out("-o", out)
    path = run / "summary.json" if run.is_dir() else run
    from traces.schema import check_summary

    from traces.chrome import load_json
    from traces.events import TraceError

    try:
        doc = load_json(path)
        check_summary(doc, str(path))
    except TraceError as e:
        fail(str(e))
    loads, ep = loads_from_summary(doc, str(path))
    routing = doc["routing"]
    E = len(loads)
    if gpus_per_node is None:
        gpus_per_node = 0
        try:
            gpus_per_node = load_config(doc["config"], doc.get("overrides") or []).hardware.gpus_per_node
        except (ConfigError, KeyError, TypeError):
            console.print("note: the run's config is not readable here; balancing without nodes "
                          "(--gpus-per-node N to split the EP group)", highlight=False)
    try:
        new = place(loads, ep, redundant, gpus_per_node)
    except ValueError as e:
        fail(f"--redundant: {e}; got {redundant}")
    slots = routing.get("slots")
    try:
        before = Placement(tuple(tuple(int(e) for e in r) for r in slots), E)
        before.rank_loads(loads)
    except (TypeError, ValueError, IndexError):
        fail(f"{path}: routing.slots: must be {ep} lists of expert ids in 0..{E - 1}")
    t = Table(title=f"tokens per EP rank ({len(routing['tokens_per_expert'])} steps x "
                    f"{len(routing['tokens_per_expert'][0])} MoE layers)")
    t.add_column("EP rank")
    t.add_column("before: experts")
    t.add_column("tokens", justify="right")
    t.add_column("after: experts")
    t.add_column("tokens", justify="right")
    lb, la = before.rank_loads(loads), new.rank_loads(loads)
    for r in range(ep):
        t.add_row(str(r), " ".join(map(str, before.slots[r])), f"{lb[r]:,.0f}", " ".join(map(str, new.slots[r])),
                  f"{la[r]:,.0f}")
    console.print(t)
    console.print(f"imbalance (max / mean per EP rank): before {imbalance(lb):.3f}, after {imbalance(la):.3f} "
                  f"({redundant} redundant slot(s) per rank; replicated: "
                  f"{', '.join(map(str, new.replicated())) or 'none'})", highlight=False)
    if out is not None:
        out.write_text(yaml.safe_dump(new.to_doc(), default_flow_style=None, sort_keys=False))
        console.print(f"wrote {out} (plan and run with --set parallel.redundant_experts={redundant} "
                      f"--set schedule.expert_placement={out})", highlight=False)


def _writable_target(path: Path, *, directory: bool = False) -> str | None:
    """Why ``path`` cannot be written (one phrase), or None: ``traces.cli.writable_target``, the
    one check of every output option (imported here, lazily: ``k3sched plan`` starts without it)."""
    from traces.cli import writable_target

    return writable_target(path, directory=directory)


@command()
def probe(
    nproc: int = typer.Option(2, help="Ranks for the collective measurements (torchrun; gloo on CPU, NCCL on GPU)."),
    out: Path = typer.Option(Path("hardware.yaml"), "-o", "--out", help="YAML to write: CONFIG with its hardware "
                             "section replaced (with --config), else a file with only the hardware section."),
    config: Optional[Path] = typer.Option(None, "--config", help="Config whose model gives the GEMM shapes and "
                                          "dtype, whose hardware gives what is not measured (memory sizes, "
                                          "gpus_per_node); the output is this config with measured hardware."),
    emulate_links: bool = typer.Option(False, help="Run the collectives in the shaped-link testbed "
                                                   "(runtime/testbed.py; needs --config and root)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field of --config: SECTION.KEY=VALUE "
                                              "(kept in the output; measured hardware fields are replaced)."),
    quick: bool = typer.Option(False, help="Fewer sizes and repetitions (~10 s on 2 cores; for tests)."),
    timeout: float = typer.Option(300.0, help="Limit of the collective measurement (and its process groups), s."),
) -> None:
    """Measure this machine (GEMM rate at the model's shapes in one thread, per-task overhead, memory
    copy, offload copy, collective bus bandwidth and latency over NPROC ranks) and write the
    hardware section the cost model reads. See [Note: what the probe measures] in runtime/probe/__init__.py."""
    if nproc < 2:
        fail(f"--nproc: the collective measurements need at least 2 ranks; got {nproc}")
    if nproc > 64:
        fail(f"--nproc: at most 64 local ranks; got {nproc}")
    _number("--timeout", timeout, gt=0, unit="seconds")
    if set_ and config is None:
        fail("--set: needs --config (it overrides the config's fields)")
    cfg = _load(config, set_) if config is not None else None
    _check_out("-o", out)
    if emulate_links and cfg is None:
        fail("--emulate-links: needs --config (the links are shaped to its hardware.internode_gbps and nvlink_gbps)")
    testbed, testbed_errors = None, ()
    if emulate_links:
        try:
            from runtime.testbed import Testbed, TestbedError, testbed_available
        except ImportError:
            fail("--emulate-links: the testbed (runtime/testbed.py) is not available")
        testbed_errors = (TestbedError,)
        reason = testbed_available()
        if reason is not None:
            fail(f"--emulate-links: {reason}")
        try:
            testbed = Testbed(cfg.hardware, nproc)  # opened around the collective measurements only
        except ValueError as e:
            fail(f"--emulate-links: {e}")
    from runtime import probe as probe_mod  # imports torch: only when a probe is asked for

    def say(msg: str) -> None:
        err_console.print(f"probe: {msg}", highlight=False)

    try:
        res = probe_mod.probe(cfg, nproc=nproc, quick=quick, testbed=testbed, timeout_s=timeout, progress=say)
    except probe_mod.ProbeError as e:
        fail(str(e), code=1)
    except testbed_errors as e:  # the testbed was refused when it was set up: nothing measured
        fail(f"--emulate-links: {e}")
    t = Table(title=f"k3sched probe: {res.device}, {res.nproc} ranks"
              + (" in the shaped-link testbed" if res.emulated else " on this machine"), title_justify="left")
    for name, just in (("measured", "left"), ("value", "right"), ("how", "left"), ("fit residual", "right")):
        t.add_column(name, justify=just)
    for r in res.rows:
        t.add_row(r.what, r.value, r.how, "" if r.residual is None else f"{r.residual * 100:.1f}%")
    console.print(t)
    bus = Table(title="collectives (nccl-tests style; time: slowest rank, median)", title_justify="left")
    for name in ("group", "op", "size", "time µs", "algbw GB/s", "busbw GB/s"):
        bus.add_column(name, justify="left" if name in ("group", "op") else "right")
    for gname, g in res.collectives["groups"].items():
        for op, rows in g["ops"].items():
            for row in rows:
                bus.add_row(gname, op, str(row["bytes"]), f"{row['time_us']:.1f}", f"{row['algbw_gbps']:.3f}",
                            f"{row['busbw_gbps']:.3f}")
    console.print(bus)
    for note in res.notes:
        console.print(f"note: {note}", highlight=False)
    try:
        path = probe_mod.write_hardware(res, out, config, set_)
    except ConfigError as e:
        fail(f"-o {out}: the measured numbers do not make a valid config: {e}")
    except OSError as e:
        fail(f"-o {out}: cannot write ({e.strerror})")
    console.print(f"wrote {path}", highlight=False)


data_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="Training data: token files for the config's data.path.")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def data_prepare(
    texts: List[Path] = typer.Argument(..., help="Text files to tokenize (any bytes)."),
    out: Path = typer.Option(..., "-o", "--out", help="Token file to write (its description goes to OUT.json)."),
    dtype: str = typer.Option("uint16", help="Token id type, as data.dtype: uint16 or uint32."),
) -> None:
    """Tokenize TEXTS with the byte tokenizer (a byte is its id, 0..255; 256 ends each file) into one
    flat token file for data.path ([Note: token files] in runtime/data.py); needs model.vocab >= 257."""
    from runtime.data import DataError, prepare

    if dtype not in ("uint16", "uint32"):
        fail(f"--dtype: must be uint16 or uint32; got {dtype!r}")
    try:
        meta = prepare(texts, out, dtype)
    except DataError as e:
        fail(str(e))
    except OSError as e:
        fail(f"-o {out}: cannot write ({e.strerror or e})")
    console.print(f"wrote {out}: {meta['tokens']:,} tokens ({dtype}; byte tokenizer: needs model.vocab >= "
                  f"{meta['vocab_needed']}) and {out}.json", highlight=False)


def main() -> None:
    """The ``k3sched`` entry point: the commands under the error boundary, usage errors as one
    line (exit 2), anything that escapes a command as :func:`exit_code_for` says."""
    try:
        rv = app(standalone_mode=False)
    except KeyboardInterrupt:
        sys.exit(130)
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        sys.exit(1)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.TyperException as e:  # usage: unknown option, missing argument, bad value
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()
            sys.exit(e.exit_code)
        ctx = getattr(e, "ctx", None)
        where = f"{ctx.command_path}: " if ctx is not None else ""
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        _say_error(where + " ".join(e.format_message().split()) + hint)
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - the boundary: escaped a command (or typer itself)
        sys.exit(exit_code_for(e))
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()

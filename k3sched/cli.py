"""The ``k3sched`` command line: plan, compare, run, validate, calibrate.

User errors (bad config, infeasible budget, unreadable trace) print one line and exit 2; no
traceback. Heavy modules (torch, the runtime, the trace readers) are imported by the commands
that need them, so ``k3sched plan`` starts fast and needs no torch.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from .config import ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="k3sched: plan, run and check a five-lane (compute, EP, collective, local and remote "
                       "offload) co-schedule of one MoE training step.")
console = Console(width=max(180, shutil.get_terminal_size((180, 24)).columns))
err_console = Console(stderr=True)


def fail(msg: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _load(config: Path, overrides: Optional[List[str]]):
    try:
        return load_config(config, overrides)
    except ConfigError as e:
        fail(str(e))


def _plan_or_fail(cfg, strategy: Optional[str] = None, schedule=None):
    from .planner import InfeasibleBudget, plan
    from .simulator import DeadlockError

    try:
        return plan(cfg, strategy, schedule)
    except (InfeasibleBudget, ConfigError) as e:
        fail(str(e))
    except DeadlockError as e:
        fail(f"schedule.pipeline: {e}")
    except ValueError as e:  # schedule generators: unsupported shape
        fail(f"schedule.pipeline: {e}")


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f}"


def summary_table(p, title: str | None = None) -> Table:
    m = p.metrics
    step, lb = m["step_time_us"], m["lower_bound_us"]
    t = Table(title=title or f"{p.cfg.model.name}: strategy {p.strategy}, pipeline {p.pipeline}", title_justify="left")
    before = m.get("peak_device_bytes_before_offload")
    offloaded = before is not None and before != m["peak_device_bytes"]
    names = ["stage", "compute busy", "bubble", "exposed comm", "exposed EP ms"]
    names += ["device GiB w/o offload"] if offloaded else []
    names += ["peak device GiB", "host GiB", "peer GiB"]
    for name in names:
        t.add_column(name, justify="right", no_wrap=True)
    for s in range(p.cfg.parallel.pp):
        b = m["bubble_ratio"][s]["compute"]
        cells = [str(s), f"{(1 - b) * 100:.1f}%", f"{b * 100:.1f}%", f"{m['exposed_comm_ratio'][s] * 100:.1f}%",
                 f"{m['exposed_comm_us'][s]['ep'] / 1e3:.2f}"]
        cells += [_gib(before[s])] if offloaded else []
        cells += [_gib(m["peak_device_bytes"][s]), _gib(m["peak_host_bytes"][s]), _gib(m["peak_peer_bytes"][s])]
        t.add_row(*cells)
    t.caption = (f"step {step / 1e3:.3f} ms | lower bound {lb / 1e3:.3f} ms (x{step / lb:.3f}) | "
                 f"exposed EP {m['exposed_ep_ratio'] * 100:.2f}% of step | budget {_gib(m['budget_bytes'])} GiB | "
                 f"offloaded sets {m['offloaded_sets']['local']} local + {m['offloaded_sets']['remote']} remote of "
                 f"{m['offloaded_sets']['total']} | {m['num_tasks']} tasks")
    return t


def write_outputs(p, out: Path, png: bool = True) -> list[Path]:
    import json

    from . import render

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "plan.json", out / "plan.trace.json", out / "timeline.txt"]
    paths[0].write_text(render.dumps_plan(p))
    paths[1].write_text(json.dumps(render.perfetto_trace(p)))
    paths[2].write_text(render.ascii_timeline(p, 160) + "\n")
    if png:
        paths.append(render.png_timeline(p, out / "timeline.png"))
    return paths


@app.command()
def plan(
    config: Path = typer.Argument(..., help="YAML config (sections model, parallel, hardware, schedule)."),
    strategy: Optional[str] = typer.Option(None, help="k3 (five-lane co-schedule) or serial (no overlap)."),
    out: Optional[Path] = typer.Option(None, help="Write plan.json, plan.trace.json (Perfetto), timeline.txt, "
                                                  "timeline.png into this directory."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: SECTION.KEY=VALUE (repeatable)."),
    timeline: bool = typer.Option(False, help="Print the ASCII timeline."),
    torch_csv: Optional[Path] = typer.Option(None, help="Also write the compute order as a torch.distributed."
                                                        "pipelining action CSV."),
    from_torch_csv: Optional[Path] = typer.Option(None, help="Plan with this torch pipelining CSV as backbone."),
    exact: bool = typer.Option(False, help="Also solve the lane placement exactly with CP-SAT (small instances: "
                                           "up to ~3000 tasks) and print the heuristic's gap."),
    exact_time_limit: float = typer.Option(20.0, help="CP-SAT time limit for --exact, seconds."),
) -> None:
    """Predict step time, bubbles, exposed communication and memory of one training step."""
    cfg = _load(config, set_)
    if strategy is not None and strategy not in ("k3", "serial"):
        fail(f"--strategy: must be k3 or serial; got {strategy!r}")
    if from_torch_csv is not None:
        from . import schedules

        try:
            text = from_torch_csv.read_bytes().decode()
            sched = schedules.Schedule.from_torch_csv(
                text, cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.microbatches,
                placement="v" if cfg.schedule.pipeline in ("zb-v", "dualpipev") else "loop")
            schedules.check(sched)
        except OSError as e:
            fail(f"--from-torch-csv: cannot read {from_torch_csv}: {e.strerror}")
        except ValueError as e:
            fail(f"--from-torch-csv: {str(e).splitlines()[0]}")
    else:
        sched = None
    p = _plan_or_fail(cfg, strategy, sched)
    console.print(summary_table(p))
    if timeline:
        from .render import ascii_timeline

        print(ascii_timeline(p, 120))
    if out is not None:
        for path in write_outputs(p, out):
            console.print(f"wrote {path}", highlight=False)
    if torch_csv is not None:
        from . import schedules

        torch_csv.parent.mkdir(parents=True, exist_ok=True)
        from .planner import backbone

        torch_csv.write_text((sched or backbone(cfg)).to_torch_csv(), newline="")
        console.print(f"wrote {torch_csv}", highlight=False)
    if exact:
        from .exact import exact_report

        try:
            rep = exact_report(p.cfg, p, time_limit_s=exact_time_limit)
        except ValueError as e:
            fail(f"--exact: {e}")
        ref = "optimum" if rep["status"] == "OPTIMAL" else "CP-SAT bound"
        console.print(f"exact ({rep['status']}, {rep['num_tasks']} tasks, {rep['wall_s']:.1f} s): best "
                      f"{rep['best_us'] / 1e3:.3f} ms, bound {rep['bound_us'] / 1e3:.3f} ms; heuristic "
                      f"{rep['heuristic_us'] / 1e3:.3f} ms, gap {rep['gap'] * 100:.2f}% vs {ref}", highlight=False)


@app.command()
def compare(
    config: Path = typer.Argument(..., help="YAML config."),
    schedules: Optional[str] = typer.Option(None, help="Comma-separated pipelines (default: every one the "
                                                       "config's shape supports)."),
    out: Optional[Path] = typer.Option(None, help="Write each plan.json, compare.json and one PNG with the "
                                                  "timelines stacked."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: SECTION.KEY=VALUE."),
) -> None:
    """Plan one config under every pipeline schedule (k3) and serial; print a comparison table."""
    from .compare import compare_command

    _load(config, set_)
    names = [s.strip() for s in schedules.split(",") if s.strip()] if schedules else None
    raise typer.Exit(compare_command(config, names, out, set_, console))


@app.command()
def run(
    config: Path = typer.Argument(..., help="YAML config (sections model, parallel, hardware, schedule)."),
    out: Path = typer.Option(Path("out/run"), help="Output directory: plan.json, trace_rank{R}.json, summary.json."),
    steps: int = typer.Option(3, help="Training steps."),
    nproc: Optional[int] = typer.Option(None, help="Local ranks (default: pp*ep*dp of the config; must match)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: SECTION.KEY=VALUE (repeatable)."),
    strategy: Optional[str] = typer.Option(None, help="k3 (five-lane co-schedule) or serial (no overlap)."),
    nsys: bool = typer.Option(False, help="Record NVTX ranges with Nsight Systems (DIR/profile.*) and validate."),
    timeout: Optional[float] = typer.Option(None, help="Wall-clock limit of the whole run, seconds."),
    emulate_links: bool = typer.Option(False, help="Run every rank in its own network namespace behind a NIC "
                                                   "shaped to hardware.internode_gbps (across emulated nodes "
                                                   "of gpus_per_node) and nvlink_gbps (within one); needs root."),
) -> None:
    """Train STEPS steps of the config for real under torchrun (gloo on CPU, NCCL on GPU), following
    the plan on five lanes; write plan.json, per-rank traces and a summary into OUT."""
    if strategy is not None and strategy not in ("k3", "serial"):
        fail(f"--strategy: must be k3 or serial; got {strategy!r}")
    from runtime.launch import run_command  # imports torch: only when a run is asked for

    raise typer.Exit(run_command(config, list(set_ or []), steps, nproc, out, nsys, strategy, timeout_s=timeout,
                                 emulate_links=emulate_links))


@app.command()
def validate(
    traces: List[Path] = typer.Argument(..., help="Recorded traces: runtime Chrome JSON, Kineto JSON(.gz), nsys "
                                                   "SQLite."),
    plan_path: Path = typer.Option(..., "--plan", help="plan.json the run followed."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON."),
    tolerance_us: float = typer.Option(50.0, help="Dependency slack allowed, microseconds."),
    cross_rank_clocks: bool = typer.Option(False, help="The ranks' clocks are comparable (one machine, or "
                                                       "synchronised): also check dependencies across ranks."),
) -> None:
    """Check recorded traces against a plan; exit 0 conforms, 1 does not, 2 unreadable input."""
    from traces.cli import validate_main

    raise typer.Exit(validate_main(str(plan_path), [str(t) for t in traces],
                                   json_out=str(json_out) if json_out else None, tolerance_us=tolerance_us,
                                   cross_rank_clocks=cross_rank_clocks))


@app.command()
def calibrate(
    traces: List[Path] = typer.Argument(..., help="Traces of a measured run: runtime trace_rank*.json or nsys "
                                                   "SQLite."),
    plan_path: Path = typer.Option(..., "--plan", help="plan.json the run followed."),
    out: Path = typer.Option(..., "-o", "--out", help="Profile YAML to write (durations_us, bandwidth_gbps)."),
    summary: Optional[Path] = typer.Option(None, help="The run's summary.json (default: beside the first trace); "
                                                      "its measured step gives the fit's residual on that run."),
) -> None:
    """Fit per-kind durations and per-lane bandwidths from a measured run; write the profile YAML
    (plan with --set schedule.profile=FILE). See [Note: calibration] in k3sched/calibrate.py."""
    from .calibrate import calibrate_files, render

    try:
        from traces.events import TraceError
    except ImportError:  # pragma: no cover
        TraceError = OSError  # noqa: N806
    try:
        fit = calibrate_files([str(t) for t in traces], str(plan_path), str(out), summary=summary)
    except (TraceError, ValueError, ConfigError) as e:
        fail(str(e))
    print(render(fit))
    console.print(f"wrote {out} (plan with --set schedule.profile={out})", highlight=False)


def _writable_target(path: Path) -> str | None:
    """Why ``path`` cannot be written (one phrase), or None."""
    import os

    if path.is_dir():
        return "is a directory"
    if path.exists():
        return None if os.access(path, os.W_OK) else "is not writable"
    anc = path.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        return f"{anc} is not a directory"
    return None if os.access(anc, os.W_OK | os.X_OK) else f"cannot create files under {anc}"


@app.command()
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
    hardware section the cost model reads. See [Note: what the probe measures] in runtime/probe.py."""
    if nproc < 2:
        fail(f"--nproc: the collective measurements need at least 2 ranks; got {nproc}")
    if nproc > 64:
        fail(f"--nproc: at most 64 local ranks; got {nproc}")
    if not timeout > 0:
        fail(f"--timeout: must be positive; got {timeout}")
    if set_ and config is None:
        fail("--set: needs --config (it overrides the config's fields)")
    cfg = _load(config, set_) if config is not None else None
    why = _writable_target(out)
    if why:
        fail(f"-o {out}: {why}")
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


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # pragma: no cover
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()

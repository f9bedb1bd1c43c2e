"""What ``k3sched plan`` (k3sched/cli.py) reads and prints besides the plan itself: the summary
table, the rank-placement lines, a torch CSV backbone in and out, the ``--exact`` report line.

Errors the user can fix are ValueErrors with a one-line message; the command turns them into its
exit 2 ([Note: CLI error boundary] in k3sched/cli.py).
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f}"


def summary_table(p, title: str | None = None) -> Table:
    m = p.metrics
    step, lb = m.step_time_us, m.lower_bound_us
    t = Table(title=title or f"{p.cfg.model.name}: strategy {p.strategy}, pipeline {p.pipeline}", title_justify="left")
    before = m.peak_device_bytes_before_offload
    offloaded = before is not None and before != m.peak_device_bytes
    names = ["stage", "compute busy", "bubble", "exposed comm", "exposed EP ms"]
    names += ["device GiB w/o offload"] if offloaded else []
    names += ["peak device GiB", "host GiB", "peer GiB"]
    for name in names:
        t.add_column(name, justify="right", no_wrap=True)
    for s in range(p.cfg.parallel.pp):
        b = m.bubble_ratio[s]["compute"]
        cells = [str(s), f"{(1 - b) * 100:.1f}%", f"{b * 100:.1f}%", f"{m.exposed_comm_ratio[s] * 100:.1f}%",
                 f"{m.exposed_comm_us[s]['ep'] / 1e3:.2f}"]
        cells += [_gib(before[s])] if offloaded else []
        cells += [_gib(m.peak_device_bytes[s]), _gib(m.peak_host_bytes[s]), _gib(m.peak_peer_bytes[s])]
        t.add_row(*cells)
    t.caption = (f"step {step / 1e3:.3f} ms | lower bound {lb / 1e3:.3f} ms (x{step / lb:.3f}) | "
                 f"exposed EP {m.exposed_ep_ratio * 100:.2f}% of step | budget {_gib(m.budget_bytes)} GiB | "
                 f"offloaded sets {m.offloaded_sets['local']} local + {m.offloaded_sets['remote']} remote of "
                 f"{m.offloaded_sets['total']} | {m.num_tasks} tasks")
    return t


def read_torch_csv(cfg, path: Path):
    """The backbone in the torch pipelining CSV at ``path`` for ``cfg``'s shape, checked
    (``--from-torch-csv``). ValueError: the file cannot be read, or the first line of what is wrong."""
    from . import schedules
    from .pipelines import TABLE as PIPELINE_TABLE

    try:
        text = path.read_bytes().decode()
        sched = schedules.Schedule.from_torch_csv(
            text, cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.microbatches,
            placement=PIPELINE_TABLE[cfg.schedule.pipeline].placement)
        schedules.check(sched)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(str(e).splitlines()[0]) from None
    return sched


def p2p_refusal(p) -> str | None:
    """Why ``p`` would hang under NCCL point-to-point semantics (one line), or None ([Note: NCCL
    P2P model] in k3sched/p2pcheck.py)."""
    from .p2pcheck import P2PDeadlock, check_p2p_transfers

    try:
        check_p2p_transfers(p)
    except P2PDeadlock as e:
        return str(e)
    return None


def print_report(console, p, timeline: bool = False, gap: bool = False) -> None:
    """What ``k3sched plan`` prints of a plan under its summary table: the sequence-slice line of
    a sliced plan, where the ranks sit (worlds of more than one rank), and on request the ASCII
    timeline and the gap report."""
    if p.cfg.parallel.seq_chunks > 1:  # [Note: sequence slices] in k3sched/seqslice.py
        from .seqslice import slices_line

        console.print(slices_line(p), highlight=False, markup=False, soft_wrap=True)
    e = p.metrics.expected
    if e:  # [Note: task-time spread] in k3sched/variability.py
        ov = ", ".join("-" if r is None else f"{r * 100:.0f}%" for r in e["comm_overlap_ratio"])
        console.print(f"expected with the task-time spread (cv {e['task_time_cv']:g}"
                      + (", per kind from the profile" if e["time_cv"] else "") + f", {e['samples']} replays of "
                      f"{e['ranks']} rank(s) a stage): step {e['step_time_us'] / 1e3:.3f} ms (p10 "
                      f"{e['step_time_p10_us'] / 1e3:.3f}, p90 {e['step_time_p90_us'] / 1e3:.3f}); comm/compute "
                      f"overlap per stage {ov}", highlight=False, markup=False, soft_wrap=True)
    if p.cfg.parallel.world > 1:
        for line in placement_lines(p):
            console.print(line, highlight=False, markup=False)
    if timeline:
        from .render import ascii_timeline

        print(ascii_timeline(p, 120))
    if gap:
        from .bound import format_gap_report

        print(format_gap_report(p))


def placement_lines(p) -> list[str]:
    """Where the plan's ranks sit and which links their P2P pairs use (worlds of more than one rank)."""
    from .compare import p2p_pairs
    from .placement import RankOrder, describe

    cfg = p.cfg
    ro = RankOrder(cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.order)
    return list(describe(ro, cfg.hardware.gpus_per_node, p2p_pairs(p)))


def write_torch_csv(cfg, sched, path: Path) -> None:
    """``--torch-csv``: the compute order (``sched``, else the config's backbone) as a torch CSV."""
    from .planner import backbone

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((sched or backbone(cfg)).to_torch_csv(), newline="")


def exact_line(p, order: str, time_limit: float) -> str:
    """``--exact``: solve the plan's config exactly (``order`` backbone or free, k3sched/exact/) and
    the one line comparing the plan with it. ValueError: the solve could not run or found nothing."""
    if order == "free":
        from .exact import free_report

        if p.cfg.parallel.seq_chunks > 1:
            raise ValueError("order free is not available for sliced plans (parallel.seq_chunks > 1): its model "
                             "keys activation sets by (stage, micro-batch, layer); use --exact-order backbone")

        rep = free_report(p.cfg, p, deterministic_time=time_limit)
        ref = "optimum" if rep["status"] == "OPTIMAL" else "CP-SAT bound"
        return (f"exact, order free, budget {rep['budget_bytes'] / 2**30:.4g} GiB ({rep['status']}, "
                f"{rep['num_tasks']} tasks, {rep['wall_s']:.1f} s): best {rep['best_us'] / 1e3:.3f} ms, bound "
                f"{rep['bound_us'] / 1e3:.3f} ms, activation sets "
                + ", ".join(f"{k} {v}" for k, v in rep["choices"].items())
                + f"; heuristic {rep['heuristic_us'] / 1e3:.3f} ms, gap {rep['gap'] * 100:.2f}% vs {ref} "
                f"({rep['gap_vs_best'] * 100:.2f}% vs best)")
    from .exact import exact_report

    rep = exact_report(p.cfg, p, time_limit_s=time_limit)
    ref = "optimum" if rep["status"] == "OPTIMAL" else "CP-SAT bound"
    return (f"exact ({rep['status']}, {rep['num_tasks']} tasks, {rep['wall_s']:.1f} s): best "
            f"{rep['best_us'] / 1e3:.3f} ms, bound {rep['bound_us'] / 1e3:.3f} ms; heuristic "
            f"{rep['heuristic_us'] / 1e3:.3f} ms, gap {rep['gap'] * 100:.2f}% vs {ref}")

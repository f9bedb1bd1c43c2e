"""The ``k3sched run`` command (registered by k3sched.cli: ``app.command("run")(run)``).

Kept here so the CLI module needs no torch at import: the runtime is imported when the command
runs. Exit codes: 0 done, 1 a rank failed (its one-line error printed), 2 user error."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def run(
    config: Path = typer.Argument(..., help="YAML config (sections model, parallel, hardware, schedule)."),
    out: Path = typer.Option(Path("out/run"), help="Output directory: plan.json, trace_rank{R}.json, summary.json."),
    steps: int = typer.Option(3, help="Training steps."),
    nproc: Optional[int] = typer.Option(None, help="Local ranks (default: pp*ep*dp of the config; must match)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: SECTION.KEY=VALUE (repeatable)."),
    strategy: Optional[str] = typer.Option(None, help="k3 (five-lane co-schedule) or serial (no overlap)."),
    nsys: bool = typer.Option(False, help="Record NVTX ranges with Nsight Systems (DIR/profile.*)."),
    timeout: Optional[float] = typer.Option(None, help="Wall-clock limit of the whole run, seconds."),
) -> None:
    """Train STEPS steps of the config for real under torchrun, following the plan on five lanes."""
    if strategy is not None and strategy not in ("k3", "serial"):
        typer.echo(f"error: --strategy: must be k3 or serial; got {strategy!r}", err=True)
        raise typer.Exit(2)
    from .launch import run_command

    raise typer.Exit(run_command(config, list(set_ or []), steps, nproc, out, nsys, strategy, timeout_s=timeout))

"""Layering: k3sched imports no torch; traces needs only the plan format (no torch, no runtime)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def _modules_after(imports: str) -> set[str]:
    code = f"import sys\n{imports}\nprint('\\n'.join(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_k3sched_imports_no_torch():
    mods = _modules_after("import k3sched.cli, k3sched.planner, k3sched.schedules, k3sched.compare, k3sched.render")
    assert not {m for m in mods if m == "torch" or m.startswith("torch.")}
    assert not {m for m in mods if m.split(".")[0] in ("runtime", "moe", "offload", "traces")}


def test_traces_needs_only_the_plan_format():
    mods = _modules_after("import traces.validate, traces.cli, traces.nsys, traces.chrome")
    assert "torch" not in mods
    assert not {m for m in mods if m.split(".")[0] in ("runtime", "moe", "offload")}
    assert not {m for m in mods if m.startswith("k3sched.") and m not in ("k3sched.tasks",)}, \
        sorted(m for m in mods if m.startswith("k3sched."))

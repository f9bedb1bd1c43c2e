"""Layering: k3sched imports no torch; traces needs only the plan format (k3sched.tasks and
k3sched.planfile) and the interval unions (k3sched.intervals); no torch, no runtime."""

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
    assert not {m for m in mods if m.startswith("k3sched.") and m not in ("k3sched.tasks", "k3sched.planfile", "k3sched.intervals")}, \
        sorted(m for m in mods if m.startswith("k3sched."))


PACKAGES = ("k3sched", "traces", "moe", "offload", "runtime")


def _package_imports() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the modules (files) that import it, from every import
    statement in the source, lazy ones inside functions included."""
    import ast

    edges: dict[str, dict[str, list[str]]] = {p: {} for p in PACKAGES}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for n in names:
                    top = n.split(".")[0]
                    if top in PACKAGES and top != pkg:
                        edges[pkg].setdefault(top, []).append(rel)
    return edges


def test_no_import_cycle_between_packages_outside_the_cli():
    """docs/design.md section 2: k3sched <- traces; k3sched <- moe <- offload <- runtime; only
    k3sched/cli.py reaches up (lazily, inside its commands). Any import, lazy or not, counts."""
    edges = _package_imports()
    graph = {p: {q for q, files in e.items() if any(f != "k3sched/cli.py" for f in files)} for p, e in edges.items()}

    def cycle_from(start):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    for p in PACKAGES:
        cyc = cycle_from(p)
        assert cyc is None, " -> ".join(cyc) + ": " + "; ".join(
            f"{a} imports {b} in {sorted(set(edges[a][b]))}" for a, b in zip(cyc, cyc[1:]))


def test_the_cycle_check_sees_lazy_imports():
    """The check reads import statements inside functions too: the CLI's lazy imports of the
    runtime are seen (and are the one allowed way up)."""
    edges = _package_imports()
    assert "k3sched/cli.py" in edges["k3sched"]["runtime"]
    assert "k3sched/cli.py" in edges["k3sched"]["traces"]

"""Layering: k3sched imports no torch; traces needs only the plan format (k3sched.tasks and
k3sched.planfile) and the interval unions (k3sched.intervals); no torch, no runtime. No module
import cycle, and no _private name imported from another module."""

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


TRACES_MAY_IMPORT = ("k3sched.tasks", "k3sched.planfile", "k3sched.intervals")
"""The k3sched modules the trace tools read: the plan format and the interval unions."""

CALIBRATE_BEYOND_THE_PLAN_FORMAT = {"k3sched.config", "k3sched.cost", "k3sched.profile", "k3sched.planner"}
"""What traces.calibrate imports from k3sched beyond TRACES_MAY_IMPORT: it fits a cost-model
profile (k3sched.profile's format, checked against the config's CostModel) and re-plans with it
(the planner, lazily) to compare a run with its plan. The one exception to the traces rule; the
test below fails when it grows or shrinks, so the list stays exact."""


def test_traces_needs_only_the_plan_format():
    mods = _modules_after("import traces.validate, traces.cli, traces.nsys, traces.chrome")
    assert "torch" not in mods
    assert not {m for m in mods if m.split(".")[0] in ("runtime", "moe", "offload")}
    assert not {m for m in mods if m.startswith("k3sched.") and m not in TRACES_MAY_IMPORT}, \
        sorted(m for m in mods if m.startswith("k3sched."))


def test_calibrate_imports_the_plan_format_and_its_listed_exceptions():
    mods = _modules_after("import traces.calibrate")
    assert "torch" not in mods
    assert not {m for m in mods if m.split(".")[0] in ("runtime", "moe", "offload")}
    direct = {t for t in _module_graph()[0]["traces.calibrate"] if t.startswith("k3sched.")}
    assert direct - set(TRACES_MAY_IMPORT) == CALIBRATE_BEYOND_THE_PLAN_FORMAT


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


def _module_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """(module -> the modules of the five packages it imports, [(importer, module, _name)] for every
    ``_private`` name imported from another module), from every import statement: function-local
    ones count, those under ``if TYPE_CHECKING:`` do not (they never run)."""
    import ast

    files = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            files[mod.removesuffix(".__init__")] = path

    def known(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {m: set() for m in files}
    private: list[tuple[str, str, str]] = []
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                for b in n.body for x in ast.walk(b)}
        pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [(known(a.name), None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                targets = [(known(f"{base}.{a.name}") if f"{base}.{a.name}" in files else known(base), a.name)
                           for a in node.names]
            else:
                continue
            for target, name in targets:
                if not target or target == mod:
                    continue
                edges[mod].add(target)
                if name and name.startswith("_") and not name.startswith("__") and f"{target}.{name}" not in files:
                    private.append((mod, target, name))
    return edges, private


def test_no_import_cycle_between_modules():
    """No module of the five packages reaches itself through imports, lazy ones included: a shared
    piece lives in the lower module (or a small one of its own) and is imported from there."""
    edges, _ = _module_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cyc := visit(n)):
                return cyc
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            cyc = visit(m)
            assert cyc is None, "import cycle: " + " -> ".join(cyc)




def test_no_private_name_imported_from_another_module():
    """A ``_name`` is its module's own: a name another module imports is part of its module's
    interface and has no underscore."""
    _, private = _module_graph()
    bad = sorted(set(private))
    assert not bad, "; ".join(f"{a} imports {n} from {b}" for a, b, n in bad)


def test_the_module_checks_see_lazy_imports_and_skip_type_checking():
    """Lazy imports count (the CLI imports the runtime inside its commands); imports under
    ``if TYPE_CHECKING:`` do not (k3sched.bound names the planner's Plan only there)."""
    edges, _ = _module_graph()
    assert "runtime.launch" in edges["k3sched.cli"]
    assert "k3sched.planner" not in edges["k3sched.bound"]

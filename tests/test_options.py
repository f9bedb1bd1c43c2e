"""[Note: runtime options]: the runtime's environment is read once, by RuntimeOptions.from_env,
with one-line errors; the objects it configures read no environment themselves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from runtime.options import RuntimeOptions

ROOT = Path(__file__).resolve().parents[1]


def test_from_env_reads_every_hook_of_its_own_rank():
    env = {"K3SCHED_OFFLOAD_DEBUG": "1", "K3SCHED_OFFLOAD_DELAY_S": "0.25", "K3SCHED_PERTURB": "compute:3@1",
           "K3SCHED_UNSAFE_SHARED_DX": "1", "K3SCHED_DETERMINISTIC": "1", "K3SCHED_FAIL_RANK": "1",
           "K3SCHED_FAIL_TASK": "*attn.fwd", "K3SCHED_FAIL_STEP": "2", "K3SCHED_FAIL_SIGNAL": "sigkill",
           "K3SCHED_STACKS_AFTER_S": "30"}
    one = RuntimeOptions.from_env(env, 1)
    assert one == RuntimeOptions(offload_debug=True, copy_delay_s=0.25, perturb=("compute", 3), unsafe_shared_dx=True,
                                 deterministic=True, fail_task="*attn.fwd", fail_step=2, fail_signal="KILL",
                                 stacks_after_s=30.0)
    zero = RuntimeOptions.from_env(env, 0)  # another rank: no perturbation, no failure
    assert (zero.perturb, zero.fail_task, zero.fail_step, zero.fail_signal) == (None, None, None, "")
    assert RuntimeOptions.from_env({}, 0) == RuntimeOptions()
    assert RuntimeOptions.from_env({"K3SCHED_FAIL_RANK": "0"}, 0).fail_task == "*"


@pytest.mark.parametrize("name, value, says", [
    ("K3SCHED_OFFLOAD_DELAY_S", "fast", "expected a number"),
    ("K3SCHED_OFFLOAD_DELAY_S", "-1", "expected a value >= 0"),
    ("K3SCHED_OFFLOAD_DEBUG", "yes", "expected 0 or 1"),
    ("K3SCHED_FAIL_SIGNAL", "TERM", "one of KILL, HANG"),
    ("K3SCHED_PERTURB", "nolane:1", "lane must be one of"),
])
def test_a_malformed_value_is_one_line_naming_the_variable(name, value, says):
    env = {name: value, "K3SCHED_FAIL_RANK": "0"}
    with pytest.raises(ValueError) as e:
        RuntimeOptions.from_env(env, 0)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_no_constructor_below_the_entry_point_reads_the_environment():
    # offload/ and the runtime's executor, stage runner and local runner take their options as arguments
    for rel in ("offload/manager.py", "offload/gradshard.py", "runtime/executor.py", "runtime/local.py",
                *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "runtime/stage").glob("*.py"))):
        tree = ast.parse((ROOT / rel).read_text())
        reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "environ"]
        assert not reads, f"{rel} reads os.environ at line(s) {reads}"


def test_run_refuses_a_malformed_hook_before_launching(tmp_path, capsys):
    from runtime.launch import run_command

    rc = run_command(ROOT / "configs" / "tiny-cpu.yaml", [], 1, None, tmp_path, env={"K3SCHED_OFFLOAD_DELAY_S": "fast"})
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == "error: K3SCHED_OFFLOAD_DELAY_S='fast': expected a number", err
    assert not (tmp_path / "summary.json").exists()  # nothing was launched

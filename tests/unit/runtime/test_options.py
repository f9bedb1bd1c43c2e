"""[Note: runtime options]: the runtime's environment is read once, by RuntimeOptions.from_env,
with one-line errors; the objects it configures read no environment themselves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from runtime.options import LaunchEnv, RuntimeOptions

ROOT = Path(__file__).resolve().parents[3]


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
    run = {"K3SCHED_TIMEOUT_S": "10", "K3SCHED_CKPT_KILL": "1:4", "K3SCHED_CKPT_VERIFIED": "1",
           "K3SCHED_FAILURES_FILE": "/tmp/f.json"}
    assert RuntimeOptions.from_env(run, 1) == RuntimeOptions(timeout_s=10.0, ckpt_kill_step=4, ckpt_verified=True,
                                                             failures_file="/tmp/f.json")
    assert RuntimeOptions.from_env(run, 0).ckpt_kill_step is None


def test_launch_env_reads_the_launchers_variables():
    assert LaunchEnv.from_env({}) == LaunchEnv(0, 1, 0, "")
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
    assert LaunchEnv.from_env(env) == LaunchEnv(3, 4, 1, "127.0.0.1")


@pytest.mark.parametrize("name, value, says", [
    ("K3SCHED_OFFLOAD_DELAY_S", "fast", "expected a number"),
    ("K3SCHED_OFFLOAD_DELAY_S", "-1", "expected a value >= 0"),
    ("K3SCHED_OFFLOAD_DEBUG", "yes", "expected 0 or 1"),
    ("K3SCHED_FAIL_SIGNAL", "TERM", "one of KILL, HANG"),
    ("K3SCHED_PERTURB", "nolane:1", "lane must be one of"),
    ("K3SCHED_TIMEOUT_S", "soon", "expected a number"),
    ("K3SCHED_CKPT_KILL", "0", "expected RANK:STEP"),
    ("K3SCHED_CKPT_VERIFIED", "yes", "expected 0 or 1"),
])
def test_a_malformed_value_is_one_line_naming_the_variable(name, value, says):
    env = {name: value, "K3SCHED_FAIL_RANK": "0"}
    with pytest.raises(ValueError) as e:
        RuntimeOptions.from_env(env, 0)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_no_constructor_below_the_entry_point_reads_the_environment():
    # offload/ and the runtime's executor, checkpointer, stage runner and local runner take their options as arguments
    for rel in ("offload/manager.py", "offload/gradshard.py", "runtime/executor.py", "runtime/local.py",
                "runtime/checkpoint.py",
                *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "runtime/stage").glob("*.py"))):
        tree = ast.parse((ROOT / rel).read_text())
        reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "environ"]
        assert not reads, f"{rel} reads os.environ at line(s) {reads}"


def test_only_the_options_read_a_k3sched_or_launcher_variable():
    # every other use of os.environ in the packages hands the environment on to a child process or
    # reads a variable of another tool (NVTX_INJECTION64_PATH, OMP_NUM_THREADS, PYTHONPATH)
    ours = re.compile(r"K3SCHED_|_ENV\b|[\"'](RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT)[\"']")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for pkg in ("k3sched", "runtime", "moe", "offload", "traces") for p in sorted((ROOT / pkg).rglob("*.py"))
             if p.relative_to(ROOT).as_posix() != "runtime/options.py"
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if ("environ" in line or "getenv" in line) and ours.search(line)]
    assert not found, found


def test_run_refuses_a_malformed_hook_before_launching(tmp_path, capsys):
    from runtime.launch import run_command

    rc = run_command(ROOT / "configs" / "tiny-cpu.yaml", [], 1, None, tmp_path, env={"K3SCHED_OFFLOAD_DELAY_S": "fast"})
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == "error: K3SCHED_OFFLOAD_DELAY_S='fast': expected a number", err
    assert not (tmp_path / "summary.json").exists()  # nothing was launched

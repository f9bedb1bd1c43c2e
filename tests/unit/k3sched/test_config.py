"""Configs: the shipped files load; every kind of bad input is one line naming the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from k3sched.config import ConfigError, load_config

from conftest import CONFIGS


@pytest.mark.parametrize("name", ["tiny-cpu", "k2-like", "dsv3-like"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.parallel.world == cfg.parallel.pp * cfg.parallel.ep * cfg.parallel.dp


def test_k2_like_has_the_public_kimi_k2_shape():
    m = load_config(CONFIGS / "k2-like.yaml").model
    assert (m.layers, m.dense_layers, m.hidden, m.heads, m.experts, m.top_k, m.shared_experts, m.expert_hidden) == (
        61, 1, 7168, 64, 384, 8, 1, 2048)
    p = load_config(CONFIGS / "k2-like.yaml").parallel
    assert (p.pp, p.ep) == (16, 16) and p.vpp > 1


@pytest.mark.parametrize("override, expected", [
    (["model.bogus=1"], "model.bogus: unknown key; allowed: name, layers"),
    (["parallel.pp=four"], "parallel.pp: Input should be a valid integer"),
    (["parallel.ep=3"], "parallel.ep: must divide model.experts (8); got 3"),
    (["parallel.world_size=8"], "parallel.world_size: must equal pp*ep*dp = 2*2*1 = 4; got 8"),
    (["parallel.pp=0"], "parallel.pp: Input should be greater than or equal to 1 (got 0); allowed: an integer from 1 to 1024"),
    (["schedule.strategy=fast"], "schedule.strategy: Input should be 'k3' or 'serial'"),
    (["schedule.pipeline=zb-v"], "parallel.vpp: zb-v places 2 chunks per rank"),
    (["nosection.x=1"], "--set nosection.x: expected SECTION.KEY"),
    (["model.layers"], "--set 'model.layers': expected KEY=VALUE"),
])
def test_bad_config_is_one_line_naming_the_field(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "tiny-cpu.yaml", override)
    msg = str(e.value)
    assert "\n" not in msg
    assert expected in msg, msg


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(bad)


def test_set_overrides_any_field():
    cfg = load_config(CONFIGS / "tiny-cpu.yaml", ["parallel.microbatches=8", "schedule.offload=none",
                                                  "hardware.mfu=0.25"])
    assert cfg.parallel.microbatches == 8 and cfg.schedule.offload == "none" and cfg.hardware.mfu == 0.25


@pytest.mark.parametrize("args", [
    ["plan", "configs/tiny-cpu.yaml", "--set", "parallel.ep=3"],
    ["plan", "configs/missing.yaml"],
    ["plan", "configs/tiny-cpu.yaml", "--strategy", "fast"],
])
def test_cli_user_errors_exit_2_without_traceback(args):
    from conftest import ROOT

    r = subprocess.run([sys.executable, "-m", "k3sched.cli", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr

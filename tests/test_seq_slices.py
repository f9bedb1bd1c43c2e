"""Sequence slices (Seq1F1B, issue 17): slice boundaries, config validation ([Note: sequence slices]
in k3sched/seqslice.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from k3sched.config import ConfigError, load_config
from k3sched.seqslice import keys, slice_bounds, token_flops

from conftest import CONFIGS

TINY = CONFIGS / "tiny-cpu.yaml"


def _cfg(*overrides: str, path=TINY):
    return load_config(path, list(overrides))


def _slice_flops(cfg, bounds):
    a, c = token_flops(cfg)
    return [a * (e - s) + c * keys(s, e) for s, e in bounds]


def test_keys_is_the_causal_sum():
    for s, e in [(0, 1), (0, 7), (3, 9), (5, 5), (100, 228)]:
        assert keys(s, e) == sum(p + 1 for p in range(s, e))


def test_one_slice_is_the_whole_sequence():
    assert slice_bounds(_cfg()) == [(0, 128)]
    assert slice_bounds(_cfg("parallel.seq_split=compute")) == [(0, 128)]


@pytest.mark.parametrize("chunks", [2, 4, 8, 128])
def test_even_slices_are_equal_and_cover_the_sequence(chunks):
    b = slice_bounds(_cfg(f"parallel.seq_chunks={chunks}"))
    assert len(b) == chunks and b[0][0] == 0 and b[-1][1] == 128
    assert all(e0 == s1 for (_, e0), (s1, _) in zip(b, b[1:]))
    assert {e - s for s, e in b} == {128 // chunks}


@pytest.mark.parametrize("chunks", [2, 3, 4, 7, 8, 128])
def test_compute_slices_cover_the_sequence_and_shrink(chunks):
    cfg = _cfg(f"parallel.seq_chunks={chunks}", "parallel.seq_split=compute")
    b = slice_bounds(cfg)
    assert len(b) == chunks and b[0][0] == 0 and b[-1][1] == 128
    assert all(e0 == s1 for (_, e0), (s1, _) in zip(b, b[1:]))
    sizes = [e - s for s, e in b]
    assert min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)  # later tokens attend to more keys: fewer of them per slice


def test_compute_slices_equalize_cost_within_one_token():
    """Each boundary is the whole token nearest the equal-cost point: moving it by one token
    never makes the two slices beside it closer in cost."""
    cfg = load_config(CONFIGS / "k2-like.yaml", ["model.seq_len=131072", "parallel.seq_chunks=8",
                                                  "parallel.seq_split=compute"])
    b = slice_bounds(cfg)
    flops = _slice_flops(cfg, b)
    even = _slice_flops(cfg, slice_bounds(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(
        update={"seq_split": "even"})})))
    assert max(flops) < max(even)
    assert max(flops) / min(flops) < 1.0001
    a, c = token_flops(cfg)
    target = sum(flops) / 8
    for j in range(1, 8):
        cum = sum(flops[:j])
        for shift in (-1, 1):
            e = b[j - 1][1] + shift
            moved = a * e + c * keys(0, e)
            assert abs(moved - target * j) >= abs(cum - target * j)


def test_compute_boundaries_follow_the_attention_share():
    """With attention dominating (long sequence, tiny MLP) the cut of 2 slices approaches
    L / sqrt(2) (equal halves of a quadratic); with no long context it approaches L / 2."""
    long = _cfg("model.seq_len=65536", "parallel.seq_chunks=2", "parallel.seq_split=compute",
                "model.expert_hidden=1", "model.dense_hidden=1", "model.shared_experts=0", "model.top_k=1")
    cut = slice_bounds(long)[0][1]
    assert abs(cut - 65536 / 2 ** 0.5) / 65536 < 0.01
    short = _cfg("model.seq_len=16", "parallel.seq_chunks=2", "parallel.seq_split=compute")
    assert slice_bounds(short)[0][1] == 8


@pytest.mark.parametrize("override, expected", [
    (["parallel.seq_chunks=3"], "parallel.seq_chunks: must divide model.seq_len (128) under parallel.seq_split "
                                "even; got 3; allowed: a divisor of 128, or seq_split compute"),
    (["parallel.seq_chunks=129", "parallel.seq_split=compute"],
     "parallel.seq_chunks: every slice needs at least one token, so at most model.seq_len (128); got 129"),
    (["parallel.seq_chunks=0"], "parallel.seq_chunks: Input should be greater than or equal to 1 (got 0); "
                                "allowed: an integer from 1 to 4096"),
    (["parallel.seq_split=tokens"], "parallel.seq_split: Input should be 'even' or 'compute' (got 'tokens'); "
                                    "allowed: one of even, compute"),
])
def test_bad_seq_values_are_one_line(override, expected):
    with pytest.raises(ConfigError) as e:
        _cfg(*override)
    assert "\n" not in str(e.value)
    assert expected in str(e.value), str(e.value)


def test_compute_split_takes_counts_that_do_not_divide():
    assert len(slice_bounds(_cfg("parallel.seq_chunks=3", "parallel.seq_split=compute"))) == 3


def test_defaults_stay_out_of_the_config_dump():
    p = _cfg().to_dict()["parallel"]
    assert "seq_chunks" not in p and "seq_split" not in p
    p = _cfg("parallel.seq_chunks=2", "parallel.seq_split=compute").to_dict()["parallel"]
    assert (p["seq_chunks"], p["seq_split"]) == (2, "compute")


def test_cli_refuses_a_bad_seq_chunks_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", str(TINY), "--set", "parallel.seq_chunks=3",
                        "--out", str(tmp_path / "p")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
    assert len(lines) == 1 and "parallel.seq_chunks: must divide model.seq_len (128)" in lines[0], lines

"""Sequence slices (Seq1F1B, issue 17): slice boundaries, config validation ([Note: sequence slices]
in k3sched/seqslice.py)."""

from __future__ import annotations

import os
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


# -- the sliced plan ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sliced_plan():
    from k3sched.planner import plan

    return plan(_cfg("parallel.seq_chunks=4", "parallel.seq_split=compute", "schedule.offload=all"))


def test_every_layer_task_exists_per_slice(sliced_plan):
    whole = _plan_of()
    per_mb = {_unsliced(t) for t in sliced_plan.tasks.values() if t.mb is not None}
    assert per_mb == {tid for tid, t in whole.tasks.items() if t.mb is not None}
    for tid, t in sliced_plan.tasks.items():
        if t.mb is not None:
            assert t.slice is not None and f"q{t.slice}/" in tid, tid
            assert sum(1 for j in range(4) if _with_slice(t, j) in sliced_plan.tasks) == 4, tid
        else:
            assert t.slice is None, tid


def _plan_of(*overrides):
    from k3sched.planner import plan

    return plan(_cfg("schedule.offload=all", *overrides))


def _unsliced(t):
    from k3sched.tasks import parse_task_id

    return str(parse_task_id(t.id).__class__(**{**parse_task_id(t.id).__dict__, "slice": None}))


def _with_slice(t, j):
    from k3sched.tasks import parse_task_id

    return str(parse_task_id(t.id).__class__(**{**parse_task_id(t.id).__dict__, "slice": j}))


def test_causal_dependencies(sliced_plan):
    tasks = sliced_plan.tasks
    n = 0
    for tid, t in tasks.items():
        if t.kind.value == "attn.fwd" and t.slice:
            assert _with_slice(t, t.slice - 1) in t.deps, tid
            n += 1
        if t.kind.value == "attn.dx" and t.slice < 3:
            assert _with_slice(t, t.slice + 1) in t.deps, tid
            n += 1
        if t.kind.value == "attn.fwd" and t.slice == 0 or t.kind.value == "attn.dx" and t.slice == 3:
            assert not any("/attn." in d for d in t.deps), tid
    assert n == 2 * 3 * 4 * 4  # (fwd + dx) x 3 later slices x 4 micro-batches x 4 layers
    for tid, t in tasks.items():  # the plan keeps them: a slice's attention starts after its predecessor's ends
        if t.kind.value == "attn.fwd" and t.slice:
            assert t.start_us >= tasks[_with_slice(t, t.slice - 1)].end_us
        if t.kind.value == "attn.dx" and t.slice < 3:
            assert t.start_us >= tasks[_with_slice(t, t.slice + 1)].end_us


def test_backbone_is_seq1f1b(sliced_plan):
    """1F1B over slices: forwards in slice order, backwards in reverse slice order, and each rank's
    first backward after the forward of micro-batch 0's last slice (S-1 more warm-up slices)."""
    S, pp = 4, 2
    for r, slots in sliced_plan.backbone.items():
        ops = [(a.op, a.mb) for a in slots]
        assert [u for op, u in ops if op == "F"] == list(range(4 * S))
        assert [u for op, u in ops if op == "B"] == list(range(4 * S))
        first_b = next(i for i, (op, _) in enumerate(ops) if op == "B")
        assert first_b == (pp - 1 - r) + (S - 1) + 1
    t = sliced_plan.tasks  # unit 0's backward is slice S-1: its head.dx comes first on the last stage
    head_dx = sorted((x for x in t.values() if x.kind.value == "head.dx" and x.mb == 0), key=lambda x: x.start_us)
    assert [x.slice for x in head_dx] == [3, 2, 1, 0]


def test_slice_costs_follow_tokens_and_keys(sliced_plan):
    from k3sched.cost import CostModel
    from k3sched.tasks import Kind

    cfg = sliced_plan.cfg
    whole = CostModel(cfg)
    b = slice_bounds(cfg)
    t = sliced_plan.tasks
    recv = [t[f"s0/mb0q{j}/v0/act.send"].bytes for j in range(4)]
    assert recv == [whole.p2p_bytes() * (e - s) // 128 for s, e in b]
    a2a = [t[f"s1/mb0q{j}/L3/dispatch.fwd"].bytes for j in range(4)]
    assert a2a == [whole.sliced(s, e).a2a_bytes(Kind.DISPATCH_FWD) for s, e in b]
    assert abs(sum(a2a) - whole.a2a_bytes(Kind.DISPATCH_FWD)) <= 4
    core = [whole.sliced(s, e).flops(Kind.ATTN_FWD) - whole.sliced(s, e).flops(Kind.ATTN_DW) for s, e in b]
    assert core == [4 * cfg.model.hidden * cfg.model.micro_batch_size * keys(s, e) for s, e in b]
    # the prefix keys / values: slice j's attention keeps K/V of [0, s_j) on top of its share
    kv = [whole.sliced(s, e).saved_bytes(Kind.ATTN_FWD)[1] - int(whole.saved_bytes(Kind.ATTN_FWD)[1] * (e - s) / 128)
          for s, e in b]
    assert kv == [2 * cfg.model.micro_batch_size * s * cfg.model.hidden * whole.b for s, _ in b]


def test_sliced_plan_json_validates_and_ids_parse(sliced_plan, tmp_path):
    import json

    from k3sched.render import write_outputs
    from k3sched.tasks import parse_task_id
    from k3sched.planfile import check_plan_doc

    write_outputs(sliced_plan, tmp_path, png=False, parallel=False)
    doc = json.loads((tmp_path / "plan.json").read_text())
    check_plan_doc(doc)
    tasks = [t for st in doc["stages"] for lane in st["lanes"].values() for t in lane]
    sl = [t for t in tasks if "slice" in t]
    assert sl and all(parse_task_id(t["id"]).slice == t["slice"] for t in sl)
    assert all(t["mb"] is None for t in tasks if "slice" not in t)
    assert doc["config"]["parallel"]["seq_chunks"] == 4


def test_task_count_is_exact_for_sliced_plans():
    from k3sched.graph import OffloadChoice, build_step
    from k3sched.limits import count_tasks

    for extra in ([], ["schedule.grad_offload=true"], ["schedule.pipeline=zb-v", "parallel.vpp=2"]):
        cfg = _cfg("parallel.seq_chunks=4", *extra)
        g = build_step(cfg, OffloadChoice(everything=True))
        assert count_tasks(cfg).total == len(g.tasks), extra


@pytest.mark.parametrize("pipeline, vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1),
                                           ("zb-h2", 1), ("zb-v", 2), ("v-half", 2), ("v-min", 2)])
def test_every_supported_backbone_plans_sliced(pipeline, vpp):
    from k3sched.planner import plan

    p = plan(_cfg("parallel.seq_chunks=2", f"schedule.pipeline={pipeline}", f"parallel.vpp={vpp}"))
    assert p.metrics.step_time_us > 0


@pytest.mark.parametrize("pipeline, vpp, pp, mbs, slices", [
    ("zb-v", 2, 4, 8, 4), ("zb-v", 2, 8, 16, 4), ("zb-v", 2, 16, 32, 4), ("v-half", 2, 8, 16, 4),
    ("v-half", 2, 16, 32, 4), ("interleaved-1f1b", 2, 16, 32, 4), ("1f1b", 1, 8, 16, 4), ("zb-h1", 1, 8, 16, 4)])
def test_seq1f1b_backbones_are_valid_for_four_slices(pipeline, vpp, pp, mbs, slices):
    """[Note: one Seq1F1B shift for every rank]: on the V schedules each rank's own backward shift
    deadlocked the sliced backbone (zb-v with 4 slices from pp 4 on); the shared shift does not."""
    from k3sched.schedules import generate, validate
    from k3sched.seqslice import _shifted, seq1f1b

    base = generate(pipeline, pp, vpp, mbs * slices)
    assert validate(seq1f1b(base, slices)) == []
    if validate(_shifted(base, slices, uniform=False)) == []:  # valid with its own shifts: kept as it was
        assert seq1f1b(base, slices).ranks == _shifted(base, slices, uniform=False).ranks


def test_zb_v_with_four_slices_plans():
    from k3sched.planner import plan

    p = plan(_cfg("parallel.seq_chunks=4", "schedule.pipeline=zb-v", "parallel.vpp=2", "parallel.pp=4",
                  "model.layers=8", "parallel.microbatches=8"))
    assert p.metrics.step_time_us > 0


@pytest.mark.parametrize("pipeline", ["dualpipev", "dualpipe", "chimera"])
def test_other_backbones_are_refused(pipeline):
    with pytest.raises(ConfigError) as e:
        _cfg("parallel.seq_chunks=2", f"schedule.pipeline={pipeline}", "parallel.vpp=2" if pipeline == "dualpipev"
             else "parallel.vpp=1", "parallel.microbatches=4")
    assert ": parallel.seq_chunks: Seq1F1B slices run on gpipe, 1f1b" in str(e.value), str(e.value)
    assert f"schedule.pipeline is {pipeline}" in str(e.value)


# -- the long-context config ----------------------------------------------------------------------

LONG = CONFIGS / "k2-long.yaml"
SMALL_LONG = ["model.layers=4", "parallel.pp=2", "parallel.vpp=1", "parallel.ep=8", "parallel.dp=1",
              "parallel.microbatches=4", "schedule.pipeline=1f1b", "schedule.warmup_extra=0",
              "schedule.grad_offload=false"]
"""k2-long (K2's layer shape at 128K tokens) cut to 4 layers on 2 stages, so it plans in a fraction of
a second; the full config's figures are in the README (k3sched compare --seq-chunks)."""


def test_k2_long_is_k2_like_at_128k():
    long, like = load_config(LONG), load_config(CONFIGS / "k2-like.yaml")
    assert long.model.seq_len == 131072 and long.model.micro_batch_size == 1 and long.parallel.seq_chunks == 1
    ml, mk = long.model.model_dump(), like.model.model_dump()
    assert {k: v for k, v in ml.items() if k not in ("name", "seq_len")} == {
        k: v for k, v in mk.items() if k not in ("name", "seq_len")}
    assert long.hardware == like.hardware


@pytest.fixture(scope="module")
def long_plans():
    from k3sched.planner import plan

    out = {}
    for chunks in (1, 2, 4, 8):
        for split in (("even",) if chunks == 1 else ("even", "compute")):
            out[(chunks, split)] = plan(load_config(LONG, SMALL_LONG + [f"parallel.seq_chunks={chunks}",
                                                                      f"parallel.seq_split={split}"]))
    return out


def test_compute_split_has_the_smaller_largest_slice(long_plans):
    from k3sched.seqslice import slice_times_us

    for chunks in (2, 4, 8):
        even, comp = (slice_times_us(long_plans[(chunks, s)]) for s in ("even", "compute"))
        assert max(comp) < 0.95 * max(even), (chunks, even, comp)
        assert even == sorted(even)  # even slices: later ones attend to more keys


def test_peak_device_memory_falls_as_slices_grow(long_plans):
    for split in ("even", "compute"):
        peaks = [long_plans[(1, "even") if n == 1 else (n, split)].metrics.peak_device_bytes for n in (1, 2, 4, 8)]
        for a, b in zip(peaks, peaks[1:]):
            assert all(y < x for x, y in zip(a, b)), (split, peaks)


def test_plan_prints_the_slices_line():
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", str(TINY), "--set", "parallel.seq_chunks=4",
                        "--set", "parallel.seq_split=compute"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("slices:"))
    b = slice_bounds(_cfg("parallel.seq_chunks=4", "parallel.seq_split=compute"))
    assert line.startswith("slices: S=4 compute: tokens " + "/".join(str(e - s) for s, e in b) + "; time per slice")
    assert "; largest " in line


def test_compare_seq_chunks_lists_every_variant():
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "compare", str(TINY), "--seq-chunks", "1,2,3",
                        "--seq-split", "even,compute"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    rows = [ln.split("│")[1:3] for ln in r.stdout.splitlines() if ln.count("│") >= 7]
    got = [(a.strip(), b.strip()) for a, b in rows]
    assert got == [("1", "-"), ("2", "even"), ("2", "compute"), ("3", "even"), ("3", "compute")], r.stdout
    assert "must divide model.seq_len" in r.stdout  # 3 does not divide 128 under even: that row says why


@pytest.mark.parametrize("args, expected", [
    (["--seq-chunks", "1,x"], "--seq-chunks: expected comma-separated integers >= 1"),
    (["--seq-chunks", "0"], "--seq-chunks: expected comma-separated integers >= 1"),
    (["--seq-chunks", "2", "--seq-split", "tokens"], "--seq-split: 'tokens' is not a split; allowed: even, compute"),
    (["--seq-split", "even"], "--seq-split: only with --seq-chunks"),
])
def test_compare_bad_seq_options_are_one_line(args, expected):
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "compare", str(TINY), *args], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], lines


def test_exact_free_order_refuses_sliced_plans_in_one_line():
    r = subprocess.run([sys.executable, "-m", "k3sched.cli", "plan", str(TINY), "--set", "parallel.seq_chunks=2",
                        "--exact", "--exact-order", "free"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --exact: order free is not available for sliced plans "
                                             "(parallel.seq_chunks > 1): its model keys activation sets by (stage, "
                                             "micro-batch, layer); use --exact-order backbone"]


@pytest.mark.parametrize("where", ["local", "remote"])
def test_sliced_offload_graph_is_closed_and_topological(where):
    """Every offloaded slice set (local or to the next stage) has its copy, its way back and the
    dependency that keeps it until the next slice's attention has read its keys / values; every
    dependency exists and comes earlier in the creation order (the planner's topological order)."""
    from k3sched.graph import OffloadChoice, build_step, set_task_id
    from k3sched.tasks import Kind

    cfg = _cfg("parallel.seq_chunks=4", "parallel.seq_split=compute")
    sets = [k for k in build_step(cfg, OffloadChoice(everything=True)).offload_sets if k[0] == 0]
    choice = OffloadChoice(local=set(sets)) if where == "local" else OffloadChoice(remote={k: 1 for k in sets})
    g = build_step(cfg, choice)
    for tid, t in g.tasks.items():
        assert all(d in g.tasks and g.topo[d] < g.topo[tid] for d in t.deps), tid
    out, back = (Kind.ACT_OFFLOAD, Kind.ACT_ONLOAD) if where == "local" else (Kind.ACT_ROFFLOAD, Kind.ACT_RONLOAD)
    for key in sets:
        off = g.tasks[set_task_id(key, out)]
        assert set_task_id(key, back) in g.tasks and off.buffer == f"s0/mb{key[1]}q{key[3]}/L{key[2]}/act"
        nxt = set_task_id((*key[:3], key[3] + 1), Kind.ATTN_FWD)
        assert (nxt in off.deps) == (key[3] < 3), key

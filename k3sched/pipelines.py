"""The pipeline schedules, one table.

[Note: schedule registry]
Every pipeline schedule is one :class:`Pipeline` entry in :data:`TABLE`: its generator (in
k3sched/schedule_generators.py), the chunks per rank it places and how (loop or V), how many
model copies a rank holds, the config rules it needs (``parallel.vpp``, pipeline depth,
micro-batches), the bubble its source publishes, and, for a schedule the runtime does not
execute, why. Config validation (``schedule.pipeline`` and its rules), the planner's backbone and
stage placement, the memory bound, ``compare``, ``tune`` and ``k3sched run``'s refusal all derive
from the entry, so adding a schedule is one generator, one entry here and its tests
(docs/design.md, section 10). Formulas use the terms of docs/design.md (F, B,
W, I = B - W per (virtual) stage, p ranks, m micro-batches); tests/unit/k3sched/test_schedules.py checks each
against :func:`k3sched.schedules.simulate_uniform`.

This module needs only the generators and the schedule data model, so the config can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .schedule_generators import (gen_1f1b, gen_chimera, gen_dualpipe, gen_dualpipev, gen_gpipe, gen_interleaved,
                                  gen_pipedream_2bw, gen_v_half, gen_v_min, gen_zb_h1, gen_zb_h2, gen_zb_v)
from .schedule_ir import Schedule

Check = tuple[Callable[[int, int, int], bool], Callable[[str, int, int, int], str]]
"""(fails(pp, vpp, microbatches), message(name, pp, vpp, microbatches)): one config rule."""


def _vpp_at_least_2() -> Check:
    return (lambda pp, vpp, m: vpp < 2,
            lambda n, pp, vpp, m: f"schedule.pipeline: {n} needs parallel.vpp >= 2; got vpp {vpp}")


def _v_shape() -> Check:
    return (lambda pp, vpp, m: vpp != 2,
            lambda n, pp, vpp, m: f"parallel.vpp: {n} places 2 chunks per rank (V shape); set vpp 2, got {vpp}")


def _mb_multiple_of_pp() -> Check:
    return (lambda pp, vpp, m: m % pp != 0,
            lambda n, pp, vpp, m: f"parallel.microbatches: {n} needs a multiple of pp ({pp}); got {m}")


def _mb_at_least_2pp() -> Check:
    return (lambda pp, vpp, m: m < 2 * pp,
            lambda n, pp, vpp, m: f"parallel.microbatches: {n} needs at least 2*pp = {2 * pp}; got {m}")


@dataclass(frozen=True)
class Pipeline:
    """One schedule of :data:`TABLE` (see [Note: schedule registry])."""

    name: str
    generator: Callable[[int, int, int, int], Schedule]
    chunks: int
    """Model chunks per rank the generator places (its ``vpp``); 0: any ``parallel.vpp`` >= 2."""
    placement: str
    """``loop`` (Megatron's round robin) or ``v`` (a V: down then back up)."""
    formula: str
    source: str
    copies: int = 1
    """Model copies per rank: 2 for the bidirectional schedules (one stage of each copy per rank,
    ``parallel.vpp`` 1, [Note: dualpipe mapping])."""
    checks: tuple[Check, ...] = ()
    """Config rules, checked in order; the first that fails is the error."""
    planned_only: str | None = None
    """Why the runtime does not execute it (None: it runs)."""
    steps: int = 1
    """Training steps one plan spans: 2 for pipedream-2bw, whose second step's micro-batches are
    numbered M..2M-1 ([Note: pipedream-2bw] in k3sched/schedule_generators.py)."""

    @property
    def vpp(self) -> int:
        """The generator's chunks per rank (0: any >= 2); kept for the registry's readers."""
        return self.chunks

    @property
    def bidirectional(self) -> bool:
        return self.copies == 2

    @property
    def config_vpp(self) -> int | None:
        """The ``parallel.vpp`` a config needs; None: any >= 2."""
        return 1 if self.copies == 2 else (self.chunks or None)

    def config_error(self, pp: int, vpp: int, microbatches: int) -> str | None:
        """The first config rule ``(pp, vpp, microbatches)`` breaks, as one line; None if none."""
        for fails, message in self.checks:
            if fails(pp, vpp, microbatches):
                return message(self.name, pp, vpp, microbatches)
        return None


TABLE: dict[str, Pipeline] = {p.name: p for p in (
    Pipeline("gpipe", gen_gpipe, 1, "loop", "bubble ratio (p-1)/(m+p-1); m micro-batches in flight",
             "Huang et al., GPipe, NeurIPS 2019"),
    Pipeline("1f1b", gen_1f1b, 1, "loop", "idle (p-1)(F+B); at most p micro-batches in flight",
             "Narayanan et al., PipeDream-Flush / Megatron-LM, SC 2021"),
    Pipeline("interleaved-1f1b", gen_interleaved, 0, "loop", "idle (p-1)(F+B) per chunk, 1/vpp of 1F1B's",
             "Narayanan et al., Megatron-LM interleaved schedule, SC 2021",
             checks=(_vpp_at_least_2(), _mb_multiple_of_pp())),
    Pipeline("zb-h1", gen_zb_h1, 1, "loop", "idle (p-1)(F+B-2W) at 1F1B's memory",
             "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024"),
    Pipeline("zb-h2", gen_zb_h2, 1, "loop", "idle <= (p-1)F (fill skew only) at 2p-1 micro-batches",
             "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024"),
    Pipeline("zb-v", gen_zb_v, 2, "v", "idle <= (p-1)max(F, I) at 1F1B's memory",
             "Qi et al., Zero Bubble Pipeline Parallelism (V schedule), 2024", checks=(_v_shape(),)),
    Pipeline("dualpipev", gen_dualpipev, 2, "v", "idle (p-1)(F&B+B-3W), F&B = F+B here",
             "DeepSeek DualPipe README (DualPipeV, the cut-in-half DualPipe)",
             checks=(_v_shape(), _mb_at_least_2pp())),
    Pipeline("dualpipe", gen_dualpipe, 2, "v", "idle (p/2-1)(F&B+B-3W); two parameter copies",
             "DeepSeek-V3 technical report, 2024; DualPipe README", copies=2,
             checks=((lambda pp, vpp, m: bool(pp % 2 or m < 2 * pp),
                      lambda n, pp, vpp, m: f"schedule.pipeline: {n} needs an even pp and microbatches >= 2*pp; "
                                            f"got pp {pp}, microbatches {m}"),)),
    Pipeline("v-half", gen_v_half, 2, "v", "bubble ratio ~ p/(2m) (F = B = W); peak activations (p+2)//2 "
             "micro-batches, about 1/2 of 1F1B's p", "Qi et al., Pipeline Parallelism with Controllable "
             "Memory, NeurIPS 2024 (arXiv 2405.15362); the authors' table", checks=(_v_shape(),)),
    Pipeline("v-min", gen_v_min, 2, "v", "bubble ratio ~ 2p/(3m) (F = B = W); peak activations (p+4)//3 "
             "micro-batches, about 1/3 of 1F1B's p", "Qi et al., Pipeline Parallelism with Controllable "
             "Memory, NeurIPS 2024 (arXiv 2405.15362); the authors' table", checks=(_v_shape(),)),
    Pipeline("chimera", gen_chimera, 2, "v", "bubble ratio (D-2)/(2N+D-2) with F = B, D = p stages, N = m "
             "micro-batches; two parameter copies", "Li & Hoefler, Chimera: Efficiently Training "
             "Large-Scale Neural Networks with Bidirectional Pipelines, SC 2021, Table 2", copies=2,
             checks=((lambda pp, vpp, m: bool(pp % 2 or m % 2),
                      lambda n, pp, vpp, m: f"schedule.pipeline: {n} needs an even pp and an even number of "
                                            f"microbatches; got pp {pp}, microbatches {m}"),)),
    Pipeline("pipedream-2bw", gen_pipedream_2bw, 1, "loop", "no flush: steady-state idle 0; a plan of two steps "
             "idles (p-1)(F+B), bubble ratio (p-1)/(2m+p-1), half of two 1F1B steps'; two weight versions",
             "Narayanan et al., Memory-Efficient Pipeline-Parallel DNN Training (PipeDream-2BW), ICML 2021",
             checks=((lambda pp, vpp, m: m < pp,
                      lambda n, pp, vpp, m: f"parallel.microbatches: {n} needs at least pp = {pp} micro-batches "
                                            f"per step (two weight versions suffice only then); got {m}"),),
             steps=2),
)}
PIPELINES: tuple[str, ...] = tuple(TABLE)

"""The schedule data model: actions, pairs, placements, per-rank orders, torch CSV.

Validation, uniform-cost simulation, the registry and ``generate`` are in
:mod:`k3sched.schedules` (which re-exports everything here); the generators in
:mod:`k3sched.schedule_generators`.

[Note: schedule data model]
A schedule is ``ranks: dict[pp_rank, list[slot]]``: the order in which each PP rank runs its
compute. A slot is

- an :class:`Action` ``(vstage, op, mb)`` rendered torch-pipelining style: ``0F0`` (forward of
  global virtual stage 0, micro-batch 0), ``3I1`` (backward for inputs, dX), ``2W0`` (backward for
  weights, dW), ``1B0`` (full backward: I then W fused);
- a :class:`Pair` of a forward and a backward of two micro-batches run overlapped (DualPipe's
  "F&B" chunk, where one's EP all-to-all hides under the other's compute). It is rendered exactly
  as torch 2.13 renders its ``OVERLAP_F_B`` action: ``(0F1;5B0)OVERLAP_F_B`` (sub-actions in
  parentheses, ``;``-separated, forward first);
- ``None``: an idle slot (an empty CSV cell). Generators emit compact orders without idle slots;
  the simulator, not the slot index, decides when each action runs.

Virtual stages are global indices ``0 .. pp*vpp-1`` in model order; a :class:`Placement` maps
each to ``(pp rank, local chunk)``: ``loop`` (interleaved, vstage = chunk*pp + rank) or ``v``
(chunk 0 vstage = rank, chunk 1 vstage = 2*pp-1-rank; zig-zag for more chunks).

[Note: torch CSV format]
``Schedule.to_torch_csv`` writes what ``torch.distributed.pipelining``'s
``_PipelineSchedule._dump_csv`` writes (``csv.writer`` default dialect, so ``\\r\\n`` line ends):
one row per PP rank in rank order, one cell per slot, a cell being ``str(_Action)`` -- ``0F0``,
``(0F1;5B0)OVERLAP_F_B`` -- or empty for an idle slot. Stage indices are global (virtual) stage
indices. Torch's ``_load_csv(format="compute_only")`` reads it back with ``_Action.from_str``
per cell and infers the stage -> rank mapping from which row a stage appears in.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from typing import Iterable, Literal, Union

OPS = ("F", "I", "W", "B")
BWD_OPS = ("I", "B")
_ACTION_RE = re.compile(r"^(\d+)([FIWB])(\d+)$")
_PAIR_RE = re.compile(r"^\((\d+F\d+);(\d+[IB]\d+)\)OVERLAP_F_B$")
PAIR_TAG = "OVERLAP_F_B"


# ----------------------------------------------------------------------------------------------
# slots


@dataclass(frozen=True, order=True)
class Action:
    """One compute action: ``op`` of global virtual stage ``vstage`` on micro-batch ``mb``."""

    vstage: int
    op: str
    mb: int

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Action op must be one of {OPS}; got {self.op!r}")
        if self.vstage < 0 or self.mb < 0:
            raise ValueError(f"Action vstage and mb must be >= 0; got {self.vstage}, {self.mb}")

    def __str__(self) -> str:
        return f"{self.vstage}{self.op}{self.mb}"

    @staticmethod
    def parse(text: str) -> "Action":
        """Inverse of ``str``: ``Action.parse("3I1") == Action(3, "I", 1)``."""
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (expected STAGE OP MB with OP in F, I, W, B, e.g. '3I1')")
        return Action(int(m[1]), m[2], int(m[3]))


@dataclass(frozen=True)
class Pair:
    """A forward of one micro-batch overlapped with a backward (``B`` or ``I``) of another."""

    fwd: Action
    bwd: Action

    def __post_init__(self) -> None:
        if self.fwd.op != "F" or self.bwd.op not in BWD_OPS:
            raise ValueError(f"Pair needs a forward and a backward (B or I); got {self.fwd}, {self.bwd}")

    def __str__(self) -> str:
        return f"({self.fwd};{self.bwd}){PAIR_TAG}"

    @property
    def parts(self) -> tuple[Action, Action]:
        return (self.fwd, self.bwd)

    @staticmethod
    def parse(text: str) -> "Pair":
        m = _PAIR_RE.match(text.strip())
        if not m:
            raise ValueError(f"not an overlapped pair: {text!r} (expected e.g. '(0F1;5B0){PAIR_TAG}')")
        return Pair(Action.parse(m[1]), Action.parse(m[2]))


Slot = Union[Action, Pair, None]


def parse_slot(text: str) -> Slot:
    """Parse one CSV cell: empty -> None, ``(aF m;bB n)OVERLAP_F_B`` -> Pair, else Action."""
    text = text.strip()
    if not text:
        return None
    if text.startswith("("):
        return Pair.parse(text)
    return Action.parse(text)


def slot_actions(slot: Slot) -> tuple[Action, ...]:
    if slot is None:
        return ()
    if isinstance(slot, Pair):
        return slot.parts
    return (slot,)


# ----------------------------------------------------------------------------------------------
# placement


@dataclass(frozen=True)
class Placement:
    """Maps global virtual stages to (pp rank, local chunk).

    ``loop``: vstage = chunk*pp + rank (Megatron interleaved). ``v``: even chunks run down the
    ranks, odd chunks back up (chunk 0 vstage = rank, chunk 1 vstage = 2*pp-1-rank).
    """

    style: Literal["loop", "v"]
    pp: int
    vpp: int

    def __post_init__(self) -> None:
        if self.style not in ("loop", "v"):
            raise ValueError(f"placement style must be 'loop' or 'v'; got {self.style!r}")
        if self.pp < 1 or self.vpp < 1:
            raise ValueError(f"placement needs pp >= 1 and vpp >= 1; got pp {self.pp}, vpp {self.vpp}")

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def vstage(self, rank: int, chunk: int) -> int:
        if not (0 <= rank < self.pp and 0 <= chunk < self.vpp):
            raise ValueError(f"rank {rank} / chunk {chunk} outside pp {self.pp} x vpp {self.vpp}")
        if self.style == "v" and chunk % 2:
            return chunk * self.pp + self.pp - 1 - rank
        return chunk * self.pp + rank

    def locate(self, vstage: int) -> tuple[int, int]:
        """vstage -> (rank, chunk)."""
        if not 0 <= vstage < self.num_stages:
            raise ValueError(f"vstage {vstage} outside 0..{self.num_stages - 1}")
        chunk, off = divmod(vstage, self.pp)
        if self.style == "v" and chunk % 2:
            return self.pp - 1 - off, chunk
        return off, chunk

    def rank_of(self, vstage: int) -> int:
        return self.locate(vstage)[0]

    def stages_of(self, rank: int) -> list[int]:
        return [self.vstage(rank, c) for c in range(self.vpp)]


def _as_placement(placement: "Placement | str", pp: int, vpp: int) -> Placement:
    if isinstance(placement, Placement):
        if (placement.pp, placement.vpp) != (pp, vpp):
            raise ValueError(f"placement is for pp {placement.pp} x vpp {placement.vpp}, schedule has {pp} x {vpp}")
        return placement
    return Placement(placement, pp, vpp)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# schedule


@dataclass
class Schedule:
    """Per-rank compute orders of one training step (see [Note: schedule data model])."""

    name: str
    pp: int
    vpp: int
    microbatches: int
    placement: Placement
    ranks: dict[int, list[Slot]] = field(default_factory=dict)
    bidirectional: bool = False
    """DualPipe: micro-batches split into a down and an up half (see [Note: dualpipe mapping])."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def route(self, mb: int) -> range:
        """The virtual stages micro-batch ``mb`` passes through, in forward order."""
        if not self.bidirectional:
            return range(self.num_stages)
        half = self.microbatches // 2
        return range(0, self.pp) if mb < half else range(self.pp, 2 * self.pp)

    def actions(self) -> Iterable[tuple[int, int, Action]]:
        """(rank, step, action) for every action, pairs expanded."""
        for r in sorted(self.ranks):
            for i, slot in enumerate(self.ranks[r]):
                for a in slot_actions(slot):
                    yield r, i, a

    # -- torch CSV ------------------------------------------------------------------------------

    def to_torch_csv(self) -> str:
        """The CSV torch's ``_dump_csv`` writes (see [Note: torch CSV format])."""
        buf = io.StringIO()
        writer = csv.writer(buf)
        for r in range(self.pp):
            writer.writerow(["" if s is None else str(s) for s in self.ranks.get(r, [])])
        return buf.getvalue()

    @staticmethod
    def from_torch_csv(text: str, pp: int, vpp: int, microbatches: int, *,
                       placement: "Placement | str" = "loop", name: str = "csv",
                       bidirectional: bool = False) -> "Schedule":
        """Parse a torch compute-only CSV (one row per rank). Raises ValueError naming the cell."""
        rows = list(csv.reader(io.StringIO(text)))
        if len(rows) != pp:
            raise ValueError(f"torch CSV has {len(rows)} rows; expected one per PP rank ({pp})")
        ranks: dict[int, list[Slot]] = {}
        for r, row in enumerate(rows):
            slots: list[Slot] = []
            for i, cell in enumerate(row):
                try:
                    slots.append(parse_slot(cell))
                except ValueError as e:
                    raise ValueError(f"torch CSV row {r} (rank {r}), cell {i}: {e}") from None
            ranks[r] = slots
        return Schedule(name, pp, vpp, microbatches, _as_placement(placement, pp, vpp), ranks,
                        bidirectional=bidirectional)

    # -- text -------------------------------------------------------------------------------------

    def render_grid(self, error: tuple[int, int] | None = None) -> str:
        """Steps (rows) x ranks (columns), torch ``_format_pipeline_order`` style. ``error`` =
        (rank, step) marks that row with ``<-- ERROR HERE`` and the cell with ``*``."""
        n = max((len(v) for v in self.ranks.values()), default=0)
        width = len(str(max(n - 1, 0)))
        cols = []
        for r in range(self.pp):
            slots = self.ranks.get(r, [])
            cells = ["" if i >= len(slots) or slots[i] is None else str(slots[i]) for i in range(n)]
            if error is not None and error[0] == r and error[1] < n:
                cells[error[1]] = "*" + cells[error[1]]
            cols.append(cells)
        widths = [max([len(f"Rank {r}")] + [len(c) for c in cols[r]]) for r in range(self.pp)]
        pad = " " * (len("Step ") + width + 2)
        lines = [pad + " ".join(f"{'Rank ' + str(r):<{widths[r]}}" for r in range(self.pp)).rstrip()]
        for i in range(n):
            row = f"Step {i:0{width}d}: " + " ".join(f"{cols[r][i]:<{widths[r]}}" for r in range(self.pp))
            if error is not None and error[1] == i:
                row = row.rstrip() + f"  <-- ERROR HERE (rank {error[0]})"
            lines.append(row.rstrip())
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# dependencies (shared by validate and simulate_uniform)


def deps_of(schedule: Schedule, a: Action) -> list[Action]:
    """Actions that ``a`` needs (any op of the backward that exists is accepted by the caller)."""
    route = schedule.route(a.mb)
    if a.op == "F":
        return [] if a.vstage == route[0] else [Action(a.vstage - 1, "F", a.mb)]
    if a.op == "W":
        return [Action(a.vstage, "I", a.mb)]
    # I or B: own forward, and the backward of the next vstage (unless this is the last one)
    out = [Action(a.vstage, "F", a.mb)]
    if a.vstage != route[-1]:
        out.append(Action(a.vstage + 1, "B", a.mb))  # resolved to I or B by resolve_dep
    return out


def resolve_dep(index: dict[Action, tuple[int, int]], d: Action) -> Action | None:
    if d in index:
        return d
    if d.op == "B":
        alt = Action(d.vstage, "I", d.mb)
        if alt in index:
            return alt
    return None

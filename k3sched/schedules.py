"""Pipeline schedules as plain data: generate, validate, simulate, import/export torch CSV.

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

[Note: dualpipe mapping]
DualPipe (bidirectional) holds two copies of the model's ``pp`` stages, placed so that rank r
holds model stage r of the "down" copy and model stage pp-1-r of the "up" copy. We express the
copies as ``2*pp`` virtual stages with the V placement: vstage v < pp is the down copy of model
stage v (on rank v), vstage pp + k the up copy of model stage k (on rank pp-1-k), so rank r
holds vstages r and 2*pp-1-r like DualPipeV. Micro-batches ``0 .. M/2-1`` go down (vstages
``0..pp-1``) and ``M/2 .. M-1`` go up (vstages ``pp..2pp-1``): each micro-batch visits only the
``pp`` vstages of its route (``Schedule.route(mb)``). Parameters (and their gradients) are 2x;
torch's loader cannot load it (it expects every stage to see every micro-batch). Chimera
(``chimera``) uses the same mapping with its own order and full backwards.

[Note: controllable-memory V schedules]
V-Half and V-Min (Qi et al., NeurIPS 2024) repeat one *building block* per micro-batch on the V
placement: rank r runs F of chunk 0, F of chunk 1, I of chunk 1, I of chunk 0 at fixed offsets
(``_v_block_offsets``), the block repeating every 6 units of F = I = W. The block's *lifespan*
(F of chunk 0 to the W after I of chunk 0, about 4p units for V-Min and 6p for V-Half, against
12p for ZB-V / 1F1B) divided by the 6-unit interval is how many blocks overlap, hence the peak:
(p+4)//3 micro-batches of a rank's activations for V-Min, (p+2)//2 for V-Half, against 1F1B's p.
"""


from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Literal, Union

from .simulator import DeadlockError, simulate
from .tasks import Kind, Task

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


def _deps(schedule: Schedule, a: Action) -> list[Action]:
    """Actions that ``a`` needs (any op of the backward that exists is accepted by the caller)."""
    route = schedule.route(a.mb)
    if a.op == "F":
        return [] if a.vstage == route[0] else [Action(a.vstage - 1, "F", a.mb)]
    if a.op == "W":
        return [Action(a.vstage, "I", a.mb)]
    # I or B: own forward, and the backward of the next vstage (unless this is the last one)
    out = [Action(a.vstage, "F", a.mb)]
    if a.vstage != route[-1]:
        out.append(Action(a.vstage + 1, "B", a.mb))  # resolved to I or B by _resolve
    return out


def _resolve(index: dict[Action, tuple[int, int]], d: Action) -> Action | None:
    if d in index:
        return d
    if d.op == "B":
        alt = Action(d.vstage, "I", d.mb)
        if alt in index:
            return alt
    return None


# ----------------------------------------------------------------------------------------------
# validation


@dataclass
class _Err:
    msg: str
    rank: int
    step: int

    def __str__(self) -> str:
        return f"rank {self.rank}, step {self.step}: {self.msg}"


def _validate(s: Schedule) -> list[_Err]:
    errs: list[_Err] = []
    if set(s.ranks) != set(range(s.pp)):
        errs.append(_Err(f"ranks are {sorted(s.ranks)}; expected 0..{s.pp - 1}", 0, 0))
        return errs
    index: dict[Action, tuple[int, int]] = {}
    home: dict[int, tuple[int, int]] = {}  # vstage -> first (rank, step) it was seen on
    for r in range(s.pp):
        done: set[Action] = set()
        for i, slot in enumerate(s.ranks[r]):
            if slot is not None and not isinstance(slot, (Action, Pair)):
                errs.append(_Err(f"slot {slot!r} is not an Action, Pair or None", r, i))
                continue
            for a in slot_actions(slot):
                if not 0 <= a.vstage < s.num_stages:
                    errs.append(_Err(f"{a}: vstage outside 0..{s.num_stages - 1}", r, i))
                    continue
                if a.mb >= s.microbatches:
                    errs.append(_Err(f"{a}: micro-batch outside 0..{s.microbatches - 1}", r, i))
                    continue
                if a.vstage not in s.route(a.mb):
                    errs.append(_Err(f"{a}: micro-batch {a.mb} does not pass vstage {a.vstage}", r, i))
                    continue
                want = s.placement.rank_of(a.vstage)
                if a.vstage in home and home[a.vstage][0] != r:
                    hr, hi = home[a.vstage]
                    errs.append(_Err(f"{a}: vstage {a.vstage} is on two ranks ({hr} at step {hi} and {r})", r, i))
                else:
                    home.setdefault(a.vstage, (r, i))
                    if want != r:
                        errs.append(_Err(f"{a}: vstage {a.vstage} belongs to rank {want} by the "
                                         f"{s.placement.style} placement", r, i))
                if a in index:
                    errs.append(_Err(f"{a} appears twice (first at rank {index[a][0]}, step {index[a][1]})", r, i))
                    continue
                f, ii = Action(a.vstage, "F", a.mb), Action(a.vstage, "I", a.mb)
                b = Action(a.vstage, "B", a.mb)
                if a.op in BWD_OPS and f not in done:
                    errs.append(_Err(f"{a} before its forward {f}", r, i))
                if a.op == "W" and ii not in done:
                    errs.append(_Err(f"{a} before its input backward {ii}", r, i))
                if (a.op == "I" and b in index) or (a.op == "B" and ii in index):
                    errs.append(_Err(f"{a}: micro-batch has both a full backward B and a split I", r, i))
                if a.op == "W" and b in index:
                    errs.append(_Err(f"{a}: micro-batch already has a full backward {b}", r, i))
                index[a] = (r, i)
            done.update(slot_actions(slot))
    # completeness: every (vstage, mb) on its route has one F and one backward
    for mb in range(s.microbatches):
        for v in s.route(mb):
            r = s.placement.rank_of(v)
            end = (r, len(s.ranks[r]))
            f, ii, w, b = (Action(v, op, mb) for op in "FIWB")
            if f not in index:
                errs.append(_Err(f"missing forward {f}", *end))
            if b not in index and ii not in index:
                errs.append(_Err(f"missing backward {b} (or {ii} and {w})", *end))
            if ii in index and w not in index:
                errs.append(_Err(f"missing weight backward {w} after {ii}", *end))
    if errs:
        return errs
    # deadlock: evaluate the dependency + per-rank order graph on unit-duration tasks
    try:
        _simulate(s, 1.0, 2.0, 1.0, 0.0, with_deps_on_same_rank=True)
    except DeadlockError:
        r, i, a, need = _stuck_head(s, index)
        errs.append(_Err(f"deadlock: {a} waits for {need}, which waits (directly or not) for this rank", r, i))
    return errs


def _stuck_head(s: Schedule, index: dict[Action, tuple[int, int]]) -> tuple[int, int, Action, Action]:
    """Run ranks in order until none can progress; return the first blocked head slot."""
    pos = {r: 0 for r in range(s.pp)}
    done: set[Action] = set()

    def blocker(slot: Slot) -> tuple[Action, Action] | None:
        for a in slot_actions(slot):
            for d in _deps(s, a):
                rd = _resolve(index, d)
                if rd is not None and rd not in done and rd not in slot_actions(slot):
                    return a, rd
        return None

    progress = True
    while progress:
        progress = False
        for r in range(s.pp):
            while pos[r] < len(s.ranks[r]) and blocker(s.ranks[r][pos[r]]) is None:
                done.update(slot_actions(s.ranks[r][pos[r]]))
                pos[r] += 1
                progress = True
    for r in range(s.pp):
        if pos[r] < len(s.ranks[r]):
            a, need = blocker(s.ranks[r][pos[r]])  # type: ignore[misc]
            return r, pos[r], a, need
    raise AssertionError("simulate reported a deadlock the progress sweep does not see")


def validate(schedule: Schedule) -> list[str]:
    """All problems of ``schedule`` as ``"rank R, step S: ..."`` strings; empty when valid."""
    return [str(e) for e in _validate(schedule)]


def check(schedule: Schedule) -> Schedule:
    """Raise ValueError (first problem, the count, and the grid with the failing slot marked
    ``<-- ERROR HERE``) unless ``schedule`` is valid; returns it otherwise."""
    errs = _validate(schedule)
    if errs:
        e = errs[0]
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise ValueError(f"schedule {schedule.name!r} (pp {schedule.pp}, vpp {schedule.vpp}, "
                         f"microbatches {schedule.microbatches}) is invalid: {e}{more}\n\n"
                         f"{schedule.render_grid(error=(e.rank, e.step))}")
    return schedule


# ----------------------------------------------------------------------------------------------
# uniform-cost simulation


@dataclass
class UniformResult:
    """Times in the unit of F/B/W. ``bubble[r]`` = idle compute time of rank r / step time."""

    step_time: float
    busy: dict[int, float]
    idle: dict[int, float]
    bubble: dict[int, float]
    peak_inflight: dict[int, int]
    """Peak count of (vstage, mb) activation sets held on the rank (F start .. W or B end)."""
    starts: dict[tuple[int, int], float]
    """(rank, step) -> start time of that slot."""

    @property
    def max_idle(self) -> float:
        return max(self.idle.values())

    @property
    def peak_activations(self) -> dict[int, float]:
        """peak_inflight in units of one micro-batch through all of a rank's layers (/vpp)."""
        return {r: n / self._vpp for r, n in self.peak_inflight.items()}

    _vpp: int = 1


def _simulate(s: Schedule, F: float, B: float, W: float, comm: float,
              with_deps_on_same_rank: bool = False) -> tuple[float, dict[str, Task], dict[tuple[int, int], str]]:
    I = B - W
    dur = {"F": F, "I": I, "W": W, "B": B}
    index: dict[Action, tuple[int, int]] = {}
    for r, i, a in s.actions():
        index[a] = (r, i)
    tid = {(r, i): f"r{r}/{i}/{s.ranks[r][i]}" for r in s.ranks for i in range(len(s.ranks[r]))}
    tasks: dict[str, Task] = {}
    orders: dict[tuple[int, str], list[str]] = {}
    for r in range(s.pp):
        order = []
        for i, slot in enumerate(s.ranks[r]):
            if slot is None:
                continue
            deps: list[str] = []
            for a in slot_actions(slot):
                for d in _deps(s, a):
                    rd = _resolve(index, d)
                    if rd is None:
                        continue
                    dr, di = index[rd]
                    if (dr, di) == (r, i):
                        continue
                    if dr == r and not with_deps_on_same_rank:
                        continue
                    src = tid[(dr, di)]
                    if dr != r and comm > 0:
                        cid = f"p2p/{src}->{tid[(r, i)]}"
                        if cid not in tasks:
                            tasks[cid] = Task(cid, Kind.FWD_SEND, "collective", dr, 0, a.mb, None,
                                              duration_us=comm, deps=[src])
                            orders[(dr, cid)] = [cid]
                        src = cid
                    deps.append(src)
            parts = slot_actions(slot)
            tasks[tid[(r, i)]] = Task(tid[(r, i)], Kind.ATTN_FWD, "compute", r, 0, parts[0].mb, None,
                                      duration_us=sum(dur[a.op] for a in parts), deps=deps)
            order.append(tid[(r, i)])
        orders[(r, "compute")] = order
    step = simulate(tasks, orders)
    return step, tasks, tid


def simulate_uniform(schedule: Schedule, F: float = 1.0, B: float = 2.0, W: float | None = None,
                     comm: float = 0.0) -> UniformResult:
    """Step time, per-rank bubble and peak in-flight activations with uniform costs.

    ``B`` is the full backward; ``W`` its weight part (default ``B/2``), so I = B - W. A Pair
    lasts F + B (its backward's B or I). ``comm`` delays every cross-rank dependency.
    """
    if W is None:
        W = B / 2
    if not 0 <= W <= B:
        raise ValueError(f"need 0 <= W <= B; got W {W}, B {B}")
    step, tasks, tid = _simulate(schedule, F, B, W, comm)
    busy: dict[int, float] = defaultdict(float)
    events: dict[int, list[tuple[float, int]]] = defaultdict(list)
    starts: dict[tuple[int, int], float] = {}
    for r in range(schedule.pp):
        for i, slot in enumerate(schedule.ranks[r]):
            if slot is None:
                continue
            t = tasks[tid[(r, i)]]
            assert t.start_us is not None and t.end_us is not None
            starts[(r, i)] = t.start_us
            busy[r] += t.end_us - t.start_us
            for a in slot_actions(slot):
                if a.op == "F":
                    events[r].append((t.start_us, 1))
                elif a.op in ("W", "B"):
                    events[r].append((t.end_us, -1))
    peak: dict[int, int] = {}
    for r in range(schedule.pp):
        cur = best = 0
        for _, delta in sorted(events[r]):  # frees (-1) sort before allocs (+1) at equal times
            cur += delta
            best = max(best, cur)
        peak[r] = best
    idle = {r: step - busy[r] for r in range(schedule.pp)}
    bubble = {r: (idle[r] / step if step else 0.0) for r in range(schedule.pp)}
    return UniformResult(step, dict(busy), idle, bubble, peak, starts, _vpp=schedule.vpp)


# ----------------------------------------------------------------------------------------------
# generators


class _Rank:
    """Builds one rank's order with per-(vstage, op) micro-batch counters."""

    def __init__(self, limit: int) -> None:
        self.slots: list[Slot] = []
        self.next: dict[tuple[int, str], int] = defaultdict(int)
        self.wq: list[Action] = []  # pending weight backwards, oldest first
        self.limit = limit

    def take(self, v: int, op: str) -> Action:
        key = (v, "I" if op == "B" else op)
        a = Action(v, op, self.next[key])
        self.next[key] += 1
        if op == "I":
            self.wq.append(Action(v, "W", a.mb))
        return a

    def do(self, v: int, op: str) -> None:
        self.slots.append(self.take(v, op))

    def w(self) -> None:
        if self.wq:
            self.slots.append(self.wq.pop(0))

    def pair(self, fv: int, bv: int, bop: str = "B") -> None:
        self.slots.append(Pair(self.take(fv, "F"), self.take(bv, bop)))

    def trimmed(self) -> list[Slot]:
        """Drop actions of micro-batches >= limit (generators may over-generate then trim)."""
        out: list[Slot] = []
        for s in self.slots:
            if isinstance(s, Pair):
                keep = [a for a in s.parts if a.mb < self.limit]
                if len(keep) == 2:
                    out.append(s)
                elif keep:
                    out.append(keep[0])
            elif s is not None and s.mb < self.limit:
                out.append(s)
        return out


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _gpipe(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    _need(vpp == 1, f"gpipe places one stage per rank; needs vpp 1, got {vpp}")
    ranks = {r: [Action(r, "F", m) for m in range(M)] + [Action(r, "B", m) for m in range(M)] for r in range(pp)}
    return Schedule("gpipe", pp, 1, M, Placement("loop", pp, 1), ranks)


def _1f1b(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    _need(vpp == 1, f"1f1b places one stage per rank; needs vpp 1, got {vpp}")
    ranks = {}
    for r in range(pp):
        k, warm = _Rank(M), min(pp - 1 - r, M)
        for _ in range(warm):
            k.do(r, "F")
        for _ in range(M - warm):
            k.do(r, "F")
            k.do(r, "B")
        for _ in range(warm):
            k.do(r, "B")
        ranks[r] = k.slots
    return Schedule("1f1b", pp, 1, M, Placement("loop", pp, 1), ranks)


def _interleaved(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """Megatron's interleaved 1F1B: micro-batches in groups of pp, chunk by chunk; warm-up of
    (pp-1-r)*2 + (vpp-1)*pp chunk-forwards, plus ``extra`` (Kimi K2's extra warm-up)."""
    _need(vpp >= 2, f"interleaved-1f1b needs vpp >= 2; got {vpp}")
    _need(M % pp == 0, f"interleaved-1f1b needs microbatches a multiple of pp ({pp}); got {M}")
    place = Placement("loop", pp, vpp)
    total = M * vpp

    def fwd(k: int) -> tuple[int, int]:  # k-th forward on a rank -> (chunk, mb)
        group, within = divmod(k, pp * vpp)
        return (within // pp), group * pp + within % pp

    ranks = {}
    for r in range(pp):
        warm = min(total, (pp - 1 - r) * 2 + (vpp - 1) * pp + extra)
        order: list[Slot] = []
        for k in range(warm):
            c, m = fwd(k)
            order.append(Action(place.vstage(r, c), "F", m))
        for k in range(total - warm):
            c, m = fwd(warm + k)
            order.append(Action(place.vstage(r, c), "F", m))
            c, m = fwd(k)
            order.append(Action(place.vstage(r, vpp - 1 - c), "B", m))
        for k in range(total - warm, total):
            c, m = fwd(k)
            order.append(Action(place.vstage(r, vpp - 1 - c), "B", m))
        ranks[r] = order
    return Schedule("interleaved-1f1b", pp, vpp, M, place, ranks)


def _zb_h1(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """ZB-H1: 1F1B's warm-up (pp-1-r forwards), then F I W with rank r keeping r W's pending,
    which fill its cool-down waits for I's from downstream; at most pp micro-batches in flight."""
    _need(vpp == 1, f"zb-h1 places one stage per rank; needs vpp 1, got {vpp}")
    ranks = {}
    for r in range(pp):
        k, warm = _Rank(M), min(pp - 1 - r, M)
        delay = min(r, M - warm)
        for _ in range(warm):
            k.do(r, "F")
        for i in range(M - warm):
            k.do(r, "F")
            k.do(r, "I")
            if i >= delay:
                k.w()
        for _ in range(warm):
            k.do(r, "I")
            k.w()
        while k.wq:
            k.w()
        ranks[r] = k.slots
    return Schedule("zb-h1", pp, 1, M, Placement("loop", pp, 1), ranks)


def _greedy_zb(pp: int, M: int, limit: list[int]) -> dict[int, list[Slot]]:
    """List-schedule F, I, W on pp ranks (vpp 1) with unit nominal durations: each free rank
    runs, in priority order, a ready I (critical path), a ready F while fewer than ``limit[r]``
    micro-batches hold activations (F .. W), else its oldest pending W; else it idles. The order
    is derived once with F = I = W = 1; simulate_uniform then times it under any costs."""
    done_at: dict[Action, int] = {}
    nf = [0] * pp
    ni = [0] * pp
    wq: list[list[int]] = [[] for _ in range(pp)]
    held = [0] * pp
    ranks: dict[int, list[Slot]] = {r: [] for r in range(pp)}
    t = 0
    remaining = 3 * M * pp
    while remaining:
        for r in range(pp):
            pick: Action | None = None
            if ni[r] < nf[r]:
                a = Action(r, "I", ni[r])
                need = Action(r + 1, "I", ni[r]) if r + 1 < pp else Action(r, "F", ni[r])
                if done_at.get(need, t + 1) <= t:
                    pick = a
            if pick is None and nf[r] < M and held[r] < limit[r]:
                if r == 0 or done_at.get(Action(r - 1, "F", nf[r]), t + 1) <= t:
                    pick = Action(r, "F", nf[r])
            if pick is None and wq[r]:
                pick = Action(r, "W", wq[r][0])
            if pick is None:
                continue
            if pick.op == "F":
                nf[r] += 1
                held[r] += 1
            elif pick.op == "I":
                ni[r] += 1
                wq[r].append(pick.mb)
            else:
                wq[r].pop(0)
                held[r] -= 1
            done_at[pick] = t + 1
            ranks[r].append(pick)
            remaining -= 1
        t += 1
    return ranks


def _zb_h2(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """ZB-H2: up to 2*pp-1 micro-batches in flight on every rank (about 2x 1F1B's pp): the
    extra warm-up forwards fill the wait for the first I, pending W's fill the cool-down."""
    _need(vpp == 1, f"zb-h2 places one stage per rank; needs vpp 1, got {vpp}")
    ranks = _greedy_zb(pp, M, [2 * pp - 1] * pp)
    return Schedule("zb-h2", pp, 1, M, Placement("loop", pp, 1), ranks)


def _zb_v(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """ZB-V (Qi et al., 2024, handcrafted V schedule): V placement, two chunks per rank.

    Rank r: 2(pp-r)-1 chunk-0 forwards; r x (F1, F0); (pp-r) x (F1, I1, W1); steady
    (F0, I0, W0, F1, I1, W1) while forwards remain; cool-down r x (I0, I1) and (pp-r) x (I0, W0);
    then the pending W's. Generated for max(M, 2pp-1) micro-batches, the extra ones dropped.
    """
    _need(vpp == 2, f"zb-v places two chunks per rank (V shape); needs vpp 2, got {vpp}")
    place = Placement("v", pp, 2)
    n = max(M, 2 * pp - 1)
    ranks = {}
    for r in range(pp):
        s0, s1 = place.stages_of(r)
        k = _Rank(M)
        cnt = {("F", 0): 0, ("F", 1): 0}

        def f(c: int) -> None:
            k.do((s0, s1)[c], "F")
            cnt[("F", c)] += 1

        def iw(c: int) -> None:
            v = (s0, s1)[c]
            a = k.take(v, "I")
            k.wq.remove(Action(v, "W", a.mb))
            k.slots += [a, Action(v, "W", a.mb)]

        for _ in range(2 * (pp - r) - 1):
            f(0)
        for _ in range(r):
            f(1)
            f(0)
        for _ in range(pp - r):
            f(1)
            iw(1)
        while cnt[("F", 1)] < cnt[("F", 0)] or cnt[("F", 0)] < n:
            if cnt[("F", 0)] < n:
                f(0)
            iw(0)
            f(1)
            iw(1)
        for _ in range(r):
            k.do(s0, "I")
            k.do(s1, "I")
        for _ in range(pp - r):
            k.do(s0, "I")
            k.slots.append(k.wq.pop(k.wq.index(min((w for w in k.wq if w.vstage == s0), key=lambda w: w.mb))))
        for v in (s1, s0):
            for w in sorted((w for w in k.wq if w.vstage == v), key=lambda w: w.mb):
                k.slots.append(w)
        k.wq.clear()
        ranks[r] = k.trimmed()
    return Schedule("zb-v", pp, 2, M, place, ranks)


def _dualpipev(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """DeepSeek DualPipeV (the "cut-in-half" DualPipe): V placement, two chunks per rank.

    Rank r, chunk 0 = vstage r, chunk 1 = vstage 2pp-1-r, in eight phases:
    1. 2(pp-1-r) x F0;  2. (r+1) x (F0, F1);  3. (pp-1-r) x (I1, W, F1);
    4. (M-2pp+r+1) x (F0&B1, F1&B0) -- on the last rank the first F0&B1 runs unpaired;
    5. (pp-1-r) x (B1, F1&B0);  6. (r+1) x (B1, B0), split into I's from the middle on;
    7. (pp-1-r) x (W, B0 or I0);  8. (r+1) x W.  W's run oldest first ("W" = the weight queue).
    """
    _need(vpp == 2, f"dualpipev places two chunks per rank (V shape); needs vpp 2, got {vpp}")
    _need(M >= 2 * pp, f"dualpipev needs microbatches >= 2*pp = {2 * pp}; got {M}")
    place = Placement("v", pp, 2)
    ranks = {}
    for r in range(pp):
        s0, s1 = place.stages_of(r)
        k = _Rank(M)
        for _ in range(2 * (pp - 1 - r)):
            k.do(s0, "F")
        for _ in range(r + 1):
            k.do(s0, "F")
            k.do(s1, "F")
        for _ in range(pp - 1 - r):
            k.do(s1, "I")
            k.w()
            k.do(s1, "F")
        for i in range(M - 2 * pp + r + 1):
            if i == 0 and r == pp - 1:
                k.do(s0, "F")
                k.do(s1, "B")
            else:
                k.pair(s0, s1)
            k.pair(s1, s0)
        for _ in range(pp - 1 - r):
            k.do(s1, "B")
            k.pair(s1, s0)
        split = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            k.do(s1, "I" if split else "B")
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            k.do(s0, "I" if split else "B")
        for _ in range(pp - 1 - r):
            k.w()
            k.do(s0, "I" if split else "B")
        while k.wq:
            k.w()
        ranks[r] = k.slots
    return Schedule("dualpipev", pp, 2, M, place, ranks)


def _dualpipe(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """DeepSeek DualPipe (bidirectional): pp ranks (even), M micro-batches, M/2 fed from each end
    (see [Note: dualpipe mapping]). Rank R with half-rank h = min(R, pp-1-R) runs DualPipeV's
    rank-h order for pp/2 ranks and M/2 micro-batches: DualPipeV's chunk 0 is R's stage in the
    direction where R comes early (down for R < pp/2, up otherwise) and chunk 1 its stage in the
    other direction. Each micro-batch then meets the same neighbours in the same order as in
    DualPipeV, so the bubble is DualPipe's (PP/2-1)(F&B+B-3W) with PP = pp."""
    _need(vpp == 2, f"dualpipe holds two stages per rank (two copies); needs vpp 2, got {vpp}")
    _need(pp % 2 == 0, f"dualpipe needs an even pp; got {pp}")
    _need(M % 2 == 0 and M >= 2 * pp, f"dualpipe needs an even number of microbatches >= 2*pp = {2 * pp}; got {M}")
    half, hm = pp // 2, M // 2
    base = _dualpipev(half, 2, hm, 0)
    place = Placement("v", pp, 2)
    ranks: dict[int, list[Slot]] = {}
    for R in range(pp):
        h = min(R, pp - 1 - R)
        s0, _ = base.placement.stages_of(h)
        down, up = R, 2 * pp - 1 - R  # this rank's vstages: down copy, up copy
        early, late = ((down, 0), (up, hm)) if R < half else ((up, hm), (down, 0))

        def remap(a: Action) -> Action:
            v, off = early if a.vstage == s0 else late
            return Action(v, a.op, a.mb + off)

        out: list[Slot] = []
        for slot in base.ranks[h]:
            if isinstance(slot, Pair):
                out.append(Pair(remap(slot.fwd), remap(slot.bwd)))
            elif slot is not None:
                out.append(remap(slot))
        ranks[R] = out
    return Schedule("dualpipe", pp, 2, M, place, ranks, bidirectional=True)


def _v_block_offsets(kind: str, pp: int, r: int) -> tuple[int, int, int, int]:
    """Start times of rank ``r``'s (F chunk 0, F chunk 1, I chunk 1, I chunk 0) in the first
    building block of V-Half / V-Min (Qi et al., 2024, "Pipeline Parallelism with Controllable
    Memory", sec. 4), in units of one chunk's F = I = W; the block repeats every 6 units. The
    gap ``delta`` keeps each rank's four offsets distinct modulo 6."""
    if kind == "v-min":
        delta = 2 if pp % 3 == 0 else 0
        return r, 2 * pp - 1 - r, 2 * pp + delta + r, 4 * pp + delta - 1 - r
    delta = 3 if pp % 2 == 0 else 0
    return 2 * r, 3 * pp - 2 - r, 3 * pp + delta + 2 * r - 1, 6 * pp + delta - 2 - r


def _v_controllable(kind: str, pp: int, vpp: int, M: int) -> Schedule:
    """V-Half / V-Min ([Note: controllable-memory V schedules]): V placement, two chunks per rank.

    Rank r places micro-batch k's F0, F1, I1, I0 at its block offsets + 6k; each weight backward
    W (chunk 1's first, then chunk 0's, oldest first per chunk) takes the next free unit after its
    I. The per-rank order is those units sorted by time; the simulator then runs every action as
    soon as its inputs allow (the paper's "squeeze"; its extra reordering pass is not applied).
    """
    _need(vpp == 2, f"{kind} places two chunks per rank (V shape); needs vpp 2, got {vpp}")
    place = Placement("v", pp, 2)
    ranks: dict[int, list[Slot]] = {}
    for r in range(pp):
        s0, s1 = place.stages_of(r)
        f0, f1, i1, i0 = _v_block_offsets(kind, pp, r)
        at: dict[int, Action] = {}
        for k in range(M):
            for t, a in ((f0, Action(s0, "F", k)), (f1, Action(s1, "F", k)), (i1, Action(s1, "I", k)),
                         (i0, Action(s0, "I", k))):
                assert t + 6 * k not in at, (kind, pp, r, k)  # the offsets differ modulo 6
                at[t + 6 * k] = a
        end = max(at)
        wq: dict[int, list[Action]] = {s1: [], s0: []}
        order: list[Slot] = []
        t = 0
        while t <= end or wq[s1] or wq[s0]:
            a = at.get(t)
            if a is not None:
                order.append(a)
                if a.op == "I":
                    wq[a.vstage].append(Action(a.vstage, "W", a.mb))
            else:
                for v in (s1, s0):
                    if wq[v]:
                        order.append(wq[v].pop(0))
                        break
            t += 1
        ranks[r] = order
    return Schedule(kind, pp, 2, M, place, ranks)


def _v_half(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    return _v_controllable("v-half", pp, vpp, M)


def _v_min(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    return _v_controllable("v-min", pp, vpp, M)


def _v_one_direction(p: int, M: int) -> Schedule:
    """A one-direction V schedule with full backwards (B), p ranks, two chunks: list-scheduled on
    unit durations (F = B = 1), each free rank running its ready B of the oldest micro-batch, else
    its oldest ready F (the later chunk first on ties). The base of :func:`_chimera`."""
    place = Placement("v", p, 2)
    s = Schedule("v-1f1b", p, 2, M, place, {r: [] for r in range(p)})
    todo = {r: [Action(v, op, m) for v in place.stages_of(r) for m in range(M) for op in "FB"] for r in range(p)}
    done_at: dict[Action, int] = {}
    t = 0
    while any(todo.values()):
        picks: dict[int, Action] = {}
        for r in range(p):
            ready = [a for a in todo[r] if all(done_at.get(d, t + 1) <= t for d in _deps(s, a))]
            if ready:
                picks[r] = min(ready, key=lambda a: (a.op != "B", a.mb, -a.vstage))
        for r, a in picks.items():
            todo[r].remove(a)
            s.ranks[r].append(a)
            done_at[a] = t + 1
        t += 1
    return s


def _chimera(pp: int, vpp: int, M: int, extra: int) -> Schedule:
    """Chimera (Li & Hoefler, SC'21): two pipelines in opposite directions over the same pp ranks,
    on two model replicas, rank R holding stage R of the down replica and stage pp-1-R of the up
    one ([Note: dualpipe mapping]: the same 2*pp vstages; micro-batches 0..M/2-1 go down, the rest
    up). Full backwards (Chimera does not split dW). Built like :func:`_dualpipe`: rank R with
    h = min(R, pp-1-R) runs the rank-h order of a one-direction V schedule on pp/2 ranks with M/2
    micro-batches, its chunk 0 being R's stage in the direction where R comes early, so each
    micro-batch meets the same neighbours in the same order; with F = B that order leaves each
    rank pp-2 units idle, Chimera's published (D-2)/(2N+D-2) bubble ratio."""
    _need(vpp == 2, f"chimera holds two stages per rank (two replicas); needs vpp 2, got {vpp}")
    _need(pp % 2 == 0, f"chimera needs an even pp; got {pp}")
    _need(M % 2 == 0, f"chimera needs an even number of microbatches (half go down, half up); got {M}")
    half, hm = pp // 2, M // 2
    base = _v_one_direction(half, hm)
    place = Placement("v", pp, 2)
    ranks: dict[int, list[Slot]] = {}
    for R in range(pp):
        h = min(R, pp - 1 - R)
        s0, _ = base.placement.stages_of(h)
        down, up = R, 2 * pp - 1 - R
        early, late = ((down, 0), (up, hm)) if R < half else ((up, hm), (down, 0))
        out: list[Slot] = []
        for slot in base.ranks[h]:
            assert isinstance(slot, Action)
            v, off = early if slot.vstage == s0 else late
            out.append(Action(v, slot.op, slot.mb + off))
        ranks[R] = out
    return Schedule("chimera", pp, 2, M, place, ranks, bidirectional=True)


GENERATORS = {
    "gpipe": _gpipe,
    "1f1b": _1f1b,
    "interleaved-1f1b": _interleaved,
    "zb-h1": _zb_h1,
    "zb-h2": _zb_h2,
    "zb-v": _zb_v,
    "dualpipev": _dualpipev,
    "dualpipe": _dualpipe,
    "v-half": _v_half,
    "v-min": _v_min,
    "chimera": _chimera,
}


@dataclass(frozen=True)
class ScheduleInfo:
    """A registry entry: what the schedule is, the bubble its source publishes and where from.
    Formulas use the terms of docs/design.md (F, B, W, I = B - W per (virtual) stage, p ranks,
    m micro-batches); tests/test_schedules.py checks each against :func:`simulate_uniform`."""

    name: str
    vpp: int
    placement: str
    bidirectional: bool
    formula: str
    source: str


REGISTRY: dict[str, ScheduleInfo] = {i.name: i for i in (
    ScheduleInfo("gpipe", 1, "loop", False, "bubble ratio (p-1)/(m+p-1); m micro-batches in flight",
                 "Huang et al., GPipe, NeurIPS 2019"),
    ScheduleInfo("1f1b", 1, "loop", False, "idle (p-1)(F+B); at most p micro-batches in flight",
                 "Narayanan et al., PipeDream-Flush / Megatron-LM, SC 2021"),
    ScheduleInfo("interleaved-1f1b", 0, "loop", False, "idle (p-1)(F+B) per chunk, 1/vpp of 1F1B's",
                 "Narayanan et al., Megatron-LM interleaved schedule, SC 2021"),
    ScheduleInfo("zb-h1", 1, "loop", False, "idle (p-1)(F+B-2W) at 1F1B's memory",
                 "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024"),
    ScheduleInfo("zb-h2", 1, "loop", False, "idle <= (p-1)F (fill skew only) at 2p-1 micro-batches",
                 "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024"),
    ScheduleInfo("zb-v", 2, "v", False, "idle <= (p-1)max(F, I) at 1F1B's memory",
                 "Qi et al., Zero Bubble Pipeline Parallelism (V schedule), 2024"),
    ScheduleInfo("dualpipev", 2, "v", False, "idle (p-1)(F&B+B-3W), F&B = F+B here",
                 "DeepSeek DualPipe README (DualPipeV, the cut-in-half DualPipe)"),
    ScheduleInfo("dualpipe", 2, "v", True, "idle (p/2-1)(F&B+B-3W); two parameter copies",
                 "DeepSeek-V3 technical report, 2024; DualPipe README"),
    ScheduleInfo("v-half", 2, "v", False, "bubble ratio ~ p/(2m) (F = B = W); peak activations (p+2)//2 "
                 "micro-batches, about 1/2 of 1F1B's p", "Qi et al., Pipeline Parallelism with Controllable "
                 "Memory, NeurIPS 2024 (arXiv 2405.15362); the authors' table"),
    ScheduleInfo("v-min", 2, "v", False, "bubble ratio ~ 2p/(3m) (F = B = W); peak activations (p+4)//3 "
                 "micro-batches, about 1/3 of 1F1B's p", "Qi et al., Pipeline Parallelism with Controllable "
                 "Memory, NeurIPS 2024 (arXiv 2405.15362); the authors' table"),
    ScheduleInfo("chimera", 2, "v", True, "bubble ratio (D-2)/(2N+D-2) with F = B, D = p stages, N = m "
                 "micro-batches; two parameter copies", "Li & Hoefler, Chimera: Efficiently Training "
                 "Large-Scale Neural Networks with Bidirectional Pipelines, SC 2021, Table 2"),
)}


def generate(name: str, pp: int, vpp: int, microbatches: int, *, warmup_extra: int = 0) -> Schedule:
    """Generate the named schedule (one of ``GENERATORS``) and check it; ValueError with the
    reason when the name or the (pp, vpp, microbatches) combination is not supported.

    ``warmup_extra`` only applies to ``interleaved-1f1b`` (Kimi K2's extra warm-up
    micro-batches); other schedules reject a non-zero value.
    """
    gen = GENERATORS.get(name)
    if gen is None:
        raise ValueError(f"pipeline schedule {name!r} is not supported; supported: {', '.join(GENERATORS)}")
    _need(pp >= 1 and vpp >= 1 and microbatches >= 1,
          f"{name}: need pp, vpp, microbatches >= 1; got {pp}, {vpp}, {microbatches}")
    _need(warmup_extra >= 0, f"warmup_extra must be >= 0; got {warmup_extra}")
    _need(warmup_extra == 0 or name == "interleaved-1f1b",
          f"warmup_extra applies to interleaved-1f1b only; {name} got {warmup_extra}")
    return check(gen(pp, vpp, microbatches, warmup_extra))

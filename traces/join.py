"""Joining a recorded trace to its plan: the stage each rank ran, the replica-matched peer of a
rank on another stage, and the two ends of a transfer. Validation (traces/validate.py) and
calibration (traces/calibrate.py) both join this way, through these functions only.

[Note: trace join]
Task ids are the join key ([Note: task id grammar] in k3sched/tasks.py): a trace range whose name
is a planned task id is a measured instance of that task, on the rank that recorded it.

- **Stage of a rank**: the majority stage of the distinct planned tasks the rank recorded (the
  lowest stage on a tie). The ranks of a stage are kept in rank order.
- **Replica-matched peer**: rank r of stage a meets stage b on b's only rank; else, when a and b
  have as many ranks, on the rank at r's position among a's ranks (the same replica index);
  else on none (the pairing is unknown and the pair is not compared).
- **Transfer pairs**: a transfer between two stages has a sending and a receiving task
  (``SEND_OF``: receiving kind -> sending kind). A receive is posted early and waits for its send,
  so the receive's start says nothing about the data; its end is bounded by the send's start
  (validation) and its cost starts at the send's end (calibration). In a plan the receive depends
  on its send: :func:`send_of` finds that dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from k3sched.tasks import SEND_OF as TASK_SEND_OF

# receiving kind -> sending kind: one transfer between two stages ([Note: trace join]); the task
# model's one table of transfer pairs (k3sched.tasks.SEND_OF), by kind value
SEND_OF: dict[str, str] = {r.value: s.value for r, s in TASK_SEND_OF.items()}
TRANSFER_KINDS = frozenset(SEND_OF) | frozenset(SEND_OF.values())


def is_transfer(recv_kind: str, send_kind: str) -> bool:
    """``recv_kind`` receives what ``send_kind`` sends (the two ends of one transfer)."""
    return SEND_OF.get(recv_kind) == send_kind


def send_of(kind: str, deps: Iterable[str], kind_of: Callable[[str], str | None]) -> str | None:
    """The sending task of a receiving task of ``kind``: its dependency ``d`` with
    ``kind_of(d) == SEND_OF[kind]`` (the last such when there are several); None for a task that
    receives nothing, or whose send is not among its dependencies."""
    want = SEND_OF.get(kind)
    found = None
    if want is not None:
        for d in deps:
            if kind_of(d) == want:
                found = d
    return found


@dataclass(frozen=True)
class RankStages:
    """Which stage each traced rank ran, and the ranks of each stage ([Note: trace join])."""

    stage_of: dict[int, int]        # rank -> its stage (ranks in increasing order)
    ranks_of: dict[int, list[int]]  # stage -> its ranks in increasing order (planned stages: maybe empty)

    @classmethod
    def by_majority(cls, rank, stage, stages: Iterable[int] = ()) -> RankStages:
        """From one (rank, stage) row per distinct task a rank recorded. ``stages``: stages to
        list in ``ranks_of`` even when no rank ran them (the plan's)."""
        rank = np.asarray(rank, np.int64)
        stage = np.asarray(stage, np.int64)
        stage_of = {}
        for r in np.unique(rank).tolist():
            st, cnt = np.unique(stage[rank == r], return_counts=True)
            stage_of[r] = int(st[np.argmax(cnt)])
        ranks_of: dict[int, list[int]] = {int(s): [] for s in stages}
        for r, s in stage_of.items():
            ranks_of.setdefault(s, []).append(r)
        return cls(stage_of, ranks_of)

    def peer(self, r: int, other_stage: int) -> int | None:
        """The rank of ``other_stage`` that rank ``r`` exchanges with: the replica-matched peer."""
        mine = self.ranks_of.get(self.stage_of[r], [])
        theirs = self.ranks_of.get(other_stage, [])
        if len(theirs) == 1:
            return theirs[0]
        if len(theirs) == len(mine) and r in mine:
            return theirs[mine.index(r)]
        return None


def ranges_by_name(events) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The range events of an EventTable-like ``events`` (kind ``range``; every event when it has
    no ``kind`` column): their rows, their distinct names (sorted) and each row's index into those
    names. A range is joined to the plan by its name ([Note: trace join])."""
    kind = getattr(events, "kind", None)
    rng = np.asarray(kind) == "range" if kind is not None else np.ones(len(events.name), bool)
    if not rng.any():
        return np.empty(0, np.int64), np.array([]), np.array([], int)
    names, inv = np.unique(np.asarray(events.name)[rng].astype(str), return_inverse=True)
    return np.nonzero(rng)[0], names, inv

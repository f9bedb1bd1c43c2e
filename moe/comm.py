"""EP communication: count exchange and uneven all-to-all on the EP process group.

The EP group is passed explicitly to every call (``None`` = no EP: one rank holds all experts,
the all-to-alls are identities). Calls are synchronous; the executor runs them on its EP lane.
The order of these calls on a group must be the same on every rank of it (docs/design.md, rule 3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """World size of ``group`` (1 when None)."""
    return 1 if group is None else dist.get_world_size(group)


def all_to_all_rows(out: Tensor, x: Tensor, send_splits: list[int], recv_splits: list[int],
                group: ProcessGroup) -> None:
    """``all_to_all_single`` of dim-0 rows; on gloo as receives posted before sends.

    [Note: full-duplex all-to-all on gloo] gloo sends a message's bytes only once the peer has
    posted the matching receive, and its ``all_to_all`` posts each pair's send before its receive:
    the peer's "ready" note then queues behind this rank's whole payload in the pair's one TCP
    connection, so the two directions take turns, each at little more than half the link's rate;
    with the receives posted first both directions run at once, as on a full-duplex NIC. NCCL keeps
    its own all-to-all. The result is the same tensor either way (each row block is copied as is)."""
    if dist.get_backend(group) != "gloo":
        dist.all_to_all_single(out, x, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits),
                               group=group)
        return
    me, R = dist.get_rank(group), dist.get_world_size(group)
    outs, ins = out.split(list(recv_splits)), x.split(list(send_splits))
    works = [dist.irecv(outs[r], src=dist.get_global_rank(group, r), group=group)
             for r in range(R) if r != me and recv_splits[r]]
    works += [dist.isend(ins[r], dst=dist.get_global_rank(group, r), group=group)
              for r in range(R) if r != me and send_splits[r]]
    outs[me].copy_(ins[me])
    for w in works:
        w.wait()


def exchange_counts(counts_E: Tensor, group: ProcessGroup | None) -> Tensor:
    """Send each EP rank the token counts for its experts; return ``recv_counts_RL``.

    ``counts_E`` (int64, length E = R * L) counts this rank's routed slots per global expert.
    Row ``r`` of the result holds what rank ``r`` sends to each of this rank's L local experts.
    """
    R = group_size(group)
    if R == 1:
        return counts_E.view(1, -1).clone()
    out = torch.empty_like(counts_E)
    n = counts_E.numel() // R
    all_to_all_rows(out, counts_E.contiguous(), [n] * R, [n] * R, group)
    return out.view(R, -1)


def all_to_all_uneven(x: Tensor, send_splits: list[int], recv_splits: list[int],
                      group: ProcessGroup | None) -> Tensor:
    """``all_to_all_single`` of rows: ``send_splits[r]`` rows to rank r, ``recv_splits[r]`` from it."""
    if group_size(group) == 1:
        return x.detach().clone()
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    all_to_all_rows(out, x.detach().contiguous(), send_splits, recv_splits, group)
    return out

"""Cross-rank totals a training run writes into summary.json: the routing statistics of the MoE
layers (``routing``, read by ``k3sched balance``) and the race detector's counts (``racecheck``).
Every rank calls them at the end of the run (they all-reduce); :mod:`runtime.train` assembles the
summary."""

from __future__ import annotations


def routing_summary(cfg, runner, per_step: list[dict], steps: list[int], device) -> dict | None:
    """Every rank: tokens routed per expert and per slot (replica), per step and MoE layer, summed
    over the ranks (each rank counts the slots it routes), with each EP rank's load and the imbalance
    (max over mean per EP rank; ``imbalance_contiguous``: the same tokens on the contiguous placement,
    i.e. without replicas). summary.json ``routing``; None without MoE layers."""
    import torch
    import torch.distributed as dist

    from k3sched.balance import contiguous, imbalance

    m, pl = cfg.model, runner.placement
    moe_layers = [L for L in range(m.layers) if m.is_moe(L)]
    if not moe_layers:
        return None
    E, G = m.experts, pl.ep * pl.per_rank
    buf = torch.zeros(len(per_step), len(moe_layers), E + G, dtype=torch.float64)
    for i, counts in enumerate(per_step):
        for L, (per_e, per_g) in counts.items():
            buf[i, moe_layers.index(L)] = torch.tensor(per_e + per_g, dtype=torch.float64)
    if dist.is_initialized():
        buf = buf.to(device)
        dist.all_reduce(buf)
        buf = buf.cpu()
    tpe = [[[int(x) for x in row[:E]] for row in step] for step in buf.tolist()]
    tps = [[[int(x) for x in row[E:]] for row in step] for step in buf.tolist()]
    rank_tokens = [[[sum(row[r * pl.per_rank:(r + 1) * pl.per_rank]) for r in range(pl.ep)] for row in step]
                   for step in tps]
    flat = contiguous(E, pl.ep)
    imb = [[imbalance(rt) for rt in step] for step in rank_tokens]
    imb0 = [[imbalance(flat.rank_loads(row)) for row in step] for step in tpe]
    mean = lambda xs: sum(xs) / len(xs) if xs else 1.0  # noqa: E731
    return {"experts": E, "ep": pl.ep, "redundant": pl.redundant, "layers": moe_layers, "steps": steps,
            "slots": [list(r) for r in pl.slots], "tokens_per_expert": tpe, "tokens_per_slot": tps,
            "rank_tokens": rank_tokens, "imbalance": imb, "imbalance_mean": mean([x for s in imb for x in s]),
            "imbalance_contiguous": imb0, "imbalance_contiguous_mean": mean([x for s in imb0 for x in s])}


def race_totals(rc, rank: int, device) -> dict | None:
    """Every rank: the detector's counts over ranks and steps (summary.json ``racecheck``); rank 0
    prints the clean run's line."""
    if rc is None:
        return None
    import torch
    import torch.distributed as dist

    from runtime.racecheck import clean_line

    tt = rc.totals
    t = torch.tensor([tt.storages, tt.accesses, tt.cells, tt.cell_accesses], dtype=torch.float64)
    if dist.is_initialized():
        t = t.to(device)
        dist.all_reduce(t)
    storages, accesses, cells, cell_accesses = (int(x) for x in t.cpu().tolist())
    if rank == 0:
        print(clean_line(storages, accesses), flush=True)
    return {"storages": storages, "accesses": accesses, "cells": cells, "cell_accesses": cell_accesses, "races": 0}

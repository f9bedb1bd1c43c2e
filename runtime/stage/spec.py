"""Where a stage's layers, tokens and pipeline neighbours come from: the ``moe`` model arguments of
a config, :class:`StageSpec` (which chunks and layers a PP stage holds, the peer of a P2P task),
the stage's slice of the model and the synthetic token batches."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3sched.config import Config
from k3sched.graph import placement_for
from k3sched.layersplit import split_layers
from k3sched.pipelines import TABLE as PIPELINE_TABLE
from k3sched.tasks import Kind
from moe import MoEModel, MoEModelArgs, init_full_state

from ..executor import PlanTask


def model_args(cfg: Config) -> MoEModelArgs:
    """The ``moe`` model arguments of a config (dispatch recompute and element-wise recompute
    follow the schedule)."""
    m = cfg.model
    return MoEModelArgs.from_mapping({**m.model_dump(), "dense_hidden": m.ffn_dense_hidden,
                                      "dispatch_recompute": cfg.schedule.dispatch_recompute,
                                      "recompute": cfg.schedule.recompute})


@dataclass(frozen=True)
class StageSpec:
    """Which chunks (virtual stages) and layers a PP stage holds.

    With ``copies`` 2 (chimera, dualpipe: [Note: dualpipe mapping] in
    k3sched/schedule_generators.py) the ``num_vstages = 2 pp`` vstages are two copies of the model's
    ``pp`` stages: vstage ``v < pp`` is model stage v of the down copy, ``pp + k`` model stage k of
    the up copy (``vstage_layers`` repeats the split). Stage r holds model stages r and pp-1-r, whose
    layers differ, so one ``MoEModel`` holds both (and the embedding and head, when r is an end
    stage: the first stage of one copy is the last of the other)."""

    stage: int
    num_vstages: int
    chunk_vstage: dict[int, int]  # local chunk -> vstage
    vstage_rank: tuple[int, ...]  # vstage -> PP stage
    vstage_layers: tuple[tuple[int, ...], ...]
    copies: int = 1

    @classmethod
    def of(cls, cfg: Config, stage: int) -> StageSpec:
        pl = placement_for(cfg)
        nv = pl.num_stages
        located = [pl.locate(v) for v in range(nv)]
        layers = split_layers(cfg)  # the planner's split (a vstage may hold no layer, e.g. head only)
        copies = PIPELINE_TABLE[cfg.schedule.pipeline].copies
        if copies == 2:
            layers = layers + layers
        return cls(stage, nv, {c: v for v, (r, c) in enumerate(located) if r == stage},
                   tuple(r for r, _ in located), tuple(tuple(ls) for ls in layers), copies)

    @property
    def model_stages(self) -> int:
        """Stages of one model copy (``num_vstages`` with one copy)."""
        return self.num_vstages // self.copies

    def input_index(self, v: int) -> int:
        """Index in ``MicroBatch.acts`` / ``grads`` of vstage ``v``'s input (its layers' count before it;
        the up copy's vstage ``pp + k`` starts where model stage k does. ``v = pp`` is read as the up
        copy's first vstage: the down copy's last one ends in the head, whose output is no vstage's)."""
        n = self.model_stages
        if v == self.num_vstages:  # the end of the model
            v = n
        elif v >= n:  # the up copy's model stage v - n
            v -= n
        return sum(len(ls) for ls in self.vstage_layers[:v])

    @property
    def layers(self) -> list[int]:
        return sorted({L for v in self.chunk_vstage.values() for L in self.vstage_layers[v]})

    @property
    def has_embed(self) -> bool:
        """The stage runs the first vstage of a copy (0, or ``pp`` for the up copy)."""
        return bool({0, self.model_stages} & set(self.chunk_vstage.values())) if self.copies == 2 \
            else 0 in self.chunk_vstage.values()

    @property
    def has_head(self) -> bool:
        """The stage runs the last vstage of a copy (``num_vstages - 1``, or ``pp - 1`` for the down copy)."""
        last = {self.num_vstages - 1} | ({self.model_stages - 1} if self.copies == 2 else set())
        return bool(last & set(self.chunk_vstage.values()))

    def p2p_peer(self, t: PlanTask) -> tuple[int, list]:
        """(peer PP stage, pairing key) of a P2P task: the key names the transfer the same way on
        both sides: (direction, mb, from-vstage, to-vstage)."""
        v = self.chunk_vstage[t.chunk]
        if t.kind is Kind.FWD_SEND:
            src, dst, d = v, v + 1, "act"
        elif t.kind is Kind.FWD_RECV:
            src, dst, d = v - 1, v, "act"
        elif t.kind is Kind.BWD_SEND:
            src, dst, d = v, v - 1, "grad"
        else:
            src, dst, d = v + 1, v, "grad"
        peer = self.vstage_rank[dst] if t.kind in (Kind.FWD_SEND, Kind.BWD_SEND) else self.vstage_rank[src]
        return peer, [d, t.mb, src, dst]


def build_stage_model(args: MoEModelArgs, seed: int, spec: StageSpec, *, ep_rank: int, ep_size: int,
                      device: torch.device, slots: tuple[tuple[int, ...], ...] | None = None) -> MoEModel:
    """MoEModel holding only this stage's layers (others are empty placeholders), embedding and
    head only where the stage has them, and this EP rank's slice of experts. Weights come from
    ``init_full_state(args, seed)``: identical to the single-process model of the same seed."""
    with torch.device("meta"):
        model = MoEModel(args, ep_rank=ep_rank, ep_size=ep_size, slots=slots)
    keep = set(spec.layers)
    for i in range(args.layers):
        if i not in keep:
            model.layers[i] = nn.Module()
    if not spec.has_embed:
        del model.embed
    if not spec.has_head:
        del model.final_norm
        del model.head
    model.to_empty(device=device)
    state = init_full_state(args, seed)
    wanted = model.state_dict().keys()
    model.load_state_dict({k: model.shard_of(k, state[k]).to(device) for k in wanted}, strict=True)
    return model


def synthetic_batch(seed: int, step: int, replica: int, mb: int, batch: int, seq: int, vocab: int
                    ) -> tuple[Tensor, Tensor]:
    """Tokens and next-token targets ``[B, S]`` of one micro-batch of one data replica.

    A noisy affine walk over the vocabulary (learnable, so the loss falls), seeded by
    (seed, step, replica, mb): every rank of a replica builds the same tokens."""
    h = hashlib.sha256(f"k3sched/{seed}/{step}/{replica}/{mb}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**62 - 1))
    x = torch.empty(batch, seq + 1, dtype=torch.int64)
    x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    noise = torch.randint(0, 2, (batch, seq), generator=g)
    for i in range(seq):
        x[:, i + 1] = (x[:, i] * 5 + 3 + noise[:, i]) % vocab
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


"""Runtime benchmark (CPU, gloo, 2 ranks, EP 2, the tiny config with pp=1): measured in one run,

- step time of the k3 plan vs the serial plan, both executed by the five-lane runtime;
- step time of an equivalent model built on DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``,
  ep_size 2 over gloo, plain autograd, same shapes / micro-batches / AdamW), as a ratio;
- the executor's own overhead per task (a handler table of no-ops, the stage's real plan).

Usage: ``.venv/bin/python benchmarks/bench_runtime.py [--steps 6] [--out out/bench_runtime]``.
Step times are medians over the steps after the first. Takes a couple of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TINY = REPO / "configs" / "tiny-cpu.yaml"
EP2 = ["parallel.pp=1", "parallel.ep=2"]


def runtime_step_s(strategy: str, steps: int, out: Path) -> float:
    from runtime.launch import run_command

    rc = run_command(TINY, EP2, steps, None, out, False, strategy, timeout_s=600, quiet=True)
    if rc != 0:
        raise SystemExit(f"runtime run ({strategy}) failed with exit {rc}")
    times = json.loads((out / "summary.json").read_text())["step_time_s"]
    return statistics.median(times[1:] or times)


def deepspeed_step_s(steps: int, out: Path) -> float:
    from runtime.testbed import free_port

    cmd = [sys.executable, "-m", "runtime.launch", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(Path(__file__).resolve()), "--ds-worker", str(out),
           "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    p = subprocess.run(cmd, env=env, cwd=REPO, timeout=600, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"deepspeed run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    times = json.loads((out / "ds_summary.json").read_text())["step_time_s"]
    return statistics.median(times[1:] or times)


def ds_worker(out: Path, steps: int, overrides: list[str] | None = None) -> None:
    """One rank of the DeepSpeed-MoE model: same shapes as the tiny config (pp 1, ep 2; ``overrides``
    as ``--set`` takes them, on top of EP2)."""
    import logging
    from datetime import timedelta

    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE
    from torch import nn

    from k3sched.config import load_config
    from runtime.stage import synthetic_batch

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(TINY, EP2 + list(overrides or []))
    m = cfg.model
    D, H = m.hidden, m.heads
    torch.manual_seed(0)

    class SwiGLU(nn.Module):
        def __init__(self, d: int, f: int) -> None:
            super().__init__()
            self.w1, self.w3, self.w2 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self, moe: bool) -> None:
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
            self.wqkv, self.wo = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
            self.moe = moe
            if moe:
                self.shared = SwiGLU(D, m.shared_experts * m.expert_hidden)
                self.ffn = MoE(hidden_size=D, expert=SwiGLU(D, m.expert_hidden), num_experts=m.experts,
                               ep_size=world, k=m.top_k, capacity_factor=1.0, min_capacity=0, drop_tokens=False,
                               use_rts=False, noisy_gate_policy=None)
            else:
                self.ffn = SwiGLU(D, m.ffn_dense_hidden)

        def forward(self, x):
            B, S, _ = x.shape
            q, k, v = self.wqkv(self.n1(x)).view(B, S, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
            h = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, D))
            xn = self.n2(h)
            if not self.moe:
                return h + self.ffn(xn), 0.0
            y, aux, _ = self.ffn(xn)
            return h + y + self.shared(xn), aux

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(m.vocab, D)
            self.blocks = nn.ModuleList(Block(cfg.model.is_moe(i)) for i in range(m.layers))
            self.norm, self.head = nn.RMSNorm(D, eps=1e-6), nn.Linear(D, m.vocab, bias=False)

        def forward(self, tokens, targets):
            x, aux = self.embed(tokens), 0.0
            for b in self.blocks:
                x, a = b(x)
                aux = aux + a
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.view(-1, m.vocab), targets.view(-1)) + m.aux_loss_coef * aux

    model = Model()
    for b in model.blocks:
        if b.moe:
            b.ffn.set_deepspeed_parallelism()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    dense = [p for p in model.parameters() if getattr(p, "allreduce", True)]
    M = cfg.parallel.microbatches
    times, losses = [], []
    for step in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        total = 0.0
        for mb in range(M):
            tokens, targets = synthetic_batch(0, step, rank, mb, m.micro_batch_size, m.seq_len, m.vocab)
            loss = model(tokens, targets)
            (loss / (M * world)).backward()
            total += float(loss)
        flat = torch.cat([p.grad.reshape(-1) for p in dense])  # DP over the EP replicas (non-expert weights)
        dist.all_reduce(flat)
        off = 0
        for p in dense:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
        losses.append(total / M)
    if rank == 0:
        (out / "ds_summary.json").write_text(json.dumps({"step_time_s": times, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--ds-worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ds_worker is not None:
        ds_worker(a.ds_worker, a.steps, a.overrides)
        return
    import torch

    torch.set_num_threads(1)
    base = a.out or Path(tempfile.mkdtemp(prefix="bench_runtime_"))
    base.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    from runtime.probe.inprocess import executor_overhead_us

    over_us, how = executor_overhead_us(steps=20)
    k3 = runtime_step_s("k3", a.steps, base / "k3")
    serial = runtime_step_s("serial", a.steps, base / "serial")
    ds = deepspeed_step_s(a.steps, base)
    plan_k3 = json.loads((base / "k3" / "summary.json").read_text())["predicted_step_time_us"]
    plan_serial = json.loads((base / "serial" / "summary.json").read_text())["predicted_step_time_us"]
    print(f"bench_runtime: tiny-cpu, pp 1 x ep 2 (2 ranks, gloo, CPU), {a.steps} steps each, median after step 1")
    print(f"  k3 plan        {k3 * 1e3:8.1f} ms/step   (planned {plan_k3 / 1e3:.1f} ms)")
    print(f"  serial plan    {serial * 1e3:8.1f} ms/step   (planned {plan_serial / 1e3:.1f} ms)   "
          f"serial / k3 = {serial / k3:.2f}")
    print(f"  DeepSpeed MoE  {ds * 1e3:8.1f} ms/step   DeepSpeed / k3 = {ds / k3:.2f}")
    print(f"  executor overhead: {over_us:.1f} us/task ({how})")
    print(f"  (outputs under {base}; bench took {time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()

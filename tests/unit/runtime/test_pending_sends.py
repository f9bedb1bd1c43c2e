"""Send buffers in flight are counted until their transfer completes (runtime.stage.PendingSends),
on two real gloo processes: the sender's count holds the buffer until the receiver has it, and
drops it then, before the end-of-step wait."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.testbed import free_port

pytestmark = pytest.mark.slow
NUMEL = 1 << 16


def _rank(rank: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from datetime import timedelta

    from runtime.stage import PendingSends

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    try:
        if rank == 0:
            sends = PendingSends()
            buf = torch.ones(NUMEL)
            sends.add(dist.isend(buf, dst=1), buf)
            before = sends.nbytes()  # the receiver has not posted its receive yet (it waits below)
            dist.barrier()
            dist.barrier()  # the receiver has its bytes: the reaper drops the send without wait_all
            deadline = time.monotonic() + 10
            while sends.nbytes() and time.monotonic() < deadline:
                time.sleep(0.01)
            q.put(("sender", before, sends.nbytes()))
            sends.wait_all()
        else:
            dist.barrier()
            buf = torch.empty(NUMEL)
            dist.recv(buf, src=0)
            dist.barrier()
            q.put(("receiver", float(buf.sum()), 0))
    finally:
        dist.destroy_process_group()


def test_pending_send_counts_its_buffer_until_received():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for p in procs:
        if p.is_alive():
            p.kill()
    got = {}
    while not q.empty():
        who, a, b = q.get()
        got[who] = (a, b)
    assert got["receiver"][0] == NUMEL
    before, after = got["sender"]
    assert before == NUMEL * 4 and after == 0

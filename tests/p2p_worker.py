"""Run by tests/unit/k3sched/test_p2p.py under torchrun: several training runs in one launch, then a crossing
order on one communicator in both P2P modes.

``python -m runtime.launch ... tests/p2p_worker.py SPEC.json``; SPEC holds ``runs`` (each:
``out``, ``overrides``, ``p2p``, ``steps``, optionally ``args``) and ``crossing`` (an output directory). Each run is
``runtime.train.main`` itself (plan, groups, P2P warm-up, executor, summary.json), on one default
process group kept across the runs (launching torchrun once per run costs ~10 s of start-up on a
2-core machine; a run here costs well under one). A failing run exits the process as a launched
rank does (error_rank{R}.txt in its ``out``).

The crossing: both ranks send first, then receive, on one two-rank communicator. Default mode
(gloo buffers it) completes; [Note: strict P2P] (one stream per communicator, a send waits for
the receiver's ready token) must raise within its timeout, as NCCL would hang. Each rank writes
``crossing_rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


_KEPT: list = []  # the runs' process groups, never destroyed (see _runs)


def _runs(spec: dict) -> None:
    import torch.distributed as dist

    from runtime import train

    init, destroy, new_group = dist.init_process_group, dist.destroy_process_group, dist.new_group
    dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else init(*a, **k)
    dist.destroy_process_group = lambda *a, **k: None
    # Every run's groups stay alive until the process leaves through os._exit: a gloo group
    # destroyed while a daemon thread of an earlier run (a strict-P2P stream, a send reaper) still
    # sits in it aborts the process ("terminate called without an active exception", no Python
    # error): what runtime.train's own hard exit avoids for a launched rank.
    keep: list = []
    dist.new_group = lambda *a, **k: keep.append(new_group(*a, **k)) or keep[-1]
    try:
        for run in spec["runs"]:
            argv = [str(ROOT / "configs" / "tiny-cpu.yaml"), "--out", run["out"], "--steps", str(run.get("steps", 1)),
                    "--quiet", "--p2p", run["p2p"], "--timeout", str(spec.get("timeout_s", 60))]
            for o in run["overrides"]:
                argv += ["--set", o]
            argv += run.get("args", [])  # further runtime.train arguments (e.g. --dump-params)
            t0 = time.monotonic()
            rc = train.main(argv)
            Path(run["out"], f"wall_rank{dist.get_rank()}.txt").write_text(f"{time.monotonic() - t0:.3f}\n")
            if rc:
                sys.exit(rc)
    finally:
        dist.init_process_group, dist.destroy_process_group, dist.new_group = init, destroy, new_group
        _KEPT.extend(keep)


def _crossing(out: Path, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    from runtime.stage import P2PStream, strict_recv, strict_send

    rank = dist.get_rank()
    peer = 1 - rank
    res: dict = {}
    # default mode: isend, then irecv + wait (gloo buffers the crossing)
    g = dist.new_group([0, 1])
    got = torch.zeros(4)
    w = dist.isend(torch.full((4,), float(rank + 1)), dst=peer, group=g)
    dist.irecv(got, src=peer, group=g).wait()
    w.wait()
    res["buffered"] = got.tolist()
    # strict mode: one stream for the communicator, send first, then receive
    g, ready = dist.new_group([0, 1]), dist.new_group([0, 1])
    stream = P2PStream("shared 0<->1", timeout_s)
    got = torch.zeros(4)
    t0 = time.monotonic()
    stream.submit("send", lambda dl: strict_send(torch.full((4,), float(rank + 1)), peer, g, ready, 7, dl,
                                                 f"crossing send (rank {rank})"))
    try:
        stream.submit("recv", lambda dl: strict_recv(got, peer, g, ready, 7, dl, f"crossing recv (rank {rank})")).wait(
            2 * timeout_s + 5)
        res["strict"] = got.tolist()
    except Exception as e:  # noqa: BLE001 - the expected outcome, reported to the test
        res["strict_error"] = f"{type(e).__name__}: {e}"
    res["strict_s"] = time.monotonic() - t0
    (out / f"crossing_rank{rank}.json").write_text(json.dumps(res))


def main(argv: list[str]) -> int:
    import os

    spec = json.loads(Path(argv[0]).read_text())
    _runs(spec)
    import torch.distributed as dist

    if spec.get("crossing"):
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        _crossing(Path(spec["crossing"]), float(spec.get("crossing_timeout_s", 3.0)))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os = __import__("os")
    os._exit(code)  # lane and stream threads are daemons; skip the interpreter teardown (see runtime.train)

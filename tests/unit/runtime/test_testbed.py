"""The shaped-link testbed (runtime/testbed.py, ``k3sched run --emulate-links``): the refusal
paths (fast, faked inputs), and, where the testbed can be set up (root, iproute2, namespaces
allowed), the shaped rates measured over TCP, a short training run, cleanup after a failing rank,
SIGTERM and Ctrl-C, and removal of a crashed run's leftovers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runtime import testbed as tbmod
from runtime.launch import run_command
from runtime.testbed import Testbed, links_for, reap_leftovers, testbed_available

from conftest import procs_with

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny-cpu.yaml"
LIMIT_S = 150.0
EP2 = ["parallel.pp=1", "parallel.ep=2", "parallel.microbatches=2", "model.layers=2", "model.seq_len=16",
       "model.micro_batch_size=1"]

_REASON = testbed_available()
needs_testbed = pytest.mark.skipif(_REASON is not None, reason=f"testbed unavailable: {_REASON}")


def _namespaces(prefix: str) -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith(prefix)]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------ refusals (no root needed)


def test_not_root_is_one_line_and_exit_2(monkeypatch, capfd, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert testbed_available().startswith("needs root")
    code = run_command(TINY, EP2, 1, None, tmp_path / "out", emulate_links=True, quiet=True)
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: --emulate-links: needs root"), err
    assert not (tmp_path / "out").exists()  # nothing launched


@pytest.mark.parametrize("tool", ["ip", "tc"])
def test_missing_tool_names_it(monkeypatch, tool):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real = tbmod.shutil.which
    monkeypatch.setattr(tbmod.shutil, "which", lambda name: None if name == tool else real(name))
    assert testbed_available() == f"the `{tool}` command is missing; install iproute2"


def test_refused_namespace_names_cap_sys_admin(monkeypatch):
    def fake_run(argv, stdin=None):
        return subprocess.CompletedProcess(argv, 1, "", "mount --make-shared /run/netns failed: "
                                                        "Operation not permitted")

    monkeypatch.setattr(tbmod, "_run", fake_run)
    reason = tbmod._probe()
    assert reason.startswith("cannot create a network namespace") and "CAP_SYS_ADMIN" in reason
    assert "\n" not in reason


def test_nsys_combination_refused(capfd, tmp_path):
    code = run_command(TINY, EP2, 1, None, tmp_path, nsys=True, emulate_links=True, quiet=True)
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--nsys" in err[0], err


def test_links_from_config_and_overrides(tiny_cfg):
    lk = links_for(tiny_cfg.hardware, 4)
    assert (lk.internode_gbps, lk.nvlink_gbps, lk.gpus_per_node) == (1.0, 2.0, 4)
    lk = links_for(tiny_cfg.hardware, 4, gpus_per_node=2, rate_scale=0.5)
    assert (lk.internode_gbps, lk.nvlink_gbps, lk.nodes) == (0.5, 1.0, 2)
    assert lk.gbps(0, 1) == 1.0 and lk.gbps(1, 2) == 0.5
    assert links_for({"internode_gbps": 1, "nvlink_gbps": 2, "gpus_per_node": 1}, 2, internode_gbps=0.02).gbps(0, 1) \
        == 0.02
    with pytest.raises(ValueError):
        links_for(tiny_cfg.hardware, 254)


# ------------------------------------------------------------------------------- on the testbed

_RECV = textwrap.dedent("""
    import socket, sys, time
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], 5000)); srv.listen(8); print("ready", flush=True)
    conns = [srv.accept()[0] for _ in range(int(sys.argv[2]))]
    import selectors
    sel = selectors.DefaultSelector()
    for c in conns: sel.register(c, selectors.EVENT_READ)
    n, t0, t1, open_ = 0, None, None, len(conns)
    while open_:
        for key, _ in sel.select():
            b = key.fileobj.recv(1 << 20)
            if not b:
                sel.unregister(key.fileobj); open_ -= 1; continue
            t0 = t0 or time.perf_counter(); n += len(b); t1 = time.perf_counter()
    print(n, t1 - t0, flush=True)
""")
_SEND = textwrap.dedent("""
    import socket, sys
    s = socket.create_connection((sys.argv[1], 5000)); total = int(sys.argv[2]); buf = b"x" * (1 << 16); sent = 0
    assert s.getsockname()[0] == sys.argv[3], s.getsockname()  # the rank's own address: shaping sees it
    while sent < total:
        sent += s.send(buf[: total - sent])
    s.close()
""")


def _measure(tb: Testbed, senders: list[int], dst: int, nbytes: int) -> float:
    """Bytes/s that rank ``dst`` receives while every rank in ``senders`` sends it ``nbytes``."""
    rx = subprocess.Popen(tb.rank_prefix(dst) + [sys.executable, "-c", _RECV, tb.addr(dst), str(len(senders))],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        txs = [subprocess.Popen(tb.rank_prefix(s) + [sys.executable, "-c", _SEND, tb.addr(dst), str(nbytes),
                                                     tb.addr(s)]) for s in senders]
        for t in txs:
            assert t.wait(timeout=30) == 0
        n, dt = rx.communicate(timeout=30)[0].split()
    finally:
        if rx.poll() is None:
            rx.kill()
    assert int(n) == nbytes * len(senders)
    return int(n) / float(dt)


@needs_testbed
@pytest.mark.slow
def test_shaped_rates_hold():
    """3 ranks, 2 per node: r0->r1 at the NVLink rate, r0->r2 at the NIC rate, and r0 + r1 -> r2
    together at r2's NIC rate (receive side shaped too); each within 15%."""
    hw = {"internode_gbps": 0.02, "nvlink_gbps": 0.05, "gpus_per_node": 2}
    t0 = time.perf_counter()
    with Testbed(hw, 3) as tb:
        nv = _measure(tb, [0], 1, 40_000_000)
        inter = _measure(tb, [0], 2, 24_000_000)
        incast = _measure(tb, [0, 1], 2, 12_000_000)
        ns = tb.namespaces()
    print(f"nvlink {nv / 1e6:.2f} MB/s (50), internode {inter / 1e6:.2f} MB/s (20), 2 -> 1 {incast / 1e6:.2f} "
          f"MB/s (20), {time.perf_counter() - t0:.1f} s")
    assert abs(nv / 50e6 - 1) < 0.15
    assert abs(inter / 20e6 - 1) < 0.15
    assert abs(incast / 20e6 - 1) < 0.15
    assert not set(ns) & set(_namespaces("k3sched-"))


def _exchange(tb: Testbed, a: int, b: int, nbytes: int) -> tuple[float, float]:
    """Bytes/s received by ``b`` and by ``a`` while ``a`` and ``b`` send each other ``nbytes``
    at the same time (one TCP connection per direction)."""
    rxs = {d: subprocess.Popen(tb.rank_prefix(d) + [sys.executable, "-c", _RECV, tb.addr(d), "1"],
                               stdout=subprocess.PIPE, text=True) for d in (b, a)}
    try:
        for rx in rxs.values():
            assert rx.stdout.readline().strip() == "ready"
        txs = [subprocess.Popen(tb.rank_prefix(s) + [sys.executable, "-c", _SEND, tb.addr(d), str(nbytes),
                                                     tb.addr(s)]) for s, d in ((a, b), (b, a))]
        for t in txs:
            assert t.wait(timeout=30) == 0
        rates = []
        for rx in rxs.values():
            n, dt = rx.communicate(timeout=30)[0].split()
            assert int(n) == nbytes
            rates.append(int(n) / float(dt))
    finally:
        for rx in rxs.values():
            if rx.poll() is None:
                rx.kill()
    return rates[0], rates[1]


@needs_testbed
@pytest.mark.slow
def test_two_way_exchange_gets_the_rate_each_way():
    """Full duplex: r0 -> r1 and r1 -> r0 at once over a 20 MB/s NIC get >= 0.85x of it each
    (and no more than the rate): the reverse flow's ACKs do not queue behind shaped data."""
    hw = {"internode_gbps": 0.02, "nvlink_gbps": 0.02, "gpus_per_node": 1}
    t0 = time.perf_counter()
    with Testbed(hw, 2) as tb:
        fwd, back = _exchange(tb, 0, 1, 40_000_000)
        ns = tb.namespaces()
    print(f"two-way: 0 -> 1 {fwd / 1e6:.2f} MB/s, 1 -> 0 {back / 1e6:.2f} MB/s (20 each), "
          f"{time.perf_counter() - t0:.1f} s")
    for rate in (fwd, back):
        assert 0.85 < rate / 20e6 < 1.1, (fwd, back)
    assert not set(ns) & set(_namespaces("k3sched-"))


@needs_testbed
@pytest.mark.slow
def test_training_run_on_testbed(tmp_path):
    """k3sched run --emulate-links: 4 ranks on 2 emulated nodes, exit 0, traces, the testbed in
    summary.json, then no namespace and no process left."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3sched.cli", "run", str(TINY), "--emulate-links", "--steps", "2", "--out", str(out),
           "--set", "hardware.gpus_per_node=2", "--set", "hardware.internode_gbps=0.05", "--timeout", str(LIMIT_S)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=LIMIT_S + 30)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("testbed: 4 rank(s) on 2 emulated node(s) of 2; NIC 50 MB/s across nodes"), r.stdout
    assert sorted(p.name for p in out.glob("trace_rank*.json")) == [f"trace_rank{i}.json" for i in range(4)]
    tb = json.loads((out / "summary.json").read_text())["testbed"]
    assert tb["internode_gbps"] == 0.05 and tb["nvlink_gbps"] == 2.0 and tb["nodes"] == 2
    assert _namespaces(f"k3sched-{tb['tag'].split('-')[0]}-") == []
    assert procs_with(str(out)) == []


@needs_testbed
@pytest.mark.slow
def test_failing_rank_on_testbed(tmp_path, capfd):
    code = run_command(TINY, EP2, 1, None, tmp_path, emulate_links=True, quiet=True, timeout_s=LIMIT_S,
                       env={"K3SCHED_FAIL_RANK": "1"})
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 1
    assert len(err) == 1 and err[0].startswith("error: rank 1:"), err
    assert _namespaces(f"k3sched-{os.getpid()}-") == []
    assert procs_with(str(tmp_path)) == []


@needs_testbed
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_cleans_up(tmp_path, sig):
    """SIGTERM / Ctrl-C to ``k3sched run --emulate-links`` while the ranks run: every rank
    stopped, every namespace deleted."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3sched.cli", "run", str(TINY), "--emulate-links", "--steps", "50", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(procs_with(str(out))) < 3:  # cli + torchrun + a rank
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        assert _namespaces(f"k3sched-{proc.pid}-"), "the testbed was not set up"
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert code == (143 if sig == signal.SIGTERM else 130), err
    # our one line first; torchrun's own report of being stopped may follow, no traceback of ours
    word = "terminated" if sig == signal.SIGTERM else "interrupted"
    assert err.splitlines()[0] == f"error: {word}; stopped every rank", err
    assert "k3sched/cli.py" not in err and "runtime/launch.py" not in err and "runtime/testbed.py" not in err, err
    assert _namespaces(f"k3sched-{proc.pid}-") == []
    assert procs_with(str(out)) == []


@needs_testbed
def test_leftovers_of_a_crashed_run_are_removed(capfd):
    pid = _dead_pid()
    names = [f"k3sched-{pid}-0-hub", f"k3sched-{pid}-0-r0", f"k3sched-{pid}-0-r1"]
    for ns in names:
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        with Testbed({"internode_gbps": 1, "nvlink_gbps": 1, "gpus_per_node": 1}, 1):
            pass
        err = capfd.readouterr().err.strip().splitlines()
        assert err == [f"testbed: removed 3 namespace(s) left by a crashed run (pid {pid})"], err
        assert _namespaces(f"k3sched-{pid}-") == []
        assert reap_leftovers() == 0
    finally:
        for ns in _namespaces(f"k3sched-{pid}-"):
            subprocess.run(["ip", "netns", "del", ns], check=False)


@needs_testbed
def test_exception_inside_deletes_everything():
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed({"internode_gbps": 1, "nvlink_gbps": 1, "gpus_per_node": 1}, 2) as tb:
            assert set(tb.namespaces()) <= set(_namespaces("k3sched-"))
            raise RuntimeError("boom")
    assert not set(tb.namespaces()) & set(_namespaces("k3sched-"))
    assert re.fullmatch(r"\d+-\d+", tb.tag)

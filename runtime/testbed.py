"""Shaped-link testbed: every rank in its own Linux network namespace behind a rate-limited "NIC".

On a plain CPU run all ranks talk over loopback, which costs CPU but no wire time. Inside the
testbed every byte between ranks crosses a veth "NIC" whose rate Linux traffic control (HTB)
holds to the config's ``hardware`` numbers, so the planner's cost model and the testbed agree by
construction: ``k3sched run CONFIG --emulate-links`` (:func:`runtime.launch.run_command` with
``emulate_links=True``).

Layout (only 127.0.1.0/24, only inside namespaces created here; the root namespace's interfaces
and qdiscs are never touched)::

    k3sched-<tag>-hub   bridge br0 127.0.1.254/24 (torchrun's agent and its TCPStore run here),
                        one veth end ``r<N>`` per rank enslaved to br0
    k3sched-<tag>-r<N>  veth end ``k3nic`` 127.0.1.(N+1)/24 (the same name in every rank
                        namespace: GLOO_SOCKET_IFNAME=k3nic serves all ranks)

``<tag>`` is ``<creating pid>-<counter>``. Every namespace gets ``route_localnet=1``, ``lo`` up,
IPv6 off (traffic must be IPv4 for the filters) and its ``local 127.0.0.0/8`` route deleted (the
kernel keeps ``local 127.0.0.1``), so 127.0.1.x addresses live on the veths and a connection's
source address is its rank's own.

Shaping: rank r sits on emulated node ``r // gpus_per_node``. On the egress of rank r's
``k3nic`` an HTB qdisc has one class at ``internode_gbps`` (traffic to ranks on other nodes), one
at ``nvlink_gbps`` (ranks on the same node) and one unshaped class (the hub: the store); u32
filters on the destination address choose the class, and anything unmatched falls into the
internode class (never faster than configured). The hub's end ``r<N>`` (egress towards rank N)
carries the same classes chosen by source address, so a rank's receive rate is its NIC rate too
(full duplex). On both, small TCP packets (IP total length < 128 bytes: pure ACKs, short
control messages) skip the shaping: a u32 filter at a higher priority than the address filters
sends them to the unshaped class 1:40, which HTB serves before the data classes. Without it the
ACKs of the reverse flow queue behind shaped data, and two TCP connections sending opposite ways
at once each get less than the rate; with it each gets the one-way rate. A segment with at
most 76 bytes of payload thus bypasses the rate. Rates are TCP payload rates: the HTB rate is
raised by the frame overhead at MTU 1500 (1514 / 1448 bytes per segment: Ethernet header, IP and
TCP headers with timestamps). Burst: ``max(256 KiB, 250 µs at the rate)``. GB/s means 1e9
bytes/s, one direction, as in the config. A rate above what the machine's cores can move is
effectively unshaped.

gloo and full duplex: when both ranks of a pair post ``isend`` before ``irecv``
(``batch_isend_irecv([isend, irecv])``; gloo's all_to_all behaves alike) the two directions take
turns. gloo sends a payload only after the peer's recv-ready notice, and a rank whose isend
already has that notice writes its payload into the pair's single TCP stream and then its own
irecv's notice behind it, so the peer can start its payload only when this one has arrived:
with isend first each direction gets little more than half the rate, with irecv first each gets
all of it, on the same shaping. That is gloo's protocol, not the shaping, and it would happen on any
rate-limited wire; post the irecv first to get both directions at once.

Not emulated: link latency (``*_latency_us``): this kernel has no ``sch_netem`` and none of the
qdiscs that honour a departure time (``fq``, ``etf``), so nothing can delay packets; only the rate
holds. PCIe copies (offload lanes) are memory copies and run at memory speed.

Cleanup: :class:`Testbed` is a context manager; leaving it (normally, on an exception,
KeyboardInterrupt, or SIGTERM / SIGHUP, which it turns into ``SystemExit`` while it is open in the
main thread) kills any process still inside its namespaces and deletes them all (deleting a
namespace deletes its veths). Namespaces of a testbed whose creating process no longer exists
(a crash, SIGKILL) are removed when the next testbed starts, with one line on stderr.

API::

    testbed_available() -> str | None          # None when usable, else the one-line reason
    Links(world, gpus_per_node, internode_gbps, nvlink_gbps)  # .node(r), .gbps(a, b), .describe()
    links_for(hardware, world, *, internode_gbps=None, nvlink_gbps=None, gpus_per_node=None,
              rate_scale=1.0) -> Links         # defaults from the config's hardware section
    reap_leftovers(quiet=False) -> int         # namespaces removed (one stderr line per crashed run)
    class Testbed(hardware, world, *, internode_gbps=None, nvlink_gbps=None, gpus_per_node=None,
                  rate_scale=1.0, burst_bytes=None):   # context manager; raises TestbedError
        .links, .tag, .hub (namespace), .ns(rank), .addr(rank), .master_addr ("127.0.1.254")
        .hub_prefix() / .rank_prefix(rank) -> ["ip", "netns", "exec", NS]  (prepend to argv)
        .worker_wrapper() -> argv that enters the namespace of $RANK and execs the rest
        .torchrun_command(worker_argv, *, port=None, nproc=None) -> full argv, torchrun in the hub
        .env() -> {"GLOO_SOCKET_IFNAME": "k3nic", "K3SCHED_TESTBED": JSON of .info()}
        .info() -> dict (for summary.json), .describe() -> one line

    with Testbed(cfg.hardware, world) as tb:
        cmd = tb.torchrun_command([sys.executable, "-m", "runtime.train", CONFIG, "--out", DIR])
        subprocess.run(cmd, env={**os.environ, **tb.env()})

``python -m runtime.testbed`` prints whether the testbed is usable, and ``--reap`` removes
leftovers.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

PREFIX = "k3sched-"
NIC = "k3nic"
BRIDGE = "br0"
HUB_ADDR = "127.0.1.254"
MAX_WORLD = 253  # 127.0.1.1 .. 127.0.1.253
TESTBED_ENV = "K3SCHED_TESTBED"
PAYLOAD_FACTOR = 1514 / 1448  # wire bytes per TCP payload byte at MTU 1500 (timestamps on)
MIN_BURST = 16 * 1024  # a few frames: a larger bucket lets each message start with a free burst above the rate
BURST_S = 250e-6
FAST_BITS = 100e9  # the unshaped class (hub / store traffic)
FAST_BURST = 4 * 2**20
SMALL_IP_LEN = 128  # IPv4 packets shorter than this (TCP ACKs, control messages) skip the shaping
CMD_TIMEOUT_S = 30.0

_NAME = re.compile(r"^k3sched-(\d+)-(\d+)-(hub|probe|r\d+)$")
_counter = itertools.count()


class TestbedError(RuntimeError):
    """The testbed cannot be set up: one line, what is missing and what is needed."""

    __test__ = False  # not a pytest class


# --------------------------------------------------------------------------------------- links


@dataclass(frozen=True)
class Links:
    """The emulated network: ``world`` ranks, ``gpus_per_node`` per node, NIC and NVLink GB/s."""

    world: int
    gpus_per_node: int
    internode_gbps: float
    nvlink_gbps: float

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def gbps(self, a: int, b: int) -> float:
        """GB/s of the link from rank ``a`` to rank ``b``."""
        return self.nvlink_gbps if self.node(a) == self.node(b) else self.internode_gbps

    @property
    def nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)

    def describe(self) -> str:
        return (f"{self.world} rank(s) on {self.nodes} emulated node(s) of {self.gpus_per_node}; NIC "
                f"{_fmt_gbps(self.internode_gbps)} across nodes, {_fmt_gbps(self.nvlink_gbps)} within a node "
                f"(each direction, per rank); latency not emulated")


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous port of a local run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt_gbps(g: float) -> str:
    return f"{g:g} GB/s" if g >= 1 else f"{g * 1e3:g} MB/s"


def links_for(hardware, world: int, *, internode_gbps: float | None = None, nvlink_gbps: float | None = None,
              gpus_per_node: int | None = None, rate_scale: float = 1.0) -> Links:
    """The links of ``world`` ranks from a config's ``hardware`` section (an object or a dict);
    explicit rates replace the config's, and ``rate_scale`` multiplies both."""
    def get(name):
        return hardware[name] if isinstance(hardware, dict) else getattr(hardware, name)

    if not rate_scale > 0:
        raise ValueError(f"rate_scale: must be > 0; got {rate_scale}")
    inter = float(internode_gbps if internode_gbps is not None else get("internode_gbps")) * rate_scale
    nv = float(nvlink_gbps if nvlink_gbps is not None else get("nvlink_gbps")) * rate_scale
    g = int(gpus_per_node if gpus_per_node is not None else get("gpus_per_node"))
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"world: the testbed holds 1..{MAX_WORLD} ranks; got {world}")
    if g < 1 or inter <= 0 or nv <= 0:
        raise ValueError(f"link rates must be > 0 and gpus_per_node >= 1; got internode {inter}, nvlink {nv}, "
                         f"gpus_per_node {g}")
    return Links(world, g, inter, nv)


def rank_addr(rank: int) -> str:
    return f"127.0.1.{rank + 1}"


# ---------------------------------------------------------------------------------- commands


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=False)


def _check(argv: list[str], stdin: str | None = None, what: str | None = None) -> None:
    r = _run(argv, stdin)
    if r.returncode != 0:
        msg = " ".join((r.stderr or r.stdout).split()) or f"exit status {r.returncode}"
        raise TestbedError(f"{what or ' '.join(argv[:4])}: {msg[:300]}")


def _netns_names() -> list[str]:
    r = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()] if r.returncode == 0 else []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _ns_pids(ns: str) -> list[int]:
    r = _run(["ip", "netns", "pids", ns])
    return [int(x) for x in r.stdout.split() if x.isdigit()] if r.returncode == 0 else []


def _delete_namespaces(names: list[str], grace_s: float = 5.0) -> None:
    """Kill every process inside ``names`` (SIGTERM, then SIGKILL), then delete the namespaces."""
    if not names:
        return
    me = os.getpid()
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = [p for ns in names for p in _ns_pids(ns) if p != me]
        if not pids:
            break
        for p in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)
    _run(["ip", "-force", "-batch", "-"], "".join(f"netns del {ns}\n" for ns in names))


def reap_leftovers(quiet: bool = False) -> int:
    """Delete the namespaces of testbeds whose creating process no longer exists (one line per
    crashed run on stderr unless ``quiet``); returns how many were removed."""
    by_pid: dict[int, list[str]] = {}
    for ns in _netns_names():
        m = _NAME.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            by_pid.setdefault(int(m.group(1)), []).append(ns)
    removed = 0
    for pid, names in sorted(by_pid.items()):
        _delete_namespaces(names, grace_s=1.0)
        left = set(_netns_names())
        n = sum(ns not in left for ns in names)
        removed += n
        if n and not quiet:
            print(f"testbed: removed {n} namespace(s) left by a crashed run (pid {pid})", file=sys.stderr, flush=True)
    return removed


# ------------------------------------------------------------------------------ availability

_available: dict[str, str | None] = {}


def testbed_available() -> str | None:
    """None when the testbed can be set up here, else one line naming what is missing and what
    is needed (root, ``ip`` and ``tc`` from iproute2, permission to create network namespaces,
    veth, bridge, HTB and u32 in the kernel). The namespace probe runs once per process."""
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces and traffic-control qdiscs); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command is missing; install iproute2"
    if "probe" not in _available:
        _available["probe"] = _probe()
    return _available["probe"]


def _probe() -> str | None:
    ns = f"{PREFIX}{os.getpid()}-{next(_counter)}-probe"
    r = _run(["ip", "netns", "add", ns])
    if r.returncode != 0:
        msg = " ".join(r.stderr.split())[:200] or f"exit status {r.returncode}"
        return (f"cannot create a network namespace (ip netns add: {msg}); needs CAP_SYS_ADMIN, e.g. a privileged "
                f"container or a VM")
    try:
        steps = [
            (["ip", "-n", ns, "link", "add", "pb", "type", "bridge"], None, "bridge"),
            (["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pc"], None, "veth"),
            (["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", "handle", "1:", "htb"], None, "HTB qdisc"),
            (["tc", "-n", ns, "filter", "add", "dev", "pa", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
              "match", "ip", "dst", "127.0.1.1/32", "flowid", "1:1"], None, "u32 filter"),
        ]
        for argv, stdin, what in steps:
            r = _run(argv, stdin)
            if r.returncode != 0:
                msg = " ".join(r.stderr.split())[:200]
                return (f"the kernel refused a {what} in a network namespace ({msg}); needs veth, bridge, sch_htb, "
                        f"cls_u32")
        return None
    finally:
        _run(["ip", "netns", "del", ns])


# ---------------------------------------------------------------------------------- testbed


class Testbed:
    """The shaped-link testbed of ``world`` ranks (see the module docstring); a context manager.
    Entering it removes leftovers of crashed runs, creates the namespaces and the shaping, and
    raises :class:`TestbedError` (one line) when that is refused, leaving nothing behind."""

    __test__ = False  # not a pytest class

    def __init__(self, hardware, world: int, *, internode_gbps: float | None = None,
                 nvlink_gbps: float | None = None, gpus_per_node: int | None = None, rate_scale: float = 1.0,
                 burst_bytes: int | None = None):
        self.links = links_for(hardware, world, internode_gbps=internode_gbps, nvlink_gbps=nvlink_gbps,
                               gpus_per_node=gpus_per_node, rate_scale=rate_scale)
        self.world = world
        self.burst_bytes = burst_bytes
        self.tag = f"{os.getpid()}-{next(_counter)}"
        self.hub = f"{PREFIX}{self.tag}-hub"
        self.master_addr = HUB_ADDR
        self._created: list[str] = []
        self._old_handlers: dict[int, object] = {}
        self.open = False

    # names and prefixes
    def ns(self, rank: int) -> str:
        return f"{PREFIX}{self.tag}-r{rank}"

    def addr(self, rank: int) -> str:
        return rank_addr(rank)

    def namespaces(self) -> list[str]:
        return [self.hub] + [self.ns(r) for r in range(self.world)]

    def hub_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.hub]

    def rank_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(rank)]

    def worker_wrapper(self) -> list[str]:
        """argv that enters the namespace of rank ``$RANK`` (set by torchrun) and execs the
        arguments after it (``ip netns exec`` execs: the pid and process group stay)."""
        return ["/bin/sh", "-c", f'exec ip netns exec "{PREFIX}{self.tag}-r$RANK" "$@"', "k3sched-testbed-worker"]

    def torchrun_command(self, worker_argv: list[str], *, port: int | None = None, nproc: int | None = None,
                         python: str = sys.executable) -> list[str]:
        """torchrun (one node, ``nproc`` = world ranks) in the hub namespace, master address the
        hub's bridge, each worker ``worker_argv`` (a full argv: ``[python, "-m", MODULE, ...]``)
        in its own rank namespace."""
        return self.hub_prefix() + [
            python, "-m", "runtime.launch", "--nnodes", "1", "--nproc-per-node", str(nproc or self.world),
            "--master-addr", self.master_addr, "--master-port", str(port or free_port()), "--max-restarts", "0",
            "--no-python", *self.worker_wrapper(), *worker_argv]

    def info(self) -> dict:
        return {"emulated": True, **asdict(self.links), "nodes": self.links.nodes, "latency_emulated": False,
                "tag": self.tag, "master_addr": self.master_addr, "nic": NIC}

    def env(self) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": NIC, TESTBED_ENV: json.dumps(self.info())}

    def describe(self) -> str:
        return f"testbed: {self.links.describe()}"

    # lifecycle
    def __enter__(self) -> Testbed:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        reason = testbed_available()
        if reason is not None:
            raise TestbedError(reason)
        reap_leftovers()
        self._install_signals()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        self.open = True

    def close(self) -> None:
        """Kill what still runs inside the namespaces, delete them (idempotent)."""
        blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        main = threading.current_thread() is threading.main_thread()
        if main:
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            names, self._created = self._created, []
            existing = set(_netns_names())
            _delete_namespaces([n for n in names if n in existing])
            self.open = False
            self._restore_signals()
        finally:
            if main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            old = signal.getsignal(sig)
            if old in (signal.SIG_DFL, None):
                self._old_handlers[sig] = old
                signal.signal(sig, handler)

    def _restore_signals(self) -> None:
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old_handlers = {}

    def _create(self) -> None:
        for ns in self.namespaces():
            _check(["ip", "netns", "add", ns], what=f"ip netns add {ns}")
            self._created.append(ns)
            # before any interface exists: new interfaces inherit 'default'
            _check(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=1",
                    "net.ipv4.conf.default.route_localnet=1", "net.ipv6.conf.all.disable_ipv6=1",
                    "net.ipv6.conf.default.disable_ipv6=1"], what=f"sysctl in {ns}")
        hub = [f"link add {BRIDGE} type bridge", "link set lo up", f"link set {BRIDGE} up",
               f"addr add {HUB_ADDR}/24 dev {BRIDGE}", "route del local 127.0.0.0/8 dev lo table local"]
        for r in range(self.world):
            hub += [f"link add r{r} type veth peer name {NIC} netns {self.ns(r)}", f"link set r{r} master {BRIDGE}",
                    f"link set r{r} up"]
        _check(["ip", "-n", self.hub, "-batch", "-"], "\n".join(hub) + "\n", what=f"setting up {self.hub}")
        for r in range(self.world):
            cmds = ["link set lo up", "route del local 127.0.0.0/8 dev lo table local",
                    f"addr add {rank_addr(r)}/24 dev {NIC}", f"link set {NIC} up"]
            _check(["ip", "-n", self.ns(r), "-batch", "-"], "\n".join(cmds) + "\n", what=f"setting up {self.ns(r)}")
        for r in range(self.world):
            _check(["tc", "-n", self.ns(r), "-batch", "-"], self._tc(NIC, r, "dst"), what=f"shaping {self.ns(r)}")
            _check(["tc", "-n", self.hub, "-batch", "-"], self._tc(f"r{r}", r, "src"), what=f"shaping r{r} in the hub")

    def _burst(self, bits: float) -> int:
        return int(self.burst_bytes or max(MIN_BURST, bits / 8 * BURST_S))

    def _tc(self, dev: str, rank: int, field: str) -> str:
        """HTB on ``dev`` (rank ``rank``'s NIC, or the hub end towards it): class 1:10 internode
        (also the default), 1:20 NVLink, 1:30 unshaped (hub), 1:40 unshaped small TCP packets
        (ACKs; HTB prio 0 before the data classes' 1); u32 filters: the small-packet one at prio 1,
        then the address ones on ``field`` (dst / src) at prio 2."""
        lk = self.links
        lines = [f"qdisc replace dev {dev} root handle 1: htb default 10"]
        for cls, gbps in ((10, lk.internode_gbps), (20, lk.nvlink_gbps)):
            bits = gbps * 1e9 * 8 * PAYLOAD_FACTOR
            b = self._burst(bits)
            lines.append(f"class add dev {dev} parent 1: classid 1:{cls} htb rate {int(bits)}bit burst {b}b "
                         f"cburst {b}b quantum 60000 prio 1")
        for cls in (30, 40):
            lines.append(f"class add dev {dev} parent 1: classid 1:{cls} htb rate {int(FAST_BITS)}bit "
                         f"burst {FAST_BURST}b cburst {FAST_BURST}b quantum 60000 prio 0")
        # IPv4 total length (the u16 at byte 2) below SMALL_IP_LEN: the high bits all zero
        mask = 0xFFFF & ~(SMALL_IP_LEN - 1)
        lines.append(f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff "
                     f"match u16 0x0000 {mask:#06x} at 2 flowid 1:40")
        peers = [(HUB_ADDR, 30)] + [(rank_addr(m), 20 if lk.node(m) == lk.node(rank) else 10)
                                    for m in range(lk.world) if m != rank]
        for addr, cls in peers:
            lines.append(f"filter add dev {dev} parent 1: protocol ip prio 2 u32 match ip {field} {addr}/32 "
                         f"flowid 1:{cls}")
        return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m runtime.testbed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reap", action="store_true", help="remove namespaces left by crashed runs")
    args = ap.parse_args(argv)
    reason = testbed_available()
    if reason is not None:
        print(f"testbed unavailable: {reason}")
        return 2
    if args.reap:
        print(f"removed {reap_leftovers(quiet=True)} namespace(s)")
    else:
        print("testbed available")
    return 0


if __name__ == "__main__":
    sys.exit(main())

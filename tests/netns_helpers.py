"""Nodes inside network namespaces for the multi-host tests (:mod:`lmcache_p2p.testing.netlab`)."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from agent_helpers import agent_yaml

from lmcache_p2p.testing.netlab import NetLab

HERE = Path(__file__).resolve().parent


def node_yaml(lab: NetLab, host: int, path: Path, *, node: str, cluster: str, endpoints: tuple[str, ...],
              ttl: int = 3, disk: Path | None = None, timeout_s: float = 3.0) -> Path:
    """An agent config bound to the host's own address (never loopback)."""
    agent_yaml(path, node=node, cluster=cluster, endpoints=endpoints, ttl=ttl, disk=disk, timeout_s=timeout_s)
    data = yaml.safe_load(path.read_text())
    data["metrics_host"] = lab.ip(host)
    data["transfer"]["listen_host"] = lab.ip(host)
    path.write_text(yaml.safe_dump(data))
    return path


class MeshNode:
    """``tests/mesh_node_proc.py`` in a lab host: a real agent that a test drives over stdin."""

    def __init__(self, lab: NetLab, host: int, config: Path, seeds: tuple[int, ...] = (),
                 log: Path | None = None) -> None:
        self.lab, self.host, self.config = lab, host, config
        self._log = open(log or "/dev/null", "a")  # noqa: SIM115 - closed in stop()
        self.proc = lab.popen(host, [sys.executable, str(HERE / "mesh_node_proc.py"), str(config),
                                     *map(str, seeds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.info = self._read(90)
        if not self.info.get("ready"):
            raise RuntimeError(f"node in h{host} did not start: {self.info}")

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"node in h{self.host}: no answer within {timeout:.0f}s (exit {self.proc.poll()})")
        result: dict[str, Any] = json.loads(line)
        return result

    def cmd(self, cmd: str, timeout: float = 60, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def nodes(self) -> list[str]:
        nodes: list[str] = self.cmd("nodes")["nodes"]
        return nodes

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._close_pipes()

    def stop(self, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the command loop ends; the agent stops cleanly
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()
        self._log.close()


def until(predicate: Any, timeout: float, every: float = 0.1) -> float | None:
    """Seconds until ``predicate()`` held, or None if it did not within ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(every)
    return None

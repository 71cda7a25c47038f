"""Agent processes for the mesh tests: ``lmcache-p2p agent`` started for real, in its own process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from lmcache_p2p.config import AgentConfig, load_config
from lmcache_p2p.testing.stopped_owner import wait_until  # noqa: F401 - the tests import it from here

SECRET = "mesh-test-secret-7f3a9c1e5b2d80461c9e4a7b"

T = TypeVar("T")


def agent_yaml(path: Path, *, node: str, cluster: str, endpoints: tuple[str, ...], ttl: int = 3,
               disk: Path | None = None, cpu: str = "64MiB", transports: tuple[str, ...] = ("tcp",),
               timeout_s: float = 3.0, transfer: dict[str, Any] | None = None,
               layout: dict[str, Any] | None = None, handoff: dict[str, Any] | None = None,
               etcd_extra: dict[str, Any] | None = None) -> Path:
    tiers: dict[str, Any] = {"cpu_capacity": cpu}
    if disk is not None:
        tiers.update(disk_path=str(disk), disk_capacity="256MiB")
    path.write_text(yaml.safe_dump({
        "node_id": node, "cluster": cluster, "metrics_port": 0, "tiers": tiers,
        "etcd": {"endpoints": list(endpoints), "lease_ttl_s": ttl, "timeout_s": 3.0, **(etcd_extra or {})},
        "transfer": {"transports": list(transports), "secret": SECRET, "timeout_s": timeout_s,
                     "backoff_s": 0.2, **(transfer or {})},
        **({"layout": layout} if layout else {}),
        **({"handoff": handoff} if handoff else {}),
    }))
    return path


def wait_for(value: Callable[[], T | None], timeout: float) -> T | None:
    """Poll ``value()`` until it is not None (or ``timeout`` passes); return the last value."""
    deadline = time.monotonic() + timeout
    while (got := value()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads has stopped.

    ``kill`` returns before the stop takes effect: a thread of the target may still run (and answer
    a request) for a moment afterwards, longer on a loaded machine.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} did not stop within {timeout:.0f}s")


def config(path: Path) -> AgentConfig:
    return load_config(path, env={})


class AgentProcess:
    def __init__(self, cfg: Path, seeds: tuple[int, ...] = (), tokens: int = 0, log: Path | None = None,
                 argv: list[str] | None = None) -> None:
        """``lmcache-p2p agent`` with ``cfg``; with ``seeds``, the testing agent that first stores those
        synthetic prompts of ``tokens`` tokens; or the script ``argv`` (same ready line and signals)."""
        command = ["lmcache_p2p.testing.preloaded_agent"] if seeds else ["lmcache_p2p", "agent"]
        cmd = [sys.executable, "-m", *command, "--config", str(cfg), "--log-level", "INFO"]
        for seed in seeds:
            cmd += ["--preload-seed", str(seed), "--preload-tokens", str(tokens)]
        if argv is not None:
            cmd = [sys.executable, *argv]
        self._log = open(log or os.devnull, "w")  # noqa: SIM115 - closed in stop()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_P2P_")}
        env["UCX_NET_DEVICES"] = "lo"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self.info: dict[str, Any] = {}

    def wait_ready(self, timeout: float = 60.0) -> AgentProcess:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"agent exited with {self.proc.wait()} before it was ready")
            if line.startswith("{"):
                self.info = json.loads(line)
                return self
        raise TimeoutError("agent not ready")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` s (a bound: a clean stop on a loaded machine, each etcd
        and transfer step bounded by its own timeout, once took over 20 s). Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

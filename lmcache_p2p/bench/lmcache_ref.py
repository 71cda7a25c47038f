"""LMCache 0.5.6 server mode as the reference peer for ``bench vllm`` (facts: "LMCache 0.5.6 on CPU").

LMCache lives in its own venv (``.venv-lmcache``, made by ``scripts/install_lmcache.sh``), never in the
project's. The engines run our :mod:`lmcache_p2p.testing.engine_proc` under that venv's Python
(it imports only vLLM and the stdlib; this repository goes on ``PYTHONPATH``) with vLLM's
``LMCacheMPConnector`` talking to one ``lmcache server``:

1. start ``lmcache server`` on a free loopback port and wait until it listens;
2. engine 1: warm-up prompt, then every prompt (LMCache stores their KV); stop it;
3. engine 2 (a fresh process, empty KV cache, same connector): a different warm-up prompt, then the
   timed ``ttft`` op per prompt; the hit shows as ``num_cached_tokens``.

Prefix caching is off in the engines (engine_proc), so every hit comes from LMCache, not from vLLM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from ..testing.engine_client import EngineProcess
from ..testing.synthetic import synthetic_tokens

VENV_NAME = ".venv-lmcache"
DEFAULT_REPO_ROOT = Path(__file__).resolve().parents[2]

SERVER_START_TIMEOUT_S = 120.0
ENGINE_START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0


def venv_python(repo_root: str | Path = DEFAULT_REPO_ROOT) -> Path:
    return Path(repo_root) / VENV_NAME / "bin" / "python"


def lmcache_env(repo_root: str | Path = DEFAULT_REPO_ROOT) -> dict[str, str]:
    """Extra environment for processes of the LMCache venv: this repository importable, no telemetry."""
    root = str(Path(repo_root).resolve())
    pythonpath = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": root + (os.pathsep + pythonpath if pythonpath else ""),
            "LMCACHE_TRACK_USAGE": "false"}


def lmcache_available(repo_root: str | Path = DEFAULT_REPO_ROOT) -> bool:
    """True when ``.venv-lmcache`` exists and ``import lmcache`` works in it."""
    py = venv_python(repo_root)
    if not py.is_file():
        return False
    try:
        proc = subprocess.run([str(py), "-c", "import lmcache"], env={**os.environ, **lmcache_env(repo_root)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LMCacheServer:
    """One ``lmcache server`` process (its own session, so stop() leaves no children behind)."""

    def __init__(self, repo_root: str | Path = DEFAULT_REPO_ROOT, *, port: int | None = None,
                 log_path: str | Path | None = None, l1_size_gb: float = 1.0) -> None:
        self.port = port or _free_port()
        self.http_port = _free_port()  # its HTTP server defaults to 8080: never collide with anything there
        exe = Path(repo_root) / VENV_NAME / "bin" / "lmcache"
        cmd = [str(exe), "server", "--host", "127.0.0.1", "--port", str(self.port), "--chunk-size", "256",
               "--l1-size-gb", f"{l1_size_gb:g}", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
               "--disable-observability", "--disable-metrics",
               "--http-port", str(self.http_port)]
        self._log = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log or subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, env={**os.environ, **lmcache_env(repo_root)},
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        """The server's pid, also its session's id."""
        return self._proc.pid

    def wait_ready(self, timeout: float = SERVER_START_TIMEOUT_S) -> LMCacheServer:
        """Wait until the server's port accepts TCP connections (its ZMQ socket is bound)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {self._proc.returncode} before listening")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"lmcache server not listening on port {self.port} within {timeout:.0f}s")
            time.sleep(0.5)

    def stop(self, timeout: float = 20.0) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None


def _warmup_prompt(prompts: list[list[int]], seed: int) -> list[int]:
    """A random prompt as long as the first one, ids in the prompts' range, sharing no prefix with them."""
    lo = min(min(p) for p in prompts)
    hi = max(max(p) for p in prompts)
    n = len(prompts[0])
    for attempt in range(100):
        cand = [t + lo for t in synthetic_tokens(seed + attempt, n, hi - lo + 1)]
        if all(cand[0] != p[0] for p in prompts):
            return cand
    return cand


def mp_connector_config(port: int) -> dict[str, Any]:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}


def measure_lmcache_hit(model_dir: str | Path, prompts: list[list[int]], dtype: str = "bfloat16",
                        log_dir: str | Path | None = None, *, repo_root: str | Path = DEFAULT_REPO_ROOT,
                        engine_timeout: float = ENGINE_START_TIMEOUT_S,
                        request_timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """TTFT of ``prompts`` on a fresh engine whose KV comes from LMCache (stored there by another engine).

    Returns ``{"ttft_lmcache_hit_ms": median, "lmcache_cached_tokens": [per prompt],
    "lmcache_engine_start_s": engine 2's start-up, ...}`` (plus per-prompt TTFTs and output tokens).
    Raises if ``.venv-lmcache`` is missing (check :func:`lmcache_available` first).
    """
    if not prompts:
        raise ValueError("no prompts")
    py = venv_python(repo_root)
    if not py.is_file():
        raise FileNotFoundError(f"{py} missing: run scripts/install_lmcache.sh")
    logs = Path(log_dir) if log_dir is not None else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)

    def log(name: str) -> Path | None:
        return logs / name if logs is not None else None

    env = lmcache_env(repo_root)
    server: LMCacheServer | None = None
    engine: EngineProcess | None = None
    try:
        server = LMCacheServer(repo_root, log_path=log("lmcache_server.log")).wait_ready()
        kv = mp_connector_config(server.port)

        # Engine 1 fills LMCache.
        engine = EngineProcess(model_dir, name="lmcache-store", log_path=log("lmcache_engine_store.log"),
                               env=env, dtype=dtype, kv_transfer_json=kv, python=str(py))
        engine.wait_ready(engine_timeout)
        store_start_s = engine.startup_s
        engine.request("generate", [_warmup_prompt(prompts, 1_000_003)], timeout=request_timeout, max_tokens=1)
        t0 = time.perf_counter()
        engine.request("generate", prompts, timeout=request_timeout, max_tokens=1)
        store_s = time.perf_counter() - t0
        engine.stop()
        engine = None

        # Engine 2: a fresh process, so any hit is LMCache's.
        engine = EngineProcess(model_dir, name="lmcache-hit", log_path=log("lmcache_engine_hit.log"),
                               env=env, dtype=dtype, kv_transfer_json=kv, python=str(py))
        engine.wait_ready(engine_timeout)
        hit_start_s = engine.startup_s
        engine.request("generate", [_warmup_prompt(prompts, 2_000_003)], timeout=request_timeout, max_tokens=1)
        results = engine.request("ttft", prompts, timeout=request_timeout)
    finally:
        if engine is not None:
            engine.stop()
        if server is not None:
            server.stop()

    ttfts_ms = [round(r["ttft_s"] * 1000.0, 3) for r in results]
    return {"ttft_lmcache_hit_ms": round(statistics.median(ttfts_ms), 3),
            "lmcache_cached_tokens": [int(r["num_cached_tokens"]) for r in results],
            "lmcache_engine_start_s": round(float(hit_start_s or 0.0), 3),
            "lmcache_ttfts_ms": ttfts_ms,
            "lmcache_store_engine_start_s": round(float(store_start_s or 0.0), 3),
            "lmcache_store_s": round(store_s, 3),
            "lmcache_tokens": [list(r.get("tokens", [])) for r in results]}

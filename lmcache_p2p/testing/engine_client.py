"""The parent side of :mod:`.engine_proc`: start an engine process, send requests, stop it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .engine_proc import MARKER, engine_env

_AGENT_STOPPED = re.compile(rb"lmcache_p2p\.agent .*: agent \S+ stopped in ")


def stop_group(proc: subprocess.Popen[Any], log_path: Path | None, agents: int, timeout: float) -> None:
    """Stop an engine started in its own process group (``start_new_session``): SIGTERM to the group (vLLM's
    handlers shut its workers down, and each worker's agent stops: lease revoked, disk tier closed), then
    SIGKILL to what is left once each of its ``agents`` logged its stop in ``log_path``, the group is gone,
    or ``timeout`` passed. vLLM's own teardown after that (5-7 s on these hosts: its engine core waits out
    a grace period and is killed anyway) is not waited for."""
    if proc.poll() is None:
        since = _size(log_path)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _group_alive(proc.pid):
            if agents and log_path is not None and _stops_logged(log_path, since) >= agents:
                break
            if not agents and proc.poll() is not None:  # no agent: nothing of the rest is worth waiting for
                break
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine core and workers: leave none behind
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _size(path: Path | None) -> int:
    if path is not None:
        with contextlib.suppress(OSError):
            return path.stat().st_size
    return 0


def _stops_logged(path: Path, since: int) -> int:
    try:
        with path.open("rb") as f:
            f.seek(since)
            return len(_AGENT_STOPPED.findall(f.read()))
    except OSError:
        return 0


def group_states(pgid: int) -> list[str]:
    """The state (``/proc/PID/stat``: R, S, T, Z, ...) of each process of group ``pgid``."""
    states = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone
        if int(fields[2]) == pgid:
            states.append(fields[0])
    return states


def _group_alive(pgid: int) -> bool:
    """A process of group ``pgid`` (the engine and what it started) is still running (not a zombie)."""
    return any(state != "Z" for state in group_states(pgid))


class EngineProcess:
    def __init__(self, model: str | Path, agent_config: str | Path | None = None, *, name: str = "engine",
                 log_path: str | Path | None = None, env: dict[str, str] | None = None,
                 dtype: str = "bfloat16", kv_transfer_json: dict[str, Any] | None = None,
                 python: str = sys.executable, prefix_caching: bool = False,
                 prefix: Sequence[str] = (), tensor_parallel_size: int = 1, max_lora_rank: int = 0,
                 kv_cache_bytes: int | None = None) -> None:
        # ``python`` may be another venv's interpreter (e.g. .venv-lmcache/bin/python): engine_proc
        # imports only vLLM and the stdlib; put this repository on PYTHONPATH through ``env``.
        if agent_config is not None and kv_transfer_json is not None:
            raise ValueError("agent_config and kv_transfer_json are exclusive")
        # ``prefix``: e.g. ``ip netns exec NS`` (it execs, so the pid is the engine's own)
        cmd = [*prefix, python, "-m", "lmcache_p2p.testing.engine_proc", "--model", str(model),
               "--dtype", dtype]
        if agent_config is not None:
            cmd += ["--agent-config", str(agent_config)]
        if kv_transfer_json is not None:
            cmd += ["--kv-transfer-json", json.dumps(kv_transfer_json)]
        if prefix_caching:
            cmd.append("--prefix-caching")
        if tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if max_lora_rank > 0:  # LoRA on: requests may name an adapter (``lora=``)
            cmd += ["--max-lora-rank", str(max_lora_rank)]
        if kv_cache_bytes is not None:  # vLLM's KV cache (default 1 GiB): small, and requests get preempted
            cmd += ["--kv-cache-bytes", str(kv_cache_bytes)]
        self.name = name
        self._log_path = Path(log_path) if log_path else None
        self._log = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed in stop()
        self._agents = tensor_parallel_size if agent_config is not None else 0  # lmcache-p2p agents: one per worker
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log or subprocess.DEVNULL, text=True,
                                      env={**os.environ, **engine_env(tensor_parallel_size), **(env or {})},
                                      start_new_session=True)
        self._replies: deque[dict[str, Any]] = deque()
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()
        self.startup_s: float | None = None

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(MARKER):
                with self._cv:
                    self._replies.append(json.loads(line[len(MARKER):]))
                    self._cv.notify_all()
            elif self._log is not None:
                self._log.write(line)
        with self._cv:
            self._cv.notify_all()

    def _next(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._replies:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self._proc.returncode}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no reply within {timeout:.0f}s")
                self._cv.wait(min(left, 1.0))
            return self._replies.popleft()

    def wait_ready(self, timeout: float = 300.0) -> EngineProcess:
        reply = self._next(timeout)
        if not reply.get("ready"):
            raise RuntimeError(f"{self.name}: unexpected first reply {reply}")
        self.startup_s = float(reply["startup_s"])
        return self

    def request(self, op: str, prompts: list[list[int]], timeout: float = 300.0, **extra: Any) -> list[dict[str, Any]]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": op, "prompts": prompts, **extra}) + "\n")
        self._proc.stdin.flush()
        reply = self._next(timeout)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return list(reply["results"])

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, *, cache_salt: str | None = None,
                 lora: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Greedy outputs, one request per prompt, each under ``cache_salt`` and the LoRA adapter
        ``lora`` (``{"name", "id", "path"}``; None: the base model) when given."""
        extra: dict[str, Any] = {"max_tokens": max_tokens}
        if cache_salt is not None:
            extra["cache_salt"] = cache_salt
        if lora is not None:
            extra["lora"] = lora
        return self.request("generate", prompts, **extra)

    def batch(self, prompts: list[list[int]], max_tokens: int = 16) -> list[dict[str, Any]]:
        """Greedy outputs of every prompt submitted at once (they share, and may outgrow, the KV cache)."""
        return self.request("batch", prompts, max_tokens=max_tokens)

    def concurrent(self, prompts: list[list[int]], stream: list[int], stream_tokens: int = 4000,
                   watch_s: float = 0.0) -> list[dict[str, Any]]:
        """Each prompt served (one token) while a decode stream runs: ``ttft_s``, ``tokens``,
        ``num_cached_tokens``, ``max_gap_s`` (the stream's longest gap, until the answer or ``watch_s``
        after the prompt arrived, whichever is later), ``stream_tokens_during``."""
        return self.request("concurrent", prompts, stream=stream, stream_tokens=stream_tokens, watch_s=watch_s)

    def ttft(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        return self.request("ttft", prompts)

    def score(self, prompts: list[list[int]], max_tokens: int = 8, *, scored: int = 0,
              kv_transfer_params: dict[str, Any] | None = None, timeout: float = 300.0) -> list[dict[str, Any]]:
        """Each prompt through the step loop: ``tokens``, ``ttft_s``, ``num_cached_tokens``, the logprobs of
        its last ``scored`` tokens (``prompt_logprobs``) and of each generated one (``logprobs``)."""
        return self.request("score", prompts, timeout=timeout, max_tokens=max_tokens, scored=scored,
                            kv_transfer_params=kv_transfer_params)

    def serve(self, prompt: list[int], max_tokens: int = 8, timeout: float = 300.0) -> dict[str, Any]:
        """One greedy request: ``tokens``, ``ttft_s`` (measured in the engine) and ``num_cached_tokens``."""
        return self.request("serve", [prompt], timeout=timeout, max_tokens=max_tokens)[0]

    def signal_all(self, sig: int) -> None:
        """Signal the engine and every process it started (EngineCore, workers: its session)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine and every process it started (:func:`stop_group`: its agents stop cleanly)."""
        stop_group(self._proc, self._log_path, self._agents, timeout)
        self._reader.join(5)
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None and not pipe.closed:
                with contextlib.suppress(OSError):
                    pipe.close()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

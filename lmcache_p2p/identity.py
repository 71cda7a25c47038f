"""What a model *is*, for deciding who may share KV bytes: from its contents, not its location.

    model_identity("/models/llama-3-8b")        -> "sha:1f0c9a...-w:77b1e2..."   (a local directory)
    model_identity("meta-llama/Llama-3-8B", "a1b2c3")  -> "hf:meta-llama/Llama-3-8B@a1b2c3"

A local model directory is identified by

- ``cfg``: a digest of its ``config.json`` as canonical JSON (sorted keys), without the fields that
  only say where it was loaded from (``_name_or_path``) or by which library version;
- ``w``: a digest of its weight files by content: for every ``*.safetensors`` / ``*.bin`` /
  ``*.pt`` file (sorted by name), its name, size and bytes: all of them for files up to 256 MiB,
  else 64 blocks of 1 MiB at fixed offsets spread over the file (64 MiB read per file, whatever its
  size: a 140 GB model costs ~2 GB of reads, mostly from the page cache the engine just filled).
  A fine-tune differs in nearly every block; a change confined to unsampled bytes of a large file
  would go unnoticed, so give such models distinct revisions. The same weights under another path,
  or a copy, give the same digest.

So the same weights under two paths share chunks, and a model whose ``config.json`` differs in one
field, or whose weights differ, never does. A name that is not a local directory is a hub id: its
identity is the name and the revision (``main`` when none is pinned: pin revisions in production).
``lmcache-p2p identity MODEL`` prints the identity, for cache-only agents' ``layout.model_id``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import xxhash

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_PATH_FIELDS = ("_name_or_path", "transformers_version", "_commit_hash")
_FULL_BYTES = 256 << 20
_SAMPLES, _SAMPLE_BYTES = 64, 1 << 20


def model_identity(model: str | os.PathLike[str], revision: str | None = None) -> str:
    path = Path(model)
    if (path / "config.json").is_file():
        stamp = tuple((p.name, st.st_size, st.st_mtime_ns) for p in sorted(path.iterdir())
                      if p.name == "config.json" or p.name.endswith(_WEIGHT_SUFFIXES) for st in [p.stat()])
        return _local_identity(str(path.resolve()), stamp)
    return f"hf:{model}@{revision or 'main'}"


@functools.lru_cache(maxsize=16)
def _local_identity(path: str, _stamp: tuple[tuple[str, int, int], ...]) -> str:  # per version of the files
    root = Path(path)
    config = json.loads((root / "config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{root / 'config.json'}: not a JSON object")
    canonical = json.dumps({k: v for k, v in config.items() if k not in _PATH_FIELDS}, sort_keys=True,
                           separators=(",", ":"))
    cfg = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    weights = xxhash.xxh3_128()
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    for f in files:
        size = f.stat().st_size
        weights.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= _FULL_BYTES:
                while block := fh.read(8 << 20):
                    weights.update(block)
                continue
            for i in range(_SAMPLES):
                fh.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
                weights.update(fh.read(_SAMPLE_BYTES))
    return f"sha:{cfg}-w:{weights.hexdigest()[:16] if files else 'none'}"


_ADAPTER_FILES = ("adapter_config.json",)


def adapter_stamp(path: str | os.PathLike[str]) -> tuple[tuple[str, int, int], ...] | None:
    """The name, size and modification time of each of a LoRA adapter's files (a listing and a stat
    each, no read), or None when ``path`` is not a readable adapter directory."""
    try:
        files = sorted(p for p in Path(path).iterdir() if p.is_file()
                       and (p.name in _ADAPTER_FILES or p.name.endswith(_WEIGHT_SUFFIXES)))
        stamp = tuple((p.name, st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()])
    except OSError:
        return None
    return stamp if any(name.endswith(_WEIGHT_SUFFIXES) for name, _, _ in stamp) else None


def adapter_identity(name: str, path: str | os.PathLike[str]) -> str | None:
    """``name@digest`` of a LoRA adapter's files (its config and weights, by content), or None
    when ``path`` is not a readable adapter directory: an adapter we can't identify is not cached."""
    stamp = adapter_stamp(path)
    if stamp is None:
        return None
    try:
        return f"{name}@{_files_digest(str(Path(path).resolve()), stamp)}"
    except OSError:  # unreadable, or replaced while it was read
        return None


@functools.lru_cache(maxsize=64)
def _files_digest(path: str, stamp: tuple[tuple[str, int, int], ...]) -> str:  # per version of the files
    h = xxhash.xxh3_128()
    for name, size, _ in stamp:
        h.update(f"{name}\0{size}\0".encode())
        with open(Path(path) / name, "rb") as fh:
            while block := fh.read(8 << 20):
                h.update(block)
    return h.hexdigest()[:16]


_WEIGHT_SAMPLES = 64


def loaded_weights_digest(model: Any) -> bytes:
    """A 16-byte digest of ``model``'s parameters and buffers (a ``torch.nn.Module``) as loaded now, read
    where the weights live.

    The layout fingerprint names the model by its files (:func:`model_identity`), read once at start. A weight
    update in place (an RL trainer's broadcast, ``reload_weights``) then ``reset_prefix_cache`` leaves the
    fingerprint as it was, while every chunk a peer or the object store holds under it was computed with
    the old weights. So the worker takes this digest when it registers the KV cache and again at each
    cache reset; when it changed, the node stops sharing (``integrations/vllm/worker.py``).

    Per parameter and buffer, in name order: its name, shape and dtype, its sum and its L2 norm
    (accumulated in float64, on the tensor's own device: one read of the weights, 0.7 s for 134M fp32
    parameters on 2 CPU cores) and 64 elements at even strides. Any update of a tensor's values moves its
    sums (a change that keeps both sums and the sampled elements equal is not an update a trainer makes);
    the dtype and shape cover a reload in another precision or shape.
    """
    import torch

    h = hashlib.blake2b(digest_size=16, person=b"lmcp2p-weights")
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name].detach()
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            flat = t.reshape(-1)
            if flat.numel() == 0:
                continue
            if t.is_floating_point():
                sums = torch.stack([flat.sum(dtype=torch.float64),
                                    torch.linalg.vector_norm(flat, dtype=torch.float64)])
            else:  # quantized or integer storage: its values as they are
                sums = flat.sum(dtype=torch.float64).reshape(1)
            step = max(1, flat.numel() // _WEIGHT_SAMPLES)
            sample = flat[::step][:_WEIGHT_SAMPLES]
            h.update(sums.cpu().numpy().tobytes())
            h.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()

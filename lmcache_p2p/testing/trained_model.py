"""The tiny Llama, trained for a few minutes on local text: a model whose outputs show wrong KV.

    python -m lmcache_p2p.testing.trained_model PATH [--steps 100 --seed 0 ...]

A random-weight model's greedy outputs are near-flat, so KV from the wrong prompt, tenant or
adapter barely changes them. This one starts from :func:`.tiny_model.create_tiny_model` (same
geometry and tokenizer) and is trained with torch on this interpreter's stdlib sources: every
second file (sorted) is training text, the others are held out; the held-out perplexity before
and after training is recorded in the marker file. Nothing is downloaded.

Like the tiny model, creation is deterministic for a given spec on one machine (seeded init and
batch order; CPU kernels are deterministic for a fixed thread count) and idempotent: the marker
records the spec, and a directory that already holds it is left alone. The model is built in a
temporary sibling directory and renamed into place; concurrent builders of one path (several test
runs sharing the cache) wait on a lock file and the later ones find the model built.
:func:`trained_model_path` keeps one under the user's cache directory, so a test run pays the
training once per machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .tiny_model import MARKER as TINY_MARKER
from .tiny_model import create_tiny_model, stdlib_sources

log = logging.getLogger(__name__)

MARKER = "lmcache_p2p_trained_model.json"
TRAINED_MODEL_VERSION = 1
BOS_ID, EOS_ID = 1, 2  # the tiny tokenizer's <s> and </s> (</s> separates files in the token stream)
CACHE_ENV = "LMCACHE_P2P_MODEL_CACHE"
CACHED_NAME = "trained-tiny-llama"
EVAL_LEN = 512  # tokens per held-out window, whatever the training sequence length


@dataclasses.dataclass(frozen=True, slots=True)
class TrainSpec:
    """How the tiny Llama is trained. The default budget, 600 steps of 4 x 256 tokens, takes ~3.5 min
    on 2 idle cores; held-out perplexity (512-token windows) goes from ~4,300 to ~200. Measured on
    the same budget of tokens, more small steps beat fewer big ones this early in training
    (100 x 8 x 512: 395; 500 x 4 x 256: 226; 500 x 2 x 512: 274; lr 1e-2 instead of 3e-3: 400)."""

    steps: int = 600
    batch: int = 4
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    eval_windows: int = 32

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq_len", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if not 0 <= self.warmup <= self.steps:
            raise ValueError(f"warmup: must be in [0, steps={self.steps}], got {self.warmup}")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr: must be in (0, 1), got {self.lr}")
        if self.seed < 0:
            raise ValueError(f"seed: must not be negative, got {self.seed}")

    def marker(self) -> dict[str, Any]:
        # The training text is this interpreter's stdlib: another Python version is another model.
        return {"version": TRAINED_MODEL_VERSION, "stdlib": f"{sys.version_info[0]}.{sys.version_info[1]}",
                **dataclasses.asdict(self)}


def default_cache_dir() -> Path:
    """``$LMCACHE_P2P_MODEL_CACHE``, else ``$XDG_CACHE_HOME/lmcache-p2p/models`` (``~/.cache``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmcache-p2p" / "models"


def trained_model_path(cache_dir: str | Path | None = None, spec: TrainSpec | None = None) -> Path:
    """The trained model under ``cache_dir`` (default :func:`default_cache_dir`), built if missing."""
    return create_trained_model(Path(cache_dir or default_cache_dir()) / CACHED_NAME, spec)


def read_marker(path: str | Path) -> dict[str, Any] | None:
    """The marker of a trained model directory: ``spec``, ``perplexity`` (``random``, ``trained``,
    held out), ``train_s``; None when ``path`` holds none."""
    try:
        marker = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def held_out_prompts(model_dir: str | Path, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens (BOS, then the start of one held-out stdlib file each):
    text the model has not been trained on, whose continuations depend on every token before."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    prompts: list[list[int]] = []
    for source in stdlib_sources()[1::2]:
        ids = tokenizer.encode(source.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False).ids
        if len(ids) >= length - 1:
            prompts.append([BOS_ID, *ids[: length - 1]])
        if len(prompts) == n:
            return prompts
    raise ValueError(f"n: only {len(prompts)} held-out files hold {length} tokens, asked for {n}")


def create_trained_model(path: str | Path, spec: TrainSpec | None = None) -> Path:
    """Create the trained model at ``path`` (or reuse it if it already holds ``spec``)."""
    spec = spec or TrainSpec()
    path = Path(path).resolve()
    if _holds(path, spec):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / f".{path.name}.lock"):
        if _holds(path, spec):  # built by another process while this one waited
            return path
        if path.exists() and read_marker(path) is None and any(path.iterdir()):
            raise ValueError(f"path: {path} exists, is not empty and holds no trained model; refusing to replace it")
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            model_dir = _build(staging / "model", spec)
            if path.exists():
                shutil.rmtree(path)  # an older trained model (marker present): replace it
            model_dir.rename(path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("created trained model at %s: %s", path, read_marker(path))
    return path


def _holds(path: Path, spec: TrainSpec) -> bool:
    marker = read_marker(path)
    return marker is not None and marker.get("spec") == spec.marker()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(out: Path, spec: TrainSpec) -> Path:
    """Random init + tokenizer at ``out``, trained in place; its marker written last."""
    import torch
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    create_tiny_model(out, seed=spec.seed)
    (out / TINY_MARKER).unlink()  # no longer the random tiny model: never reused as one
    train, held = _token_streams(out / "tokenizer.json")
    torch.manual_seed(spec.seed)
    model: Any = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    random_ppl = _perplexity(model, held, spec)
    _train(model, train, spec)
    model.to(torch.bfloat16).to(torch.float32)  # rounded as saved and served; evaluated in fp32
    trained_ppl = _perplexity(model, held, spec)
    model.to(torch.bfloat16).save_pretrained(out)
    marker = {"spec": spec.marker(), "perplexity": {"random": round(random_ppl, 1), "trained": round(trained_ppl, 1)},
              "train_s": round(time.perf_counter() - t0, 1), "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    (out / MARKER).write_text(json.dumps(marker, sort_keys=True))
    out.chmod(0o755)
    return out


def _token_streams(tokenizer_file: Path) -> tuple[Any, Any]:
    """The training and held-out token streams: every second stdlib file each, joined by EOS."""
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    sources = stdlib_sources()
    streams = []
    for files in (sources[0::2], sources[1::2]):
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        docs = tokenizer.encode_batch(texts, add_special_tokens=False)
        streams.append(torch.tensor([t for doc in docs for t in [*doc.ids, EOS_ID]], dtype=torch.long))
    return streams[0], streams[1]


def _train(model: Any, tokens: Any, spec: TrainSpec) -> None:
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: _lr_factor(step, spec))
    model.train()
    t0 = time.perf_counter()
    for step in range(spec.steps):
        starts = torch.randint(0, len(tokens) - spec.seq_len, (spec.batch,), generator=gen)
        batch = torch.stack([tokens[s: s + spec.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == spec.steps - 1:
            log.info("step %d/%d: loss %.3f (%.1f s)", step + 1, spec.steps, loss.item(), time.perf_counter() - t0)
    model.eval()


def _lr_factor(step: int, spec: TrainSpec) -> float:
    """Linear warm-up, then a cosine decay to a tenth of the peak."""
    if step < spec.warmup:
        return (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(spec.steps - spec.warmup, 1)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def _perplexity(model: Any, tokens: Any, spec: TrainSpec) -> float:
    """Held-out perplexity over ``eval_windows`` windows of ``EVAL_LEN`` tokens spread evenly."""
    import torch

    stride = max((len(tokens) - EVAL_LEN) // spec.eval_windows, 1)
    windows = [tokens[i * stride: i * stride + EVAL_LEN] for i in range(spec.eval_windows)]
    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(0, len(windows), 8):
            batch = torch.stack(windows[i: i + 8])
            losses.append(model(input_ids=batch, labels=batch).loss.item() * len(batch))
    return math.exp(sum(losses) / len(windows))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Create the tiny Llama trained on stdlib text (offline).")
    parser.add_argument("path", type=Path)
    defaults = TrainSpec()
    for field in dataclasses.fields(TrainSpec):
        kind = float if field.name == "lr" else int
        parser.add_argument("--" + field.name.replace("_", "-"), type=kind, default=getattr(defaults, field.name))
    args = vars(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    path = create_trained_model(args.pop("path"), TrainSpec(**args))
    print(path)
    print(json.dumps(read_marker(path), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

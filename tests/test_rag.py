"""RAG documents as data (``lmcache_p2p/rag.py``, the router's ``prompts.py``): each document a message of its
own, its tokens placed with a real tokenizer and chat template (the tiny model's byte-level BPE, built
offline), the same tokens (and segment keys) wherever it appears; templates that merge or number messages
get no spans. The router with engines whose ``/tokenize`` renders with that tokenizer: the request it
forwards, the score it asks for, a 400 for bad documents. No vLLM here: ``tests/test_vllm_rag.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from test_router import FakeEngine, post, run_router

from lmcache_p2p.keys import FingerprintDigest
from lmcache_p2p.rag import DOCUMENT_FLAG, MAX_DOCUMENTS, DocumentError, document_prompt, hf_tokenize, place_documents
from lmcache_p2p.request_params import BLEND_PARAM, SEGMENTS_PARAM
from lmcache_p2p.router.app import Router
from lmcache_p2p.router.config import RouterConfig
from lmcache_p2p.router.policy import Policy
from lmcache_p2p.segments import segment_chunks
from lmcache_p2p.testing.tiny_model import create_tiny_model

# <s> and </s> are the tiny tokenizer's special tokens: they delimit messages as ChatML's do
DELIMITED = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
             "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
# SmolLM2-Instruct's own: a default system prompt before a first message that is not one
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '" + SMOL_SYSTEM + "' }}"
           "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
JOINED = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # neighbours' tokens merge
NUMBERED = "{% for m in messages %}<s>{{ loop.index }}. {{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
ROOT = FingerprintDigest(b"\x01" * 16)
SYSTEM = {"role": "system", "content": "Answer from the documents."}
DOCS = [{"title": "Harbour", "text": " ".join(f"The harbour of Veltra opens at {h} o'clock." for h in range(60))},
        {"title": "Lighthouse", "text": "The lighthouse on Kessel point was painted red in 1911."},
        "A plain-string document: ferries leave from pier 4, except on holidays."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(create_tiny_model(tmp_path_factory.mktemp("model") / "tiny"))


def ask(question: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": question}]


def test_documents_become_messages_before_the_last_user_message():
    marked = {"role": "user", "content": "a document already a message", DOCUMENT_FLAG: True}
    messages = [SYSTEM, marked, {"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "the question"}]
    plan = place_documents(messages, [DOCS[1], DOCS[2]])
    assert plan is not None and plan.documents == (1, 4, 5)
    assert [m["content"] for m in plan.messages] == [
        SYSTEM["content"], "a document already a message", "earlier", "ok",
        "Document: Lighthouse\n" + DOCS[1]["text"], DOCS[2], "the question"]
    assert all(DOCUMENT_FLAG not in m and m["role"] in ("system", "user", "assistant") for m in plan.messages)
    assert [(s, e, d) for s, e, d in plan.units()] == [(1, 2, True), (2, 4, False), (4, 5, True), (5, 6, True)]
    assert place_documents([SYSTEM], ["x"]).messages[-1] == {"role": "user", "content": "x"}  # no user: at the end
    assert place_documents(ask("q"), None) is None and place_documents(ask("q"), []) is None
    assert place_documents("not a list", None) is None  # not ours to judge: the engine answers


@pytest.mark.parametrize(("documents", "messages", "field"), [
    ("a string", ask("q"), "documents: a list"),
    ([{"title": "t"}], ask("q"), r"documents\[0\].text"),
    (["ok", {"text": 5}], ask("q"), r"documents\[1\].text"),
    ([{"text": "x", "title": 3}], ask("q"), r"documents\[0\].title"),
    ([7], ask("q"), r"documents\[0\]: an object"),
    (["d"] * (MAX_DOCUMENTS + 1), ask("q"), f"at most {MAX_DOCUMENTS}"),
    (None, [{"role": "user", "content": "d", DOCUMENT_FLAG: "yes"}], rf"messages\[0\].{DOCUMENT_FLAG}"),
    (["d"], "not a list", "messages: a list"),
])
def test_bad_documents_name_the_field(documents, messages, field):
    with pytest.raises(DocumentError, match=field):
        place_documents(messages, documents)


def test_a_document_has_the_same_tokens_and_keys_in_any_order_and_position(tokenizer):
    tokenize = hf_tokenize(tokenizer, DELIMITED)
    one = document_prompt(tokenize, ask("When does the harbour open?"), DOCS)
    two = document_prompt(tokenize, ask("What colour is the lighthouse?"), [DOCS[2], DOCS[0], DOCS[1]])
    assert one.unsegmented is None and len(one.spans) == 3 and len(two.spans) == 3
    assert one.kv_transfer_params == {SEGMENTS_PARAM: [list(s) for s in one.spans]}
    plan = place_documents(ask("When does the harbour open?"), DOCS)
    assert one.token_ids == tokenize(plan.messages, True)  # the prompt as the engine renders it
    assert one.token_ids[:one.spans[0][0]] == two.token_ids[:two.spans[0][0]]  # the same base
    for i, j in ((0, 1), (1, 2), (2, 0)):  # document i of the first prompt is document j of the second
        (s1, e1), (s2, e2) = one.spans[i], two.spans[j]
        assert one.token_ids[s1:e1] == two.token_ids[s2:e2]
        assert (s1, e1) != (s2, e2)
    assert one.spans[0][1] - one.spans[0][0] > 512  # the long document spans several chunks
    assert "Document: Lighthouse\nThe lighthouse on Kessel" in tokenizer.decode(one.token_ids[slice(*one.spans[1])])
    keys_one = [seg.keys for seg in segment_chunks(ROOT, one.token_ids, one.spans, 256)]
    keys_two = [seg.keys for seg in segment_chunks(ROOT, two.token_ids, two.spans, 256)]
    assert keys_one == [keys_two[1], keys_two[2], keys_two[0]]
    # the object itself, its own template set, is a tokenizer too
    tokenizer.chat_template = DELIMITED
    assert document_prompt(tokenizer, ask("When does the harbour open?"), DOCS) == one


def test_with_nothing_before_the_documents_the_base_is_what_the_template_puts_first(tokenizer):
    tokenize = hf_tokenize(tokenizer, SMOLLM2)
    question = [{"role": "user", "content": "Which pier?"}]
    one = document_prompt(tokenize, question, DOCS[1:])
    two = document_prompt(tokenize, question, DOCS[:1] + DOCS[1:][::-1])  # after another document
    assert one.unsegmented is None and two.unsegmented is None
    base = tokenizer.decode(one.token_ids[:one.spans[0][0]])
    assert base == SMOL_SYSTEM
    assert one.token_ids[slice(*one.spans[0])] == two.token_ids[slice(*two.spans[2])]
    assert one.token_ids[slice(*one.spans[1])] == two.token_ids[slice(*two.spans[1])]


@pytest.mark.parametrize("template", [DELIMITED, SMOLLM2])
def test_a_long_context_is_tokenized_once_not_once_per_document(tokenizer, template, monkeypatch):
    """A 20,000-character system prompt and history before 3 documents (and a long question with nothing
    before them): the documents are tokenized after a one-message stand-in, so the long text goes to the
    tokenizer twice (the prompt, the context) instead of once per document; the spans are those the
    context itself gives."""
    tokenize = hf_tokenize(tokenizer, template)
    history = [{"role": "system", "content": "Answer from the documents. " * 400},
               {"role": "user", "content": "Earlier question?"}, {"role": "assistant", "content": "Earlier answer."},
               {"role": "user", "content": "When does the harbour open?"}]
    for messages in (history, [{"role": "user", "content": "Which pier? " * 800}]):
        seen: list[list[dict[str, Any]]] = []

        def counting(ms: list[dict[str, Any]], gen: bool, seen: list[list[dict[str, Any]]] = seen) -> list[int]:
            seen.append(ms)
            return tokenize(ms, gen)

        placed = document_prompt(counting, messages, DOCS)
        assert placed.unsegmented is None and len(placed.spans) == 3
        long_calls = [ms for ms in seen if sum(len(str(m["content"])) for m in ms) > 4096]
        assert len(long_calls) == 2 and len(seen) >= 5, [len(ms) for ms in seen]
        monkeypatch.setattr("lmcache_p2p.rag.STAND_IN_OVER", 1 << 30)  # every unit after the context itself
        assert document_prompt(tokenize, messages, DOCS) == placed
        monkeypatch.undo()


@pytest.mark.parametrize(("template", "reason"), [(JOINED, "prefix_unstable"), (NUMBERED, "merged")])
def test_templates_that_merge_or_number_messages_get_no_spans(tokenizer, template, reason):
    # joined without delimiters, "Answer from the" and "se notes" become "... these notes": merged tokens
    messages = [{"role": "system", "content": "Answer from the"}, {"role": "user", "content": "which pier"}]
    placed = document_prompt(hf_tokenize(tokenizer, template), messages, ["se notes", "harbour opens"])
    assert placed.spans == [] and placed.unsegmented == reason and placed.kv_transfer_params == {}
    assert placed.token_ids  # still the prompt, for a request without segments


# -- the router -------------------------------------------------------------------------------------------


def template_engines(tokenizer: Any, template: str) -> type[FakeEngine]:
    class TemplateEngine(FakeEngine):
        """An engine whose chat ``/tokenize`` renders with a real tokenizer and template; ``broken``: 500s."""

        broken = False

        async def _tokenize(self, request: web.Request) -> web.Response:
            body = await request.json()
            self.tokenized += 1
            if self.broken:
                return web.json_response({"error": "boom"}, status=500)
            tokens = hf_tokenize(tokenizer, template)(body["messages"], body.get("add_generation_prompt", True))
            return web.json_response({"tokens": tokens, "count": len(tokens)})

    return TemplateEngine


def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": 4, **extra}


def test_the_router_forwards_documents_as_messages_with_their_spans_and_scores_them(tokenizer):
    scored: list[dict[str, Any]] = []
    expected = document_prompt(hf_tokenize(tokenizer, DELIMITED), ask("Which pier?"), DOCS)

    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        own = {"mine": 1, BLEND_PARAM: True}  # the client's own params; it asks to be blended
        status, _, _ = await post(url + "/v1/chat/completions",
                                  chat(ask("Which pier?"), documents=DOCS, kv_transfer_params=own))
        assert status == 200
        (sent,) = [b for e in engines for b in e.bodies]
        assert "documents" not in sent and sent["messages"] == place_documents(ask("Which pier?"), DOCS).messages
        assert sent["kv_transfer_params"] == {**own, SEGMENTS_PARAM: [list(s) for s in expected.spans]}
        assert scored[-1] == {"tokens": expected.token_ids, "segments": [list(s) for s in expected.spans],
                              "blend": True}
        # documents already messages, marked: the same prompt, the mark removed
        documents = [{**m, DOCUMENT_FLAG: True} for m in place_documents([], DOCS).messages]
        marked = [SYSTEM, *documents, ask("Which pier?")[1]]
        status, _, _ = await post(url + "/v1/chat/completions", chat(marked))
        assert status == 200
        sent = [b for e in engines for b in e.bodies][-1]
        assert sent["messages"] == place_documents(ask("Which pier?"), DOCS).messages
        assert sent["kv_transfer_params"] == {SEGMENTS_PARAM: [list(s) for s in expected.spans]}
        assert "blend" not in scored[-1]  # not said: the engines' blend.by_default decides
        # an app calling an engine directly gets the same from the helper and the engine's /tokenize
        direct = await asyncio.to_thread(document_prompt, engines[0].url, ask("Which pier?"), DOCS)
        assert direct == expected
        assert router.metrics.documents.labels("segments")._value.get() == 2

    run_router(2, scenario, engine_type=template_engines(tokenizer, DELIMITED), scored=scored)


def test_bad_documents_get_a_400_naming_the_field_and_reach_no_engine(tokenizer):
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        for documents, field in (("x", "documents"), ([{"text": 1}], "documents[0].text"),
                                 (["d"] * (MAX_DOCUMENTS + 1), "documents")):
            status, _, body = await post(url + "/v1/chat/completions", chat(ask("q"), documents=documents))
            error = json.loads(body)["error"]
            assert status == 400 and error["message"].startswith(field) and error["type"] == "invalid_request_error"
        assert not any(e.bodies or e.tokenized for e in engines)

    run_router(1, scenario, engine_type=template_engines(tokenizer, DELIMITED))


def test_without_a_template_that_places_documents_the_request_goes_without_spans(tokenizer):
    async def scenario(url: str, engines: list[FakeEngine], router: Router) -> None:
        status, _, _ = await post(url + "/v1/chat/completions", chat(ask("q"), documents=DOCS))
        assert status == 200 and "kv_transfer_params" not in engines[0].bodies[-1]
        assert engines[0].bodies[-1]["messages"] == place_documents(ask("q"), DOCS).messages  # rewritten all the same
        engines[0].broken = True  # type: ignore[attr-defined]
        status, _, _ = await post(url + "/v1/chat/completions", chat(ask("q"), documents=DOCS))
        assert status == 200 and "kv_transfer_params" not in engines[0].bodies[-1]
        assert router.metrics.documents.labels("merged")._value.get() == 1
        assert router.metrics.documents.labels("tokenize_failed")._value.get() == 1

    run_router(1, scenario, engine_type=template_engines(tokenizer, NUMBERED),
               config=RouterConfig(first_byte_timeout_s=2.0, documents_timeout_s=5.0))


def test_a_rag_request_goes_where_its_documents_are():
    from test_router import engine

    a, b = engine("a"), engine("b")
    kw: dict[str, Any] = {"tokens": 2000, "hash_key": b"k", "mean_prefill_s": 0.5, "s_per_token": 1e-3}
    # nobody holds its prefix; b can blend 1,500 of its document tokens (computing 400)
    score = {"nodes": [{"node": "a", "matched_tokens": 0, "estimated_load_ms": 0.0, "estimated_compute_ms": None},
                       {"node": "b", "matched_tokens": 0, "segment_tokens": 1500, "computed_tokens": 400,
                        "estimated_load_ms": 3.0, "estimated_compute_ms": None}]}
    choice = Policy("score_load").choose([a, b], score=score, **kw)
    assert choice is not None and choice.engine is b and choice.matched_tokens == 1600
    assert choice.expected_prefill_s == pytest.approx(0.003 + 0.4)


def test_the_router_cli_takes_a_documents_timeout():
    from lmcache_p2p.cli.router import parser

    args = parser().parse_args(["--engine", "http://x:1", "--documents-timeout", "3.5"])
    assert args.documents_timeout == 3.5
    with pytest.raises(ValueError, match="documents_timeout_s"):
        RouterConfig(documents_timeout_s=0)

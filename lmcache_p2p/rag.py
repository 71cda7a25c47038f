"""RAG documents as segments: each document a chat message of its own, and where its tokens lie.

A chat request may carry documents as data: vLLM's ``documents`` field (objects with ``text`` and
optionally ``title``, or plain strings), or messages marked ``"lmcache_p2p_document": true``.
:func:`place_documents` makes each one a message (role ``user``, ``"Document: {title}\\n{text}"``),
inserted before the last user message, and drops what vLLM would not know. :class:`SpanPlan` then finds
each document message's tokens in the prompt, from tokenizations with the engine's own chat template
(the router asks an engine's ``/tokenize``; :func:`document_prompt` any tokenizer)::

    messages:  | sys | doc A | doc B | note | doc C | question |
    context    T(sys)                      the messages before the first document (the base)
    units      T(sys + [doc A]), T(sys + [doc B]), T(sys + [note]), T(sys + [doc C]); each minus T(sys)
    full       T(all messages, as the request asks)
    check      full == base | A | B | note | C | rest      spans: where A, B and C lie in full

Every document message is tokenized alone after the same context, so when the prompt is that
concatenation a document's tokens are the same in every prompt with this base: what segment keys need
(``segments.py``). Delimiters such as ChatML's ``<|im_start|>`` keep a message's tokens from
merging with its neighbours'; a template that merges them, or renders a message by its position
(numbers it), fails the check and the request is served by prefix reuse only, with the reason. With no
message before the first document the context is the last message, and the base is what the template
puts before a first message (a default system prompt, BOS): ``T([doc A])`` minus A's tokens.
No tokenizer call tokenizes an empty conversation (transformers refuses one). A context over
``STAND_IN_OVER`` characters (a long history, a 7 MiB first message) is tokenized once; each unit
then follows a one-message stand-in (``T([stand-in] + [doc A]) - T([stand-in])``), and the check
above holds those pieces to the prompt all the same.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .request_params import MAX_SEGMENTS, SEGMENTS_PARAM

DOCUMENTS_FIELD = "documents"  # vLLM's chat field
DOCUMENT_FLAG = "lmcache_p2p_document"  # on a message: it is a document
MAX_DOCUMENTS = min(64, MAX_SEGMENTS)
STAND_IN_OVER = 4096  # characters of context past which documents are tokenized after a stand-in (SpanPlan)

Message = dict[str, Any]
ChatTokenize = Callable[[list[Message], bool], list[int]]
"""A chat template and tokenizer: (messages, add_generation_prompt) -> token ids."""


class DocumentError(ValueError):
    """A request's documents are malformed (the message names the field)."""


class NotSegmentable(ValueError):
    """The template does not place documents as independent token runs; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class SpanPlan:
    """A request's messages (its documents among them) and the tokenizations that place the documents."""

    messages: list[Message]
    documents: tuple[int, ...]  # indices of the document messages, ascending, at least one

    def units(self) -> list[tuple[int, int, bool]]:
        """``[start, end)`` runs of messages from the first document to the last, and whether the run is a
        document: each document alone, the messages between two documents together."""
        out: list[tuple[int, int, bool]] = []
        for i, d in enumerate(self.documents):
            if i and d > self.documents[i - 1] + 1:
                out.append((self.documents[i - 1] + 1, d, False))
            out.append((d, d + 1, True))
        return out

    def _context(self) -> list[Message]:
        return self.messages[:self.documents[0]] if self.documents[0] else self.messages[-1:]

    def _lead(self) -> list[Message] | None:
        """What each unit is tokenized after when the context is long (over ``STAND_IN_OVER`` characters): one
        short message of the context's last role, so that a long history is sent twice (the prompt, the
        context) rather than once per document. None: the context itself."""
        context = self._context()
        if sum(len(str(m.get("content", ""))) for m in context) <= STAND_IN_OVER:
            return None
        return [{"role": context[-1].get("role", "user"), "content": "."}]

    def calls(self) -> list[list[Message]]:
        """The message lists to tokenize without a generation prompt: the context, [a short stand-in for
        it,] each unit after the stand-in or the context, and (no message before the first document) the
        first document alone."""
        first, context, lead = self.documents[0], self._context(), self._lead()
        calls = [context] + ([lead] if lead is not None else [])
        calls += [(lead if lead is not None else context) + self.messages[s:e] for s, e, _ in self.units()]
        return calls + ([self.messages[:1]] if not first else [])

    def spans(self, tokenized: Sequence[Sequence[int]], full: Sequence[int]) -> list[tuple[int, int]]:
        """The document messages' ``[start, end)`` token spans in ``full`` (the prompt as the request asks
        for it), from the token ids of :meth:`calls`; :class:`NotSegmentable` when they do not add up.
        Units tokenized after a stand-in for the context are held to ``full`` like the others: a template
        that renders a message by what precedes it fails the check."""
        skip = 2 if self._lead() is not None else 1
        context, lead = list(tokenized[0]), list(tokenized[skip - 1])
        pieces = []
        for toks in tokenized[skip:skip + len(self.units())]:
            if list(toks[:len(lead)]) != lead or len(toks) == len(lead):
                raise NotSegmentable("prefix_unstable", "a message's tokens do not extend the tokens before it")
            pieces.append(list(toks[len(lead):]))
        base = context
        if not self.documents[0]:  # the base is what the template puts before the first message
            head = list(tokenized[-1])
            cut = len(head) - len(pieces[0])
            if cut < 0 or head[cut:] != pieces[0]:
                raise NotSegmentable("first_position", "the first document's tokens differ when it comes first")
            base = head[:cut]
        expect = base + [t for piece in pieces for t in piece]
        if list(full[:len(expect)]) != expect:
            raise NotSegmentable("merged", "the prompt's tokens are not the messages' own tokens in a row")
        spans, pos = [], len(base)
        for (_, _, document), piece in zip(self.units(), pieces, strict=True):
            if document:
                spans.append((pos, pos + len(piece)))
            pos += len(piece)
        return spans


def place_documents(messages: Any, documents: Any) -> SpanPlan | None:
    """The messages with ``documents`` (vLLM's field) inserted before the last user message, one message
    each, and every message's :data:`DOCUMENT_FLAG` removed; None when there are no documents.
    :class:`DocumentError` names what is malformed."""
    if documents is None:
        documents = []
    if not isinstance(documents, list):
        raise DocumentError(f"{DOCUMENTS_FIELD}: a list of documents is needed, got {type(documents).__name__}")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        if not documents:
            return None  # not ours to judge: the engine answers as it would
        raise DocumentError(f"messages: a list of message objects is needed with {DOCUMENTS_FIELD}")
    flagged = [_flag(m, i) for i, m in enumerate(messages)]
    total = len(documents) + sum(flagged)
    if not total:
        return None
    if total > MAX_DOCUMENTS:
        raise DocumentError(f"{DOCUMENTS_FIELD}: {total} documents, at most {MAX_DOCUMENTS}")
    placed = [_document_message(d, i) for i, d in enumerate(documents)]
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    at = users[-1] if users else len(messages)
    out = [{k: v for k, v in m.items() if k != DOCUMENT_FLAG} for m in messages]
    is_doc = flagged[:at] + [True] * len(placed) + flagged[at:]
    out = out[:at] + placed + out[at:]
    return SpanPlan(out, tuple(i for i, d in enumerate(is_doc) if d))


def _flag(message: Message, i: int) -> bool:
    flag = message.get(DOCUMENT_FLAG, False)
    if not isinstance(flag, bool):
        raise DocumentError(f"messages[{i}].{DOCUMENT_FLAG}: true or false, got {flag!r:.40}")
    return flag


def _document_message(doc: Any, i: int) -> Message:
    if isinstance(doc, str):
        return {"role": "user", "content": doc}
    if not isinstance(doc, dict):
        raise DocumentError(f"{DOCUMENTS_FIELD}[{i}]: an object with 'text' (and 'title') or a string is needed")
    text, title = doc.get("text"), doc.get("title")
    if not isinstance(text, str):
        raise DocumentError(f"{DOCUMENTS_FIELD}[{i}].text: a string is needed")
    if title is not None and not isinstance(title, str):
        raise DocumentError(f"{DOCUMENTS_FIELD}[{i}].title: a string is needed")
    return {"role": "user", "content": f"Document: {title}\n{text}" if title else text}


# -- for applications that call engines directly -----------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class DocumentPrompt:
    """A chat prompt's token ids (for ``/v1/completions``) and its documents' spans; no spans, and
    ``unsegmented`` saying why, when the template does not place documents independently."""

    token_ids: list[int]
    spans: list[tuple[int, int]]
    unsegmented: str | None = None

    @property
    def kv_transfer_params(self) -> dict[str, Any]:
        return {SEGMENTS_PARAM: [list(s) for s in self.spans]} if self.spans else {}


def document_prompt(tokenizer: ChatTokenize | str | Any, messages: list[Message], documents: Sequence[Any] = (),
                    *, add_generation_prompt: bool = True) -> DocumentPrompt:
    """The prompt of ``messages`` with ``documents`` (as :func:`place_documents` places them), tokenized
    by ``tokenizer``: a transformers tokenizer (its chat template), an engine's base URL (its
    ``/tokenize``: :func:`engine_tokenize`) or a :data:`ChatTokenize`. :class:`DocumentError` when the
    documents are malformed."""
    tokenize = chat_tokenize(tokenizer)
    plan = place_documents(messages, list(documents))
    if plan is None:
        return DocumentPrompt(tokenize(messages, add_generation_prompt), [], "no documents")
    full = tokenize(plan.messages, add_generation_prompt)
    try:
        return DocumentPrompt(full, plan.spans([tokenize(c, False) for c in plan.calls()], full))
    except NotSegmentable as exc:
        return DocumentPrompt(full, [], exc.reason)


def chat_tokenize(tokenizer: ChatTokenize | str | Any) -> ChatTokenize:
    if isinstance(tokenizer, str):
        return engine_tokenize(tokenizer)
    if hasattr(tokenizer, "apply_chat_template"):
        return hf_tokenize(tokenizer)
    if callable(tokenizer):
        return tokenizer
    raise TypeError(f"tokenizer: an engine URL, a transformers tokenizer or a callable, got {type(tokenizer)}")


def hf_tokenize(tokenizer: Any, chat_template: str | None = None) -> ChatTokenize:
    """A transformers tokenizer's chat template (or ``chat_template``) and vocabulary."""

    def tokenize(messages: list[Message], add_generation_prompt: bool) -> list[int]:
        out = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=True,
                                            add_generation_prompt=add_generation_prompt)
        ids = out["input_ids"] if isinstance(out, Mapping) else out  # transformers 5 answers a BatchEncoding
        return [int(t) for t in ids]

    return tokenize


def engine_tokenize(url: str, model: str | None = None, timeout_s: float = 10.0) -> ChatTokenize:
    """An OpenAI-compatible engine's ``POST /tokenize`` (vLLM's) with its own chat template."""

    def tokenize(messages: list[Message], add_generation_prompt: bool) -> list[int]:
        ask: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if model is not None:
            ask["model"] = model
        req = urllib.request.Request(url.rstrip("/") + "/tokenize", data=json.dumps(ask).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - the caller's engine
            return [int(t) for t in json.loads(resp.read())["tokens"]]

    return tokenize

"""A graded RAG task: fictional product sheets with checkable facts, and questions about them.

Each document describes one invented product (a name no model has seen) with facts unique across the
pool: its serial code, its colour and the city it is made in, padded with neutral prose (the same
sentences in every document, none naming the product) to about ``doc_words`` words. A question asks either

    single   one fact of one document in the prompt ("What is the serial code of the Ortes?", its
             colour, its city)
    pair     the same fact of two documents in the prompt ("What are the colours of the Ortes and
             the Nuri?"): it needs both

The answer is started for the model ("The serial code of the Ortes is"; for ``pair``, with the first
product): a 135M model answers far more often when it completes a sentence than when it writes one.
A ``single`` answer scores 1 when it names the expected value; a ``pair`` answer 0.5 per value it
names (:meth:`Question.score`). What a 135M model gets right with a full prefill decided this shape
(weights in grams, "which weighs more" comparisons and filler that names the product each had it
near chance; ``bench blend`` reports the full prefill's score next to every reuse mode). Facts and
wording are seeded: every run builds the same task.

Prompts are ChatML token ids built piece by piece, so each document is tokenized alone (its tokens
are the same wherever it appears, the condition for segment reuse), with the documents' spans::

    <|im_start|>system ...<|im_end|><|im_start|>user | doc | doc | doc | doc | Question: ...<|im_start|>assistant\nThe
    '------------------- base ---------------------'   '------ segments -----'   '------------ tail -----------------'
"""

from __future__ import annotations

import dataclasses
import random
import re
import string
from collections.abc import Callable, Sequence

SYSTEM = ("You are a precise assistant. Answer the question using only the product documents the user "
          "gives. Answer with the value or the product name only.")
_SYLLABLES = ["or", "va", "lin", "ka", "tes", "mo", "ri", "zen", "qua", "dor", "sel", "pix", "nu", "bra", "fen"]
_COLOURS = ["crimson", "teal", "amber", "violet", "ivory", "olive", "indigo", "coral", "slate", "saffron",
            "magenta", "jade", "copper", "lilac", "ochre", "cobalt"]
_CITIES = ["Tallinn", "Porto", "Dakar", "Quito", "Hobart", "Tromso", "Valletta", "Cusco", "Nagpur", "Perth",
           "Lyon", "Gdansk", "Mombasa", "Salta", "Bergen", "Osaka"]
_KINDS = ["desk lamp", "travel kettle", "field radio", "hand drill", "pocket camera", "smart scale",
          "air purifier", "e-reader", "bike light", "label printer", "rice cooker", "tide clock"]
_FILLER = [
    "Reviewers describe it as sturdy and easy to clean after daily use.",
    "Its housing is assembled from parts sourced from several regional suppliers.",
    "A two-year limited warranty covers manufacturing defects.",
    "Spare parts can be ordered through authorised service centres.",
    "The manual explains maintenance steps in plain language with clear drawings.",
    "Customers often mention how quietly it runs in a small apartment.",
    "The design team tested several prototypes before settling on the final shape.",
    "Firmware updates are published a few times each year.",
    "The product page lists accessories sold separately, such as a carrying pouch.",
    "Packaging is made from recycled cardboard with a printed quick-start card.",
]
FIELDS = ("code", "colour", "city")
_ASK = {"code": "What is the serial code of the {}?", "colour": "What is the colour of the {}?",
        "city": "In which city is the {} made?"}
_ASK_TWO = {"code": "What are the serial codes of the {} and the {}?",
            "colour": "What are the colours of the {} and the {}?",
            "city": "In which cities are the {} and the {} made?"}
_START = {"code": "The serial code of the {} is", "colour": "The colour of the {} is",
          "city": "The {} is made in the city of"}


@dataclasses.dataclass(frozen=True, slots=True)
class Product:
    name: str
    kind: str
    code: str
    colour: str
    city: str

    def sheet(self, words: int, rnd: random.Random) -> str:
        facts = [f"The {self.name} has the serial code {self.code}.",
                 f"The colour of the {self.name} is {self.colour}.",
                 f"The {self.name} is made in the city of {self.city}."]
        body = [f"The {self.name} is a {self.kind}.", *facts]
        while len(" ".join(body).split()) < words:
            body.insert(rnd.randrange(1, len(body) + 1), rnd.choice(_FILLER))
        return f"Product document: {self.name}\n" + " ".join(body) + "\n\n"


@dataclasses.dataclass(frozen=True, slots=True)
class Question:
    kind: str  # single | pair
    text: str
    start: str  # the answer's start, given to the model
    answers: tuple[str, ...]  # single: one value; pair: one per product

    def score(self, reply: str) -> float:
        """The share of the expected values the reply names, each as a word of its own ("1985" does not
        name 985): 0 or 1 for ``single``, 0, 0.5 or 1 for ``pair``."""
        said = reply.lower().replace(",", "")
        found = [re.search(rf"(?<![\w-]){re.escape(a.lower())}(?![\w-])", said) is not None for a in self.answers]
        return sum(found) / len(found)


def products(n: int, seed: int = 0) -> list[Product]:
    if n > len(_COLOURS):
        raise ValueError(f"docs: at most {len(_COLOURS)} products have facts unique across the pool")
    rnd = random.Random(seed)
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rnd.sample(_SYLLABLES, 2)).capitalize())
    codes: set[str] = set()
    while len(codes) < n:
        letters = "".join(rnd.choice(string.ascii_uppercase) for _ in range(2))
        codes.add(f"{letters}-{rnd.randrange(1000, 10000)}")
    return [Product(name, _KINDS[i % len(_KINDS)], code, _COLOURS[i], _CITIES[i])
            for i, (name, code) in enumerate(zip(sorted(names), sorted(codes), strict=True))]


def question(kind: str, chosen: Sequence[Product], rnd: random.Random) -> Question:
    field = rnd.choice(FIELDS)
    if kind == "pair":
        a, b = rnd.sample(list(chosen), 2)
        return Question("pair", _ASK_TWO[field].format(a.name, b.name), _START[field].format(a.name),
                        (getattr(a, field), getattr(b, field)))
    p = rnd.choice(list(chosen))
    return Question("single", _ASK[field].format(p.name), _START[field].format(p.name), (getattr(p, field),))


@dataclasses.dataclass(frozen=True, slots=True)
class RagPrompt:
    tokens: list[int]
    spans: list[list[int]]  # the documents' [start, end) token spans
    question: Question


class RagTask:
    """The pool of documents (each tokenized alone) and prompts over them."""

    def __init__(self, encode: Callable[[str], list[int]], docs: int = 8, doc_words: int = 330, seed: int = 0) -> None:
        self._encode = encode
        rnd = random.Random(seed + 1)
        self.products = products(docs, seed)
        self.doc_tokens = [self._ids(p.sheet(doc_words, rnd)) for p in self.products]
        self.base = self._ids(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")

    def _ids(self, text: str) -> list[int]:
        return list(self._encode(text))

    def prompt(self, order: Sequence[int], q: Question) -> RagPrompt:
        tokens, spans = list(self.base), []
        for i in order:
            spans.append([len(tokens), len(tokens) + len(self.doc_tokens[i])])
            tokens += self.doc_tokens[i]
        tokens += self._ids(f"Question: {q.text}<|im_end|>\n<|im_start|>assistant\n{q.start}")
        return RagPrompt(tokens, spans, q)

    def pairs(self, n: int, pick: int, seed: int = 0) -> list[tuple[RagPrompt, RagPrompt]]:
        """``n`` prompt pairs: the same ``pick`` documents in two orders, each with its own question;
        questions alternate single and pair."""
        rnd = random.Random(seed + 2)
        out = []
        for k in range(n):
            chosen = rnd.sample(range(len(self.products)), pick)
            order = list(chosen)
            while order == chosen:
                rnd.shuffle(order)
            kind = "single" if k % 2 == 0 else "pair"
            docs = [self.products[i] for i in chosen]
            out.append((self.prompt(chosen, question(kind, docs, rnd)), self.prompt(order, question(kind, docs, rnd))))
        return out

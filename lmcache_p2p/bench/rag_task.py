"""A graded RAG task: fictional product sheets with checkable facts, and questions about them.

Each document describes one invented product (a name no model has seen) with facts unique across the
pool: its weight in grams, its colour and the city it is made in (price and battery life too made the
task too hard for a 135M model even with a full prefill: 25 % right), padded with neutral prose to
about ``doc_words`` words. A question asks either

    single   one fact of one document in the prompt ("How much does the Onyx weigh, in grams?", its
             colour, its city)
    pair     a comparison of two documents in the prompt ("Which is heavier, the Onyx or the Vela?")

and an answer is right when it names the expected value (for ``pair``: the heavier product, and not
the other). Facts and wording are seeded: every run builds the same task.

Prompts are ChatML token ids built piece by piece, so each document is tokenized alone (its tokens
are the same wherever it appears, the condition for segment reuse), with the documents' spans::

    <|im_start|>system ...<|im_end|><|im_start|>user | doc | doc | doc | doc | Question: ...<|im_start|>assistant
    '------------------- base ---------------------'   '------ segments -----'   '----------- tail --------------'
"""

from __future__ import annotations

import dataclasses
import random
import re
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
    "The {name} ships in a recycled cardboard box with a printed quick-start card.",
    "Reviewers describe the {name} as sturdy and easy to clean after daily use.",
    "Its housing is assembled from parts sourced from several regional suppliers.",
    "A two-year limited warranty covers manufacturing defects of the {name}.",
    "Spare parts for the {name} can be ordered through authorised service centres.",
    "The manual explains maintenance steps in plain language with clear drawings.",
    "Customers often mention how quietly the {name} runs in a small apartment.",
    "The design team tested several prototypes before settling on the final shape.",
    "Firmware updates for the {name} are published a few times each year.",
    "The product page lists accessories sold separately, such as a carrying pouch.",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Product:
    name: str
    kind: str
    weight_g: int
    price_usd: int
    battery_h: int
    colour: str
    city: str

    def sheet(self, words: int, rnd: random.Random) -> str:
        facts = [f"The {self.name} is a {self.kind}.",
                 f"The {self.name} weighs {self.weight_g} grams.",
                 f"The {self.name} comes in {self.colour}.",
                 f"The {self.name} is made in {self.city}."]
        filler = [f.format(name=self.name) for f in _FILLER]
        body = list(facts)
        while len(" ".join(body).split()) < words:
            body.insert(rnd.randrange(1, len(body) + 1), rnd.choice(filler))
        return f"Product document: {self.name}\n" + " ".join(body) + "\n\n"


@dataclasses.dataclass(frozen=True, slots=True)
class Question:
    kind: str  # single | pair
    text: str
    answer: str
    wrong: str | None = None  # pair: the other product, which a right answer does not name

    def grade(self, reply: str) -> bool:
        said = reply.lower()
        if self.kind == "single":  # the value as a word or number of its own ("1985" does not name 985)
            return re.search(rf"(?<![\w]){re.escape(self.answer.lower())}(?![\w])", said.replace(",", "")) is not None
        assert self.wrong is not None
        return self.answer.lower() in said and self.wrong.lower() not in said


def products(n: int, seed: int = 0) -> list[Product]:
    rnd = random.Random(seed)
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rnd.sample(_SYLLABLES, 2)).capitalize())
    weights = rnd.sample(range(120, 990), n)
    prices = rnd.sample(range(15, 480), n)
    hours = rnd.sample(range(3, 60), n)
    return [Product(name, _KINDS[i % len(_KINDS)], weights[i], prices[i], hours[i], _COLOURS[i % len(_COLOURS)],
                    _CITIES[i % len(_CITIES)]) for i, name in enumerate(sorted(names))]


def question(kind: str, chosen: Sequence[Product], rnd: random.Random) -> Question:
    if kind == "pair":
        a, b = rnd.sample(list(chosen), 2)
        heavy, light = (a, b) if a.weight_g > b.weight_g else (b, a)
        return Question("pair", f"Which weighs more, the {a.name} or the {b.name}?", heavy.name, light.name)
    p = rnd.choice(list(chosen))
    field = rnd.choice(["weight_g", "colour", "city"])
    text = {"weight_g": f"How much does the {p.name} weigh, in grams?",
            "colour": f"What colour does the {p.name} come in?",
            "city": f"In which city is the {p.name} made?"}[field]
    return Question("single", text, str(getattr(p, field)))


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
        tokens += self._ids(f"Question: {q.text}<|im_end|>\n<|im_start|>assistant\n")
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

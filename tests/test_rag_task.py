"""The graded RAG task of ``bench blend --task facts``: documents, questions, spans and grading."""

from __future__ import annotations

from lmcache_p2p.bench.rag_task import Question, RagTask, products


def encode(text: str) -> list[int]:
    return list(text.encode())


def test_facts_are_unique_across_the_pool_and_the_task_is_the_same_every_run() -> None:
    pool = products(12, seed=3)
    for field in ("name", "code", "colour", "city"):
        assert len({getattr(p, field) for p in pool}) == 12, field
    assert products(12, seed=3) == pool and products(12, seed=4) != pool
    a, b = RagTask(encode, docs=6, seed=1), RagTask(encode, docs=6, seed=1)
    assert a.doc_tokens == b.doc_tokens and a.pairs(4, 3) == b.pairs(4, 3)


def test_each_prompt_holds_its_documents_at_their_spans_in_another_order_the_second_time() -> None:
    task = RagTask(encode, docs=6, doc_words=120)
    for first, second in task.pairs(6, 4):
        assert first.question.kind == second.question.kind
        docs = []
        for prompt in (first, second):
            assert prompt.tokens[: len(task.base)] == task.base
            found = [prompt.tokens[s:e] for s, e in prompt.spans]
            assert all(doc in task.doc_tokens for doc in found)
            docs.append(found)
        assert docs[0] != docs[1] and sorted(map(tuple, docs[0])) == sorted(map(tuple, docs[1]))
    sheet = bytes(task.doc_tokens[0]).decode()
    assert len(sheet.split()) >= 120 and f"serial code {task.products[0].code}." in sheet
    assert bytes(first.tokens[-40:]).decode().endswith(f"assistant\n{first.question.start}")


def test_answers_are_scored_by_the_values_they_name_each_as_a_word_of_its_own() -> None:
    single = Question("single", "What is the serial code of the Onyx?", "The serial code of the Onyx is", ("QX-985",))
    assert single.score(" QX-985.") == 1 and single.score("QX-985, like the Vela")
    assert single.score(" QX-9850") == 0 and single.score(" AQX-985") == 0 and single.score(" The Onyx") == 0
    pair = Question("pair", "What are the colours of the Onyx and the Vela?", "The colour of the Onyx is",
                    ("teal", "amber"))
    assert pair.score(" teal, and the Vela is amber.") == 1 and pair.score(" teal.") == 0.5
    assert pair.score(" tealish ambers") == 0

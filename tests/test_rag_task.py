"""The graded RAG task of ``bench blend --task facts``: documents, questions, spans and grading."""

from __future__ import annotations

from lmcache_p2p.bench.rag_task import Question, RagTask, products


def encode(text: str) -> list[int]:
    return list(text.encode())


def test_facts_are_unique_across_the_pool_and_the_task_is_the_same_every_run() -> None:
    pool = products(12, seed=3)
    for field in ("name", "weight_g", "price_usd", "battery_h"):
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
    assert len(sheet.split()) >= 120 and f"weighs {task.products[0].weight_g} grams" in sheet


def test_answers_are_graded_by_the_value_or_the_heavier_product_alone() -> None:
    single = Question("single", "How much does the Onyx weigh, in grams?", "985")
    assert single.grade("The Onyx weighs 985 grams.") and single.grade("985")
    assert single.grade("It weighs 1,985") is False and not single.grade("9850") and not single.grade("The Onyx")
    pair = Question("pair", "Which weighs more, the Onyx or the Vela?", "Onyx", "Vela")
    assert pair.grade("The Onyx.") and not pair.grade("The Vela") and not pair.grade("The Onyx or the Vela")

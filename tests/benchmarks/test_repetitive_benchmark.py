"""benchmarks/repetitive.py's workload: repetitive by design, made here, and nothing of Spec-Bench's."""

from __future__ import annotations

import pytest

from specserve.ablation.config import SPEC_BENCH
from specserve.training.self_instruct import CONTAMINATION_WORDS, evaluation_grams, word_grams
from tests.conftest import import_benchmark

repetitive = import_benchmark("repetitive")
EDITS, TASKS, workload = repetitive.EDITS, repetitive.TASKS, repetitive.workload


def test_the_workload_interleaves_extractions_with_conversations_whose_turns_follow_in_order():
    order = workload(60)
    assert len(order) == 60 and order == workload(60)  # fixed by its seed
    assert sum(conversation is None for _, conversation in order) == 40
    for c in range(len(TASKS)):
        turns = [text for text, conversation in order if conversation == c]
        assert turns and turns == [TASKS[c], *EDITS][: len(turns)]
    invoices = [text for text, conversation in order if conversation is None]
    assert len(set(invoices)) == len(invoices) and all("as JSON with the keys" in text for text in invoices)


@pytest.mark.skipif(not SPEC_BENCH.exists(), reason="Spec-Bench questions are not in ../shared/data")
def test_no_request_shares_a_13_gram_with_a_spec_bench_question():
    forbidden = evaluation_grams(SPEC_BENCH)
    for text, _ in workload(60):
        assert not word_grams(text, CONTAMINATION_WORDS) & forbidden, text

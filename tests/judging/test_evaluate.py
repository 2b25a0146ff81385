"""Held-out scores of a policy (node/judging/evaluate.py): greedy, and sampled at the run's temperature."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import pytest

from intellect_node.config import RunConfig
from intellect_node.judging import evaluate
from intellect_node.judging.evaluate import accuracy
from intellect_node.judging.tasks import task_source
from intellect_node.policy.model import build_model, build_tokenizer
from tests.helpers.tiny import run_spec

SPEC = run_spec(RunConfig(sampling={"max_new_tokens": 8}), seed=5)  # type: ignore[arg-type]
TOK = build_tokenizer(SPEC.model)
TASKS = [task_source(SPEC.task).assigned(5, "f" * 32, 0, 0, slot) for slot in range(12)]


def test_sampled_accuracy_is_a_share_of_samples_and_repeats_its_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """An untrained tiny model never answers right; a stand-in reward (1 for half of all texts, by their hash) makes
    the counts tell: a share of 60 samples, the same draws however the samples are batched, other draws under
    another seed, and greedy answers the same under every seed."""
    texts: list[str] = []

    def half(task: Any, text: str, *_: Any) -> float:
        texts.append(text)
        return float(hashlib.sha256(f"{task.id}/{text}".encode()).digest()[0] % 2)

    monkeypatch.setattr(evaluate, "reward", half)
    model = build_model(SPEC.model, TOK).eval()
    sampled = accuracy(SPEC, model, TOK, TASKS, rows=10, samples=5)
    assert len(texts) == 60 and len(set(texts)) > 12  # five draws per task, not five copies of one
    assert 0.0 < sampled < 1.0 and round(sampled * 60, 6).is_integer()
    assert accuracy(SPEC, model, TOK, TASKS, rows=7, samples=5) == sampled  # batched otherwise: the same draws
    texts.clear()
    accuracy(SPEC, model, TOK, TASKS, rows=10, samples=5)
    mine = list(texts)
    texts.clear()
    accuracy(SPEC, model, TOK, TASKS, rows=10, samples=5, seed=1)
    shared = sum((Counter(mine) & Counter(texts)).values())
    assert shared < 15  # the next seed draws anew (seeds shifted by one row shared 48 of the 60 draws)
    greedy = [accuracy(SPEC, model, TOK, TASKS, seed=s) for s in (0, 1000)]
    assert greedy[0] == greedy[1]

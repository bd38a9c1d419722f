"""The eval stage's numbers: the unbiased pass@k against its definition, and the per-domain
summary against a direct count."""
from __future__ import annotations

import itertools
import random

import pytest

from stages.eval.scoring import ALL_DOMAINS, Scored, pass_at_k, summarize


@pytest.mark.parametrize("trial", range(30))
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one(trial):
    rng = random.Random(trial)
    n = rng.randint(1, 8)
    c, k = rng.randint(0, n), rng.randint(1, n)
    subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


@pytest.mark.parametrize("n,k", [(4, 0), (4, 5)])
def test_pass_at_k_refuses_k_outside_1_to_n(n, k):
    with pytest.raises(ValueError, match=f"pass@{k}"):
        pass_at_k(n, 1, k)


def test_summary_per_domain_and_all():
    rng = random.Random(0)
    scored = [Scored(row, dom, float(rng.random() < 0.5), rng.randint(1, 50), rng.random() < 0.7)
              for row, dom in enumerate(["math"] * 6 + ["countdown"] * 4) for _ in range(4)]
    out = summarize(scored, [1, 4])
    assert set(out) == {"math", "countdown", ALL_DOMAINS}
    for dom, items in (("math", scored[:24]), ("countdown", scored[24:]), (ALL_DOMAINS, scored)):
        m = out[dom]
        assert m["rows"] == len(items) / 4 and m["responses"] == len(items)
        assert m["accuracy"] == pytest.approx(sum(s.score for s in items) / len(items))
        assert m["pass_at_1"] == pytest.approx(m["accuracy"])  # binary scores: pass@1 is the mean
        rows = {s.row_index for s in items}
        assert m["pass_at_4"] == pytest.approx(sum(any(s.score == 1 for s in items if s.row_index == r)
                                                for r in rows) / len(rows))
        assert m["response_len_mean"] == pytest.approx(sum(s.tokens for s in items) / len(items))
        assert m["eos_fraction"] == pytest.approx(sum(s.ended_by_eos for s in items) / len(items))


def test_rows_that_name_their_task_are_also_reported_per_domain_and_task():
    # rows 0-1: leg_counting, 2: chain_sum (4 samples each), 3: a math row without a task
    right = {0: [1, 1, 1, 1], 1: [1, 0, 0, 0], 2: [0, 0, 0, 0], 3: [1, 0, 1, 0]}
    task = {0: "leg_counting", 1: "leg_counting", 2: "chain_sum", 3: None}
    domain = {0: "reasoning_gym", 1: "reasoning_gym", 2: "reasoning_gym", 3: "math"}
    scored = [Scored(r, domain[r], float(x), 10, True, task[r]) for r, xs in right.items() for x in xs]
    out = summarize(scored, [4])
    assert set(out) == {"reasoning_gym", "reasoning_gym/leg_counting", "reasoning_gym/chain_sum", "math",
                        ALL_DOMAINS}
    legs = out["reasoning_gym/leg_counting"]
    assert legs["rows"] == 2 and legs["accuracy"] == pytest.approx(5 / 8) and legs["pass_at_4"] == 1.0
    assert legs["partly_right"] == 0.5          # row 1 only: row 0 is all right
    assert out["reasoning_gym/chain_sum"]["partly_right"] == 0.0
    assert out["reasoning_gym"]["rows"] == 3 and out[ALL_DOMAINS]["partly_right"] == pytest.approx(2 / 4)


def test_one_sample_per_row_reports_no_partly_right():
    out = summarize([Scored(0, "math", 1.0, 3, True), Scored(1, "math", 0.0, 3, True)], [])
    assert "partly_right" not in out["math"]

"""Strict grading (verifiers/grading.py) in every domain: the red team of red_team.py, built
from the hedge categories, gets 0 under strict grading (the RL reward) whatever reference
grading (evaluation) gives it; honest right answers in every format keep their reward under
both; the two gradings side by side per domain and category (run with -s to see the table);
how rows get their grading; and every check stays linear on hostile responses."""
from __future__ import annotations

import random
import time
from collections import defaultdict

import pytest

from data_curation.benchmarks import benchmarks_dir
from tests.conftest import NO_BENCHMARKS
from tests.verifiers import red_team
from tests.verifiers.test_verifiers_math import _answers, _rewrite
from verifiers import TaskRow, verify, verify_batch
from verifiers.grading import grading_of, with_grading

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tasks() -> list[red_team.Task]:
    return red_team.tasks()


def both(row: dict, response: str) -> tuple[float, float, str]:
    """(reference score, strict score, strict reason)."""
    strict = verify({**row, "grading": "strict"}, response)
    return verify(row, response).score, strict.score, strict.reason


def test_the_red_team_gets_nothing_under_strict_grading(tasks, capsys):
    table: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # n, reference paid, strict paid
    paid = []
    for task in tasks:
        for category, shape, response in red_team.red_team(task):
            ref, strict, _ = both(task.row, response)
            cell = table[(task.domain, category)]
            cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + (ref == 1), cell[2] + (strict > 0)
            if strict > 0:
                paid.append((task.domain, category, shape, response[-200:]))
    with capsys.disabled():
        print("\n" + f"{'domain':16s} {'category':16s} {'n':>4s} {'eval (reference) pays':>22s} {'RL (strict) pays':>17s}")
        for (domain, category), (n, ref, strict) in sorted(table.items()):
            print(f"{domain:16s} {category:16s} {n:4d} {ref:>22d} {strict:>17d}")
    assert sum(n for n, _, _ in table.values()) > 500
    assert {d for d, _ in table} == {"math", "reasoning_gym", "sudoku", "arc", "maze", "countdown", "knights_knaves",
                                     "code", "ifeval"}
    assert sum(ref for _, ref, _ in table.values()) > 100  # the red team is real: evaluation's grading pays much of it
    assert not paid, paid[:10]


def test_honest_right_answers_in_every_format_are_paid_under_both_gradings(tasks):
    unpaid = [(task.domain, fmt, ref, strict, reason) for task in tasks for fmt, response in red_team.controls(task)
              for ref, strict, reason in [both(task.row, response)] if (ref, strict) != (1.0, 1.0)]
    assert not unpaid, unpaid
    assert sum(len(red_team.controls(t)) for t in tasks) >= 80


@pytest.mark.parametrize("row,response", [
    ({"domain": "math", "reference": {"answer": "5"}}, r"\boxed{5 \text{ (or 6)}}"),
    ({"domain": "math", "reference": {"answer": r"\frac{1}{2}"}}, r"\boxed{\frac{1}{2} \text{ and/or } \frac{1}{3}}"),
    ({"domain": "math", "reference": {"answer": "5"}}, r"\boxed{5 \approx 6}"),
    ({"domain": "math", "reference": {"answer": "5"}}, "The answer is 6.\nThe answer is 5."),
    ({"domain": "math", "reference": {"answer": "5"}}, "The answer is 6. \\boxed{5}"),
])
def test_hedges_the_reference_grading_pays_in_math_are_refused_when_strict(row, response):
    ref, strict, reason = both(row, response)
    assert (ref, strict) == (1.0, 0.0) and reason.startswith("strict grading:"), reason


@pytest.mark.parametrize("gold,answer", [
    ("2, 3", r"x = 2 \text{ or } x = 3"), ("2, 3", r"\{2, 3\}"), ("(1, 2)", "x = 1, y = 2"),
    ("[1, 3)", r"1 \le x < 3"), (r"1 \le x < 3", "[1, 3)"), (r"1 \pm \sqrt{2}", r"1 \pm \sqrt{2}"),
    ("33799089600", "33,799,089,600 dollars"), ("5", "10 / 2"), ("-2", "-2"),
])
def test_a_gold_that_is_itself_a_list_set_or_interval_allows_as_much(gold, answer):
    ref, strict, reason = both({"domain": "math", "reference": {"answer": gold}}, f"\\boxed{{{answer}}}")
    assert (ref, strict) == (1.0, 1.0), reason


@pytest.mark.skipif(benchmarks_dir() is None, reason=NO_BENCHMARKS)
@pytest.mark.parametrize("name,limit", [("aime24.jsonl", None), ("amc23.jsonl", None), ("gsm8k.jsonl", 150),
                                        ("math500.jsonl", 300), ("minerva_math.jsonl", 80)])
def test_the_public_math_golds_keep_their_verdict_under_strict_grading(name, limit):
    """Every gold of the public test sets (a list, a set, an interval, an equation...), boxed as
    it is and rewritten in an equivalent form, is paid under both gradings."""
    rng = random.Random(0)
    changed = []
    for gold in _answers(name)[:limit]:
        for answer in (gold, _rewrite(gold, rng)):
            ref, strict, reason = both({"domain": "math", "reference": {"answer": gold}},
                                       f"<think>...</think> The answer is $\\boxed{{{answer}}}$.")
            if ref != strict:
                changed.append((gold, answer, reason))
    assert not changed, changed[:10]


def test_several_programs_and_a_helper_snippet():
    task = red_team.code_task()
    helper_first = "```python\nimport math\n```\n" + red_team.fenced(task.right)
    assert both(task.row, red_team.T + helper_first)[:2] == (1.0, 1.0)  # a snippet is no candidate program
    ref, strict, reason = both(task.row, red_team.T + task.extra["two_programs"])
    assert (ref, strict) == (1.0, 0.0) and "2 different programs" in reason


def test_rows_get_the_grading_they_do_not_name():
    rows = [{"domain": "math", "reference": "5"}, {"domain": "math", "reference": {"answer": "5"}, "grading": "reference"},
            {"domain": "ifeval", "reference": {"instructions": [{"type": "no_commas"}], "grading": "reference"}},
            {"domain": "ifeval", "reference": {"instructions": [{"type": "no_commas"}]}}]
    graded = with_grading(rows, "strict")
    assert [grading_of(TaskRow.coerce(r)) for r in graded] == ["strict", "reference", "reference", "strict"]
    assert rows[0] == {"domain": "math", "reference": "5"}  # the caller's rows are not changed
    # a row's grading reaches IFEval's verifier, which reads its reference's
    assert TaskRow.coerce(graded[3]).reference["grading"] == "strict"
    hack = "Apples\uff0c pears and plums."  # a full-width comma: the reference check does not see it
    assert [r.score for r in verify_batch(graded[2:], [hack, hack], num_workers=0)] == [1.0, 0.0]
    with pytest.raises(ValueError, match="grading must be one of"):
        with_grading(rows, "lenient")
    bad = verify({"domain": "math", "grading": "strict", "reference": {"answer": "5", "grading": "reference"}}, "5")
    assert bad.source == "invalid_row" and "disagree" in bad.reason


def test_eval_rows_name_no_grading_and_get_the_reference_verdict_unchecked():
    row = {"domain": "math", "reference": {"answer": "5"}}
    hedge = r"\boxed{5 \text{ (or 6)}}"
    evaluated = verify(row, hedge)
    assert evaluated.score == 1.0 and "hedged" not in evaluated.details  # no check: evaluation pays nothing more
    rl_reference = verify({**row, "grading": "reference"}, hedge)  # an RL stage set to reference grading
    assert rl_reference.score == 1.0 and rl_reference.details["hedge"] == "alternatives"
    assert "reference_score" not in rl_reference.details


def test_a_failing_check_leaves_a_reference_reward_and_fails_a_strict_one(monkeypatch):
    from verifiers import grading

    def broken(row, text, reward):
        raise RuntimeError("a bug in a check")

    monkeypatch.setitem(grading.HEDGE_CHECKS, "math", broken)
    row = {"domain": "math", "reference": {"answer": "5"}}
    kept = verify({**row, "grading": "reference"}, r"\boxed{5}")
    assert kept.score == 1.0 and "a bug in a check" in kept.details["hedge_check_error"]
    failed = verify({**row, "grading": "strict"}, r"\boxed{5}")
    assert failed.score == 0.0 and failed.source == "verifier_error"


def test_the_pool_grades_strictly_too():
    rows = with_grading([{"domain": "math", "reference": {"answer": "5"}}] * 2, "strict")
    rewards = verify_batch(rows, [r"\boxed{5}", r"\boxed{5 \text{ (or 6)}}"], num_workers=1, timeout_s=10)
    assert [r.score for r in rewards] == [1.0, 0.0] and rewards[1].details["reference_score"] == 1.0


HOSTILE = ["5 or " * 10_000 + "5", "(" * 50_000 + "5", "5, " * 20_000, "9" * 50_000, "1/" * 25_000,
           "between " * 8_000, "\\text{" * 8_000 + "5", "x = 1, " * 8_000, "5 / " * 12_000 + "5",
           "3 < x < " * 8_000, "\\pm " * 12_000, "Answer: 5\n\n" * 5_000, "<answer>5</answer>" * 3_000,
           "Final answer:\n" + "1 2\n3 4\n\n" * 5_000]  # ~50 KB each: a quadratic scan would take minutes


@pytest.mark.parametrize("hostile", HOSTILE, ids=range(len(HOSTILE)))
def test_the_strict_checks_are_fast_on_hostile_answers(hostile):
    """What strict grading adds to a rewarded response, on ~50 KB: each check, and each
    domain's whole check given the hostile text as the rewarded answer (the reference verdict
    before it, math-verify's or a family's, is bounded by the row's timeout as before)."""
    from verifiers import extract, hedges
    from verifiers.code_strict import code_hedge
    from verifiers.logic.strict import logic_hedge
    from verifiers.math_strict import math_hedge
    from verifiers.rgym_strict import rgym_hedge
    from verifiers.schema import Reward

    rows = {math_hedge: {"domain": "math", "reference": {"answer": "5"}},
            rgym_hedge: {"domain": "reasoning_gym", "reference": {"family": "leg_counting", "answer": "5", "metadata": {}}},
            logic_hedge: {"domain": "knights_knaves",
                          "reference": {"names": ["A"], "statements": [[0, {"is": 0, "knight": True}]]}},
            code_hedge: {"domain": "code", "reference": red_team.CODE_TESTS}}
    checks = [hedges.counts, hedges.alternatives, hedges.ranges, hedges.slash_parts, extract.stated_answers,
              extract.answer_is_blocks, extract.marked_answers, lambda t: hedges.more_than_gold(t, ["5", "(1, 2)"])]
    checks += [lambda t, f=f, row=row: f(TaskRow.coerce(row), t, Reward.one(extracted=t, source="answer_tag"))
               for f, row in rows.items()]
    for check in checks:
        t0 = time.perf_counter()
        check(hostile)
        assert time.perf_counter() - t0 < 3.0, (check, hostile[:40])


@pytest.mark.parametrize("hostile", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_responses_get_a_strict_verdict_without_a_timer(hostile):
    rows = [{"domain": "reasoning_gym", "reference": {"family": "leg_counting", "answer": "5", "metadata": {}}},
            {"domain": "knights_knaves", "reference": {"names": ["A"], "statements": [[0, {"is": 0, "knight": True}]]}}]
    for row in rows:
        for response in (f"<answer>{hostile}</answer>", hostile, f"\\boxed{{5}} {hostile} <answer>5</answer>"):
            t0 = time.perf_counter()
            r = verify({**row, "grading": "strict"}, response, timeout_s=None)  # no timer: the checks end by themselves
            assert r.source not in ("verifier_error", "timeout"), r.reason
            assert time.perf_counter() - t0 < 5.0, (row["domain"], response[:60])

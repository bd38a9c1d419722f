"""The `reasoning_gym` verifier domain through `verifiers.verify`: answer extraction from the
format the rows ask for, the family's own scorer, strict vs partial credit, bad rows, and
hostile responses (huge, nested, code the scorers would execute)."""
from __future__ import annotations

import inspect
import json
import re
import time

import pytest
import reasoning_gym
from reasoning_gym.factory import DATASETS

from verifiers import verify
from verifiers.rgym import EXCLUDED_FAMILIES
from verifiers.rgym_safety import EVAL_FAMILIES, SYMPY_FAMILIES


def row(family: str, idx: int = 0, partial_credit: bool = False, **config) -> dict:
    entry = json.loads(json.dumps(reasoning_gym.create_dataset(family, size=idx + 1, seed=7, **config)[idx]))
    return {"domain": "reasoning_gym", "prompt": entry["question"],
            "reference": {"family": family, "answer": entry["answer"], "metadata": entry["metadata"],
                          "config": config, "partial_credit": partial_credit}}


@pytest.fixture(scope="module")
def legs() -> dict:
    return row("leg_counting")


@pytest.mark.parametrize("template,source", [
    ("<think>\ncount\n</think>\n<answer>{a}</answer>", "answer_tag"),
    ("<think>x</think><answer>1</answer> then <ANSWER> {a} </ANSWER>", "answer_tag"),  # the last tag
    ("The total is \\boxed{{{a}}}.", "boxed"),
    ("so many legs\nFinal answer: {a}", "answer_is"),
    ("<think>\n</think>\n{a}", "whole_text"),
    ("1. Count the legs.\n\nSo, the final answer is {a}.", "answer_is"),  # SmolLM2-135M's own habit
    ("<answer>**{a}**</answer>", "answer_tag"),
])
def test_the_answer_is_read_from_the_format_asked_and_common_others(legs, template, source):
    r = verify(legs, template.format(a=legs["reference"]["answer"]))
    assert (r.score, r.source, r.extracted) == (1.0, source, legs["reference"]["answer"]), r


@pytest.mark.parametrize("response,needle", [
    ("<answer>1</answer>", "score_answer gave 0"),
    ("<answer></answer>", "empty"),
    ("<think>still counting", "not closed"),
    ("", "empty"),
    ("word " * 1000, "taken whole only up to"),
])
def test_wrong_malformed_and_missing_answers_score_zero_with_a_reason(legs, response, needle):
    r = verify(legs, response)
    assert r.score == 0.0 and needle in r.reason, r


def test_every_prompt_format_gold_answer_scores_one_after_a_json_round_trip():
    """ARC's scorer compares against tuples (restored); families without a gold answer
    (boxnet) are scored by validity and are not in this check."""
    for family in ("arc_agi", "rearc", "mini_sudoku", "countdown", "knights_knaves", "maze", "simple_integration"):
        r = row(family)
        assert verify(r, f"<answer>{r['reference']['answer']}</answer>").score == 1.0, family


def test_partial_credit_only_when_the_row_asks_for_it():
    strict, partial = row("knights_knaves"), row("knights_knaves", partial_credit=True)
    names = strict["reference"]["metadata"]["names"]
    terms = strict["reference"]["metadata"]["knight_knave_terms"]
    sol = strict["reference"]["metadata"]["solution"]
    one_wrong = ", ".join(f"{n} is {terms['a_knight'] if (s if i else not s) else terms['a_knave']}"
                          for i, (n, s) in enumerate(zip(names, sol)))
    s, p = verify(strict, f"<answer>{one_wrong}</answer>"), verify(partial, f"<answer>{one_wrong}</answer>")
    assert s.score == 0.0 and 0 < s.details["family_score"] < 1 and "partial credit off" in s.reason
    assert p.score == s.details["family_score"]


@pytest.mark.parametrize("reference,needle", [
    ("leg_counting", "must be an object"),
    ({"answer": "1", "metadata": {}}, "family"),
    ({"family": "no_such_family", "answer": "1", "metadata": {}}, "unknown reasoning-gym family"),
    ({"family": "composite", "answer": "1", "metadata": {}}, "unknown reasoning-gym family"),
    ({"family": "leg_counting", "answer": "1", "metadata": []}, "must be objects"),
])
def test_bad_references_score_zero_naming_the_problem(reference, needle):
    r = verify({"domain": "reasoning_gym", "reference": reference}, "<answer>1</answer>")
    assert r.score == 0.0 and needle in r.reason, r


@pytest.mark.parametrize("response", [
    "\\boxed{" * 100_000,                       # unclosed nested boxes (quadratic in a naive scan)
    "{" * 500_000 + "}" * 500_000,
    "<answer>" * 100_000 + "</answer>",
    "</answer>" * 100_000,
    "Answer: " * 100_000,
    "<answer>" + "9" * 50_000 + "</answer>",
    "<answer>\x00\ud800</answer>",
])
def test_hostile_responses_end_fast_without_an_exception(legs, response):
    t0 = time.perf_counter()
    r = verify(legs, response, timeout_s=None)  # no timer: the scan itself must be fast
    assert r.score == 0.0 and r.source not in ("verifier_error", "timeout")
    assert time.perf_counter() - t0 < 3.0


@pytest.mark.parametrize("family,answer", [
    ("countdown", "__import__('os').system('touch {marker}')"),
    ("countdown", "(exit)()"),
    ("countdown", "9**9**9**9"),
    ("puzzle24", "N(pi, 10**9)"),
    ("simple_integration", "open('{marker}', 'w')"),
    ("spiral_matrix", "[__import__('os').system('touch {marker}')]"),
    ("n_queens", "exit()"),
    ("intermediate_integration", "+".join(["sin(sin(sin(x)))"] * 100)),
])
def test_answers_the_scorer_would_execute_are_refused(tmp_path, family, answer):
    """reasoning-gym's scorers eval() / sympy.parse_expr() these families' answers: without the
    screen the first case runs a shell command in the verifier and (exit)() ends it."""
    marker = tmp_path / "pwned"
    r = verify(row(family), f"<answer>{answer.format(marker=marker)}</answer>", timeout_s=5)
    assert r.score == 0.0 and "scorer" in r.reason, r
    assert not marker.exists()


def test_every_family_whose_scorer_executes_the_answer_is_screened():
    """A later reasoning-gym release that adds eval() of an answer must fail here."""
    executes = re.compile(r"\beval\(answer|parse_expr\(answer")
    found = {name for name, (cls, _) in DATASETS.items()
             if executes.search(inspect.getsource(inspect.getmodule(cls)))}
    assert found <= EVAL_FAMILIES | SYMPY_FAMILIES, found - (EVAL_FAMILIES | SYMPY_FAMILIES)
    assert "composite" in EXCLUDED_FAMILIES


def test_a_timeout_during_the_first_import_leaves_reasoning_gym_whole():
    """The first row of a fresh worker imports reasoning_gym (seconds); a timer that expires
    meanwhile times that row out after the import, not inside it, so later rows score."""
    import subprocess
    import sys

    code = ("from verifiers import verify\n"
            "row = {'domain': 'reasoning_gym', 'reference': {'family': 'leg_counting', 'answer': '4', 'metadata': {}}}\n"
            "first = verify(row, '<answer>4</answer>', timeout_s=0.01)\n"
            "second = verify(row, '<answer>4</answer>', timeout_s=30)\n"
            "print(first.source, second.score)\n")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["timeout", "1.0"], out.stdout + out.stderr


def test_the_worker_pool_scores_rows_without_paying_the_import_in_a_row():
    """reasoning_gym takes over a second to import; the pool's forkserver preloads it
    (registry.WORKER_PRELOAD), so a 1 s row timeout is enough even for each worker's first row."""
    from verifiers import verify_batch

    rows = [row("leg_counting", i) for i in range(4)]
    answers = [f"<answer>{r['reference']['answer']}</answer>" for r in rows]
    rewards = verify_batch(rows, answers, num_workers=2, timeout_s=1.0)
    assert [r.score for r in rewards] == [1.0] * 4, [r.reason for r in rewards]

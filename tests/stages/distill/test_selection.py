"""Which responses the distill stage keeps (pure rules) and how it counts them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from stages.distill.selection import VERDICTS, normalise, report, verdicts


def rules(**over):
    base = {"min_score": 1.0, "require_eos": True, "min_tokens": 3, "longest": 10, "max_per_prompt": 2}
    return SimpleNamespace(**{**base, **over})


def s(response: str, score: float = 1.0, tokens: int = 5, eos: bool = True) -> dict:
    return {"response": response, "score": score, "tokens": tokens, "ended_by_eos": eos}


def test_each_rule_in_order():
    samples = [s("a", score=0.0), s("b", eos=False), s("c", tokens=2), s("d", tokens=11),
               s("The answer is 4."), s("  the ANSWER is\n4. "), s("x = 4"), s("y = 4"),
               s("z", score=0.0, eos=False, tokens=99)]  # a wrong answer is `rejected` whatever else
    assert verdicts(samples, rules()) == ["rejected", "truncated", "too_short", "too_long", "kept",
                                          "duplicate", "kept", "over_limit", "rejected"]


def test_bounds_are_inclusive_and_the_switches_work():
    assert verdicts([s("a", tokens=3), s("b", tokens=10)], rules()) == ["kept", "kept"]
    assert verdicts([s("a", eos=False)], rules(require_eos=False)) == ["kept"]
    assert verdicts([s("a", score=0.5), s("b", score=0.4)], rules(min_score=0.5)) == ["kept", "rejected"]
    assert verdicts([s("a"), s("b"), s("c")], rules(max_per_prompt=1)) == ["kept", "over_limit", "over_limit"]


def test_a_rejected_or_dropped_response_does_not_block_its_duplicate():
    """Dedup is among kept responses: an identical text that failed a rule earlier (cut,
    here) does not stop the same text from being kept."""
    assert verdicts([s("same", eos=False), s("same")], rules()) == ["truncated", "kept"]


@pytest.mark.parametrize("a,b", [("A  b\n", "a b"), ("ﬁx", "fix"), ("Straße", "STRASSE")])
def test_normalise(a, b):
    assert normalise(a) == normalise(b)


def test_report_counts_per_family_domain_and_overall():
    recs = [{"prompt": 0, "family": "sums", "domain": "math", "verdict": "kept"},
            {"prompt": 0, "family": "sums", "domain": "math", "verdict": "duplicate"},
            {"prompt": 1, "family": "sums", "domain": "math", "verdict": "rejected"},
            {"prompt": 1, "family": "sums", "domain": "math", "verdict": "rejected"},
            {"prompt": 2, "family": "cd", "domain": "countdown", "verdict": "too_long"},
            {"prompt": 2, "family": "cd", "domain": "countdown", "verdict": "kept"}]
    rep = report(recs, [{"family": "cd", "domain": "countdown"}])
    sums, cd, o = rep["families"]["sums"], rep["families"]["cd"], rep["overall"]
    assert (sums["prompts"], sums["samples"], sums["accepted"], sums["kept"], sums["prompts_with_kept"]) == (2, 4, 2, 1, 1)
    assert sums["acceptance_rate"] == 0.5 and sums["verdict_duplicate"] == 1 and sums["prompts_skipped"] == 0
    assert (cd["prompts"], cd["samples"], cd["accepted"], cd["kept"], cd["prompts_skipped"]) == (1, 2, 2, 1, 1)
    assert rep["domains"]["math"] == sums and rep["domains"]["countdown"] == cd
    assert (o["prompts"], o["samples"], o["accepted"], o["kept"], o["prompts_with_kept"]) == (3, 6, 4, 2, 2)
    assert sum(o[f"verdict_{v}"] for v in VERDICTS) == o["samples"]

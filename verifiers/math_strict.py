"""Strict grading of math answers (``grading.py``): what a rewarded math answer must not do.

The reference verdict (``math_answer.py``) reads one extracted answer; math-verify can find
the gold inside an answer that states more (``5 \\text{ (or 6)}``, ``\\frac12 \\text{ and/or }
\\frac13``, ``5 \\approx 6``), and the last of several marked answers wins. Strict grading
gives 0 to a rewarded answer that:

- marks several answers that are not all equivalent: boxes, "the answer is" lines, "####"
  lines (a marked answer with words in it is prose, not an answer, and is not compared);
- states more candidates than the gold has (``hedges.more_than_gold``): joined alternatives,
  a list, a range or a ``\\pm`` where one value is asked. A gold that is a list, a set or a
  tuple allows as many (``x = 2 \\text{ or } x = 3`` for ``2, 3``). An answer read by a
  fallback (the last number of an unmarked text) is judged with the whole text it came from:
  "$43 \\text{ or } 42$" offers two numbers, not the last one;
- joins candidates with a spaced slash, one of them equivalent to the gold by itself
  (``5 / 6`` for 5; ``10 / 2`` for 5 has no such side and stays a quotient).
"""
from __future__ import annotations

import re

from .extract import marked_answers
from .grading import Hedge, register_hedge_check
from .hedges import MAX_CANDIDATE_CHARS, more_than_gold, plain, slash_parts
from .math_answer import gold_answers, row_equal
from .schema import FALLBACK_SOURCES, Reward, TaskRow

MAX_COMPARED = 8  # marked answers compared with the extracted one; more different ones are a hedge by themselves
_PROSE_RE = re.compile(r"[A-Za-z]{2,}")
_COMMAND_RE = re.compile(r"\\[A-Za-z]+")


def _is_math(answer: str) -> bool:
    """A marked answer that is mathematics, not a sentence (no word outside LaTeX commands)."""
    return "\\boxed" not in answer and not _PROSE_RE.search(_COMMAND_RE.sub("", plain(answer)))


def _several(pred: str, text: str, same) -> Hedge | None:
    others = list(dict.fromkeys(a for a in marked_answers(text) if a != pred and _is_math(a)))
    if len(others) > MAX_COMPARED:
        return Hedge("several_answers", f"{len(others) + 1} different marked answers")
    for other in others:  # a long one differs from pred as text: no honest answer is restated at that length
        if max(len(pred), len(other)) > MAX_CANDIDATE_CHARS or not same(pred, other):
            return Hedge("several_answers", f"marked answers disagree: {pred[:60]!r} and {other[:60]!r}")
    return None


@register_hedge_check("math", "science")
def math_hedge(row: TaskRow, text: str, reward: Reward) -> Hedge | None:
    """Why a rewarded math answer is a hedge (module doc), or None."""
    pred = reward.extracted or ""
    equal = row_equal(row)
    golds = gold_answers(row.reference)
    several = _several(pred, text, lambda a, b: equal(a, b)[0])
    if several:
        return several
    found = more_than_gold(text if reward.source in FALLBACK_SOURCES else pred, golds)
    if found:
        return Hedge(*found)
    sides = [s for s in slash_parts(pred) if len(s) <= MAX_CANDIDATE_CHARS]
    right = next((s for s in sides if any(equal(g, s)[0] for g in golds)), None)
    if right is not None:
        return Hedge("alternatives", f"{len(sides)} candidates joined by a slash, {right[:60]!r} among them")
    return None

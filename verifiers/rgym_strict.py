"""Strict grading of reasoning-gym answers (``grading.py``): what a rewarded answer must not do.

The reference verdict is the family's own ``score_answer`` on the extracted answer
(``rgym.py``), and several families give full marks to an answer that holds the gold among
other candidates: a scorer that reads the first number or fraction in the text, a time
parser that stops at the first time, a knights-and-knaves parser that keeps a person's first
role ("Amelia is a hero and a villain"). Strict grading gives 0 to a rewarded answer that:

- states several marked answers (answer tags, boxes outside them, or, without either,
  "answer:" blocks) that the family does not all give full marks;
- offers more candidates than the family's gold answer has (``hedges.more_than_gold``):
  joined alternatives, more values than the gold (a list where one value is asked, a second
  grid, a role too many), a range where one number is asked. The gold is the template, so
  a family whose answer is itself a list, a set, a grid or a sentence allows as much; a
  family with no gold (scored by validity) allows no joined alternative;
- joins candidates with a spaced slash, one of which gets full marks by itself;
- is not the gold itself, in a family whose scorer passes other answers (``GOLD_ONLY``:
  game_of_life_halting gives full marks to any non-empty text).
"""
from __future__ import annotations

from typing import Any

from .extract import stated_answers
from .grading import Hedge, register_hedge_check
from .hedges import MAX_CANDIDATE_CHARS, alternatives, more_than_gold, slash_parts
from .rgym import DOMAIN, readings, score_readings
from .schema import Reward, TaskRow

MAX_COMPARED = 8  # stated answers scored against the extracted one; more different ones are a hedge by themselves
# families whose scorer gives full marks to answers other than the gold: strict grading wants the gold itself
GOLD_ONLY = {"game_of_life_halting": "its scorer compares bool(answer) with bool(gold): every non-empty answer passes"}


def _norm(answer: str) -> str:
    return " ".join(readings(answer)[-1].split())


def _not_gold(ref: dict[str, Any], answer: str) -> Hedge | None:
    why = GOLD_ONLY.get(ref["family"])
    if why is None or _norm(answer).lower() == _norm(str(ref.get("answer"))).lower():
        return None
    return Hedge("domain", f"{ref['family']} takes only its answer {str(ref.get('answer'))[:40]!r} ({why})")


def _full(ref: dict[str, Any], answer: str) -> bool:
    score, _, refused = score_readings(ref, ref["family"], answer)
    return refused is None and score >= 1.0 and _not_gold(ref, answer) is None


def _several(ref: dict[str, Any], text: str, answer: str) -> Hedge | None:
    mine = _norm(answer)
    others = list(dict.fromkeys(n for n in map(_norm, stated_answers(text)) if n and n != mine))
    if len(others) > MAX_COMPARED:
        return Hedge("several_answers", f"{len(others) + 1} different answers stated")
    wrong = next((o for o in others if len(o) > MAX_CANDIDATE_CHARS or not _full(ref, o)), None)
    if wrong is not None:
        return Hedge("several_answers", f"answers disagree: {answer[:60]!r} and {wrong[:60]!r}")
    return None


def _candidates(gold: Any, answer: str) -> Hedge | None:
    if gold is None:
        n = alternatives(answer)
        return Hedge("alternatives", f"{n} joined alternatives in the answer") if n else None
    found = more_than_gold(answer, [str(gold)])
    return Hedge(*found) if found else None


@register_hedge_check(DOMAIN)
def rgym_hedge(row: TaskRow, text: str, reward: Reward) -> Hedge | None:
    """Why a rewarded reasoning-gym answer is a hedge (module doc), or None."""
    ref: dict[str, Any] = row.reference  # type: ignore[assignment]  # a rewarded row's reference is valid
    answer = reward.extracted or ""
    found = (_not_gold(ref, answer) or _several(ref, text, answer)
             or _candidates(ref.get("answer"), readings(answer)[-1]))  # counted without emphasis, $ or final period
    if found:
        return found
    sides = [s for s in slash_parts(answer) if len(s) <= MAX_CANDIDATE_CHARS]
    right = next((s for s in sides if _full(ref, s)), None)
    if right is not None:
        return Hedge("alternatives", f"{len(sides)} candidates joined by a slash, {right[:60]!r} among them")
    return None

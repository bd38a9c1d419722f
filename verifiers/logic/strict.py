"""Strict grading of the logic games (``grading.py``).

Inside one answer the games are strict already: their verifiers take exactly one grid, one
line of moves, one expression, one role per person (``knight/knave``, "a knight or a knave",
two grids, "RRDD or DDRR" all score 0 under both gradings). What a reference verdict still
rewards is an answer stated several times, differently: the verifiers read the last answer
tag or box, so "\\boxed{wrong} ... \\boxed{right}" scores 1. Strict grading gives 0 to a
rewarded response whose stated answers (answer tags, boxes outside them, or, without either,
"answer:" blocks) differ and do not all score as the one that was read.
"""
from __future__ import annotations

from ..extract import stated_answers
from ..grading import Hedge, register_hedge_check
from ..registry import get_verifier
from ..schema import Reward, TaskRow

DOMAINS = ("sudoku", "maze", "countdown", "24game", "knights_knaves", "arc")
MAX_COMPARED = 8  # stated answers verified one by one; more different ones are a hedge by themselves


@register_hedge_check(*DOMAINS)
def logic_hedge(row: TaskRow, text: str, reward: Reward) -> Hedge | None:
    """Why a rewarded logic-game response is a hedge (module doc), or None."""
    stated = list(dict.fromkeys(" ".join(a.split()) for a in stated_answers(text) if a.strip()))
    if len(stated) < 2:
        return None
    if len(stated) > MAX_COMPARED:
        return Hedge("several_answers", f"{len(stated)} different answers stated")
    verify = get_verifier(row.domain)
    for answer in stated:
        if verify(row, f"<answer>{answer}</answer>").score < reward.score:
            return Hedge("several_answers", f"{len(stated)} different answers stated, {answer[:60]!r} "
                                            "scoring less than the one read")
    return None

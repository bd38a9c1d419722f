"""Gradings: ``reference`` for evaluation, ``strict`` for RL rewards, in every domain.

``reference`` gives each domain's own verdict: the reference checker's (IFEval), the
family's ``score_answer`` (reasoning-gym), equivalence with the gold (math), the game's
rules (logic), the tests (code). Right for evaluation, where scores must match what others
measure. But a reference verdict can reward a response that states several candidates (the
right one among them: "5 or 6", two answer tags, a range), and a policy learns within steps
to state them. ``strict`` gives such a response 0.

A row's grading is its ``grading`` (or its reference's ``grading``, IFEval's key since before
the other domains had one); ``reference`` when it names none. ``with_grading`` gives the rows
of an RL step the stage's grading (``strict`` by default). The domains' checks are
registered with ``register_hedge_check``: ``fn(row, text, reward) -> Hedge | None`` (the final
text and the reference reward of a rewarded response), and ``grade`` (run by ``verify``
after the domain's verifier, inside its time limit) applies them. IFEval's strict grading
lives in ``ifeval_strict.py``: its verifier reads the grading itself.

The check runs on every rewarded response of a row that names a grading, either one, so the
hedging monitor (``monitor.py``) sees hedges under reference grading too (an RL stage names
one on every row): ``details["hedged"]`` says whether it found one, ``details["hedge"]``
which, and under strict grading ``details["reference_score"]`` keeps the score it took away.
A row that names none (evaluation's) gets the reference verdict and no check.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .schema import Reward, TaskRow
from .timeouts import VerifierTimeout

GRADINGS = ("reference", "strict")
DEFAULT_GRADING = "reference"


@dataclass(frozen=True)
class Hedge:
    """A response that states more than one candidate: its category and why."""

    category: str  # one of HEDGE_CATEGORIES
    why: str


HEDGE_CATEGORIES = {
    "alternatives": "candidates joined by or / either...or / and/or / a slash",
    "list": "more values than the answer asks for (a list where one value is asked)",
    "range": "a range, or a value plus or minus another, where one value is asked",
    "several_answers": "several answer tags, boxes, answer lines or programs that disagree",
    "domain": "a domain's own rule (a reasoning-gym family whose scorer passes any answer takes only its gold)",
}

HedgeCheck = Callable[[TaskRow, str, Reward], "Hedge | None"]
HEDGE_CHECKS: dict[str, HedgeCheck] = {}


def register_hedge_check(*domains: str) -> Callable[[HedgeCheck], HedgeCheck]:
    def deco(fn: HedgeCheck) -> HedgeCheck:
        for d in domains:
            HEDGE_CHECKS[d] = fn
        return fn

    return deco


def check_grading(grading: Any, where: str = "grading") -> str:
    if grading not in GRADINGS:
        raise ValueError(f"{where} must be one of {list(GRADINGS)}, got {grading!r}")
    return grading


def named_grading(row: TaskRow) -> str | None:
    """The grading the row names: its own, else its reference's; None when it names none."""
    if row.grading is not None:
        return row.grading
    ref = row.reference if isinstance(row.reference, dict) else {}
    return None if ref.get("grading") is None else check_grading(ref["grading"], "reference.grading")


def grading_of(row: TaskRow) -> str:
    """The row's grading: the one it names, else ``reference``."""
    return named_grading(row) or DEFAULT_GRADING


def with_grading(rows: list[dict[str, Any]], grading: str) -> list[dict[str, Any]]:
    """The rows, each that names no grading given `grading` (an RL reward passes "strict"; a
    row that chose its grading keeps it). ``TaskRow`` passes it on to a dict reference that
    names none: IFEval's verifier reads its reference's."""
    check_grading(grading)
    out = []
    for row in rows:
        ref = row.get("reference")
        if row.get("grading") is None and not (isinstance(ref, dict) and ref.get("grading") is not None):
            row = {**row, "grading": grading}
        out.append(row)
    return out


def grade(row: TaskRow, text: str, reward: Reward) -> Reward:
    """The reward under the grading the row names: a rewarded response its domain's check
    finds hedging keeps its score under reference grading and gets 0 under strict grading.
    A row that names no grading (evaluation's) is not checked: its verdict is the reference's
    and costs nothing more. Under reference grading the check only informs the monitor, so a
    check that fails leaves the reward as it is (and says so in its details)."""
    grading, check = named_grading(row), HEDGE_CHECKS.get(row.domain)
    if grading is None or check is None or reward.score <= 0:
        return reward
    try:
        hedge = check(row, text, reward)
    except VerifierTimeout:
        raise  # the row's time is spent: the verdict is a timeout, whatever the grading
    except Exception as e:
        if grading == "strict":
            raise
        reward.details["hedge_check_error"] = f"{type(e).__name__}: {e}"[:200]
        return reward
    reward.details["hedged"] = hedge is not None
    if hedge is None:
        return reward
    reward.details["hedge"] = hedge.category
    if grading != "strict":
        return reward
    return Reward(score=0.0, extracted=reward.extracted, source=reward.source,
                  reason=f"strict grading: {hedge.why} (reference grading: {reward.score:g}, {reward.reason})",
                  details={**reward.details, "reference_score": reward.score})

"""Knights (always tell the truth) and Knaves (always lie).

Reference: {"names": [...], "statements": [[speaker_index, claim], ...]} where a claim is
``{"is": i, "knight": bool}``, ``{"not": c}``, ``{"and": [c, ...]}``, ``{"or": [c, ...]}``
or ``{"iff": [c, c]}``. Generated puzzles have exactly one solution (checked by brute
force). The verifier checks the answer's assignment against every statement (a knight's
claim is true, a knave's is false) and requires every person named exactly once.
"""
from __future__ import annotations

import itertools
import random
import re
from typing import Any

from ..registry import register_verifier
from ..schema import Reward, TaskRow
from . import ANSWER_INSTRUCTION

NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi"]


def holds(claim: dict[str, Any], roles: list[bool]) -> bool:
    if "is" in claim:
        return roles[claim["is"]] == claim["knight"]
    if "not" in claim:
        return not holds(claim["not"], roles)
    if "and" in claim:
        return all(holds(c, roles) for c in claim["and"])
    if "or" in claim:
        return any(holds(c, roles) for c in claim["or"])
    if "iff" in claim:
        a, b = claim["iff"]
        return holds(a, roles) == holds(b, roles)
    raise ValueError(f"unknown claim {claim}")


def consistent(statements: list, roles: list[bool]) -> bool:
    return all(holds(c, roles) == roles[s] for s, c in statements)


def solutions(n_people: int, statements: list) -> list[list[bool]]:
    return [list(r) for r in itertools.product([True, False], repeat=n_people) if consistent(statements, list(r))]


def say(claim: dict[str, Any], names: list[str]) -> str:
    if "is" in claim:
        return f"{names[claim['is']]} is a {'knight' if claim['knight'] else 'knave'}"
    if "not" in claim:
        return f"it is not the case that {say(claim['not'], names)}"
    if "and" in claim:
        return " and ".join(say(c, names) for c in claim["and"])
    if "or" in claim:
        return " or ".join(say(c, names) for c in claim["or"])
    a, b = claim["iff"]
    return f"{say(a, names)} if and only if {say(b, names)}"


def _random_claim(rng: random.Random, n: int, depth: int) -> dict[str, Any]:
    if depth <= 0 or rng.random() < 0.4:
        return {"is": rng.randrange(n), "knight": rng.random() < 0.5}
    kind = rng.choice(["and", "or", "not", "iff"])
    if kind == "not":
        return {"not": _random_claim(rng, n, depth - 1)}
    return {kind: [_random_claim(rng, n, depth - 1), _random_claim(rng, n, depth - 1)]}


def generate(n: int, seed: int, people: int = 3, depth: int = 1) -> list[dict]:
    """``people`` in 2..8; ``depth`` = nesting of and/or/not/iff in each claim."""
    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n:
        names = rng.sample(NAMES, people)
        statements = [[s, _random_claim(rng, people, depth)] for s in range(people)]
        sols = solutions(people, statements)
        if len(sols) != 1:
            continue
        lines = [f"{names[s]} says: \"{say(c, names)}.\"" for s, c in statements]
        prompt = (f"On an island, knights always tell the truth and knaves always lie. You meet {people} "
                  f"inhabitants: {', '.join(names)}.\n" + "\n".join(lines) +
                  f"\nWho is a knight and who is a knave?\n{ANSWER_INSTRUCTION} "
                  "Answer like: Alice is a knight, Bob is a knave.")
        out.append({"id": f"kk-{seed}-{len(out)}", "domain": "knights_knaves", "prompt": prompt,
                    "reference": {"names": names, "statements": statements,
                                  "solution": {nm: ("knight" if r else "knave") for nm, r in zip(names, sols[0])}}})
    return out


def parse_roles(text: str, names: list[str]) -> tuple[list[bool] | None, str]:
    roles: list[bool] = []
    for nm in names:
        found = set(m.lower() for m in re.findall(
            rf"\b{re.escape(nm)}\b\W*(?:is\W+(?:an?\W+)?|:\s*|=\s*|-\s*)?(knight|knave)s?\b", text, re.IGNORECASE))
        if not found:
            return None, f"no role given for {nm}"
        if len(found) > 1:
            return None, f"{nm} is called both knight and knave"
        roles.append(found.pop() == "knight")
    return roles, ""


@register_verifier("knights_knaves")
def verify_kk(row: TaskRow, text: str) -> Reward:
    ref = row.reference
    names = ref["names"]
    statements = ref["statements"]
    roles, problem = parse_roles(text, names)
    if roles is None:
        return Reward.zero(problem)
    extracted = ", ".join(f"{nm}={'knight' if r else 'knave'}" for nm, r in zip(names, roles))
    for s, claim in statements:
        if holds(claim, roles) != roles[s]:
            kind = "knight" if roles[s] else "knave"
            return Reward.zero(f"{names[s]} as a {kind} cannot say \"{say(claim, names)}\"", extracted=extracted)
    return Reward.one("assignment satisfies every statement", extracted=extracted)

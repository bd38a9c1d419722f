"""Knights (always tell the truth) and Knaves (always lie).

Reference: {"names": [...], "statements": [[speaker_index, claim], ...]} where a claim is
``{"is": i, "knight": bool}``, ``{"not": c}``, ``{"and": [c, ...]}``, ``{"or": [c, ...]}``
or ``{"iff": [c, c]}``. Generated puzzles have exactly one solution (checked by brute
force). The verifier checks the answer's assignment against every statement (a knight's
claim is true, a knave's is false); ``parse_roles`` says how the answer is read.
"""
from __future__ import annotations

import itertools
import random
import re
from typing import Any

from ..registry import register_verifier
from ..schema import Reward, TaskRow
from . import ANSWER_INSTRUCTION, answer_region

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


_ROLE_RE = re.compile(r"^(knight|knave)s?$", re.IGNORECASE)
_NEGATION = {"not", "isn't", "isnt", "never", "no", "neither", "nor", "aren't", "arent", "cannot", "can't"}
_TOKEN_RE = re.compile(r"[A-Za-z][A-Za-z'’]*|[^\sA-Za-z]")
_ASSIGN = {"is", "are", ":", "=", "-", "→", "was", "were", "be"}


def parse_roles(text: str, names: list[str]) -> tuple[list[bool] | None, str]:
    """Every person of the puzzle exactly one role, read strictly from the answer.

    A role word ("knight(s)"/"knave(s)") goes to the people named since the previous role
    word ("Alice is a knight", "Bob and Carol are knaves", "Dave: knave"). Rejected, with
    the reason: a role word with nobody before it ("a knight and a knave", "knight/knave"),
    a person given two different roles, a negated role ("is not a knave"), someone who is
    not in the puzzle given a role, a person of the puzzle given none."""
    by_lower = {n.lower(): n for n in names}
    roles: dict[str, str] = {}
    pending: list[str] = []
    stranger: str | None = None
    tokens = _TOKEN_RE.findall(text)
    for i, tok in enumerate(tokens):
        low = tok.lower()
        if low in by_lower:
            pending.append(by_lower[low])
            continue
        if low in _NEGATION:
            return None, f"negated role ({tok!r}): say what each person is"
        m = _ROLE_RE.match(tok)
        if m:
            role = m.group(1).lower()
            if stranger is not None and not pending:
                return None, f"{stranger} is not one of the puzzle's people ({', '.join(names)})"
            if not pending:
                return None, f"'{tok}' is not given to anyone: each role must follow the person's name"
            for person in pending:
                if roles.setdefault(person, role) != role:
                    return None, f"{person} is called both knight and knave"
            pending, stranger = [], None
            continue
        nxt = tokens[i + 1].lower() if i + 1 < len(tokens) else ""
        if tok[0].isupper() and nxt in _ASSIGN and low not in ("it", "this", "that", "so", "then", "thus"):
            stranger = tok
    missing = [n for n in names if n not in roles]
    if missing:
        return None, f"no role given for {', '.join(missing)}"
    return [roles[n] == "knight" for n in names], ""


@register_verifier("knights_knaves")
def verify_kk(row: TaskRow, text: str) -> Reward:
    ref = row.reference
    names = ref["names"]
    statements = ref["statements"]
    region, source = answer_region(text)
    roles, problem = parse_roles(region, names)
    if roles is None:
        return Reward.zero(problem, source=source)
    extracted = ", ".join(f"{nm}={'knight' if r else 'knave'}" for nm, r in zip(names, roles))
    for s, claim in statements:
        if holds(claim, roles) != roles[s]:
            kind = "knight" if roles[s] else "knave"
            return Reward.zero(f"{names[s]} as a {kind} cannot say \"{say(claim, names)}\"", extracted=extracted,
                               source=source)
    return Reward.one("assignment satisfies every statement", extracted=extracted, source=source)

"""Small arithmetic math rows for smoke tests of the RL loop with a tiny model."""
from __future__ import annotations

import random

PROMPT_SUFFIX = "Think inside <think> </think>, then write only the number after </think>."


def generate_arithmetic(n: int, seed: int, max_operand: int = 10, ops: str = "+-*") -> list[dict]:
    """Rows like {"domain": "math", "prompt": "What is 7 + 5? ...", "reference": {"answer": "12"}}.
    Subtraction keeps results non-negative."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(ops)
        if op == "-" and a < b:
            a, b = b, a
        ans = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"id": f"arith-{seed}-{i}", "domain": "math",
                     "prompt": f"What is {a} {op} {b}? {PROMPT_SUFFIX}",
                     "reference": {"answer": str(ans)}})
    return rows

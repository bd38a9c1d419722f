"""24 Game / Countdown: reach the target with + - * / over the given numbers.

Reference: {"numbers": [..], "target": t, "use_all": true}. ``use_all`` (24 Game rules):
every number exactly once; otherwise (Countdown rules) each number at most once. The
expression is parsed with ``ast`` (no eval): only integer literals, + - * /, parentheses;
arithmetic is exact (fractions), so 8/(3-8/3) = 24 counts and 24.0000001 does not.
"""
from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction

from ..registry import register_verifier
from ..schema import Reward, TaskRow
from . import ANSWER_INSTRUCTION, answer_region, one_line

MAX_EXPR_CHARS = 200
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


class BadExpression(ValueError):
    pass


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of ``expr`` and the integer literals it uses. Raises BadExpression."""
    if len(expr) > MAX_EXPR_CHARS:
        raise BadExpression("expression too long")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise BadExpression(f"not an arithmetic expression: {e.msg}") from None
    used: list[int] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and b == 0:
                raise BadExpression("division by zero")
            return _OPS[type(node.op)](a, b)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise BadExpression(f"{type(node).__name__} is not allowed (only integers, + - * / and parentheses)")

    return ev(tree.body), used


def normalise_expression(line: str) -> str:
    s = line
    for a, b in (("\\times", "*"), ("\\cdot", "*"), ("×", "*"), ("·", "*"), ("\\div", "/"), ("÷", "/"),
                 ("−", "-"), ("\\left", ""), ("\\right", ""), ("{", "("), ("}", ")"), ("[", "("), ("]", ")")):
        s = s.replace(a, b)
    s = re.sub(r"(?<=[\d)\s])x(?=[\s\d(])", "*", s)
    if "=" in s:  # "3*8 = 24" or "24 = 3*8": keep the side that is not just the target
        sides = [p.strip() for p in s.split("=") if p.strip()]
        ops = [p for p in sides if re.search(r"[-+*/]", p)]
        s = ops[0] if ops else sides[0]
    return s.rstrip(".").strip()


def _random_expression(nums: list[int], rng: random.Random) -> tuple[str, Fraction]:
    items = [(str(v), Fraction(v)) for v in nums]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (ea, va), (eb, vb) = items[i], items[j]
        op = rng.choice("+-*/")
        if op == "/" and (vb == 0 or (va / vb).denominator != 1):
            op = "+"
        if op == "-" and va < vb:
            (ea, va), (eb, vb) = (eb, vb), (ea, va)
        val = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va / vb if vb else va}[op]
        items = [it for k, it in enumerate(items) if k not in (i, j)] + [(f"({ea} {op} {eb})", val)]
    return items[0]


def generate(n: int, seed: int, count: int = 3, max_number: int = 9, max_target: int = 50,
             target: int | None = None, use_all: bool = True) -> list[dict]:
    """``count`` numbers in 1..``max_number``; the target is reachable by construction
    (a random expression over the numbers), positive and <= ``max_target``. ``target=24``
    with ``count=4`` gives the 24 Game (numbers retried until 24 is reachable)."""
    rng = random.Random(seed)
    out: list[dict] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 1000 * max(n, 1):
            raise ValueError("could not generate puzzles with these settings")
        nums = [rng.randint(1, max_number) for _ in range(count)]
        for _ in range(50):
            expr, val = _random_expression(nums, rng)
            if val.denominator == 1 and 0 < val <= max_target and (target is None or val == target):
                break
        else:
            continue
        t = int(val)
        rule = "each number exactly once" if use_all else "each number at most once"
        prompt = (f"Using the numbers {', '.join(map(str, nums))} ({rule}) and + - * / with parentheses, "
                  f"make {t}.\n{ANSWER_INSTRUCTION} Write only the expression, for example (1 + 2) * 3.")
        out.append({"id": f"countdown-{seed}-{len(out)}", "domain": "countdown", "prompt": prompt,
                    "reference": {"numbers": nums, "target": t, "use_all": use_all, "example": expr}})
    return out


@register_verifier("countdown", "24game")
def verify_countdown(row: TaskRow, text: str) -> Reward:
    ref = row.reference
    nums, target = [int(v) for v in ref["numbers"]], Fraction(ref["target"])
    region, source = answer_region(text)
    line = one_line(region)
    if line is None:
        return Reward.zero("the answer must be one expression on one line", source=source)
    expr = normalise_expression(line)
    if not expr:
        return Reward.zero("no expression in the final answer", source=source)
    try:
        value, used = evaluate(expr)
    except BadExpression as e:
        return Reward.zero(str(e), extracted=expr, source=source)
    have, want = Counter(used), Counter(nums)
    if ref.get("use_all", True):
        if have != want:
            return Reward.zero(f"uses {sorted(used)}, must use exactly {sorted(nums)}", extracted=expr, source=source)
    elif have - want:
        return Reward.zero(f"uses {sorted((have - want).elements())} beyond the given numbers", extracted=expr,
                           source=source)
    if value != target:
        return Reward.zero(f"evaluates to {value}, not {target}", extracted=expr, source=source)
    return Reward.one("reaches the target with the given numbers", extracted=expr, source=source)

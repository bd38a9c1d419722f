"""Generated math verification cases: equivalent forms that must score 1 and near misses
that must score 0, by category, for measuring the math verifier (tests and
``benchmarks/verifier_throughput.py --math-cases``).

    cases = generate_cases(n_per_category=20, seed=0)   # [Case(category, kind, row, response)]
    table = score_cases(cases)                          # {category: {"n", "ok", "rate"}}

``kind`` is "equivalent" (a correct answer written another way) or "near_miss" (a wrong
answer that looks like the right one: off by a little, extra letters, a second
candidate, a stray option letter, a number list, an interval with the wrong bracket).
"""
from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from .api import verify

Row = dict[str, Any]


@dataclass(frozen=True)
class Case:
    category: str
    kind: str  # "equivalent" | "near_miss"
    row: Row
    response: str


def _row(gold: str, **ref: Any) -> Row:
    return {"domain": "math", "prompt": ref.pop("prompt", ""), "reference": {"answer": gold, **ref}}


def _boxed(pred: str) -> str:
    return f"<think>work</think> The answer is $\\boxed{{{pred}}}$."


def _integers(rng: random.Random) -> tuple[list[tuple[Row, str]], list[tuple[Row, str]]]:
    v = rng.choice([rng.randint(2, 99), rng.randint(100, 99999), rng.randint(10**6, 10**11) // 100 * 100])
    g = _row(str(v))
    digits = str(v).rstrip("0")
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    same = [f"{v:,}", f"{v}.0", f"{v}.00", f"\\${v:,}", f"{v:,} dollars", f"{v} \\text{{ cm}}", f"{v} units",
            f"+{v}", f"{mantissa}e{len(str(v)) - 1}", f"{mantissa} \\times 10^{{{len(str(v)) - 1}}}"]
    near = [f"{v + 1}", f"{v - 1}", f"{v + 1}.0", f"{v - 1}.0", f"{v * 10}", f"{v}.5", f"{v}.000001", f"-{v}",
            f"{v}i", f"{v}x", f"{v}n", f"{v} \\text{{ or }} {v + 1}", f"{v}, {v + 1}", f"{v} or {v + 1}",
            f"\\pm {v}", f"{v}\\sqrt{{2}}", f"\\frac{{{v}}}{{2}} x"]
    return [(g, _boxed(s)) for s in same], [(g, _boxed(s)) for s in near]


def _fractions(rng: random.Random):
    b = rng.choice([3, 6, 7, 9, 11, 12, 14])  # non-terminating decimals: rounding them is a near miss
    a = rng.choice([k for k in range(1, 3 * b) if Fraction(k, b).denominator == b])
    f = Fraction(a, b)
    g = _row(f"\\frac{{{a}}}{{{b}}}")
    same = [f"{a}/{b}", f"\\dfrac{{{a}}}{{{b}}}", f"\\tfrac{a}{b}" if a < 10 and b < 10 else f"{a}/{b}",
            f"{float(f):.10f}", f"\\frac{{{2 * a}}}{{{2 * b}}}", f"{a} / {b}"]
    near = [f"{a + 1}/{b}", f"{a}/{b + 1}", f"{b}/{a}", f"{float(f):.2f}", f"{float(f):.3f}", f"-{a}/{b}",
            f"\\frac{{{a}}}{{{b}}}x", f"{a}"]
    return [(g, _boxed(s)) for s in same], [(g, _boxed(s)) for s in near]


def _decimals(rng: random.Random):
    v = Fraction(rng.randint(101, 99999), 10 ** rng.choice([1, 2, 3]))
    while v.denominator == 1:
        v += Fraction(1, 10)
    text = f"{float(v):g}"
    g = _row(text)
    same = [f"{v.numerator}/{v.denominator}", f"\\frac{{{v.numerator}}}{{{v.denominator}}}", text + "0",
            f"{float(v) * 100:g}\\%"]
    step = Fraction(1, v.denominator)
    near = [f"{float(v + step):g}", f"{float(v - step):g}", f"{float(v * 10):g}", f"{float(v) * (1 + 1e-4):.8g}",
            f"{round(float(v))}", f"{text}i"]
    return [(g, _boxed(s)) for s in same], [(g, _boxed(s)) for s in near]


def _currency_percent(rng: random.Random):
    dollars = rng.randint(1000, 99999)
    pct = rng.randint(1, 99)
    money, percent = _row(f"{dollars}"), _row(f"{pct}\\%")
    same = [(money, f"The answer is ${dollars:,}."), (money, _boxed(f"\\${dollars:,}")),
            (money, f"</think> Final answer: $\\${dollars:,}$"), (money, _boxed(f"\\${dollars:,}.00")),
            (percent, _boxed(f"{pct / 100:g}")), (percent, _boxed(f"{pct}\\%")), (percent, f"The answer is {pct}%.")]
    near = [(money, _boxed(f"\\${dollars + 1:,}")), (money, _boxed(f"\\${dollars:,}.50")),
            (money, _boxed(f"\\${dollars // 10:,}")), (percent, _boxed(f"{pct + 1}\\%")),
            (percent, _boxed(f"{pct / 1000:g}"))]
    return same, near


def _intervals(rng: random.Random):
    a = rng.randint(-9, 9)
    b = a + rng.randint(1, 9)
    pairs_same = [(f"x > {a}", f"({a}, \\infty)"), (f"({a}, \\infty)", f"x > {a}"), (f"[{a}, {b})", f"{a} \\le x < {b}"),
                  (f"{a} \\le x < {b}", f"[{a}, {b})"), (f"(-\\infty, {a}]", f"x \\le {a}"),
                  (f"x < {a} \\text{{ or }} x > {b}", f"(-\\infty, {a}) \\cup ({b}, \\infty)")]
    pairs_near = [(f"x > {a}", f"[{a}, \\infty)"), (f"({a}, \\infty)", f"x \\ge {a}"), (f"[{a}, {b})", f"{a} < x < {b}"),
                  (f"[{a}, {b})", f"[{a}, {b}]"), (f"x > {a}", f"(-\\infty, {a})"), (f"[{a}, {b}]", f"({a}, {b})")]
    return ([(_row(g), _boxed(p)) for g, p in pairs_same], [(_row(g), _boxed(p)) for g, p in pairs_near])


def _repeated_answers(rng: random.Random):
    b = rng.choice([2, 4, 5, 8])
    a = rng.randint(1, b - 1)
    f = Fraction(a, b)
    g = _row(f"\\frac{{{a}}}{{{b}}}")
    same = [(g, f"</think> So $\\boxed{{\\frac{{{a}}}{{{b}}}}}$, i.e. $\\boxed{{{float(f):g}}}$."),
            (g, f"</think> $\\boxed{{{a}/{b}}}$ and again $\\boxed{{{a}/{b}}}$.")]
    n = rng.randint(20, 200)
    near = [(g, f"</think> $\\boxed{{{a}/{b}}}$ or maybe $\\boxed{{{a + 1}/{b}}}$."),
            (_row(str(n)), "</think> " + " ".join(str(i) for i in range(1, n + 1))),
            (_row(str(n)), f"</think> The answer is unclear; the count is somewhere near {n}."),
            (_row(str(n)), f"</think> \\boxed{{n}} where n = {n}")]
    return same, near


def _choices(rng: random.Random):
    values = rng.sample(range(2, 60), 4)
    letters = "ABCD"
    k = rng.randrange(4)
    right, wrong = letters[k], letters[(k + 1) % 4]
    prompt = "Pick one. " + " ".join(f"({L}) {v}" for L, v in zip(letters, values))
    g = _row(right, prompt=prompt)
    same = [right, f"({right})", f"\\text{{({right})}}", f"{right}) {values[k]}", f"({right}) {values[k]}",
            f"{values[k]}"]
    near = [wrong, f"{right} or {wrong}", f"{right}, {wrong}", f"({right}) ({wrong})", f"{right} {wrong}",
            f"{right}) {values[(k + 1) % 4]}", f"{values[(k + 1) % 4]}", f"{right}/{wrong}"]
    stray = _row(str(values[k]), prompt=prompt)  # a numeric gold: an option letter is not the number
    return ([(g, _boxed(s)) for s in same], [(g, _boxed(s)) for s in near] + [(stray, _boxed(right))])


def _algebra(rng: random.Random):
    a = rng.randint(2, 9)
    pairs_same = [(f"x^2+{2 * a}x+{a * a}", f"(x+{a})^2"), (f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a}}}"),
                  (f"\\frac{{\\pi}}{{{a}}}", f"\\pi/{a}"), (f"\\{{1,{a}\\}}", f"\\{{{a},1\\}}"), (f"x={a}", f"{a}")]
    pairs_near = [(f"x^2+{2 * a}x+{a * a}", f"(x-{a})^2"), (f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a + 1}}}"),
                  (f"(1,{a})", f"({a},1)"), (f"\\frac{{\\pi}}{{{a}}}", f"\\pi/{a + 1}")]
    return [(_row(g), _boxed(p)) for g, p in pairs_same], [(_row(g), _boxed(p)) for g, p in pairs_near]


CATEGORIES: dict[str, Callable[[random.Random], tuple[list, list]]] = {
    "integer": _integers, "fraction": _fractions, "decimal": _decimals, "currency_percent": _currency_percent,
    "interval_inequality": _intervals, "repeated_or_listed": _repeated_answers, "multiple_choice": _choices,
    "algebra": _algebra,
}


def generate_cases(n_per_category: int, seed: int) -> list[Case]:
    """``n_per_category`` draws of every category, each giving several cases of both kinds."""
    rng = random.Random(seed)
    out: list[Case] = []
    for name, make in CATEGORIES.items():
        for _ in range(n_per_category):
            same, near = make(rng)
            out += [Case(name, "equivalent", r, s) for r, s in same]
            out += [Case(name, "near_miss", r, s) for r, s in near]
    return out


def score_cases(cases: list[Case], verify_fn: Callable[[Row, str], Any] | None = None) -> dict[str, dict]:
    """Per (category, kind): how many cases the verifier got right (equivalent -> 1, near
    miss -> 0), with the failures for inspection."""
    verify_fn = verify_fn or verify
    table: dict[str, dict] = defaultdict(lambda: {"n": 0, "ok": 0, "failures": []})
    for c in cases:
        score = verify_fn(c.row, c.response).score
        right = score == 1 if c.kind == "equivalent" else score == 0
        for key in (f"{c.category}/{c.kind}", f"all/{c.kind}"):
            table[key]["n"] += 1
            table[key]["ok"] += right
            if not right:
                table[key]["failures"].append((c.row["reference"]["answer"], c.response))
    return {k: {**v, "rate": v["ok"] / v["n"]} for k, v in sorted(table.items())}

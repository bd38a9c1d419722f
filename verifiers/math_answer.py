"""Math (and science) answers: numbers, LaTeX, algebra, intervals, sets/tuples, letters.

Order of checks, cheapest first:
1. multiple-choice letters, only for tasks with lettered options (``reference.options``
   {"A": text, ...}, or "(A) ..." option lines in the prompt) and a letter as gold: the
   prediction must be that one letter ("C", "(C)", "\\text{(C)}", "C) <text of C>") or the
   option's text; a second letter anywhere rejects it;
2. plain words (gold "Evelyn", "\\text{odd}"): case/space-insensitive string match (sympy
   would read a word as a product of symbols, so anagrams would pass);
3. numbers on both sides (integers, decimals, fractions, percentages, scientific notation,
   thousands separators, currency signs, a trailing unit from ``UNITS``): exact rational
   comparison when the gold is an integer; when it is not, ``abs(gold - pred) <=
   max(abs_tol, rel_tol * abs(gold))`` with ``reference.rel_tol`` (default 1e-6) and
   ``reference.abs_tol`` (default 0). "25%" also equals 0.25. A trailing word that is not
   a known unit (``2i``, ``3x``, "5 or 6") makes it no number; a task may name more units
   (``reference.units``, e.g. ["eggs"]). Two different units never match;
4. otherwise ``math-verify`` (sympy + latex2sympy2) parses both sides as LaTeX and decides
   equivalence: expressions, \\frac, \\sqrt, \\pi, exponents, intervals, sets (unordered),
   tuples (ordered), equations "x = 3". An inequality in one variable and interval notation
   are compared as sets ("x > 3" = "(3, \\infty)", "2 \\le x < 5" = "[2, 5)").
Several boxed answers are accepted when they are all the same answer (``1/2`` and ``0.5``).
All of it runs under the per-call timeout of ``verifiers.verify`` (signal based, see
``timeouts.py``); math-verify's own signal timeouts are switched off so they do not fight it.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any

from .extract import ExtractionOptions, NoAnswer, extract_answer
from .registry import register_verifier
from .schema import Reward, TaskRow

DEFAULT_REL_TOL = 1e-6
_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def _strip_math(s: str) -> str:
    s = s.strip()
    for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(a) and s.endswith(b) and len(s) >= len(a) + len(b):
            s = s[len(a): len(s) - len(b)].strip()
    s = s.replace("\\$", "").replace("$", "")  # currency; inner $ $ pairs ("a+$ $b") would split the expression
    s = s.replace("\\!", "").replace("\\,", "").replace("\\ ", " ").replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.strip().rstrip(".").strip()


def _unwrap_text(s: str) -> str:
    return _TEXT_WRAP_RE.sub(lambda m: m.group(1), s).strip()


# ---- multiple choice -----------------------------------------------------------------------
_LETTER_RE = re.compile(r"^\(?([A-J])\)?$")
_OPTION_LINE_RE = re.compile(r"(?:^|\s)\(([A-J])\)\s*([^()\n]+?)(?=\s*\([A-J]\)|\n|$)|^\s*([A-J])[.):]\s+(.+?)\s*$",
                             re.MULTILINE)
_PRED_LETTER_RE = re.compile(r"^\(?([A-J])\)?(?:[.:)]\s*(.*))?$", re.DOTALL)


def task_options(row: TaskRow) -> dict[str, str]:
    """Lettered options of the task: ``reference.options`` or "(A) ..." lines of the prompt."""
    ref = row.reference if isinstance(row.reference, dict) else {}
    if isinstance(ref.get("options"), dict):
        return {str(k).strip("() ").upper(): str(v) for k, v in ref["options"].items()}
    found: dict[str, str] = {}
    for m in _OPTION_LINE_RE.finditer(row.prompt or ""):
        letter, text = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        found.setdefault(letter, text.strip())
    return found if len(found) >= 2 else {}


def choice_equal(letter: str, pred: str, options: dict[str, str]) -> bool:
    p = _unwrap_text(_strip_math(pred)).strip()
    named = set(re.findall(r"(?<![A-Za-z])\(?([A-J])\)(?![A-Za-z])|(?<![A-Za-z\\])([A-J])(?![A-Za-z])", p))
    letters = {a or b for a, b in named}
    m = _PRED_LETTER_RE.match(p)
    if m:
        if letters != {m.group(1)} or m.group(1) != letter:
            return False
        rest = (m.group(2) or "").strip()
        return not rest or _same_option_text(rest, options.get(letter, ""))
    if letters:  # option text with a letter somewhere in it: a second, stray choice
        return False
    return _same_option_text(p, options.get(letter, ""))


def _same_option_text(pred: str, option: str) -> bool:
    if not option:
        return False
    if " ".join(pred.lower().split()) == " ".join(_unwrap_text(_strip_math(option)).lower().split()):
        return True
    ok, _ = math_equal(option, pred)
    return ok


# ---- words ---------------------------------------------------------------------------------
_WORD_RE = re.compile(r"^[A-Za-z][A-Za-z \-']{2,}$")


def _as_words(s: str) -> str | None:
    t = _unwrap_text(_strip_math(s))
    if _WORD_RE.match(t) and "\\" not in s.replace("\\text", ""):
        return " ".join(t.lower().replace("-", " ").split())
    return None


# ---- numbers -------------------------------------------------------------------------------
_UNIT_NAMES = {
    "mm": "millimeter millimeters millimetre millimetres", "cm": "centimeter centimeters centimetre centimetres",
    "m": "meter meters metre metres", "km": "kilometer kilometers kilometre kilometres",
    "in": "inch inches", "ft": "foot feet", "yd": "yard yards", "mi": "mile miles",
    "mg": "milligram milligrams", "g": "gram grams", "kg": "kilogram kilograms", "lb": "lbs pound pounds",
    "oz": "ounce ounces", "t": "ton tons tonne tonnes",
    "ms": "millisecond milliseconds", "s": "sec secs second seconds", "min": "mins minute minutes",
    "h": "hr hrs hour hours", "day": "days", "week": "weeks", "month": "months", "year": "years yr yrs",
    "ml": "milliliter milliliters millilitre millilitres", "l": "liter liters litre litres",
    "gal": "gallon gallons", "cup": "cups", "mph": "", "km/h": "kmh kph", "m/s": "",
    "dollar": "dollars usd", "cent": "cents", "euro": "euros eur", "pound sterling": "gbp",
    "degree": "degrees deg ° ^\\circ ^{\\circ} \\circ \\degree", "radian": "radians rad",
    "unit": "units", "percent": "percentage", "j": "joule joules", "n": "newton newtons", "w": "watt watts",
    "v": "volt volts", "a": "amp amps ampere amperes", "hz": "hertz", "k": "kelvin", "pa": "pascal pascals",
}
UNITS: dict[str, str] = {}  # every spelling -> canonical name
for _canon, _others in _UNIT_NAMES.items():
    for _name in (_canon, *_others.split()):
        UNITS[_name] = _canon
_SINGLE_LETTER_UNITS = {u for u in UNITS if len(u) == 1}  # only when spaced or in \text: "2 m", not "2m"
_CURRENCY_RE = re.compile(r"\\\$|\$|£|€|\\euro|\\pounds|USD|EUR|GBP")
_UNIT_TAIL_RE = re.compile(r"(?:\\text\s*\{([^{}]*)\}|\\mathrm\s*\{([^{}]*)\}|\\mbox\s*\{([^{}]*)\}"
                           r"|((?:square|sq\.?|cubic)\s+[A-Za-z]+|[A-Za-z][A-Za-z/]*(?:\^\{?[23]\}?)?"
                           r"|°|\^\s*\{?\\circ\}?|\\circ|\\degree))\s*$")
_NUM_RE = re.compile(r"^[-+]?(?:\d+(?:,\d{3})*|\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?$")
_SCI_RE = re.compile(r"^([-+]?\d*\.?\d+)\s*(?:\\times|\\cdot|\*|×)\s*10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?$")
_FRAC_RE = re.compile(r"^([-+]?)\\frac\s*\{\s*([-+]?\d+)\s*\}\s*\{\s*([-+]?\d+)\s*\}$")
_SLASH_RE = re.compile(r"^([-+]?\d+)\s*/\s*([-+]?\d+)$")


@dataclass(frozen=True)
class Number:
    value: Fraction
    percent: bool = False
    unit: str | None = None  # canonical unit name


def _unit_of(tail: str, spaced: bool, extra_units: frozenset[str]) -> str | None:
    """Canonical unit for a trailing word, or None when it is no unit we know."""
    t = " ".join(tail.strip().lower().split())
    power = ""
    m = re.fullmatch(r"(.+?)\s*\^\s*\{?([23])\}?", t)
    if m:
        t, power = m.group(1), "^" + m.group(2)
    m = re.fullmatch(r"(square|sq\.?|cubic)\s+(.+)", t)
    if m:
        t, power = m.group(2), "^3" if m.group(1) == "cubic" else "^2"
    if t in extra_units:
        return t + power
    if t not in UNITS or (t in _SINGLE_LETTER_UNITS and not spaced):
        return None
    return UNITS[t] + power


def parse_number(s: str, extra_units: frozenset[str] = frozenset()) -> Number | None:
    """A plain number with optional currency sign, percent and one trailing known unit."""
    t = _CURRENCY_RE.sub("", _strip_math(s)).strip()
    unit = None
    m = _UNIT_TAIL_RE.search(t)
    if m and m.start() > 0:
        tail = next(g for g in m.groups() if g is not None)
        wrapped = m.group(0).lstrip().startswith("\\")
        unit = _unit_of(tail, wrapped or t[m.start() - 1].isspace() or m.group(0)[0].isspace(), extra_units)
        if unit is None:
            return None
        t = t[: m.start()].strip()
    pct = False
    if t.endswith("\\%") or t.endswith("%"):
        pct = True
        t = t[:-2] if t.endswith("\\%") else t[:-1]
        t = t.strip()
    t = t.replace("{,}", ",").replace(" ", "") if re.fullmatch(r"[-+\d{},. ]+", t) else t
    try:
        if _NUM_RE.match(t) and any(ch.isdigit() for ch in t):
            return Number(Fraction(t.replace(",", "")), pct, unit)
        m = _SCI_RE.match(t)
        if m:
            return Number(Fraction(m.group(1)) * Fraction(10) ** int(m.group(2)), pct, unit)
        m = _FRAC_RE.match(t)
        if m and int(m.group(3)) != 0:
            v = Fraction(int(m.group(2)), int(m.group(3)))
            return Number(-v if m.group(1) == "-" else v, pct, unit)
        m = _SLASH_RE.match(t)
        if m and int(m.group(2)) != 0:
            return Number(Fraction(int(m.group(1)), int(m.group(2))), pct, unit)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


@dataclass(frozen=True)
class Tolerance:
    rel: float = DEFAULT_REL_TOL
    abs: float = 0.0

    def close(self, gold: Fraction, pred: Fraction) -> bool:
        """Integers compare exactly; a non-integer gold within the tolerance."""
        if gold.denominator == 1 or gold == pred:
            return gold == pred
        return abs(gold - pred) <= max(Fraction(self.abs), Fraction(self.rel) * abs(gold))


def numbers_equal(gold: Number, pred: Number, tol: Tolerance = Tolerance()) -> bool:
    if gold.unit and pred.unit and gold.unit != pred.unit:
        return False
    if tol.close(gold.value, pred.value):
        return True
    if pred.percent and not gold.percent:  # "25%" for 0.25
        return tol.close(gold.value, pred.value / 100)
    if gold.percent and not pred.percent:
        return tol.close(gold.value / 100, pred.value)
    return False


# ---- math-verify ---------------------------------------------------------------------------
_MV = None


def _math_verify():
    global _MV
    if _MV is None:
        import math_verify
        from math_verify import grader

        grader.TIMEOUT_WARNING_SHOWN = True  # our own timeout is in force (timeouts.py)
        try:
            from math_verify import parser as _p

            _p.TIMEOUT_WARNING_SHOWN = True
        except Exception:  # pragma: no cover - layout differs between versions
            pass
        configs = [
            math_verify.LatexExtractionConfig(boxed_match_priority=0),
            math_verify.ExprExtractionConfig(),
        ]
        _MV = (math_verify, configs)
    return _MV


def _mv_parse(s: str):
    mv, configs = _math_verify()
    return mv.parse("$" + _strip_math(s) + "$", extraction_config=configs, parsing_timeout=None)


def _reliable(src: str, parsed: list) -> bool:
    """latex2sympy sometimes reads only a fragment of an expression it cannot handle (e.g.
    "\\hbar \\omega(v+1/2) - ..." became 2). A parse that lost every variable of the
    source (letters outside commands, \\text and \\mathrm) is not trusted."""
    import sympy

    expr = parsed[0]
    letters = re.sub(r"\\(?:text|mathrm|mbox|operatorname)\s*\{[^{}]*\}|\\[A-Za-z]+", "", src)
    if re.search(r"[A-Za-z]", letters) and isinstance(expr, sympy.Basic) and expr.is_number:
        return False
    return True


def _as_solution_set(expr):
    """An inequality (or a chain, or "a or b") in one variable as a real set; else None."""
    import sympy

    if isinstance(expr, sympy.Set) and not isinstance(expr, sympy.FiniteSet):
        return expr
    parts = list(expr) if isinstance(expr, sympy.FiniteSet) else [expr]
    if not parts or not all(isinstance(p, (sympy.core.relational.Relational, sympy.And, sympy.Or)) for p in parts):
        return None
    if any(isinstance(p, sympy.Eq) for p in parts):
        return None
    symbols = set().union(*(p.free_symbols for p in parts))
    if len(symbols) != 1:
        return None
    try:
        return sympy.Union(*(p.as_set() for p in parts))
    except (NotImplementedError, TypeError, ValueError):
        return None


def symbolic_equal(gold: str, pred: str) -> bool:
    mv, _ = _math_verify()
    g, p = _mv_parse(gold), _mv_parse(pred)
    if not g or not p or not _reliable(_strip_math(gold), g) or not _reliable(_strip_math(pred), p):
        return False
    gs, ps = _as_solution_set(g[0]), _as_solution_set(p[0])
    if gs is not None and ps is not None:
        return bool(gs == ps or gs.symmetric_difference(ps).is_empty)
    return bool(mv.verify(g, p, timeout_seconds=None))


# ---- the verifier --------------------------------------------------------------------------
def math_equal(gold: str, pred: str, options: dict[str, str] | None = None, tol: Tolerance = Tolerance(),
               extra_units: frozenset[str] = frozenset()) -> tuple[bool, str]:
    """Is ``pred`` equivalent to ``gold``? Returns (equal, which check decided)."""
    gold, pred = str(gold).strip(), str(pred).strip()
    if not pred:
        return False, "empty"
    letter = _LETTER_RE.match(_unwrap_text(_strip_math(gold)))
    if letter and options:
        return choice_equal(letter.group(1), pred, options), "choice"
    if letter:  # no lettered options: only the same letter, however it is written
        p = _LETTER_RE.match(_unwrap_text(_strip_math(pred)))
        return bool(p and p.group(1) == letter.group(1)), "choice"
    words = _as_words(gold)
    if words is not None:
        return _as_words(pred) == words, "text"
    gn, pn = parse_number(gold, extra_units), parse_number(pred, extra_units)
    if gn is not None and pn is not None:
        return numbers_equal(gn, pn, tol), "number"
    if _strip_math(gold).replace(" ", "") == _strip_math(pred).replace(" ", ""):
        return True, "string"
    return symbolic_equal(gold, pred), "math-verify"


def gold_answers(reference: Any) -> list[str]:
    if isinstance(reference, dict):
        ans = reference.get("answer", reference.get("answers"))
    else:
        ans = reference
    if ans is None:
        raise ValueError("math reference has no 'answer'")
    if isinstance(ans, (list, tuple)):
        return [str(a) for a in ans]
    if isinstance(ans, float) and ans.is_integer():
        return [str(int(ans))]
    return [str(ans)]


def _tolerance(ref: Any) -> Tolerance:
    ref = ref if isinstance(ref, dict) else {}
    values = {}
    for key in ("rel_tol", "abs_tol"):
        v = ref.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise ValueError(f"math reference: {key} must be a number in [0, 1), got {v!r}")
        values[key.split("_")[0]] = float(v)
    return Tolerance(**values)


def row_equal(row: TaskRow) -> Callable[[str, str], tuple[bool, str]]:
    """``math_equal`` with the row's options, tolerance and units."""
    ref = row.reference if isinstance(row.reference, dict) else {}
    units = ref.get("units") or []
    if not isinstance(units, list) or not all(isinstance(u, str) for u in units):
        raise ValueError("math reference: units must be a list of words")
    return partial(math_equal, options=task_options(row), tol=_tolerance(row.reference),
                   extra_units=frozenset(" ".join(u.lower().split()) for u in units))


@register_verifier("math", "science")
def verify_math(row: TaskRow, text: str) -> Reward:
    equal = row_equal(row)
    golds = gold_answers(row.reference)
    try:
        pred, source = extract_answer(text, ExtractionOptions.from_dict(row.extraction),
                                      same=lambda a, b: equal(a, b)[0])
    except NoAnswer as e:
        return Reward.zero(str(e), source="no_answer")
    for gold in golds:
        ok, how = equal(gold, pred)
        if ok:
            return Reward.one(f"equivalent to reference ({how})", extracted=pred, source=source, gold=gold)
    return Reward.zero("not equivalent to the reference", extracted=pred, source=source, gold=golds[0])

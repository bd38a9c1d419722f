"""Math (and science) answers: numbers, LaTeX, algebra, intervals, sets/tuples, letters.

Order of checks, cheapest first:
1. multiple-choice letters (gold "C", "(C)", "\\text{(C)}"): the prediction must name the
   same single letter;
2. plain words (gold "Evelyn", "\\text{odd}"): case/space-insensitive string match (sympy
   would read a word as a product of symbols, so anagrams would pass);
3. numbers on both sides (integers, decimals, fractions, percentages, scientific notation,
   thousands separators, units/currency around them): exact rational comparison, with a
   relative tolerance of 1e-6 when either side is a decimal; "25%" also equals 0.25;
4. otherwise ``math-verify`` (sympy + latex2sympy2) parses both sides as LaTeX and decides
   equivalence: expressions, \\frac, \\sqrt, \\pi, exponents, intervals, sets (unordered),
   tuples (ordered), equations "x = 3".
All of it runs under the per-call timeout of ``verifiers.verify`` (signal based, see
``timeouts.py``); math-verify's own signal timeouts are switched off so they do not fight it.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from .extract import ExtractionOptions, NoAnswer, extract_answer
from .registry import register_verifier
from .schema import Reward, TaskRow

_MC_RE = re.compile(r"^\(?([A-Ea-e])\)?$")
_MC_PRED_RE = re.compile(r"^\(?([A-E])\)?(?:$|[\s.:)]\s*)")
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


def mc_letter(s: str) -> str | None:
    m = _MC_RE.match(_unwrap_text(_strip_math(s)).strip())
    return m.group(1).upper() if m else None


_WORD_RE = re.compile(r"^[A-Za-z][A-Za-z \-']{2,}$")


def _as_words(s: str) -> str | None:
    t = _unwrap_text(_strip_math(s))
    if _WORD_RE.match(t) and "\\" not in s.replace("\\text", ""):
        return " ".join(t.lower().replace("-", " ").split())
    return None


# ---- numbers ---------------------------------------------------------------------------
_UNIT_TAIL_RE = re.compile(
    r"(?:\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}|\\mbox\{[^{}]*\}|[A-Za-z][A-Za-z .]*|\^\\circ|°|\\circ)\s*$"
)
_NUM_RE = re.compile(r"^[-+]?(?:\d+(?:,\d{3})*|\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?$")
_SCI_RE = re.compile(r"^([-+]?\d*\.?\d+)\s*(?:\\times|\\cdot|\*|x)\s*10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?$")
_FRAC_RE = re.compile(r"^([-+]?)\\frac\s*\{\s*([-+]?\d+)\s*\}\s*\{\s*([-+]?\d+)\s*\}$")
_SLASH_RE = re.compile(r"^([-+]?\d+)\s*/\s*([-+]?\d+)$")


def parse_number(s: str) -> tuple[Fraction, bool, bool] | None:
    """Parse a plain number. Returns (value, is_percent, is_inexact) or None.

    Accepts thousands separators, %, scientific notation (1.2e3, 1.2\\times10^{3}), a/b,
    \\frac{a}{b}, a leading currency sign and trailing units/words ("27 miles", "5\\text{ cm}").
    """
    t = _strip_math(s)
    t = t.replace("\\$", "").replace("$", "").replace("£", "").replace("€", "").strip()
    # remove trailing units, repeatedly ("5 \\text{cm}^2" is not a number, stop at ^)
    for _ in range(3):
        t2 = _UNIT_TAIL_RE.sub("", t).strip()
        if t2 == t or not t2:
            break
        t = t2
    pct = False
    if t.endswith("\\%") or t.endswith("%"):
        pct = True
        t = t[:-2] if t.endswith("\\%") else t[:-1]
        t = t.strip()
    t = t.replace("{,}", ",").replace(" ", "") if re.fullmatch(r"[-+\d{},. ]+", t) else t
    try:
        if _NUM_RE.match(t) and any(ch.isdigit() for ch in t):
            inexact = "." in t or "e" in t.lower()
            return Fraction(t.replace(",", "")), pct, inexact
        m = _SCI_RE.match(t)
        if m:
            return Fraction(m.group(1)) * Fraction(10) ** int(m.group(2)), pct, True
        m = _FRAC_RE.match(t)
        if m and int(m.group(3)) != 0:
            v = Fraction(int(m.group(2)), int(m.group(3)))
            return (-v if m.group(1) == "-" else v), pct, False
        m = _SLASH_RE.match(t)
        if m and int(m.group(2)) != 0:
            return Fraction(int(m.group(1)), int(m.group(2))), pct, False
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def _num_close(a: Fraction, b: Fraction, inexact: bool) -> bool:
    if a == b:
        return True
    if not inexact:
        return False
    return abs(a - b) <= Fraction(1, 10**6) * max(abs(a), abs(b))  # relative only: 7.4e-12 != 8.4e-12


def numbers_equal(gold: tuple[Fraction, bool, bool], pred: tuple[Fraction, bool, bool]) -> bool:
    g, gp, gi = gold
    p, pp, pi_ = pred
    inexact = gi or pi_
    if _num_close(g, p, inexact):
        return True
    # "25%" vs "0.25" (either side may carry the percent sign)
    if pp and not gp and _num_close(g, p / 100, inexact):
        return True
    if gp and not pp and _num_close(g / 100, p, inexact):
        return True
    return False


# ---- math-verify -----------------------------------------------------------------------
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


def symbolic_equal(gold: str, pred: str) -> bool:
    mv, _ = _math_verify()
    g, p = _mv_parse(gold), _mv_parse(pred)
    if not g or not p or not _reliable(_strip_math(gold), g) or not _reliable(_strip_math(pred), p):
        return False
    return bool(mv.verify(g, p, timeout_seconds=None))


def math_equal(gold: str, pred: str) -> tuple[bool, str]:
    """Is ``pred`` equivalent to ``gold``? Returns (equal, which check decided)."""
    gold, pred = str(gold).strip(), str(pred).strip()
    if not pred:
        return False, "empty"
    letter = mc_letter(gold)
    if letter is not None:
        p = _unwrap_text(_strip_math(pred))
        m = _MC_PRED_RE.match(p)
        if m is None or re.search(r"\b(?:or|and)\b|[,;/]", p, re.IGNORECASE):
            return False, "choice"
        named = set(re.findall(r"\(([A-E])\)", p)) | {m.group(1)}
        return named == {letter}, "choice"
    words = _as_words(gold)
    if words is not None:
        return _as_words(pred) == words, "text"
    gn, pn = parse_number(gold), parse_number(pred)
    if gn is not None and pn is not None:
        return numbers_equal(gn, pn), "number"
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


@register_verifier("math", "science")
def verify_math(row: TaskRow, text: str) -> Reward:
    opts = ExtractionOptions.from_dict(row.extraction)
    try:
        pred, strategy = extract_answer(text, opts)
    except NoAnswer as e:
        return Reward.zero(str(e))
    golds = gold_answers(row.reference)
    for gold in golds:
        ok, how = math_equal(gold, pred)
        if ok:
            return Reward.one(f"equivalent to reference ({how})", extracted=pred, strategy=strategy, gold=gold)
    return Reward.zero("not equivalent to the reference", extracted=pred, strategy=strategy, gold=golds[0])

"""How many candidates a stated answer holds, measured against its gold answer: what strict
grading (``grading.py``) counts, shared by the domains' checks.

A candidate is one value the answer offers for one value asked. ``counts`` measures an
answer two ways, and ``more_values`` compares an answer with its gold the same way, so a
gold that is itself a list, a set, a tuple or a grid allows as many (``"2, 3"`` allows
``"x = 2 or x = 3"``; a 4x4 grid allows 16 numbers however they are laid out):

- numbers, when both are plain lists of numbers (separated by spaces, commas, semicolons,
  colons, bars, brackets, lines: no operator between them): ``1,000`` is one number, ``3/4``
  one fraction, ``[[1,2],[3,4]]`` and ``1 2\\n3 4`` four each;
- else parts, split outside brackets at ``,`` ``;`` line breaks and the joining words or /
  either / and / and/or / nor / vs (and, in LaTeX, ``\\lor`` ``\\vee`` ``\\quad`` ``\\\\``
  ``\\approx``) and at a slash between two words; parts that all assign a different
  variable (``x = 1, y = 2``) are one answer. ``±`` adds a candidate to either count; an
  interval or inequality gold allows two (``[1, 3)`` as ``1 \\le x < 3``, and back).

``alternatives``, ``ranges`` and ``plus_minus`` count the other shapes a hedge takes
(``more_than_gold`` applies all of them); ``slash_parts`` splits at a spaced slash, which a
domain judges by scoring each side (a fraction ``6 / 8`` has no side that is right by
itself; ``5 / 6`` for 5 has). Every function is linear in the text: a number pattern starts
only where no digit precedes it, so a run of digits is read once, and the bracket depth at
a separator is counted over the stretch since the previous one.
"""
from __future__ import annotations

import re

MAX_PARTS = 64  # enough for any gold the domains ship; beyond it the count is "many"
MAX_SIDES = 8  # sides of spaced slashes a domain scores one by one
MAX_CANDIDATE_CHARS = 2_000  # a candidate longer than this is not scored: it is no honest answer's alternative

_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?|\.\d+"
# a number that starts a value (after a separator or the start): "3-5" holds one such, "-5" not
_LIST_NUMBER_RE = re.compile(r"(?<![^\s,;:|(\[{\\$])[-+]?(?:" + _NUM + ")")
_SPLIT_WORDS_RE = re.compile(
    r"\b(?:and/or|either|neither|or|nor|and|versus|vs)\b\.?|\\(?:lor|vee|quad|qquad|approx)\b|\\\\|≈|∨"
    r"|(?<=[^\W\d_][^\W\d_])\s*/\s*(?=[^\W\d_]{2})", re.IGNORECASE)
_ALTERNATIVE_RE = re.compile(
    r"\b(?:and/or|either|or|nor|versus|vs)\b|\\(?:lor|vee)\b|(?<=[^\W\d_][^\W\d_])\s*/\s*(?=[^\W\d_]{2})",
    re.IGNORECASE)
_SPLIT_RE = re.compile(r"[,;\n]|" + _SPLIT_WORDS_RE.pattern, re.IGNORECASE)
_LIST_REST_RE = re.compile(r"[\s,;:|()\[\]{}\\$]*")  # what may stand between the numbers of a plain list
_INTERVAL_RE = re.compile(r"[\[(][^,\[\]()]*,[^,\[\]()]*[\])]|\\infty|∞|\\cup\b|∪|<|>|≤|≥|\\[lg]e(?:q)?\b")
_ASSIGNMENT_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_']*)\s*=(?!=)")
_CONTENT_RE = re.compile(r"[^\W_]")
_PLUS_MINUS_RE = re.compile(r"±|∓|\\pm\b|\\mp\b")
_N = r"(?<![\d.])-?\d+(?:\.\d+)?(?:/\d+)?"
_REL = r"(?:<=?|>=?|≤|≥|\\le(?:q)?\b|\\ge(?:q)?\b|\\lt\b|\\gt\b)"
_RANGE_RE = re.compile(
    rf"\bbetween\b[^\n]{{1,60}}?\band\b|(?:[\d)\]}}]|\\[A-Za-z]+)[ \t]+(?:to|through|thru)[ \t]+[-\d(\[{{\\$]"
    rf"|{_N}\s*(?:–|—|~|\\sim\b|\.\.\.?|…|\\[lc]?dots\b)\s*{_N}"
    rf"|{_REL}[ \t]*[A-Za-z]\w*[ \t]*{_REL}", re.IGNORECASE)
_HYPHEN_RANGE_RE = re.compile(r"(?<![\w.\-])(\d+(?:\.\d+)?)-(\d+(?:\.\d+)?)(?![\w.])")
_SPACED_SLASH_RE = re.compile(r"\s+/\s+")
_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")


def plain(answer: str) -> str:
    """The answer with LaTeX's text wrappers opened (``5 \\text{ or } 6`` -> ``5  or  6``)."""
    return _TEXT_WRAP_RE.sub(lambda m: f" {m.group(1)} ", answer)


def _list_numbers(s: str) -> int | None:
    """How many numbers a plain list of numbers holds, or None when `s` is not one."""
    found = _LIST_NUMBER_RE.findall(s)
    if not found:
        return None
    return len(found) if _LIST_REST_RE.fullmatch(_LIST_NUMBER_RE.sub(" ", s)) else None


def _thousands(s: str, i: int) -> bool:
    """Is the comma at `i` a thousands separator (digit, comma, exactly three digits)?"""
    return 0 < i and s[i - 1].isdigit() and s[i + 1: i + 4].isdigit() and len(s[i + 1: i + 4]) == 3 \
        and not s[i + 4: i + 5].isdigit()


def parts(s: str) -> list[str]:
    """The parts of `s` split outside brackets at separators and joining words (module doc);
    only parts with a letter or digit. The bracket depth at a separator is counted from the
    previous one (C-speed counts over disjoint stretches: linear); when the brackets do not
    balance, every separator splits (an unclosed bracket must not hide the ones after it)."""
    balanced = sum(map(s.count, "([{")) == sum(map(s.count, ")]}")) > 0
    out, pos, depth, last = [], 0, 0, 0
    for m in _SPLIT_RE.finditer(s):
        i = m.start()
        if balanced:
            depth += sum(s.count(c, last, i) for c in "([{") - sum(s.count(c, last, i) for c in ")]}")
            last = i
            if depth > 0:
                continue
        if m.group() == "," and _thousands(s, i):
            continue
        out.append(s[pos:i])
        pos = m.end()
    out.append(s[pos:])
    return [p.strip() for p in out if _CONTENT_RE.search(p)]


def _trimmed(answer: str) -> str:
    """The answer as counted: text wrappers opened, no final period."""
    return plain(answer).strip().removesuffix(".").strip()


def counts(answer: str) -> tuple[int | None, int]:
    """(numbers when the answer is a plain list of numbers else None, its parts outside
    brackets), each with a candidate added per ``±``. Parts that all assign a different
    variable (``x = 1, y = 2``) are one."""
    s = _trimmed(answer)
    found = parts(s)
    lhs = [m.group(1) for m in map(_ASSIGNMENT_RE.match, found) if m]
    separated = 1 if len(found) > 1 and len(lhs) == len(found) == len(set(lhs)) else max(1, len(found))
    numbers, extra = _list_numbers(s), plus_minus(s)
    return (None if numbers is None else numbers + extra), separated + extra


def candidates(answer: str) -> int:
    """How many values the answer offers (module doc); at least 1."""
    numbers, separated = counts(answer)
    return separated if numbers is None else numbers


def more_values(mine: tuple[int | None, int], gold: str) -> tuple[int, int]:
    """(values an answer of `counts` `mine` offers, values the gold allows), counted alike:
    numbers when both are plain lists of numbers (a grid as rows or as JSON), else parts (two
    sets joined by "and/or" are two, though the gold's set has two numbers). An interval or
    inequality allows two (its endpoints, however written)."""
    (na, sa), (ng, sg) = mine, counts(gold)
    have, allowed = (na, ng) if na is not None and ng is not None else (sa, sg)
    return have, max(allowed, 2 if _interval_like(gold) else 0)


def alternatives(answer: str) -> int:
    """Joining words of alternatives (or, either, and/or, nor, vs, a slash between words)."""
    return len(_ALTERNATIVE_RE.findall(plain(answer)))


def plus_minus(answer: str) -> int:
    return len(_PLUS_MINUS_RE.findall(answer))


def ranges(answer: str) -> int:
    """Ranges: "between 3 and 5", "3 to 5" (two values joined by to / through: a number,
    a bracket or a LaTeX command on each side, not "how to solve"), "3–5",
    "3..5", "3 < x < 5", and a hyphen between two numbers of which the first is the smaller
    ("3-5"; "5-3" reads as a difference)."""
    s = plain(answer)
    hyphens = sum(float(a) < float(b) for a, b in _HYPHEN_RANGE_RE.findall(s))
    return len(_RANGE_RE.findall(s)) + hyphens


def slash_parts(answer: str) -> list[str]:
    """The sides of the answer's spaced slashes (``5 / 6`` -> ["5", "6"]); [] when it has none.
    At most ``MAX_SIDES`` (the rest stays in the last side): a domain scores each side."""
    found = _SPACED_SLASH_RE.split(plain(answer), maxsplit=MAX_SIDES - 1)
    return [p.strip() for p in found if p.strip()] if len(found) > 1 else []


def _interval_like(gold: str) -> bool:
    """An interval or inequality (``[1, 3)``, ``x > 2``): one answer that reads as a range or
    as two endpoints, and equals either form."""
    return bool(_INTERVAL_RE.search(gold))


def _allowed_alternatives(gold: str) -> int:
    """A gold of k values may be stated as k alternatives ("x = 2 or x = 3" for "2, 3")."""
    return max(alternatives(gold), candidates(gold) - 1)


def _allowed_ranges(gold: str) -> int:
    return max(ranges(gold), 1 if _interval_like(gold) else 0)


_RULES = (("alternatives", alternatives, _allowed_alternatives, "joined alternatives"),
          ("range", ranges, _allowed_ranges, "ranges"), ("range", plus_minus, plus_minus, "plus-minus signs"))


def more_than_gold(answer: str, golds: list[str]) -> tuple[str, str] | None:
    """(category, why) when the answer offers more than every gold does, else None."""
    for category, count, allowed_by, what in _RULES:
        have, allowed = count(answer), max(allowed_by(g) for g in golds)
        if have > allowed:
            return category, f"the answer states {have} {what} where the task's answer allows {allowed}"
    mine = counts(answer)
    have, allowed = min((more_values(mine, g) for g in golds), key=lambda hv: hv[0] - hv[1])
    if have > allowed:
        return "list", f"the answer states {have} values where the task's answer has {allowed}"
    return None

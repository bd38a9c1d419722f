"""Answer extraction shared by all verifiers.

Only the text after the last ``</think>`` counts. A response whose ``<think>`` is never
closed has no answer. Inside the final text, the answer is looked for with an ordered list
of strategies (configurable per dataset through the row's ``extraction`` dict); the
strategy that found it is the reward's ``source`` (stable names, see ``schema.SOURCES``):

- ``boxed``: the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces).
  Several boxes must all be the same answer (``same`` decides, e.g. ``1/2`` and ``0.5``):
  more than ``max_distinct_boxed`` different ones is answer stuffing and extracts nothing;
- ``answer_is``: the text after "the answer is" / "final answer:" / "answer:" (last one);
- ``bare``: the whole final text when it is one short line of mathematics (no words of
  two or more letters outside LaTeX commands), e.g. ``\frac{1}{2}`` or ``x = 3, y = 4``;
- ``last_number`` (fallback): the last number in the text (fractions a/b and a trailing %
  included). Never used when the text has an answer marker (a box or "the answer is"):
  a marked answer that cannot be read is no answer. Refused when the text holds more than
  ``max_fallback_numbers`` numbers (a list of candidates is stuffing, not an answer);
- ``full`` (fallback): the whole final text, stripped;
- ``hashes`` (opt-in, not a default): the text after the last "####" (to the line's end), GSM8K's
  answer format (its worked solutions end with "#### 18"); a GSM8K benchmark set lists it
  first (stages/eval/benchmarks.py ``GSM8K_EXTRACTION``).

Options (``row.extraction``): ``strategies`` (list, default
``["boxed", "answer_is", "bare", "last_number"]``), ``require_think`` (bool, default False:
responses without any ``<think>`` are taken whole), ``max_distinct_boxed`` (int, default 1),
``max_fallback_numbers`` (int, default 4).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DEFAULT_STRATEGIES = ("boxed", "answer_is", "bare", "last_number")


class NoAnswer(Exception):
    """Raised when a response has no extractable final answer; the message is the reason."""


STRATEGIES = ("boxed", "answer_is", "bare", "last_number", "full", "hashes")
MARKED = ("boxed", "answer_is", "hashes")  # strategies that read an explicit answer marker


@dataclass
class ExtractionOptions:
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    require_think: bool = False
    max_distinct_boxed: int = 1
    max_fallback_numbers: int = 4
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "ExtractionOptions":
        d = dict(d or {})
        opts = cls()
        if "strategies" in d:
            strategies = tuple(d.pop("strategies"))
            unknown = set(strategies) - set(STRATEGIES)
            if unknown:
                raise ValueError(f"extraction.strategies: unknown {sorted(unknown)}; known: {list(STRATEGIES)}")
            opts.strategies = strategies
        if "require_think" in d:
            opts.require_think = bool(d.pop("require_think"))
        for key in ("max_distinct_boxed", "max_fallback_numbers"):
            if key in d:
                value = d.pop(key)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"extraction.{key} must be an integer >= 1, got {value!r}")
                setattr(opts, key, value)
        opts.extra = d
        return opts


def final_text(response: str, require_think: bool = False) -> str:
    """Text after the last ``</think>``. Raises NoAnswer for an unclosed thinking section."""
    if response is None:
        raise NoAnswer("response is None")
    last_close = response.rfind(THINK_CLOSE)
    last_open = response.rfind(THINK_OPEN)
    if last_open > last_close:
        raise NoAnswer("thinking section not closed (<think> without </think>): no final answer")
    if last_close == -1:
        if require_think:
            raise NoAnswer("no </think> found and the dataset requires a thinking section")
        return response.strip()
    return response[last_close + len(THINK_CLOSE):].strip()


_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def find_boxed(text: str) -> list[str]:
    """All outermost ``\\boxed{...}`` contents, in order, with nested braces balanced
    (``\\{`` and ``\\}`` are text, not structure). A box that never closes holds no answer, but
    a box inside it still can; a box inside a closed box is part of that box's answer.

    Linear in the text, whatever it holds (a response is untrusted: thousands of unclosed
    openers must not cost a scan each): one pass pairs every brace with its match on a stack
    (a brace's match is where the depth counted from it returns to zero, which is what a scan
    from each opener would find), then the openers are read in order."""
    openers = [(m.start(), m.end()) for m in _BOX_RE.finditer(text)]
    if not openers:
        return []
    wanted = {end - 1 for _, end in openers}  # the openers' own braces
    # an escaped brace becomes a blank of the same length (positions stay); left to right, as a
    # scan that steps over each escape pair reads `\\{`: its brace is escaped
    plain = text.replace("\\{", "\\ ").replace("\\}", "\\ ")
    closing: dict[int, int] = {}  # an opener's brace -> its matching brace
    stack: list[int] = []
    first = openers[0][1] - 1  # braces before the first box pair nothing of it
    for i, c in enumerate(plain[first:], first):  # per character: cheaper than a match per brace
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            opened = stack.pop()
            if opened in wanted:
                closing[opened] = i
    out: list[str] = []
    end_of_last = -1
    for start, end in openers:
        close = closing.get(end - 1)
        if start < end_of_last or close is None:  # inside the last box (its answer), or never closed
            continue
        out.append(text[end:close].strip())
        end_of_last = close + 1
    return out


_ANSWER_IS_RE = re.compile(
    r"(?:the\s+)?(?:final\s+)?answer\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE
)
_HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")  # anywhere, as lm-eval's gsm8k strict-match reads it
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?%?|-?\.\d+%?")


def _clean_tail(s: str) -> str:
    """First line of the text after "the answer is", without emphasis or a final period."""
    s = s.strip()
    s = s.splitlines()[0] if s else s
    return s.strip().strip("*_ ").rstrip(".").strip().strip("*_ ")


def _distinct(answers: list[str], same: Callable[[str, str], bool]) -> list[str]:
    groups: list[str] = []
    for a in answers:
        if not any(a == g or same(g, a) for g in groups):
            groups.append(a)
    return groups


def has_marker(text: str) -> bool:
    """Does the text mark an answer explicitly (a box, "the answer is")?"""
    return bool(_BOX_RE.search(text) or _ANSWER_IS_RE.search(text))


def extract_answer(text: str, opts: ExtractionOptions | None = None,
                   same: Callable[[str, str], bool] = lambda a, b: False) -> tuple[str, str]:
    """Extract from the final text. Returns (answer, strategy). Raises NoAnswer.
    ``same(a, b)``: are two boxed answers the same answer written differently?"""
    opts = opts or ExtractionOptions()
    marked = has_marker(text)
    for strategy in opts.strategies:
        if marked and strategy not in MARKED:
            continue
        if strategy == "boxed":
            boxed = find_boxed(text)
            if boxed:
                distinct = _distinct(boxed, same)
                if len(distinct) > opts.max_distinct_boxed:
                    raise NoAnswer(f"answer stuffing: {len(distinct)} different boxed answers "
                                   f"(at most {opts.max_distinct_boxed} allowed)")
                return boxed[-1], "boxed"
        elif strategy == "answer_is":
            matches = list(_ANSWER_IS_RE.finditer(text))
            if matches:
                ans = _clean_tail(matches[-1].group(1))
                ans = re.sub(r"(?<!\\)\$", "", ans).strip()  # math delimiters; a currency "\$" stays
                if ans:
                    return ans, "answer_is"
        elif strategy == "hashes":
            matches = _HASHES_RE.findall(text)
            if matches and _clean_tail(matches[-1]):
                return re.sub(r"(?<!\\)\$", "", _clean_tail(matches[-1])).strip(), "hashes"
        elif strategy == "bare":
            t = text.strip().strip("$").strip().rstrip(".")
            if t and "\n" not in t and len(t) <= 100 and not re.search(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", "", t)):
                return t, "bare"
        elif strategy == "last_number":
            nums = _NUMBER_RE.findall(text)
            if len(nums) > opts.max_fallback_numbers:
                raise NoAnswer(f"no answer marker and {len(nums)} numbers in the text: the last-number fallback "
                               f"takes at most {opts.max_fallback_numbers}")
            if nums:
                return nums[-1], "last_number"
        elif strategy == "full":
            if text.strip():
                return text.strip(), "full"
    if marked:
        raise NoAnswer("the answer marker holds no readable answer (no fallback when a marker is present)")
    raise NoAnswer(f"no answer found with strategies {list(opts.strategies)}")

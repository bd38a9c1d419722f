"""Answer extraction shared by all verifiers.

Only the text after the last ``</think>`` counts. A response whose ``<think>`` is never
closed has no answer. Inside the final text, the answer is looked for with an ordered list
of strategies (configurable per dataset through the row's ``extraction`` dict); the
strategy that found it is the reward's ``source`` (stable names, see ``schema.SOURCES``):

- ``boxed``: the content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces).
  Several boxes must all be the same answer (``same`` decides, e.g. ``1/2`` and ``0.5``):
  more than ``max_distinct_boxed`` different ones is answer stuffing and extracts nothing;
- ``answer_is``: the answer after the last "the answer is" / "final answer:" / "answer:":
  the rest of its line, or, when that is empty, the block on the lines below (a display
  ``$$ ... $$``, a grid, a table), read whole by ``block_after``;
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

Strict grading (``grading.py``) compares every answer a text states: ``stated_answers``
(answer tags, boxes outside them, else every "answer:" block and the blocks below it of the
same shape) and ``marked_answers`` (math's marked strategies, each occurrence).

Options (``row.extraction``): ``strategies`` (list, default
``["boxed", "answer_is", "bare", "last_number"]``), ``require_think`` (bool, default False:
responses without any ``<think>`` are taken whole), ``max_distinct_boxed`` (int, default 1),
``max_fallback_numbers`` (int, default 4).
"""
from __future__ import annotations

import re
from collections import deque
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


_ANSWER_IS_RE = re.compile(r"(?:the\s+)?(?:final\s+)?answer\s*(?:is\b|:|=)[ \t]*:?[ \t]*", re.IGNORECASE)
_HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")  # anywhere, as lm-eval's gsm8k strict-match reads it
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?%?|-?\.\d+%?")


def _clean_tail(s: str) -> str:
    """An answer after a marker, without surrounding emphasis or a final period."""
    return s.strip().strip("*_ ").rstrip(".").strip().strip("*_ ")


_WORDY_RE = re.compile(r"[^\W\d_]{3,}")
_LATEX_COMMAND_RE = re.compile(r"\\[A-Za-z]+")


def _wordy(line: str) -> bool:
    """Does the line hold a word (three letters or more; LaTeX commands such as \\frac are none)?"""
    return bool(_WORDY_RE.search(_LATEX_COMMAND_RE.sub(" ", line)))


MAX_BLOCK_CHARS = 20_000  # a marked answer longer than this is cut (no task's answer is that long)


def _continues(first: str, line: str) -> bool:
    """Does `line` continue the block that `first` starts? A line of numbers and symbols
    continues one of numbers and symbols (grid rows, a table's rules, futoshiki's constraint
    rows); a line with words continues one with words and as many tokens (the rows of a
    table, one move per line), not a sentence of explanation."""
    wordy = _wordy(line)
    if wordy != _wordy(first):
        return False
    return not wordy or len(line.split()) == len(first.split())


def block_after(text: str, pos: int, limit: int | None = None) -> str:
    """The answer that starts at `pos`, just after an answer marker: the rest of its line and
    the lines below it that continue it (``_continues``), or, when the rest of the line is
    empty, the block starting at the next line with something on it. A block ends at an empty
    line, at `limit` (the next marker) or after ``MAX_BLOCK_CHARS``; the scan never passes them,
    so reading every marker's block stays linear in the text."""
    start, end = _block_span(text, pos, limit)
    return text[start:end].strip()


def _block_span(text: str, pos: int, limit: int | None) -> tuple[int, int]:
    """(start, end) of ``block_after``'s block in the text."""
    end = min(len(text) if limit is None else limit, pos + MAX_BLOCK_CHARS)
    first, start, stop_at = None, pos, pos
    i = pos
    while i < end:
        nl = text.find("\n", i, end)
        stop = end if nl == -1 else nl
        line = text[i:stop]
        if first is None:  # the marker's line, then the lines before the block starts
            if line.strip():
                first, start, stop_at = line, i, stop
        elif not line.strip("\r") or not _continues(first, line):
            break
        else:
            stop_at = stop
        i = stop + 1
    return start, stop_at


def last_answer_is_block(text: str) -> str | None:
    """The answer after the last "the answer is" / "final answer:" marker, or None without one."""
    last = deque(_ANSWER_IS_RE.finditer(text), maxlen=1)
    return block_after(text, last[0].end()) if last else None


def answer_is_blocks(text: str) -> list[str]:
    """The answers after every "the answer is" / "final answer:" marker, in order: each
    marker's block (``block_after``), then each later block, after an empty line and before
    the next marker, whose first line has the shape of the first block's (as many tokens,
    words or none: a second grid below the first, "5" below "6"; not "3 + 2 = 5" below "5"):
    what strict grading compares, where reading stops at the first block."""
    marks = list(_ANSWER_IS_RE.finditer(text))
    out: list[str] = []
    for k, m in enumerate(marks):
        limit = marks[k + 1].start() if k + 1 < len(marks) else len(text)
        start, end = _block_span(text, m.end(), limit)
        first = text[start:end].strip()
        out.append(first)
        if not first:
            continue
        head = first.splitlines()[0]
        for chunk in re.split(r"\n\r?\n", text[end: min(limit, m.end() + MAX_BLOCK_CHARS)]):
            lines = [ln for ln in chunk.splitlines() if ln.strip()]
            if lines and _wordy(lines[0]) == _wordy(head) and len(lines[0].split()) == len(head.split()):
                out.append("\n".join(lines).strip())
    return out


def _distinct(answers: list[str], same: Callable[[str, str], bool]) -> list[str]:
    groups: list[str] = []
    for a in answers:
        if not any(a == g or same(g, a) for g in groups):
            groups.append(a)
    return groups


_TAG_OPEN_RE = re.compile(r"<answer>", re.IGNORECASE)
_TAG_CLOSE_RE = re.compile(r"</answer>", re.IGNORECASE)


def answer_tag_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the content of every closed ``<answer>...</answer>`` (any case), in
    order: a closing tag pairs with the last opening tag since the previous pair. One pass."""
    opens = list(_TAG_OPEN_RE.finditer(text))
    spans: list[tuple[int, int]] = []
    k, floor = 0, 0
    for close in _TAG_CLOSE_RE.finditer(text):
        last = None
        while k < len(opens) and opens[k].end() <= close.start():
            if opens[k].start() >= floor:
                last = opens[k].end()
            k += 1
        if last is not None:
            spans.append((last, close.start()))
        floor = close.end()
    return spans


def stated_answers(text: str) -> list[str]:
    """Every answer the final text states in a marked form, in order: each closed answer tag
    and each box outside the tags, or, when there is neither, each "answer:" block and the
    blocks that continue it (``answer_is_blocks``). Strict grading compares them: several
    that disagree are a hedge."""
    spans = answer_tag_spans(text)
    outside, pos = [], 0
    for a, b in spans:
        outside.append(text[pos:a])
        pos = b
    outside.append(text[pos:])
    found = [text[a:b].strip() for a, b in spans] + find_boxed(" ".join(outside))
    return found if found else [b for b in answer_is_blocks(text) if b]


def _clean_marked(s: str) -> str:
    """A marked answer as math reads it: no emphasis, final period or math delimiters (a
    currency "\\$" stays)."""
    return re.sub(r"(?<!\\)\$", "", _clean_tail(s)).strip()


def marked_answers(text: str) -> list[str]:
    """Every answer the text marks, as ``extract_answer``'s marked strategies read them: each
    box, each "the answer is" block, each "####" line (empty ones left out)."""
    blocks = [b[:m.start()] if (m := _BOX_RE.search(b)) else b for b in answer_is_blocks(text)]  # its box is read as one
    found = find_boxed(text) + [_clean_marked(b) for b in blocks]
    found += [_clean_marked(h) for h in _HASHES_RE.findall(text)]
    return [a for a in found if a]


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
            block = last_answer_is_block(text)
            if block is not None and _clean_marked(block):
                return _clean_marked(block), "answer_is"
        elif strategy == "hashes":
            matches = _HASHES_RE.findall(text)
            if matches and _clean_marked(matches[-1]):
                return _clean_marked(matches[-1]), "hashes"
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

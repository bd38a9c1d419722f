"""`find_boxed` (verifiers/extract.py) reads an untrusted response: its work is linear in the
text whatever the text holds (many unclosed `\\boxed{` openers, deep or unbalanced braces), and
it finds what a scan from each opener finds."""
from __future__ import annotations

import random
import sys
import time

import pytest

from verifiers.extract import _BOX_RE, extract_answer, find_boxed


def scan_from_each_opener(text: str) -> list[str]:
    """The definition: from each opener not inside the last box found, count braces until the
    depth returns to zero (`\\{`, `\\}` are text). Quadratic on unclosed openers: small inputs only."""
    out: list[str] = []
    end_of_last = -1
    for m in _BOX_RE.finditer(text):
        if m.start() < end_of_last:
            continue
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end(): i - 1].strip())
            end_of_last = i
    return out


PIECES = ["\\boxed{", "\\fbox {", "\\boxed", "{", "}", "\\{", "\\}", "\\", "\\\\", "a", "1", " ", "x}"]


def test_the_same_boxes_as_a_scan_from_each_opener():
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))
        assert find_boxed(text) == scan_from_each_opener(text), text
    assert find_boxed(r"\boxed{ \boxed{a}") == ["a"]  # an unclosed box: the box inside it still counts
    assert find_boxed(r"\boxed{a \boxed{b} } \boxed{c}") == [r"a \boxed{b}", "c"]
    assert find_boxed(r"\boxed{\{x\}} \boxed{\\{y}}") == [r"\{x\}", r"\\{y"]
    assert find_boxed("}}} \\boxed{1} {{{") == ["1"]


def _lines_run(text: str) -> int:
    """Python lines executed inside find_boxed on `text`: its work, counted exactly."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code is find_boxed.__code__:
            if event == "line":
                count += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        find_boxed(text)
    finally:
        sys.settrace(None)
    return count


ADVERSARIAL = {
    "unclosed openers": lambda n: "\\boxed{" * (n // 7),
    "deep braces": lambda n: "\\boxed{" + "{" * n,
    "nested boxes, no close": lambda n: "\\boxed{{" * (n // 8) + "}" * (n // 16),
    "escaped closers": lambda n: "\\boxed{" + "\\}" * (n // 2),
    "alternating": lambda n: "\\fbox{}{" * (n // 8),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_work_is_linear_in_the_text(name):
    make = ADVERSARIAL[name]
    small, large = _lines_run(make(4000)), _lines_run(make(16000))
    assert large <= 4.5 * small + 50, (small, large)  # a scan per opener would be ~16x


def test_a_megabyte_of_adversarial_braces_is_read_at_once():
    text = "".join(("\\boxed{", "{", "\\}", "\\fbox {{")[i % 4] for i in range(200_000))[:1_000_000]
    text += "{" * (1_000_000 - len(text))
    t0 = time.perf_counter()
    assert find_boxed(text) == []
    assert extract_answer(text + " the answer is 3") == ("3", "answer_is")  # the whole extraction with it
    # generous for a loaded 2-core machine: a scan from each of its 100,000 openers takes hours
    assert time.perf_counter() - t0 < 5.0

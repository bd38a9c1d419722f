"""Logic games. Each module has ``generate(n, seed, **difficulty) -> list[dict]`` (task rows
whose prompts state the answer format) and a registered verifier that checks the rules of
the game, not string equality with one stored solution."""
from __future__ import annotations

import json
import re

from ..extract import answer_tag_spans, find_boxed, last_answer_is_block

ANSWER_INSTRUCTION = "Think inside <think> </think>, then give only the final answer after </think>."


def answer_region(text: str) -> tuple[str, str]:
    """(the part of the final text that is the answer, its source): the last closed answer
    tag ("answer_tag"), else the last boxed answer ("boxed"), else the block after the last
    "answer:" marker ("answer_is": its line, or a grid on the lines below it), else the whole
    final text ("whole_text")."""
    tags = answer_tag_spans(text)
    if tags:
        return text[tags[-1][0]: tags[-1][1]], "answer_tag"
    boxed = find_boxed(text)
    if boxed:
        return boxed[-1], "boxed"
    block = last_answer_is_block(text)
    return (block, "answer_is") if block else (text, "whole_text")


def one_line(region: str) -> str | None:
    """The answer when it is on one line (blank lines and surrounding $ ` ignored), else None."""
    lines = [ln.strip().strip("$`").strip() for ln in region.strip().splitlines()]
    lines = [ln for ln in lines if ln]
    return lines[0] if len(lines) == 1 else None


def parse_int_grids(text: str) -> list[list[list[int]]]:
    """Every grid of integers in the text, tolerant of formatting: JSON ``[[1,2],[3,4]]``,
    rows of numbers separated by spaces/commas/bars, or rows of single digits ("0120").
    A block of consecutive numeric lines is one grid (table rules like "---+---" inside it
    are skipped); text lines separate grids. Verifiers require exactly one."""
    text = re.sub(r"\\\\[ \t]*\r?\n?", "\n", text)  # LaTeX's row break, with or without a line break after it
    grids: list[list[list[int]]] = []
    rest, pos = [], 0
    for m in re.finditer(r"\[\s*\[", text):
        if m.start() < pos:
            continue
        depth = 0
        for j in range(m.start(), len(text)):
            depth += {"[": 1, "]": -1}.get(text[j], 0)
            if depth == 0:
                try:
                    grid = json.loads(text[m.start(): j + 1])
                except ValueError:
                    break
                if isinstance(grid, list) and grid and all(
                        isinstance(r, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
                        for r in grid):
                    grids.append(grid)
                    rest.append(text[pos: m.start()])
                    pos = j + 1
                break
    rest.append(text[pos:])
    blocks: list[list[list[int]]] = [[]]
    for line in "\n".join(rest).splitlines():
        s = line.strip().strip("`|[]").strip()
        if s and re.fullmatch(r"[\d\s,|;\[\]\.\-+]+", s) and re.search(r"\d", s):
            cleaned = re.sub(r"[|;\[\]]", " ", s)
            if re.search(r"[\s,]", cleaned.strip()) and not re.fullmatch(r"\d+", cleaned.strip()):
                row = [int(t) for t in re.findall(r"-?\d+", cleaned)]
            else:
                row = [int(c) for c in re.sub(r"\D", "", cleaned)]
            blocks[-1].append(row)
        elif re.fullmatch(r"[-+=|\s]+", s or "x") and blocks[-1]:
            continue
        elif blocks[-1]:
            blocks.append([])
    return grids + [b for b in blocks if b]


def one_grid(text: str) -> tuple[list[list[int]] | None, str]:
    """(the single grid of the answer, "") or (None, why not)."""
    grids = parse_int_grids(text)
    if not grids:
        return None, "no grid found in the final answer"
    if len(grids) > 1:
        return None, f"{len(grids)} grids in the final answer: give exactly one"
    return grids[0], ""


def grid_to_text(grid: list[list[int]]) -> str:
    return "\n".join(" ".join(str(v) for v in row) for row in grid)

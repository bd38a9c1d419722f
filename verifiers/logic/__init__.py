"""Logic games. Each module has ``generate(n, seed, **difficulty) -> list[dict]`` (task rows
whose prompts state the answer format) and a registered verifier that checks the rules of
the game, not string equality with one stored solution."""
from __future__ import annotations

import json
import re

from ..extract import find_boxed

ANSWER_INSTRUCTION = "Think inside <think> </think>, then give only the final answer after </think>."


def answer_region(text: str) -> str:
    """The last boxed answer if any, else the whole final text."""
    boxed = find_boxed(text)
    return boxed[-1] if boxed else text


def parse_int_grid(text: str) -> list[list[int]] | None:
    """A grid of integers from text, tolerant of formatting: JSON ``[[1,2],[3,4]]``, rows of
    numbers separated by spaces/commas/bars, or rows of single digits ("0120"). The last
    block of consecutive numeric lines wins (so a sentence before the grid is fine)."""
    text = text.replace("\\\\", "\n")
    starts = [m.start() for m in re.finditer(r"\[\s*\[", text)]
    for s in reversed(starts):
        depth = 0
        for j in range(s, len(text)):
            depth += {"[": 1, "]": -1}.get(text[j], 0)
            if depth == 0:
                try:
                    grid = json.loads(text[s: j + 1])
                    if isinstance(grid, list) and grid and all(isinstance(r, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in r) for r in grid):
                        return grid
                except ValueError:
                    pass
                break
    blocks: list[list[list[int]]] = [[]]
    for line in text.splitlines():
        s = line.strip().strip("`|[]").strip()
        if s and re.fullmatch(r"[\d\s,|;\[\]\.\-+]+", s) and re.search(r"\d", s):
            cleaned = re.sub(r"[|;\[\]]", " ", s)
            if re.search(r"[\s,]", cleaned.strip()) and not re.fullmatch(r"\d+", cleaned.strip()):
                row = [int(t) for t in re.findall(r"-?\d+", cleaned)]
            else:
                digits = re.sub(r"\D", "", cleaned)
                row = [int(c) for c in digits]
            blocks[-1].append(row)
        elif re.fullmatch(r"[-+=|\s]+", s or "x") and blocks[-1]:
            continue  # table rules like "------+------" inside a grid
        elif blocks[-1]:
            blocks.append([])
    nonempty = [b for b in blocks if b]
    return nonempty[-1] if nonempty else None


def grid_to_text(grid: list[list[int]]) -> str:
    return "\n".join(" ".join(str(v) for v in row) for row in grid)

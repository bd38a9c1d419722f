"""Sudoku 4x4 (2x2 boxes), 6x6 (2x3 boxes), 9x9 (3x3 boxes).

Reference: {"size": n, "box": [box_rows, box_cols], "puzzle": [[0 = empty, ...], ...]}.
The answer must be exactly one grid. The verifier accepts any completed grid that respects the givens and has every digit 1..n
exactly once per row, column and box (puzzles need not have a unique solution).
"""
from __future__ import annotations

import random

from ..registry import register_verifier
from ..schema import Reward, TaskRow
from . import ANSWER_INSTRUCTION, answer_region, grid_to_text, one_grid

BOXES = {4: (2, 2), 6: (2, 3), 9: (3, 3)}


def _solved_grid(size: int, rng: random.Random) -> list[list[int]]:
    br, bc = BOXES[size]
    base = [[(bc * (r % br) + r // br + c) % size + 1 for c in range(size)] for r in range(size)]
    # shuffle digits, rows within bands, bands, cols within stacks, stacks: all keep validity
    digits = list(range(1, size + 1))
    rng.shuffle(digits)
    grid = [[digits[v - 1] for v in row] for row in base]
    bands = list(range(size // br))
    rng.shuffle(bands)
    rows = [b * br + r for b in bands for r in rng.sample(range(br), br)]
    stacks = list(range(size // bc))
    rng.shuffle(stacks)
    cols = [s * bc + c for s in stacks for c in rng.sample(range(bc), bc)]
    return [[grid[r][c] for c in cols] for r in rows]


def check_solution(grid: list[list[int]], puzzle: list[list[int]], size: int, box: tuple[int, int]) -> str | None:
    """None when ``grid`` solves ``puzzle``, else the first broken rule."""
    if len(grid) != size or any(len(r) != size for r in grid):
        return f"grid is not {size}x{size}"
    want = set(range(1, size + 1))
    for r in range(size):
        for c in range(size):
            if puzzle[r][c] and grid[r][c] != puzzle[r][c]:
                return f"given at row {r + 1}, column {c + 1} changed"
    for r in range(size):
        if set(grid[r]) != want:
            return f"row {r + 1} is not 1..{size}"
    for c in range(size):
        if {grid[r][c] for r in range(size)} != want:
            return f"column {c + 1} is not 1..{size}"
    br, bc = box
    for r0 in range(0, size, br):
        for c0 in range(0, size, bc):
            if {grid[r][c] for r in range(r0, r0 + br) for c in range(c0, c0 + bc)} != want:
                return f"box at row {r0 + 1}, column {c0 + 1} is not 1..{size}"
    return None


def generate(n: int, seed: int, size: int = 4, holes: float = 0.5) -> list[dict]:
    """``size`` in {4, 6, 9}; ``holes`` = fraction of cells emptied (difficulty)."""
    if size not in BOXES:
        raise ValueError(f"sudoku size must be one of {sorted(BOXES)}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        sol = _solved_grid(size, rng)
        cells = [(r, c) for r in range(size) for c in range(size)]
        puzzle = [row[:] for row in sol]
        for r, c in rng.sample(cells, int(round(holes * len(cells)))):
            puzzle[r][c] = 0
        br, bc = BOXES[size]
        prompt = (
            f"Solve this {size}x{size} Sudoku (boxes are {br} rows x {bc} columns; 0 marks an empty cell). "
            f"Every row, column and box must contain the digits 1 to {size} exactly once.\n\n"
            f"{grid_to_text(puzzle)}\n\n{ANSWER_INSTRUCTION} Write the completed grid, one row per line, "
            "digits separated by spaces."
        )
        rows.append({"id": f"sudoku-{size}-{seed}-{i}", "domain": "sudoku", "prompt": prompt,
                     "reference": {"size": size, "box": [br, bc], "puzzle": puzzle}})
    return rows


@register_verifier("sudoku")
def verify_sudoku(row: TaskRow, text: str) -> Reward:
    ref = row.reference
    size = int(ref["size"])
    box = tuple(ref.get("box") or BOXES[size])
    region, source = answer_region(text)
    grid, problem = one_grid(region)
    if grid is None:
        return Reward.zero(problem, source=source)
    problem = check_solution(grid, ref["puzzle"], size, box)
    extracted = grid_to_text(grid)
    if problem:
        return Reward.zero(problem, extracted=extracted, source=source)
    return Reward.one("valid solution", extracted=extracted, source=source)

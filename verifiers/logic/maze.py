"""Mazes on a grid: '#' wall, '.' open, 'S' start, 'E' end. Answer = moves U/D/L/R.

Reference: {"grid": ["S..#", ...], "shortest": k, "require_shortest": bool}. The verifier
walks the path: it must stay on open cells, start at S and finish on E; with
``require_shortest`` its length must equal the BFS shortest length.
"""
from __future__ import annotations

import random
import re
from collections import deque

from ..registry import register_verifier
from ..schema import Reward, TaskRow
from . import ANSWER_INSTRUCTION, answer_region, one_line

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
_WORDS = {"UP": "U", "DOWN": "D", "LEFT": "L", "RIGHT": "R", "NORTH": "U", "SOUTH": "D", "WEST": "L", "EAST": "R"}


def _find(grid: list[str], ch: str) -> tuple[int, int]:
    for r, line in enumerate(grid):
        c = line.find(ch)
        if c >= 0:
            return r, c
    raise ValueError(f"maze has no {ch!r}")


def shortest_path(grid: list[str]) -> str | None:
    start, end = _find(grid, "S"), _find(grid, "E")
    prev: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    q = deque([start])
    while q:
        cur = q.popleft()
        if cur == end:
            path = []
            while prev[cur] is not None:
                cur, m = prev[cur][0], prev[cur][1]
                path.append(m)
            return "".join(reversed(path))
        for m, (dr, dc) in MOVES.items():
            r, c = cur[0] + dr, cur[1] + dc
            if 0 <= r < len(grid) and 0 <= c < len(grid[r]) and grid[r][c] != "#" and (r, c) not in prev:
                prev[(r, c)] = (cur, m)
                q.append((r, c))
    return None


def parse_moves(line: str) -> str | None:
    s = line.upper()
    for w, m in _WORDS.items():
        s = re.sub(rf"\b{w}\b", m, s)
    s = re.sub(r"[\s,;\->→\[\]\"'`.]+", "", s)
    return s if s and re.fullmatch(r"[UDLR]+", s) else None


def generate(n: int, seed: int, rows: int = 5, cols: int = 5, wall_density: float = 0.3,
             require_shortest: bool = False) -> list[dict]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        cells = [["#" if rng.random() < wall_density else "." for _ in range(cols)] for _ in range(rows)]
        cells[0][0], cells[rows - 1][cols - 1] = "S", "E"
        grid = ["".join(r) for r in cells]
        path = shortest_path(grid)
        if path is None:
            continue
        i = len(out)
        prompt = (
            "Find a path through this maze from S to E. '#' is a wall, '.' is open; you move one cell "
            "at a time up (U), down (D), left (L) or right (R)"
            + (" and the path must be as short as possible" if require_shortest else "")
            + ".\n\n" + "\n".join(grid) + f"\n\n{ANSWER_INSTRUCTION} Write the moves as one string such as RRDD."
        )
        out.append({"id": f"maze-{seed}-{i}", "domain": "maze", "prompt": prompt,
                    "reference": {"grid": grid, "shortest": len(path), "require_shortest": require_shortest}})
    return out


@register_verifier("maze")
def verify_maze(row: TaskRow, text: str) -> Reward:
    ref = row.reference
    grid = ref["grid"]
    region, source = answer_region(text)
    line = one_line(region)
    moves = parse_moves(line) if line is not None else None
    if moves is None:
        return Reward.zero("the answer must be one line of moves (U/D/L/R) and nothing else", source=source)
    r, c = _find(grid, "S")
    for k, m in enumerate(moves):
        dr, dc = MOVES[m]
        r, c = r + dr, c + dc
        if not (0 <= r < len(grid) and 0 <= c < len(grid[r])):
            return Reward.zero(f"move {k + 1} ({m}) leaves the maze", extracted=moves, source=source)
        if grid[r][c] == "#":
            return Reward.zero(f"move {k + 1} ({m}) walks into a wall", extracted=moves, source=source)
    if grid[r][c] != "E":
        return Reward.zero("path does not end at E", extracted=moves, source=source)
    shortest = ref.get("shortest") or len(shortest_path(grid) or "")
    if ref.get("require_shortest") and len(moves) != shortest:
        return Reward.zero(f"path has {len(moves)} moves, shortest is {shortest}", extracted=moves, source=source)
    return Reward.one("valid path", extracted=moves, source=source, length=len(moves), shortest=shortest)

"""ARC-style grid tasks: infer a transformation from examples, apply it to a test grid.

Reference: {"output": [[...], ...]} (and the generator also stores "train" and "test_input").
The answer must be exactly one grid, equal to the output grid; formatting is free (JSON,
spaces, commas, digits without separators, a boxed grid).
"""
from __future__ import annotations

import random

from ..registry import register_verifier
from ..schema import Reward, TaskRow
from . import ANSWER_INSTRUCTION, answer_region, grid_to_text, one_grid

TRANSFORMS = {
    "flip_horizontal": lambda g: [row[::-1] for row in g],
    "flip_vertical": lambda g: g[::-1],
    "transpose": lambda g: [list(r) for r in zip(*g)],
    "rotate_90": lambda g: [list(r) for r in zip(*g[::-1])],
}


def _recolor(g, mapping):
    return [[mapping.get(v, v) for v in row] for row in g]


def generate(n: int, seed: int, size: int = 3, colors: int = 4, examples: int = 2) -> list[dict]:
    """``size`` = grid side; ``colors`` = number of colours 0..colors-1; transformation
    drawn from flips, transpose, rotation and a colour swap."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name = rng.choice(list(TRANSFORMS) + ["recolor"])
        if name == "recolor":
            a, b = rng.sample(range(colors), 2)
            fn = lambda g, a=a, b=b: _recolor(g, {a: b, b: a})  # noqa: E731
        else:
            fn = TRANSFORMS[name]
        grids = [[[rng.randrange(colors) for _ in range(size)] for _ in range(size)] for _ in range(examples + 1)]
        train = [{"input": g, "output": fn(g)} for g in grids[:-1]]
        test = grids[-1]
        shown = "\n\n".join(f"Example {k + 1} input:\n{grid_to_text(ex['input'])}\nExample {k + 1} output:\n"
                            f"{grid_to_text(ex['output'])}" for k, ex in enumerate(train))
        prompt = (f"Find the rule that turns each input grid into its output grid.\n\n{shown}\n\n"
                  f"Test input:\n{grid_to_text(test)}\n\n{ANSWER_INSTRUCTION} "
                  "Write the output grid, one row per line, numbers separated by spaces.")
        out.append({"id": f"arc-{seed}-{i}", "domain": "arc", "prompt": prompt,
                    "reference": {"output": fn(test), "train": train, "test_input": test, "rule": name}})
    return out


@register_verifier("arc")
def verify_arc(row: TaskRow, text: str) -> Reward:
    want = row.reference["output"]
    region, source = answer_region(text)
    grid, problem = one_grid(region)
    if grid is None:
        return Reward.zero(problem, source=source)
    if grid != want:
        return Reward.zero(_difference(want, grid), extracted=grid_to_text(grid), source=source)
    return Reward.one("exact grid match", extracted=grid_to_text(grid), source=source)


def _difference(want: list[list[int]], got: list[list[int]]) -> str:
    if len(got) != len(want) or any(len(a) != len(b) for a, b in zip(got, want)):
        return (f"grid is {len(got)}x{len(got[0]) if got else 0}, expected "
                f"{len(want)}x{len(want[0]) if want else 0}")
    r, c = next((r, c) for r in range(len(want)) for c in range(len(want[r])) if want[r][c] != got[r][c])
    return f"grid differs from the expected output first at row {r + 1}, column {c + 1}"

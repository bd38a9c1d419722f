"""Multi-line final answers (grids, tables, lists) are read whole wherever a task accepts them:
inside answer tags, inside a box, and in the block after a "Final answer:" line; wrong grids
still score 0, and a second grid below the first is a hedge under strict grading. The block
after a marker is `extract.block_after`'s: the rest of the marker's line and the lines that
continue it, or the block below an empty marker line, up to an empty line."""
from __future__ import annotations

import json

import pytest
import reasoning_gym

from tests.verifiers.red_team import sudoku_solution
from verifiers import verify
from verifiers.extract import answer_is_blocks, block_after
from verifiers.logic import arc, sudoku
from verifiers.rgym import extract

T = "<think>\nworking\n</think>\n"


def rg_row(family: str, **config) -> dict:
    e = json.loads(json.dumps(reasoning_gym.create_dataset(family, size=1, seed=5, **config)[0], default=str))
    return {"domain": "reasoning_gym", "prompt": e["question"],
            "reference": {"family": family, "answer": e["answer"], "metadata": e["metadata"], "config": config}}


@pytest.mark.parametrize("text,block", [
    ("Final answer:\n1 2\n3 4", "1 2\n3 4"),
    ("Final answer:\n\n1 2\n3 4\n\nEach row checks out.", "1 2\n3 4"),
    ("Answer: 1 2\n3 4", "1 2\n3 4"),                         # a grid that starts on the marker's line
    ("Answer: 42\nbecause 6 * 7 = 42", "42"),                 # an explanation is no row of the answer
    ("Answer: Paris.\nParis is the capital.", "Paris."),
    ("The answer is:\n$$\n\\frac{1}{3}\n$$\n\nSo it is.", "$$\n\\frac{1}{3}\n$$"),
    ("Final answer:\n4   5 > 2\n        ∧\n2   3   1", "4   5 > 2\n        ∧\n2   3   1"),  # futoshiki's rows
    ("Final answer:\nMove disk 1 from Peg 1 to Peg 3\nMove disk 2 from Peg 1 to Peg 2",
     "Move disk 1 from Peg 1 to Peg 3\nMove disk 2 from Peg 1 to Peg 2"),
])
def test_the_block_after_a_marker(text, block):
    start = text.lower().index(":") + 1
    assert block_after(text, start) == block


def test_every_block_strict_grading_compares_ends_at_the_next_marker():
    assert answer_is_blocks("Answer: 1\nAnswer: 2") == ["1", "2"]
    assert answer_is_blocks("Final answer:\n1 2\n3 4\n\nor\n\n5 6\n7 8") == ["1 2\n3 4", "5 6\n7 8"]
    assert answer_is_blocks("Final answer: 5\n\n3 + 2 = 5") == ["5"]  # a check below the answer is not a second one


@pytest.mark.parametrize("family,config", [("mini_sudoku", {}), ("rotate_matrix", {}), ("n_queens", {}),
                                           ("futoshiki", {}), ("arc_1d", {}), ("tower_of_hanoi", {})])
def test_reasoning_gym_grids_and_lists_after_a_final_answer_line(family, config):
    row = rg_row(family, **config)
    gold = row["reference"]["answer"]
    for response in (f"Final answer:\n{gold}", f"Some reasoning.\n\nFinal answer:\n\n{gold}\n\nDone.",
                     f"<answer>\n{gold}\n</answer>", f"\\boxed{{{gold}}}"):
        for grading in ("reference", "strict"):
            r = verify({**row, "grading": grading}, T + response)
            assert r.score == 1.0, (family, grading, response[:80], r.reason)
    wrong = gold.replace("1", "7", 1) if "1" in gold else gold[::-1]
    assert verify(row, T + f"Final answer:\n{wrong}").score < 1.0


def test_a_multi_line_answer_line_was_read_as_its_first_row_only():
    row = rg_row("mini_sudoku")
    gold = row["reference"]["answer"]
    answer, source = extract(f"Final answer:\n{gold}")
    assert (answer, source) == (gold, "answer_is")


def test_logic_grids_after_the_puzzle_is_echoed():
    """The reasoning shows the puzzle's grid, then "Final answer:" and the solution: the
    whole text holds two grids (0 before), the block one."""
    row = sudoku.generate(1, seed=2, size=4, holes=0.5)[0]
    puzzle = row["reference"]["puzzle"]
    grid = "\n".join(" ".join(map(str, r)) for r in sudoku_solution(puzzle))
    echoed = "\n".join(" ".join(map(str, r)) for r in puzzle)
    for grading in ("reference", "strict"):
        good = verify({**row, "grading": grading}, f"The puzzle:\n{echoed}\n\nFinal answer:\n{grid}")
        assert good.score == 1.0 and good.source == "answer_is", good.reason
        latex_rows = verify({**row, "grading": grading}, "\\boxed{" + grid.replace("\n", " \\\\\n") + "}")
        assert latex_rows.score == 1.0, latex_rows.reason
    bad = grid.replace(grid[0], "9", 1)
    assert verify(row, f"The puzzle:\n{echoed}\n\nFinal answer:\n{bad}").score == 0.0
    two = verify({**row, "grading": "strict"}, f"Final answer:\n{grid}\n\nor\n\n{echoed}")
    assert two.score == 0.0 and two.details["reference_score"] == 1.0, two.reason


def test_arc_grid_in_an_answer_tag_and_a_table():
    row = arc.generate(1, seed=3)[0]
    out = row["reference"]["output"]
    tagged = "<answer>\n" + "\n".join(" ".join(map(str, r)) for r in out) + "\n</answer>"
    table = "Final answer:\n" + "\n".join("| " + " | ".join(map(str, r)) + " |" for r in out)
    for response in (tagged, table):
        assert verify({**row, "grading": "strict"}, T + response).score == 1.0, response


def test_math_answer_in_a_display_block_after_the_marker():
    row = {"domain": "math", "reference": {"answer": "\\frac{1}{3}"}}
    for grading in ("reference", "strict"):
        assert verify({**row, "grading": grading}, "The final answer is:\n\n$$\n\\frac{1}{3}\n$$").score == 1.0
    assert verify(row, "The final answer is:\n\n$$\n\\frac{1}{4}\n$$").score == 0.0

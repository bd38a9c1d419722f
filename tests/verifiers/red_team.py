"""A red team of hedges built from their categories, and the honest controls beside it.

A task is a row, its right and a wrong answer, and the formats its domain accepts an answer
in (answer tag, box, "the answer is" line, "Final answer:" block, bare text, a fenced
program). From these the red team is built, not listed: every category below, in every
format, both orders (right first and last):

- alternatives: the right and the wrong answer joined by or / either...or / and/or / a slash;
- list: both stated as a list (two grids, for a grid);
- range: a range around or from the right number, a value plus or minus another (numeric golds);
- several_answers: the wrong answer in one marked format, the right one in another after it;
- multi_line: a "Final answer:" block that holds the right answer and, on the next line, the wrong one;
- domain: a domain's own hedge (IFEval: a constrained response naming two options; code: two programs).

`controls` are the right answer in every format. The tasks: math golds of several kinds,
reasoning-gym families of several answer shapes, the five logic games, a code task, IFEval.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import reasoning_gym

from verifiers.logic import arc, countdown, knights_knaves, maze, sudoku
from verifiers.logic.maze import shortest_path

T = "<think>\nworking it out\n</think>\n"
Format = Callable[[str], str]


def tag(a: str) -> str:
    return f"<answer>{a}</answer>"


def boxed(a: str) -> str:
    return f"\\boxed{{{a}}}"


def boxed_rows(a: str) -> str:
    """A grid in a box with LaTeX's row breaks (logic games read them; reasoning-gym's grids do not)."""
    return "\\boxed{" + a.replace("\n", " \\\\\n") + "}"


def line(a: str) -> str:
    return f"So the answer is {a}." if "\n" not in a else f"Final answer:\n{a}"


def block(a: str) -> str:
    return f"Final answer:\n{a}"


def bare(a: str) -> str:
    return a


@dataclass
class Task:
    domain: str
    row: dict
    right: str
    wrong: str
    formats: dict[str, Format]
    number: bool = False  # the answer is one number: ranges apply
    latex: bool = False   # joining words go in \text{...}, as a math answer writes them
    extra: dict[str, str] = field(default_factory=dict)  # the domain's own hedges: name -> final text


MATH_FORMATS = {"boxed": lambda a: f"The answer is $\\boxed{{{a}}}$.", "answer_is": lambda a: f"The answer is ${a}$.",
                "final_block": lambda a: f"Final answer:\n$$\n{a}\n$$", "bare": lambda a: f"${a}$"}
MATH_GOLDS = [("42", "43", True), ("\\frac{1}{2}", "\\frac{1}{3}", False), ("2\\sqrt{3}", "3\\sqrt{2}", False),
              ("0.25", "0.5", True), ("x^2+1", "x^2-1", False), ("\\pi", "2\\pi", False), ("-7", "7", True),
              ("(1, 2)", "(2, 1)", False), ("\\{1, 3\\}", "\\{2, 3\\}", False)]
RG_FORMATS = {"tag": tag, "boxed": boxed, "line": line, "bare": bare}
RG_FAMILIES = ["leg_counting", "fraction_simplification", "time_intervals", "gsm_symbolic", "knights_knaves",
               "word_sorting", "spell_backward", "mini_sudoku", "basic_arithmetic", "advanced_geometry"]
LOGIC_FORMATS = {"tag": tag, "boxed": boxed, "boxed_rows": boxed_rows, "answer_line": line, "whole_text": bare}


def math_tasks() -> list[Task]:
    return [Task("math", {"domain": "math", "reference": {"answer": g}}, g, w, MATH_FORMATS, number=n, latex=True)
            for g, w, n in MATH_GOLDS]


def rgym_tasks() -> list[Task]:
    out = []
    for family in RG_FAMILIES:
        ds = reasoning_gym.create_dataset(family, size=3, seed=3)
        entries = [json.loads(json.dumps(ds[i], default=str)) for i in range(3)]
        golds = [e["answer"] for e in entries]
        e = entries[0]
        wrong = next(g for g in golds if g != e["answer"] and ds.score_answer(answer=g, entry=ds[0]) < 1)
        row = {"domain": "reasoning_gym", "prompt": e["question"],
               "reference": {"family": family, "answer": e["answer"], "metadata": e["metadata"], "config": {}}}
        out.append(Task("reasoning_gym", row, e["answer"], wrong, RG_FORMATS,
                        number=bool(re.fullmatch(r"-?\d+(\.\d+)?", e["answer"]))))
    return out


def _grid(g: list[list[int]]) -> str:
    return "\n".join(" ".join(map(str, r)) for r in g)


def sudoku_solution(puzzle: list[list[int]]) -> list[list[int]]:
    g = [r[:] for r in puzzle]
    n, (br, bc) = len(g), sudoku.BOXES[len(g)]

    def ok(r, c, v):
        r0, c0 = r // br * br, c // bc * bc
        return (v not in g[r] and all(g[i][c] != v for i in range(n))
                and all(g[i][j] != v for i in range(r0, r0 + br) for j in range(c0, c0 + bc)))

    def fill(k):
        if k == n * n:
            return True
        r, c = divmod(k, n)
        if g[r][c]:
            return fill(k + 1)
        for v in range(1, n + 1):
            if ok(r, c, v):
                g[r][c] = v
                if fill(k + 1):
                    return True
                g[r][c] = 0
        return False

    assert fill(0)
    return g


def logic_tasks() -> list[Task]:
    su = sudoku.generate(1, seed=4, size=4, holes=0.25)[0]
    sol = sudoku_solution(su["reference"]["puzzle"])
    bad = [r[:] for r in sol]
    bad[0][0], bad[0][1] = bad[0][1], bad[0][0]
    ar = arc.generate(1, seed=4)[0]
    out_grid = ar["reference"]["output"]
    wrong_grid = [[(v + 1) % 4 for v in r] for r in out_grid]
    mz = maze.generate(1, seed=4)[0]
    path = shortest_path(mz["reference"]["grid"])
    cd = countdown.generate(1, seed=4)[0]
    expr = cd["reference"]["example"]
    kk = knights_knaves.generate(1, seed=4)[0]
    roles = dict(kk["reference"]["solution"])
    right_kk = ", ".join(f"{n} is a {r}" for n, r in roles.items())
    first = next(iter(roles))
    roles[first] = "knave" if roles[first] == "knight" else "knight"
    wrong_kk = ", ".join(f"{n} is a {r}" for n, r in roles.items())
    return [Task("sudoku", su, _grid(sol), _grid(bad), LOGIC_FORMATS),
            Task("arc", ar, _grid(out_grid), _grid(wrong_grid), LOGIC_FORMATS),
            Task("maze", mz, path, path[::-1] + "U", LOGIC_FORMATS),
            Task("countdown", cd, expr, f"{expr} + 1", LOGIC_FORMATS),
            Task("knights_knaves", kk, right_kk, wrong_kk, LOGIC_FORMATS)]


CODE_TESTS = {"tests": [{"fn": "add", "args": [1, 2], "expected": 3}, {"fn": "add", "args": [5, 5], "expected": 10}],
              "timeout_s": 4}


def fenced(program: str) -> str:
    return f"```python\n{program}\n```"


def code_task() -> Task:
    right, wrong = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b"
    extra = {"two_programs": f"First try:\n{fenced(wrong)}\nOr:\n{fenced(right)}",
             "two_programs_helper_between": f"{fenced(wrong)}\nA check:\n```python\nprint(add(1, 2))\n```\n{fenced(right)}"}
    return Task("code", {"domain": "code", "reference": CODE_TESTS}, right, wrong,
                {"fenced": fenced, "example_after": lambda p: f"{fenced(p)}\nUse it like `add(1, 2)`."}, extra=extra)


def ifeval_task() -> Task:
    ref = {"instruction_id_list": ["detectable_format:constrained_response"], "kwargs": [{}]}
    extra = {"two_options": "My answer is yes. My answer is no.", "three_options":
             "My answer is maybe.\nMy answer is yes.\nMy answer is no."}
    return Task("ifeval", {"domain": "ifeval", "prompt": "Is the sky blue? Answer with one of the options.",
                           "reference": ref}, "My answer is yes.", "My answer is no.", {"bare": bare}, extra=extra)


def tasks() -> list[Task]:
    return [*math_tasks(), *rgym_tasks(), *logic_tasks(), code_task(), ifeval_task()]


def _joined(task: Task, word: str) -> Callable[[str, str], str]:
    if task.latex:
        return lambda a, b: f"{a} \\text{{ {word} }} {b}"
    if "\n" in task.right:
        return lambda a, b: f"{a}\n\n{word}\n\n{b}"
    return lambda a, b: f"{a} {word} {b}"


def hedges(task: Task) -> dict[tuple[str, str], str]:
    """(category, shape) -> the hedged answer, before a format wraps it."""
    r, w = task.right, task.wrong
    pairs = {"or": _joined(task, "or"), "and_or": _joined(task, "and/or"), "slash": lambda a, b: f"{a} / {b}",
             "either": lambda a, b: ("\\text{either } " if task.latex else "either ") + _joined(task, "or")(a, b)}
    out = {}
    for name, join in pairs.items():
        out[("alternatives", name)] = join(r, w)
        out[("alternatives", name + "_rev")] = join(w, r)
    sep = "\n\n" if "\n" in r else ", "
    out[("list", "right_first")], out[("list", "right_last")] = f"{r}{sep}{w}", f"{w}{sep}{r}"
    if task.number:
        lo, hi = sorted((float(r), float(w)))
        to = "\\text{ to }" if task.latex else "to"
        out[("range", "to")] = f"{r} {to} {w}"
        between = f"between {lo:g} and {hi:g}"
        out[("range", "between")] = f"\\text{{{between}}}" if task.latex else between
        out[("range", "plus_minus")] = f"{r} \\pm 1" if task.latex else f"{r} ± 1"
    return out


def several_pairs(task: Task) -> list[tuple[str, str]]:
    """(format of the wrong answer, format of the right one after it) of several marked answers:
    in math every marked form (a marked answer there is mathematics: no sentence is taken for
    one); elsewhere answer tags and boxes, and answer lines among themselves (a sentence with
    "the answer is" beside a tag is prose, not a second answer)."""
    marked = [f for f in task.formats if f not in ("bare", "whole_text")]
    if task.domain == "math":
        return [(a, b) for a in marked for b in marked]
    tags = [f for f in marked if f in ("tag", "boxed", "boxed_rows")]
    lines = [f for f in marked if f not in tags]
    return [(a, b) for a in tags for b in tags] + [(a, b) for a in lines for b in lines]


def red_team(task: Task) -> list[tuple[str, str, str]]:
    """(category, shape, response) for the task: every category, every format, both orders."""
    if task.domain in ("code", "ifeval"):
        return [("domain", k, T + v) for k, v in task.extra.items()]
    out = [(cat, f"{shape}/{fmt}", T + wrap(ans)) for (cat, shape), ans in hedges(task).items()
           for fmt, wrap in task.formats.items()]
    out += [("several_answers", f"{a}_then_{b}", T + task.formats[a](task.wrong) + "\n\n" + task.formats[b](task.right))
            for a, b in several_pairs(task)]
    if "\n" not in task.right:
        out += [("multi_line", "right_then_wrong", T + block(f"{task.right}\n{task.wrong}")),
                ("multi_line", "wrong_then_right", T + block(f"{task.wrong}\n{task.right}"))]
    else:
        out.append(("multi_line", "two_grids_in_block", T + block(f"{task.right}\n\n{task.wrong}")))
    return out


def controls(task: Task) -> list[tuple[str, str]]:
    """(format, response): the right answer alone, in every format the task accepts."""
    return [(fmt, T + wrap(task.right)) for fmt, wrap in task.formats.items()]

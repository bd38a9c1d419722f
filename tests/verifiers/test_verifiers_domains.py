import pytest

from verifiers import verify
from verifiers.logic import arc, countdown, knights_knaves, maze, sudoku
from verifiers.logic.knights_knaves import solutions
from verifiers.logic.maze import shortest_path

pytestmark = pytest.mark.timeout(60)
T = "<think>working</think>\n"


def code(tests, program, **ref):
    return verify({"domain": "code", "reference": {"tests": tests, "timeout_s": 2, **ref}}, T + f"```python\n{program}\n```")


def test_code_function_tests_fraction_and_all_or_nothing():
    tests = [{"fn": "f", "args": [2], "expected": 4}, {"fn": "f", "args": [3], "expected": 9},
             {"fn": "f", "args": [0], "expected": 0}, {"fn": "g", "args": [[1, 2]], "expected": [2, 1]}]
    assert code(tests, "def f(x): return x*x\ndef g(v): return v[::-1]").score == 1
    r = code(tests, "def f(x): return x+x\ndef g(v): return tuple(reversed(v))")
    assert r.score == pytest.approx(0.75)
    assert code(tests, "def f(x): return x+x\ndef g(v): return v[::-1]", scoring="all_or_nothing").score == 0
    assert code(tests, "raise SystemExit(1)").score == 0
    assert verify({"domain": "code", "reference": {"tests": tests}}, T).score == 0


def test_code_cannot_print_expected_by_reading_tests():
    tests = [{"input": "", "output": "42\n"}]
    prog = ("import glob, os\nfor f in glob.glob('**/*', recursive=True) + glob.glob('/work/**/*.jsonl', recursive=True):\n"
            "    print(open(f).read()[:50]) if os.path.isfile(f) and f != 'main.py' else None")
    assert code(tests, prog).score == 0
    assert code(tests, "print(42)").score == 1


def test_sudoku_generate_and_verify():
    for size, holes in [(4, 0.5), (6, 0.4), (9, 0.5)]:
        rows = sudoku.generate(3, seed=size, size=size, holes=holes)
        assert rows == sudoku.generate(3, seed=size, size=size, holes=holes)
        for row in rows:
            puzzle = row["reference"]["puzzle"]
            # our own solver-free check: reconstruct via brute force on small grids is slow; use the
            # generator's property that a valid completion exists by solving with backtracking
            sol = _solve(puzzle, size, tuple(row["reference"]["box"]))
            text = "\n".join(" ".join(map(str, r)) for r in sol)
            assert verify(row, T + text).score == 1
            assert verify(row, T + "\n".join(",".join(map(str, r)) for r in sol)).score == 1
            assert verify(row, T + str(sol)).score == 1
            bad = [r[:] for r in sol]
            bad[0][0], bad[0][1] = bad[0][1], bad[0][0]
            assert verify(row, T + "\n".join(" ".join(map(str, r)) for r in bad)).score == 0
            # a valid Latin/sudoku grid that ignores the givens scores 0
            other = sudoku._solved_grid(size, __import__("random").Random(99))
            if any(puzzle[r][c] and puzzle[r][c] != other[r][c] for r in range(size) for c in range(size)):
                assert verify(row, T + str(other)).score == 0
            assert verify(row, "<think>" + text + "</think> no idea").score == 0


def _solve(p, n, box):
    g = [r[:] for r in p]

    def ok(r, c, v):
        br, bc = box
        if v in g[r] or any(g[i][c] == v for i in range(n)):
            return False
        r0, c0 = r - r % br, c - c % bc
        return all(g[i][j] != v for i in range(r0, r0 + br) for j in range(c0, c0 + bc))

    def bt():
        for r in range(n):
            for c in range(n):
                if not g[r][c]:
                    for v in range(1, n + 1):
                        if ok(r, c, v):
                            g[r][c] = v
                            if bt():
                                return True
                            g[r][c] = 0
                    return False
        return True

    assert bt()
    return g


def test_maze():
    rows = maze.generate(5, seed=1, rows=6, cols=6)
    for row in rows:
        path = shortest_path(row["reference"]["grid"])
        assert verify(row, T + path).score == 1
        assert verify(row, T + ", ".join({"U": "up", "D": "down", "L": "left", "R": "right"}[m] for m in path)).score == 1
        assert verify(row, T + path[:-1]).score == 0
        assert verify(row, T + "U" + path).score == 0  # walks off the grid first
        # detour: valid but not shortest
        detour = path[0] + {"U": "D", "D": "U", "L": "R", "R": "L"}[path[0]] + path
        assert verify(row, T + detour).score == 1
        strict = dict(row, reference={**row["reference"], "require_shortest": True})
        assert verify(strict, T + detour).score == 0 and verify(strict, T + path).score == 1


def test_countdown_and_24_game():
    rows = countdown.generate(20, seed=0, count=3, max_number=9, max_target=30)
    assert rows == countdown.generate(20, seed=0, count=3, max_number=9, max_target=30)
    for row in rows:
        ex = row["reference"]["example"]
        assert verify(row, T + ex).score == 1, (row, ex)
        assert verify(row, T + f"$${ex} = {row['reference']['target']}$$").score == 1
    row = {"domain": "countdown", "reference": {"numbers": [3, 3, 8, 8], "target": 24}}
    assert verify(row, T + "8 / (3 - 8/3)").score == 1
    assert verify(row, T + r"\boxed{8 \div (3 - 8 \div 3)}").score == 1
    for gamed in ["24", "8*3", "8*3*(8-8+3-3+1)", "(8+8+8)*(3/3)", "4*6", "8/(3-8/3) + 0*9",
                  "__import__('os').system('true')", "8**1*3*(3-8/8)", "24.0", "8 / (3 - 8/3) or 24", "(3+3)*(8-8/8)"]:
        assert verify(row, T + gamed).score == 0, gamed
    hard = countdown.generate(3, seed=1, count=4, max_number=13, target=24, max_target=24)
    assert all(r["reference"]["target"] == 24 and len(r["reference"]["numbers"]) == 4 for r in hard)


def test_knights_knaves():
    rows = knights_knaves.generate(5, seed=2, people=3, depth=2)
    for row in rows:
        ref = row["reference"]
        assert len(solutions(len(ref["names"]), ref["statements"])) == 1
        sol = ref["solution"]
        good = ", ".join(f"{n} is a {r}" for n, r in sol.items())
        assert verify(row, T + good + ".").score == 1
        flipped = dict(sol)
        first = ref["names"][0]
        flipped[first] = "knave" if sol[first] == "knight" else "knight"
        assert verify(row, T + ", ".join(f"{n} is a {r}" for n, r in flipped.items())).score == 0
        stuffed = good + ". Or maybe " + ", ".join(f"{n} is a {r}" for n, r in flipped.items())
        assert verify(row, T + stuffed).score == 0
        assert verify(row, T + ", ".join(f"{n} is a {r}" for n, r in list(sol.items())[:-1])).score == 0


def test_arc():
    for row in arc.generate(6, seed=3, size=3):
        want = row["reference"]["output"]
        assert verify(row, T + "\n".join(" ".join(map(str, r)) for r in want)).score == 1
        assert verify(row, T + "Output:\n" + "\n".join("".join(map(str, r)) for r in want)).score == 1
        assert verify(row, T + str(want)).score == 1
        bad = [r[:] for r in want]
        bad[1][1] = (bad[1][1] + 1) % 10
        assert verify(row, T + str(bad)).score == 0
        assert verify(row, T + str(want[:-1])).score == 0


def ife(instructions, text, mode="strict", **ref):
    return verify({"domain": "ifeval", "reference": {"instructions": instructions, "mode": mode, **ref}}, T + text)


def test_ifeval_constraints():
    cases = [
        ({"type": "word_count", "relation": "at least", "n": 5}, "one two three four five", "one two"),
        ({"type": "sentence_count", "relation": "exactly", "n": 2}, "Hi there. Bye now!", "Hi. Bye. Again."),
        ({"type": "paragraph_count", "n": 2}, "para one\n***\npara two", "para one\n\npara two"),  # IFEval: *** only
        ({"type": "keywords_include", "keywords": ["river", "Stone"]}, "A stone by the river.", "A stone only."),
        ({"type": "nth_paragraph_first_word", "n": 2, "nth_paragraph": 2, "first_word": "then"},
         "First.\n\n\"Then, second.", "First.\n\nNext, second."),
        ({"type": "constrained_response"}, "My answer is yes.", "Yes."),
        ({"type": "two_responses"}, "One way.\n******\nAnother way.", "One way.\n******\nOne way."),
        ({"type": "repeat_prompt", "prompt": "Say hi."}, "say hi. Hi!", "Hi!"),
        ({"type": "capital_word_frequency", "n": 2, "relation": "at least"}, "I DON'T know", "I do not know"),
        ({"type": "keywords_exclude", "keywords": ["bad"]}, "all good", "this is BAD"),
        ({"type": "keyword_frequency", "keyword": "cat", "relation": "at least", "n": 2}, "cat and cat", "cat"),
        ({"type": "letter_frequency", "letter": "z", "relation": "at least", "n": 3}, "Zzz", "zz"),
        ({"type": "json_format"}, '```json\n{"a": 1}\n```', "{a: 1}"),
        ({"type": "bullet_count", "n": 2}, "* a\n* b", "* a\n* b\n* c"),
        ({"type": "section_count", "n": 2}, "Section 1\nx\nSection 2\ny", "Section 1 only"),
        ({"type": "placeholder_count", "n": 2}, "Dear [name] at [address]", "Dear [name]"),
        ({"type": "highlight_count", "n": 1}, "this is *key*", "nothing"),
        ({"type": "lowercase"}, "the weather is nice today and we walk in the park", "The weather is nice today"),
        ({"type": "uppercase"}, "THE WEATHER IS NICE TODAY AND WE WALK IN THE PARK", "The weather is nice today"),
        ({"type": "start_with", "phrase": "Dear Sir"}, "dear sir, hello", "Hello"),
        ({"type": "end_with", "phrase": "Any questions?"}, "Text. Any questions?  ", "Any questions? Text."),
        ({"type": "no_commas"}, "no commas here", "a, b"),
        ({"type": "title"}, "<<My Title>>\nbody", "My Title"),
        ({"type": "quotation"}, '"quoted"', "quoted"),
        ({"type": "postscript"}, "body\nP.S. later", "body"),
        ({"type": "language", "lang": "fr"}, "Le chat est sur la table et il dort dans le jardin.",
         "The cat is on the table and it sleeps in the garden."),
        ({"type": "language", "lang": "ru"}, "Сегодня хорошая погода, и мы пойдем гулять в парк с нашими друзьями.", "Hello there"),
    ]
    for inst, good, bad in cases:
        assert ife([inst], good).score == 1, (inst, good)
        assert ife([inst], bad).score == 0, (inst, bad)


def test_ifeval_strict_vs_loose_and_scoring():
    inst = [{"type": "lowercase"}]
    text = "Sure, here it is:\nthe weather is nice today and we walk in the park with our friends"
    assert ife(inst, text).score == 0 and ife(inst, text, mode="loose").score == 1
    two = [{"type": "no_commas"}, {"type": "word_count", "relation": "at most", "n": 3}]
    assert ife(two, "a, b").score == 0
    assert ife(two, "a, b", scoring="fraction").score == 0.5
    assert ife(two, "<think>a b</think>").score == 0  # nothing after the thinking section


# ---- strict parsing: every game reads the whole answer and says why it rejects ------------
def test_knights_knaves_every_person_exactly_one_role():
    row = knights_knaves.generate(1, seed=5, people=3)[0]
    sol = row["reference"]["solution"]
    names = list(sol)
    right = ", ".join(f"{n} is a {sol[n]}" for n in names)
    flip = {"knight": "knave", "knave": "knight"}
    assert verify(row, T + right).score == 1
    assert verify(row, T + rf"\boxed{{{right}}}").source == "boxed"
    grouped = " and ".join(n for n in names if sol[n] == "knight")
    cases = {
        "both roles": right.replace(f"is a {sol[names[0]]}", "is a knight and a knave", 1),
        "either role": right.replace(f"is a {sol[names[0]]}", "is a knight/knave", 1),
        "two roles": right + f", {names[0]} is a {flip[sol[names[0]]]}",
        "negation": right.replace(f"is a {sol[names[0]]}", f"is not a {flip[sol[names[0]]]}", 1),
        "extra person": right + ", Zed is a knave",
        "missing person": ", ".join(f"{n} is a {sol[n]}" for n in names[1:]),
    }
    for what, answer in cases.items():
        r = verify(row, T + answer)
        assert r.score == 0 and r.reason, (what, answer)
    if grouped:  # "A and B are knights" names two people with one role word
        rest = ", ".join(f"{n} is a {sol[n]}" for n in names if sol[n] == "knave")
        assert verify(row, T + f"{grouped} are knights" + (f", {rest}" if rest else "")).score == 1


def test_grid_games_need_exactly_one_grid():
    row = arc.generate(1, seed=2, size=3)[0]
    out, wrong = row["reference"]["output"], row["reference"]["test_input"]
    text = "\n".join(" ".join(map(str, r)) for r in out)
    other = "\n".join(" ".join(map(str, r)) for r in wrong)
    assert verify(row, T + text).score == 1
    for answer in (f"{other}\n\nor maybe\n\n{text}", f"{wrong}\n{out}", f"{text}\n\nalternatively\n{text}"):
        r = verify(row, T + answer)
        assert r.score == 0 and "exactly one" in r.reason, answer
    if out != wrong:
        assert "first at row" in verify(row, T + other).reason or "grid is" in verify(row, T + other).reason


def test_one_line_answers_for_countdown_and_maze():
    row = countdown.generate(1, seed=1)[0]
    good = row["reference"]["example"]
    assert verify(row, T + good).score == 1
    r = verify(row, T + f"1 + 2\n{good}")
    assert r.score == 0 and "one line" in r.reason
    mrow = maze.generate(1, seed=3)[0]
    path = shortest_path(mrow["reference"]["grid"])
    assert verify(mrow, T + path).score == 1
    assert verify(mrow, T + f"UUU\n{path}").score == 0


@pytest.mark.parametrize("expected,printed,ok", [
    ("3\n", "3\n", True), ("3\n", "3.0\n", False), ("1000000\n", "1000001\n", False),
    ("2.5\n", "2.5000001\n", True), ("2.5\n", "2.6\n", False), ("1 2\n", "1 2 3\n", False), ("yes\n", "YES\n", False),
])
def test_code_integer_outputs_are_exact(expected, printed, ok):
    r = code([{"input": "", "output": expected}], f"print({printed.strip()!r})")
    assert (r.score == 1) is ok, r.reason
    if not ok:
        assert "wrong output" in r.reason
    assert r.source == "fenced_code"


def test_code_function_values_integers_exact():
    tests = [{"fn": "f", "args": [], "expected": 1000000}]
    assert code(tests, "def f(): return 1000000").score == 1
    r = code(tests, "def f(): return 1000000.5")
    assert r.score == 0 and "wrong value" in r.reason
    assert code([{"fn": "f", "args": [], "expected": 0.1}], "def f(): return 0.1000000001").score == 1
    unfenced = verify({"domain": "code", "reference": {"tests": tests}}, T + "def f(): return 1000000")
    assert unfenced.score == 1 and unfenced.source == "unfenced_code"

"""Agreement of reasoning-gym's own graders (the `reasoning_gym` domain) with our logic
verifiers on the families both cover: the same responses (right, wrong, malformed,
adversarial) to the same tasks, each task translated into our verifier's reference. Run with
`-s` to see the table. Every disagreement is listed in DISAGREEMENTS with why; any other
disagreement fails the test.

maze is not in the response comparison: reasoning-gym's maze asks for the number of steps,
ours for the moves, so no response answers both; the test checks that the two agree on the
ground truth instead (BFS shortest length on the same grid).
"""
from __future__ import annotations

import json
import re

import reasoning_gym

from verifiers import verify
from verifiers.logic.maze import shortest_path

ROWS_PER_FAMILY = 12
# (family, case, rg passes, ours passes) -> why they differ
DISAGREEMENTS = {
    # our verifiers read more notations than reasoning-gym's graders
    ("countdown", "right/equals_target", False, True): "rg's prompt forbids '='; ours keeps the non-target side",
    ("countdown", "right/latex_times", False, True): "ours reads \\times; rg's scorer (and its screen) does not",
    ("knights_knaves", "right/colon", False, True): "rg reads 'Name is a role'; 'Name: role' keeps the colon in the name",
    ("mini_sudoku", "right/boxed", False, True): "a grid in \\boxed{} with \\\\ rows: rg wants one row per line",
    ("mini_sudoku", "right/json", False, True): "rg reads rows of digits per line, not a JSON grid",
    ("mini_sudoku", "right/bars", False, True): "rg: digits per line are right, but 0.9 (its penalty for a non-standard format)",
    # reasoning-gym accepts a contradiction: its parser keeps the first role of 'X is a knight and a
    # knave' and drops the second; ours rejects a person given two roles
    ("knights_knaves", "adv/both_roles", True, False): "rg bug: contradictory roles accepted when the first is right",
    # extraction policy: the reasoning_gym domain takes an unmarked final text whole only up to
    # 2000 chars; our logic verifiers take any length
    ("knights_knaves", "adv/huge", False, True): "unmarked 400k-char final text: not taken whole by the rg domain",
}


def rg_row(family: str, entry: dict, config: dict) -> dict:
    e = json.loads(json.dumps(entry))
    return {"domain": "reasoning_gym", "prompt": e["question"],
            "reference": {"family": family, "answer": e["answer"], "metadata": e["metadata"], "config": config}}


def kk_claim(st):
    op = st[0]
    if op == "telling-truth": return {"is": st[1], "knight": True}
    if op == "lying": return {"is": st[1], "knight": False}
    if op == "not": return {"not": kk_claim(st[1])}
    if op in ("and", "or"): return {op: [kk_claim(s) for s in st[1:]]}
    if op == "->": return {"or": [{"not": kk_claim(st[1])}, kk_claim(st[2])]}
    if op == "<=>": return {"iff": [kk_claim(st[1]), kk_claim(st[2])]}
    raise ValueError(op)

def kk_cases(e):
    m = e["metadata"]; names = m["names"]; sol = m["solution"]
    role = lambda b: "knight" if b else "knave"
    ours = {"domain": "knights_knaves", "reference": {"names": names, "statements": [[i, kk_claim(s)] for i, s in enumerate(m["statements"])]}}
    gold = e["answer"]
    flip0 = ", ".join(f"{n} is a {role(s if i else not s)}" for i, (n, s) in enumerate(zip(names, sol)))
    allflip = ", ".join(f"{n} is a {role(not s)}" for n, s in zip(names, sol))
    rev = ", ".join(f"{n} is a {role(s)}" for n, s in reversed(list(zip(names, sol))))
    cases = {
        "right/gold": gold, "right/reordered": rev, "right/boxed": f"\\boxed{{{gold}}}",
        "right/colon": "\n".join(f"{n}: {role(s)}" for n, s in zip(names, sol)),
        "wrong/one_flipped": flip0, "wrong/all_flipped": allflip,
        "malformed/empty": "", "malformed/roles_only": "knight/knave", "malformed/missing_person": f"{names[0]} is a {role(sol[0])}",
        "malformed/unclosed_think": "<think> still thinking",
        "adv/both_roles": ", ".join(f"{n} is a knight and a knave" for n in names),
        "adv/negation": ", ".join(f"{n} is not a {role(not s)}" for n, s in zip(names, sol)),
        "adv/stuffing": gold + " " + allflip,
        "adv/huge": gold + " x" * 200000,
    }
    return ours, cases

def countdown_cases(e):
    m = e["metadata"]
    ours = {"domain": "countdown", "reference": {"numbers": m["numbers"], "target": m["target"], "use_all": True}}
    gold = e["answer"]
    nums = re.findall(r"\d+", gold)
    changed = gold.replace(nums[0], str(int(nums[0]) + 1), 1)
    flipped = gold.replace("+", "#").replace("-", "+").replace("#", "-") if ("+" in gold or "-" in gold) else gold.replace("*", "/", 1)
    cases = {
        "right/gold": gold, "right/parens": f"({gold})", "right/boxed": f"\\boxed{{{gold}}}", "right/equals_target": f"{gold} = {m['target']}",
        "right/latex_times": gold.replace("*", "\\times"),
        "wrong/number_changed": changed, "wrong/op_flipped": flipped, "wrong/extra_number": f"{gold} + 1",
        "malformed/empty": "", "malformed/words": "I cannot find it", "malformed/target_only": str(m["target"]),
        "adv/code": "__import__('os').system('ls')", "adv/two_lines": f"{gold}\n{flipped}", "adv/power": f"{gold} + 0**2",
        "adv/nested_parens": "(" * 500 + gold + ")" * 500, "adv/huge": gold + " " * 100 + "1" * 100000,
    }
    return ours, cases

def sudoku_solutions(puzzle, limit=3):
    g = [row[:] for row in puzzle]; out = []
    def ok(r, c, v):
        if v in g[r] or any(g[i][c] == v for i in range(4)): return False
        br, bc = r // 2 * 2, c // 2 * 2
        return all(g[i][j] != v for i in range(br, br + 2) for j in range(bc, bc + 2))
    def rec(k):
        if len(out) >= limit: return
        if k == 16: out.append([row[:] for row in g]); return
        r, c = divmod(k, 4)
        if g[r][c]: return rec(k + 1)
        for v in range(1, 5):
            if ok(r, c, v): g[r][c] = v; rec(k + 1); g[r][c] = 0
    rec(0); return out

def sudoku_cases(e):
    m = e["metadata"]
    ours = {"domain": "sudoku", "reference": {"size": 4, "box": [2, 2], "puzzle": m["puzzle"]}}
    sol = m["solution"]; txt = lambda g: "\n".join(" ".join(map(str, r)) for r in g)
    sols = sudoku_solutions(m["puzzle"])
    swapped = [r[:] for r in sol]; swapped[0][0], swapped[0][1] = swapped[0][1], swapped[0][0]
    cases = {"right/gold": txt(sol), "right/boxed": "\\boxed{" + txt(sol).replace("\n", "\\\\") + "}" ,
             "right/json": json.dumps(sol), "right/bars": "\n".join("|".join(map(str, r)) for r in sol),
             "wrong/swapped": txt(swapped), "wrong/givens_broken": txt([[(v % 4) + 1 for v in r] for r in sol]),
             "malformed/three_rows": txt(sol[:3]), "malformed/empty": "", "malformed/words": "it is solved",
             "adv/two_grids": txt(sol) + "\n\nor\n\n" + txt(swapped), "adv/huge": txt(sol) + "\n" + "9 " * 100000}
    if len(sols) > 1:
        alt = next(s for s in sols if s != sol); cases["right/other_solution"] = txt(alt)
    return ours, cases


FAMILIES = [("countdown", {"min_numbers": 3, "max_numbers": 4}, countdown_cases),
            ("knights_knaves", {}, kk_cases), ("mini_sudoku", {}, sudoku_cases)]


def compare(family: str, config: dict, make) -> list[tuple]:
    ds = reasoning_gym.create_dataset(family, size=4 * ROWS_PER_FAMILY, seed=5, **config)
    out, used = [], 0
    for i in range(len(ds)):
        e = ds[i]
        if family == "knights_knaves" and e["metadata"]["knight_knave_terms"]["knight"] != "knight":
            continue  # ours knows only knight/knave; rg also says angel/devil, saint/sinner, ...
        used += 1
        if used > ROWS_PER_FAMILY:
            break
        ours, cases = make(e)
        for name, final in cases.items():
            resp = final if name.startswith("malformed/unclosed") else f"<think>\nworking\n</think>\n{final}"
            a, b = verify(rg_row(family, e, config), resp), verify(ours, resp)
            out.append((family, name, a.score == 1.0, b.score == 1.0))
    return out


def test_rg_graders_and_our_logic_verifiers_agree_except_where_explained():
    results = [r for fam, cfg, make in FAMILIES for r in compare(fam, cfg, make)]
    for fam, *_ in FAMILIES:
        mine = [r for r in results if r[0] == fam]
        agree = sum(r[2] == r[3] for r in mine)
        print(f"{fam}: {agree}/{len(mine)} responses agree ({agree / len(mine):.1%})")
    seen = {r for r in results if r[2] != r[3]}
    unexplained = seen - set(DISAGREEMENTS)
    assert not unexplained, sorted(unexplained)
    # every right answer in the notation both ask for passes both; every wrong one fails both
    for fam, name, a, b in results:
        if name in ("right/gold", "right/boxed") and fam != "mini_sudoku":
            assert a and b, (fam, name)
        if name.startswith(("wrong/", "malformed/")):
            assert not a and not b, (fam, name)


def test_maze_ground_truths_agree():
    ds = reasoning_gym.create_dataset("maze", size=30, seed=5)
    for e in ds:
        m = e["metadata"]
        table = {m["wall"]: "#", m["path"]: ".", m["start"]: "S", m["goal"]: "E"}
        grid = ["".join(table[c] for c in line) for line in m["grid"]]
        assert len(shortest_path(grid)) == m["shortest_path_length"] == int(e["answer"])

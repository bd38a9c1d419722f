"""Every reasoning-gym family of the installed release, graded by the `reasoning_gym` domain
against reasoning-gym's own scorer. For a few items per family, responses in several shapes:
right and wrong in each answer format the rows accept (answer tag, box, "Final answer:"
line or block, bare text), no answer, the question echoed, hedges (or, either...or, and/or,
a slash, a list, a range) and several answers that disagree.

- reference grading must equal the family's `score_answer` on the stated answer (full marks
  -> 1), where an answer the family's scorer would execute passes `rgym_safety`'s screen;
- strict grading must equal reference grading on well-formed shapes (right, wrong, no
  answer, echo) and give 0 to every hedge and several-answers shape, also where reasoning-gym
  itself gives the hedge full marks (the table's "rg rewards hedges" column).

A family without a gold answer (scored by validity) gets its right answer from its metadata
where it has one (`METADATA_ANSWERS`); else only its wrong and malformed shapes are built
(rush_hour, boxnet in 0.1.25). A family that cannot generate offline is skipped and named in
the table (none in 0.1.25); `composite` mixes other families and is not one
(`rgym.EXCLUDED_FAMILIES`).
The table (per family: items, agreement of each grading, hedges rewarded by reasoning-gym) is
printed and also raised as a UserWarning, which pytest-xdist's workers pass on to the summary
of every run (a builtin category: the controller rebuilds a warning by importing its class, and
a class defined in a test module is not importable there).
"""
from __future__ import annotations

import functools
import json
import re
import time
import warnings
from collections import defaultdict

import reasoning_gym
from reasoning_gym.factory import DATASETS

from verifiers import verify
from verifiers.extract import NoAnswer
from verifiers.rgym import EXCLUDED_FAMILIES, extract
from verifiers.rgym_safety import SYMPY_FAMILIES, unsafe_answer

ITEMS = 2
SPARE = 1  # one more item: the items' golds are each other's wrong answers
SEED = 11
# smaller items where the default ones cost seconds: sokoban's generator solves each puzzle by
# A* (1.4 s an item), and sympy takes ~1 s to compare two trigonometric integrals
_TYPES = ["linear", "radical", "log_inverse_trig", "polynomial_exp_trig", "exponential", "cyclic", "repeated_parts"]
CONFIGS = {"sokoban": {"min_w": 6, "max_w": 6, "min_h": 6, "max_h": 6, "min_boxes": 2, "max_boxes": 2, "max_depth": 40},
           "intermediate_integration": {"problem_types": _TYPES, "problem_type_weights": [1 / len(_TYPES)] * len(_TYPES)}}
FAMILIES = sorted(f for f in DATASETS if f not in EXCLUDED_FAMILIES)
# validity-scored families: a right answer their metadata carries
METADATA_ANSWERS = {"rubiks_cube": "example_correct_answer", "propositional_logic": "example_answer",
                    "graph_color": "possible_answer"}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _both_roles(entry: dict, right: str, wrong: str) -> str:
    """knights_knaves: the first person given both roles ("Amelia is a hero and a villain, ..."),
    which reasoning-gym's parser reads as the first role."""
    terms = entry["metadata"]["knight_knave_terms"]
    first, _, rest = right.partition(",")
    other = terms["a_knave"] if first.endswith(str(terms["a_knight"])) else terms["a_knight"]
    return f"{first} and {other},{rest}"


FAMILY_HEDGES = {"knights_knaves": {"both_roles": _both_roles}}  # family -> its own hedge shapes


def right_answer(family: str, entry: dict) -> str | None:
    if entry["answer"] is not None:
        return str(entry["answer"])
    value = entry["metadata"].get(METADATA_ANSWERS.get(family, ""))
    if isinstance(value, dict):
        return json.dumps({str(k): v for k, v in value.items()})  # graph_color's coloring, as JSON
    return value


def wrong_answer(ds, entry: dict, right: str | None, others: list[str]) -> str | None:
    """Another item's answer, else a changed copy of this one, that the family scores below full
    marks; else (a family that passes every answer) the first of them."""
    changed = []
    if right is not None:
        flips = {"True": "False", "False": "True", "Yes": "No", "No": "Yes", "yes": "no", "no": "yes"}
        changed = [flips.get(right, ""), _NUMBER.sub(lambda m: str(int(float(m.group())) + 7), right, count=1),
                   right[::-1], right + " x"]
    cands = [c for c in [*others, *changed] if c and c != right]
    return next((c for c in cands if ds.score_answer(answer=c, entry=entry) < 1.0), cands[0] if cands else None)


def fmt(answer: str) -> dict[str, str]:
    line = f"Final answer: {answer}" if "\n" not in answer.strip() else f"Final answer:\n{answer}"
    return {"tag": f"<answer>{answer}</answer>", "boxed": f"\\boxed{{{answer}}}", "line": line, "bare": answer}


def shapes(family: str, entry: dict, right: str | None, wrong: str | None) -> dict[str, tuple[str, str | None, str]]:
    """name -> (final text, the answer it states (None: as the rows' format reads it), kind):
    kind is right, wrong, non_answer or hedge."""
    out: dict[str, tuple[str, str | None, str]] = {}
    for kind, ans in (("right", right), ("wrong", wrong)):
        if ans is not None:
            out.update({f"{kind}/{f}": (text, ans, kind) for f, text in fmt(ans).items()})
    out["none/empty_tag"] = ("<answer></answer>", None, "non_answer")
    out["none/prose"] = ("I am not sure how to solve this.", None, "non_answer")
    out["echo/question"] = (entry["question"], None, "non_answer")
    if right is None or wrong is None:
        return out
    r, w = right, wrong
    multi = "\n" in r.strip() or "\n" in w.strip()
    hedges = {"or": f"{r} or {w}", "or_rev": f"{w} or {r}", "either": f"either {r} or {w}",
              "and_or": f"{r} and/or {w}", "list": f"{r}\n\n{w}" if multi else f"{r}, {w}",
              "list_rev": f"{w}\n\n{r}" if multi else f"{w}, {r}"}
    if family not in SYMPY_FAMILIES:  # there "a / b" is a quotient (and sympy takes seconds to simplify one)
        hedges.update({"slash": f"{r} / {w}", "slash_rev": f"{w} / {r}"})
    if _NUMBER.fullmatch(r.strip()) and _NUMBER.fullmatch(w.strip()):
        lo, hi = sorted((float(r), float(w)))
        hedges.update({"range_to": f"{r} to {w}", "range_between": f"between {r} and {w}"})
        if lo >= 0:
            hedges["range_dash"] = f"{lo:g}-{hi:g}"
    hedges.update({k: make(entry, r, w) for k, make in FAMILY_HEDGES.get(family, {}).items()})
    out.update({f"hedge/{k}": (f"<answer>{v}</answer>", v, "hedge") for k, v in hedges.items()})
    several = {"tags": f"<answer>{w}</answer>\n<answer>{r}</answer>",
               "boxes": f"\\boxed{{{w}}} or rather \\boxed{{{r}}}",
               "tag_and_box": f"\\boxed{{{w}}}\n<answer>{r}</answer>"}
    if not multi:
        several["lines"] = f"Answer: {w}\n\nAnswer: {r}"
    out.update({f"several/{k}": (v, r, "hedge") for k, v in several.items()})
    return out


def expected_reference(score, family: str, text: str, stated: str | None) -> bool:
    """reasoning-gym's verdict on the stated answer: full marks, unless our screen refuses it."""
    if stated is None:
        try:
            stated, _ = extract(text)
        except NoAnswer:
            return False
    stated = stated.strip()
    if not stated or unsafe_answer(family, stated):
        return False
    try:
        return score(stated) >= 1.0
    except Exception:  # a scorer that raises on an answer it cannot read: ours scores it 0 ("verifier error")
        return False


def grade_family(family: str) -> list[tuple]:
    """(family, shape, kind, reasoning-gym's verdict, reference verdict, strict verdict) per response."""
    config = CONFIGS.get(family, {})
    ds = reasoning_gym.create_dataset(family, size=ITEMS + SPARE, seed=SEED, **config)
    entries = [ds[i] for i in range(ITEMS + SPARE)]
    rights = [right_answer(family, e) for e in entries]
    out = []
    for i, entry in enumerate(entries[:ITEMS]):
        e = json.loads(json.dumps(entry, default=str))
        row = {"domain": "reasoning_gym", "prompt": e["question"], "grading": "strict",
               "reference": {"family": family, "answer": e["answer"], "metadata": e["metadata"], "config": config}}
        right = rights[i]
        wrong = wrong_answer(ds, entry, right, [r for r in rights if r is not None and r != right])
        score = functools.cache(lambda a, entry=entry: ds.score_answer(answer=a, entry=entry))
        for name, (text, stated, kind) in shapes(family, e, right, wrong).items():
            reward = verify(row, f"<think>\nworking\n</think>\n{text}")
            reference = reward.details.get("reference_score", reward.score) == 1.0  # strict only ever zeroes it
            out.append((family, name, kind, expected_reference(score, family, text, stated), reference,
                        reward.score == 1.0))
    return out


def _count(rows: list[tuple], kind: str, ok) -> str:
    mine = [r for r in rows if r[2] == kind]
    return f"{sum(ok(r) for r in mine)}/{len(mine)}"


def table(results: list[tuple], seconds: dict[str, float]) -> str:
    """Per family: reference grading's agreement with reasoning-gym, strict grading's verdicts
    on right answers (kept) and hedges (rejected), and what reasoning-gym rewards that it
    should not (hedge shapes, wrong answers, non-answers)."""
    head = (f"{'family':26s} {'resp':>4s} {'reference=rg':>12s} {'strict: right kept':>18s} "
            f"{'hedges rejected':>15s} {'s':>5s}  reasoning-gym rewards")
    by_family: dict[str, list[tuple]] = defaultdict(list)
    for r in results:
        by_family[r[0]].append(r)
    lines = [head]
    for family in [*(f for f in FAMILIES if f in seconds), "all"]:
        rows = results if family == "all" else by_family[family]
        agree = f"{sum(r[3] == r[4] for r in rows)}/{len(rows)}"
        # several/*: reasoning-gym scores the answer read (the last, right one); the check is strict grading's
        rg_pays = sorted({r[1] for r in rows if r[3] and r[2] != "right" and not r[1].startswith("several/")})
        rg_pays = rg_pays if family != "all" else []
        notes = ", ".join(rg_pays) or "-"
        if family != "all" and not any(r[2] == "right" for r in rows):
            notes = "no right answer (validity-scored, none in its metadata); " + notes
        took = sum(seconds.values()) if family == "all" else seconds[family]
        lines.append(f"{family:26s} {len(rows):4d} {agree:>12s} {_count(rows, 'right', lambda r: r[5] == r[4]):>18s} "
                     f"{_count(rows, 'hedge', lambda r: not r[5]):>15s} {took:5.1f}  {notes}")
    return "\n".join(lines)


def test_every_family_agrees_with_reasoning_gym_and_strict_grading_rejects_every_hedge(capsys):
    results, seconds, offline = [], {}, {}
    for family in FAMILIES:
        t0 = time.perf_counter()
        try:
            results += grade_family(family)
        except OSError as e:  # a family that needs the network to generate (ConnectionError is one)
            offline[family] = f"{type(e).__name__}: {e}"[:100]
            continue
        seconds[family] = time.perf_counter() - t0
    report = table(results, seconds) + "".join(f"\n{f:26s} skipped: cannot generate offline ({why})"
                                                for f, why in offline.items())
    with capsys.disabled():
        print("\n" + report)
    warnings.warn("reasoning-gym families, reference and strict grading:\n" + report, UserWarning, stacklevel=1)
    disagree = [r[:2] + r[3:5] for r in results if r[3] != r[4]]
    assert not disagree, f"reference grading differs from reasoning-gym: {disagree[:20]}"
    lost = [r[:2] for r in results if r[2] == "right" and r[5] != r[4]]
    assert not lost, f"strict grading took the reward of a right answer: {lost[:20]}"
    raised = [r[:2] for r in results if r[5] > r[4]]
    assert not raised, f"strict grading rewarded what reference grading does not: {raised[:20]}"
    hedges_paid = [r[:2] for r in results if r[2] == "hedge" and r[5]]
    assert not hedges_paid, f"strict grading rewarded a hedge: {hedges_paid[:20]}"
    right = {r[0] for r in results if r[2] == "right"}
    assert right >= set(FAMILIES) - {"rush_hour", "boxnet"} - set(offline), sorted(set(FAMILIES) - right)

"""Held-out evaluation sets share no problem with training data, by construction: a problem's
split is a function of its expression alone (`split_of`), so no choice of generator, seed,
size or difficulty makes a `train` file and a `heldout` file overlap. And the multi-step
chains are correct worked solutions the math verifier accepts."""
from __future__ import annotations

import random
import re

import pytest
from pydantic import ValidationError

from stages.synthetic_data.config import SyntheticDataConfig
from stages.synthetic_data.generators import HELDOUT_PERCENT, get_generator, split_of

BOXED = re.compile(r"\\boxed\{(-?\d+)\}")
EXPRESSION = re.compile(r"^What is ([-+*\d ]+)\?$")
SPLIT_GENERATORS = ("arithmetic_cot", "arithmetic_rl", "chain_cot", "chain_rl", "preference_pairs")


def expression(row: dict) -> str:
    question = row["messages"][0]["content"] if "messages" in row else row["prompt"]
    return EXPRESSION.match(question).group(1)


def random_params(name: str, rng: random.Random) -> dict:
    lo = rng.randint(1, 3)
    params = {"min_digits": lo, "max_digits": rng.randint(lo, 3)}
    if name.startswith("chain"):
        t = rng.randint(2, 4)
        params.update(min_terms=t, max_terms=rng.randint(t, 5), ops=rng.choice([["+"], ["-"], ["+", "-"]]))
        if name == "chain_cot":
            params["work"] = rng.choice(["columns", "compact"])
    else:
        params["ops"] = rng.sample(["+", "-", "*"], rng.randint(1, 3))
    return params


@pytest.mark.parametrize("trial", range(12))
def test_train_and_heldout_files_never_share_a_problem(trial):
    """Any two generators, any seeds, any difficulty: the train file's problems and the
    held-out file's problems are disjoint, and each file holds only its own split."""
    rng = random.Random(trial)
    a, b = rng.choice(SPLIT_GENERATORS), rng.choice(SPLIT_GENERATORS)
    train = get_generator(a)(300, rng.randrange(10**6), split="train", **random_params(a, rng))
    heldout = get_generator(b)(100, rng.randrange(10**6), split="heldout", **random_params(b, rng))
    train_exprs, heldout_exprs = {expression(r) for r in train}, {expression(r) for r in heldout}
    assert not train_exprs & heldout_exprs
    assert {split_of(e) for e in train_exprs} == {"train"}
    assert {split_of(e) for e in heldout_exprs} == {"heldout"}


def test_a_small_problem_space_is_split_exhaustively():
    """Every one-digit sum is in exactly one split; the held-out share is about HELDOUT_PERCENT."""
    space = {f"{x} + {y}" for x in range(10) for y in range(10)}
    train = {expression(r) for r in get_generator("arithmetic_rl")(3000, 0, max_digits=1, ops=["+"], split="train")}
    heldout = {expression(r) for r in get_generator("arithmetic_rl")(3000, 0, max_digits=1, ops=["+"],
                                                                       split="heldout")}
    assert train | heldout == space and not train & heldout  # 3000 draws cover each split of 100
    assert abs(len(heldout) - HELDOUT_PERCENT) <= 8


def test_the_split_is_the_problems_not_the_generators():
    """The same expression from two generators lands in the same split: a two-term chain is
    the binary problem of arithmetic_rl."""
    binary = get_generator("arithmetic_rl")(200, 4, max_digits=2, ops=["+", "-"])
    chains = get_generator("chain_rl")(400, 4, min_terms=2, max_terms=2, max_digits=2)
    shared = {expression(r) for r in binary} & {expression(r) for r in chains}
    assert shared  # the spaces overlap, so the check below is not vacuous
    for split in ("train", "heldout"):
        one = {expression(r) for r in get_generator("arithmetic_rl")(200, 5, max_digits=1, split=split)}
        other = {expression(r) for r in get_generator("chain_rl")(200, 6, max_terms=2, max_digits=1, split=split)}
        assert {split_of(e) for e in one | other} == {split}


def test_split_all_is_plain_sampling():
    """split: all (the default) keeps the random stream of the generators before splits existed."""
    rows = get_generator("arithmetic_rl")(500, 9, max_digits=2)
    assert {split_of(expression(r)) for r in rows} == {"train", "heldout"}
    assert rows == get_generator("arithmetic_rl")(500, 9, max_digits=2, split="all")


@pytest.mark.parametrize("work", ["columns", "compact"])
@pytest.mark.parametrize("trial", range(2))
def test_chain_rows_are_correct_worked_chats_the_verifier_accepts(trial, work):
    from verifiers import verify

    rng = random.Random(100 + trial)
    params = random_params("chain_rl", rng)
    seed = rng.randrange(10**6)
    sft = get_generator("chain_cot")(60, seed, work=work, **params)
    rl = get_generator("chain_rl")(60, seed, **params)
    for s, r in zip(sft, rl):
        expr = expression(r)
        assert expr == expression(s)  # same seed and parameters: the same problems
        terms = expr.split(" ")
        assert params["min_terms"] <= (len(terms) + 1) // 2 <= params["max_terms"]
        total, steps = int(terms[0]), []
        for op, x in zip(terms[1::2], terms[2::2]):
            assert op in params["ops"] or (op == "+" and "-" in params["ops"])
            steps.append(f"{total} {op} {x} = {total + int(x) if op == '+' else total - int(x)}")
            total = total + int(x) if op == "+" else total - int(x)
            assert total >= 0  # every step is column work on non-negative numbers
        assert r["reference"]["answer"] == str(total)
        answer = s["messages"][1]["content"]
        assert int(BOXED.findall(answer)[-1]) == total
        think = answer.split("</think>")[0].removeprefix("<think>\n").splitlines()
        if work == "compact":  # one line per operation, the running total carried
            assert think == steps
        else:  # each operation worked digit by digit, ending in its result
            assert [line for line in think if line.startswith("So ")] == [f"So {st}." for st in steps]
        assert verify(r, answer, timeout_s=None).score == 1.0


@pytest.mark.parametrize("params,needle", [
    ({"min_terms": 4, "max_terms": 3}, "min_terms (4) exceeds max_terms (3)"),
    ({"max_terms": 9}, "max_terms"),
    ({"ops": ["*"]}, "ops.0"),
    ({"split": "test"}, "split"),
    ({"work": "terse"}, "work"),
])
def test_chain_config_rejects_bad_params(params, needle):
    with pytest.raises(ValidationError) as e:
        SyntheticDataConfig.model_validate({"kind": "synthetic_data", "files": {
            "a.jsonl": {"generator": "chain_cot", "n": 3, "params": params}}})
    assert needle in str(e.value)

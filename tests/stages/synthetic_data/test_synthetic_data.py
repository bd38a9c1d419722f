"""The synthetic_data stage: generators produce correct, consistent rows; the config
rejects unknown generators and bad parameters; the stage writes files + counts."""
from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from stages.synthetic_data.config import SyntheticDataConfig
from stages.synthetic_data.generators import GENERATORS, ArithmeticTask, add_steps, get_generator, worked_solution

BOXED = re.compile(r"\\boxed\{(-?\d+)\}")
QUESTION = re.compile(r"^What is (\d+) ([-+*]) (\d+)\?$")


def _eval(q: str) -> int:
    a, op, b = QUESTION.match(q).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


@pytest.mark.parametrize("ops,max_digits", [(["+"], 4), (["-"], 3), (["*"], 3), (["+", "-", "*"], 2)])
def test_arithmetic_cot_rows_are_correct_worked_chats(ops, max_digits):
    rows = get_generator("arithmetic_cot")(200, 7, max_digits=max_digits, ops=ops)
    assert len(rows) == 200 and len({r["id"] for r in rows}) == 200
    for r in rows:
        assert r["domain"] == "math"
        user, asst = r["messages"]
        assert user["role"] == "user" and asst["role"] == "assistant"
        a, op, b = QUESTION.match(user["content"]).groups()
        assert op in ops and len(a) <= max_digits and len(b) <= max_digits
        content = asst["content"]
        assert content.startswith("<think>\n") and "\n</think>\nThe answer is " in content
        assert int(BOXED.findall(content)[-1]) == _eval(user["content"])
        think = content.split("</think>")[0]
        assert len(think.splitlines()) >= 3  # real step-by-step work, not just the answer


def test_column_addition_lines_show_carries():
    lines, total = add_steps(57, 68)
    assert total == 125
    assert lines[0] == "ones: 7 + 8 = 15, write 5, carry 1"
    assert lines[1] == "tens: 5 + 6 + 1 = 12, write 2, carry 1"
    assert "leading digit" in lines[2]
    # forgetting carries is how preference_pairs makes a plausible wrong answer
    assert add_steps(57, 68, drop_carry=True)[1] != 125


def test_worked_subtraction_with_borrow_and_negative_result():
    text = worked_solution(ArithmeticTask(42, "-", 91))
    assert "borrow" in text and text.endswith("\\boxed{-49}.")


def test_rl_rows_match_the_sft_task_format():
    sft = get_generator("arithmetic_cot")(50, 3)
    rl = get_generator("arithmetic_rl")(50, 3)
    for s, r in zip(sft, rl):
        assert set(r) == {"id", "domain", "prompt", "reference"} and r["domain"] == "math"
        assert r["prompt"] == s["messages"][0]["content"]  # same seed, same questions
        assert r["reference"]["answer"] == BOXED.findall(s["messages"][1]["content"])[-1]
    assert [r["prompt"] for r in rl] != [r["prompt"] for r in get_generator("arithmetic_rl")(50, 4)]


def test_rl_rows_are_scored_by_the_math_verifier():
    """The RL stage rewards through `verifiers`: the SFT-format answer scores 1, a wrong one 0."""
    from verifiers import verify

    sft = get_generator("arithmetic_cot")(20, 8, ops=["+", "-", "*"])
    rl = get_generator("arithmetic_rl")(20, 8, ops=["+", "-", "*"])
    for s, r in zip(sft, rl):
        good = s["messages"][1]["content"]
        assert verify(r, good, timeout_s=None).score == 1.0, (r, good)
        wrong = good.replace(f"\\boxed{{{r['reference']['answer']}}}", "\\boxed{100000}")
        assert verify(r, wrong, timeout_s=None).score == 0.0


def test_preference_pairs_chosen_correct_rejected_not():
    rows = get_generator("preference_pairs")(300, 5, max_digits=3, ops=["+", "-", "*"])
    kinds = set()
    for r in rows:
        assert {"id", "prompt", "chosen", "rejected"} <= set(r)
        truth = _eval(r["prompt"])
        assert int(BOXED.findall(r["chosen"])[-1]) == truth
        assert r["rejected"] != r["chosen"]
        boxed = BOXED.findall(r["rejected"])
        well_formed = r["rejected"].startswith("<think>") and "</think>" in r["rejected"] and boxed
        assert not (well_formed and int(boxed[-1]) == truth), r  # wrong, or badly formatted
        kinds.add(r["rejected_kind"])
    assert kinds == {"wrong", "no_think", "unboxed"}


def test_generators_are_deterministic_in_seed():
    for name in ("arithmetic_cot", "arithmetic_rl", "preference_pairs"):
        assert get_generator(name)(20, 11) == get_generator(name)(20, 11)
        assert get_generator(name)(20, 11) != get_generator(name)(20, 12)


def test_config_rejects_unknown_generator_listing_known_ones():
    with pytest.raises(ValidationError) as e:
        SyntheticDataConfig.model_validate({"kind": "synthetic_data",
                                            "files": {"a.jsonl": {"generator": "arithmetc_cot", "n": 3}}})
    msg = str(e.value)
    assert "unknown generator 'arithmetc_cot'" in msg
    for name in GENERATORS:
        assert name in msg


@pytest.mark.parametrize("params,needle", [
    ({"digits": 3}, "digits: Extra inputs are not permitted (parameters of arithmetic_cot: min_digits, max_digits, ops, split)"),
    ({"ops": ["/"]}, "ops.0"),
    ({"max_digits": 0}, "max_digits"),
    ({"min_digits": 3, "max_digits": 2}, "min_digits (3) exceeds max_digits (2)"),
])
def test_config_rejects_bad_params(params, needle):
    with pytest.raises(ValidationError) as e:
        SyntheticDataConfig.model_validate({"kind": "synthetic_data", "files": {
            "a.jsonl": {"generator": "arithmetic_cot", "n": 3, "params": params}}})
    assert needle in str(e.value)


@pytest.mark.parametrize("name", ["../x.jsonl", "/abs.jsonl", "x.json", "a//b.jsonl"])
def test_config_rejects_bad_file_names(name):
    with pytest.raises(ValidationError, match="relative path ending in .jsonl"):
        SyntheticDataConfig.model_validate({"kind": "synthetic_data", "files": {
            name: {"generator": "arithmetic_rl", "n": 3}}})


def test_verifier_backed_generators_wrap_the_verifiers_package():
    """`countdown` and `math_verifiable` are the verifiers package's generators, loaded on
    first use, their parameters checked against their signatures."""
    from verifiers import verify
    from verifiers.logic.countdown import generate
    from verifiers.math_gen import generate_arithmetic

    assert get_generator("countdown")(5, 1, count=3) == generate(5, 1, count=3)
    rows = get_generator("math_verifiable")(5, 2, max_operand=20, ops="+")
    assert rows == generate_arithmetic(5, 2, max_operand=20, ops="+")
    answer = rows[0]["reference"]["answer"]
    assert verify(rows[0], f"<think>\nok\n</think>\n\\boxed{{{answer}}}", timeout_s=None).score == 1.0
    for name, params in (("countdown", {"bogus": 1}), ("math_verifiable", {"max_operand": "ten"})):
        with pytest.raises(ValidationError, match="bogus|max_operand"):
            SyntheticDataConfig.model_validate({"kind": "synthetic_data", "files": {
                "c.jsonl": {"generator": name, "n": 3, "params": params}}})


@pytest.mark.slow
def test_stage_writes_files_and_counts(data_artifact, data_dir):
    summary = data_artifact.summary
    assert summary["files"] == {"sft.jsonl": {"rows": 1200, "generator": "arithmetic_cot"},
                                "rl.jsonl": {"rows": 40, "generator": "arithmetic_rl"},
                                "prefs.jsonl": {"rows": 40, "generator": "preference_pairs"}}
    for name, meta in summary["files"].items():
        lines = (data_dir / name).read_text().splitlines()
        assert len(lines) == meta["rows"]
        assert all(isinstance(json.loads(line), dict) for line in lines)

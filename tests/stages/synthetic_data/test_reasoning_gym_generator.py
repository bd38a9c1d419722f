"""The `reasoning_gym` generator of synthetic_data: recipe validation names the bad family or
key, rows are what reasoning_rl reads and score 1 with their gold answer, train and held-out
files share no normalised question, and a run through `pipeline.execute.run_stage`."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from stages.reasoning_rl.config import RLData
from stages.reasoning_rl.data import load_rows
from stages.synthetic_data.config import SyntheticDataConfig
from stages.synthetic_data.generators import get_generator, split_of
from stages.synthetic_data.rgym import apportion, normalise_question
from verifiers import verify

GEN = get_generator("reasoning_gym")
MIX = {"leg_counting": {"weight": 2, "config": {"min_animals": 1, "max_animals": 2}},
       "basic_arithmetic": {"config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
       "mini_sudoku": {}}


def config(params: dict) -> dict:
    return {"kind": "synthetic_data", "files": {"rg.jsonl": {"generator": "reasoning_gym", "n": 5, "params": params}}}


@pytest.mark.parametrize("tasks,needle", [
    ({"no_such_family": {}}, "unknown reasoning-gym family 'no_such_family'"),
    ({"composite": {}}, "unknown reasoning-gym family 'composite'"),
    ({"leg_counting": {"config": {"max_legs": 3}}}, "tasks.leg_counting.config.max_legs is not one of its fields"),
    ({"leg_counting": {"config": {"seed": 3}}}, "tasks.leg_counting.config.seed is set by the generator"),
    ({"leg_counting": {"config": {"min_animals": 5, "max_animals": 2}}}, "rejected by leg_counting"),
    ({"leg_counting": {"weight": -1}}, "greater than 0"),
    ({"leg_counting": {"difficulty": 3}}, "difficulty"),
    ({}, "at least one"),
])
def test_a_bad_mix_is_a_recipe_error_naming_it(tasks, needle):
    with pytest.raises(ValidationError, match="reasoning_gym") as e:
        SyntheticDataConfig.model_validate(config({"tasks": tasks}))
    assert needle in str(e.value)


def test_rows_are_rl_rows_that_score_one_with_their_own_answer(tmp_path):
    rows = GEN(12, 3, tasks=MIX)
    assert Counter(r["task"] for r in rows) == {"leg_counting": 6, "basic_arithmetic": 3, "mini_sudoku": 3}
    path = tmp_path / "rg.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_rows(lambda p: Path(p), [RLData(path=str(path))])
    assert [r["id"] for r in loaded] == [r["id"] for r in rows] and loaded[0]["messages"][0]["role"] == "user"
    for r in loaded:
        assert "<answer> </answer>" in r["prompt"] and r["domain"] == "reasoning_gym"
        assert verify(r, f"<think>\nok\n</think>\n<answer>{r['reference']['answer']}</answer>").score == 1.0
        assert verify(r, "<think>\nok\n</think>\n<answer>not it</answer>").score == 0.0
    assert GEN(12, 3, tasks=MIX) == rows  # deterministic in its seed


def test_adding_a_family_leaves_the_others_rows_unchanged():
    alone = [r for r in GEN(4, 9, tasks={"leg_counting": {}}) if r["task"] == "leg_counting"]
    mixed = [r for r in GEN(8, 9, tasks={"leg_counting": {}, "chain_sum": {}}) if r["task"] == "leg_counting"]
    assert sorted(r["id"] for r in alone) == sorted(r["id"] for r in mixed)


def questions(rows: list[dict]) -> list[str]:
    return [normalise_question(r["prompt"].split("\n\n")[0]) for r in rows]


@pytest.mark.parametrize("seeds", [(1, 1), (1, 2)])
def test_train_and_heldout_share_no_normalised_question(seeds):
    """A small question space (one-digit sums of two terms): many draws collide, across
    seeds too; the split is a function of the normalised question, so none crosses."""
    small = {"basic_arithmetic": MIX["basic_arithmetic"]}
    train, heldout = GEN(150, seeds[0], tasks=small, split="train"), GEN(15, seeds[1], tasks=small, split="heldout")
    tq, hq = questions(train), questions(heldout)
    assert len(set(tq)) == len(tq) and len(set(hq)) == len(hq)  # no duplicate within a file
    assert not set(tq) & set(hq)
    assert {split_of(q) for q in tq} == {"train"} and {split_of(q) for q in hq} == {"heldout"}


def test_normalisation_merges_case_space_and_unicode_forms():
    assert normalise_question("What is  2 + 3?\n") == normalise_question("WHAT IS 2 + 3?") \
        == normalise_question("What\u00a0is 2 \uff0b 3?")  # no-break space, fullwidth plus (NFKC)
    assert normalise_question("What is 2 + 3?") != normalise_question("What is 2 + 4?")


def test_a_question_space_too_small_for_the_request_is_a_clear_error():
    tiny = {"leg_counting": {"config": {"min_animals": 1, "max_animals": 1, "min_instances": 1,
                                        "max_instances": 1}}}
    with pytest.raises(ValueError, match="distinct 'heldout' questions"):
        GEN(200, 0, tasks=tiny, split="heldout")


def test_apportion_follows_weights_and_sums_to_n():
    assert apportion(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}
    assert apportion(7, {"a": 3, "b": 1}) == {"a": 5, "b": 2}
    assert sum(apportion(101, {"a": 0.3, "b": 0.7, "c": 1.9}).values()) == 101


@pytest.mark.slow
def test_a_synthetic_data_stage_writes_reasoning_gym_files(stage_env):
    from data_curation.urls import local_path
    from pipeline.execute import run_stage

    files = {f"{split}.jsonl": {"generator": "reasoning_gym", "n": n, "seed": 4,
                                "params": {"tasks": MIX, "split": split}}
             for split, n in (("train", 20), ("heldout", 6))}
    run = run_stage("synthetic_data", {"files": files}, stage="rg_data", storage=stage_env["storage"],
                    recipe="rgym", work_root=stage_env["work_root"])
    out = Path(local_path(run.url))
    rows = {name: [json.loads(line) for line in (out / name).read_text().splitlines()] for name in files}
    assert {k: len(v) for k, v in rows.items()} == {"train.jsonl": 20, "heldout.jsonl": 6}
    assert not {r["prompt"] for r in rows["train.jsonl"]} & {r["prompt"] for r in rows["heldout.jsonl"]}


@pytest.mark.slow
def test_a_file_whose_config_cannot_be_met_fails_the_stage_as_a_user_error_naming_it(tmp_path):
    from pipeline.execute import run_stage
    from stages.common.contract import StageFailed

    tiny = {"leg_counting": {"config": {"min_animals": 1, "max_animals": 1, "min_instances": 1,
                                        "max_instances": 1}}}
    files = {"ok.jsonl": {"generator": "reasoning_gym", "n": 2, "seed": 0, "params": {"tasks": MIX}},
             "held.jsonl": {"generator": "reasoning_gym", "n": 200, "seed": 0,
                            "params": {"tasks": tiny, "split": "heldout"}}}
    with pytest.raises(StageFailed) as e:
        run_stage("synthetic_data", {"files": files}, stage="rg_bad", storage=str(tmp_path / "store"),
                  work_root=tmp_path / "work")
    message = str(e.value)
    assert "files.held.jsonl (reasoning_gym)" in message and "distinct 'heldout' questions" in message
    assert "Traceback" not in message

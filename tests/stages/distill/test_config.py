"""The distill stage's config: what a user can get wrong is refused with the key named."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.loader import load_recipe
from stages.distill.config import DistillConfig


def config(**over) -> dict:
    return {"kind": "distill", "teacher": "${stages.base.output}", "data": "rl.jsonl", **over}


def test_defaults_and_data_forms():
    cfg = DistillConfig.model_validate(config(data=["a.jsonl", {"path": "b", "default_domain": "math"}]))
    assert [(d.path, d.default_domain) for d in cfg.data_list] == [("a.jsonl", None), ("b", "math")]
    assert cfg.longest == cfg.max_new_tokens and cfg.max_per_prompt == 1 and cfg.min_score == 1.0
    assert DistillConfig.model_validate(config(max_tokens=100, max_new_tokens=200)).longest == 100


def test_a_vllm_teacher_needs_no_sleep_mode():
    """RL's colocated vLLM engine must be built to sleep; distill's has no trainer beside it."""
    cfg = DistillConfig.model_validate(config(rollout={"engine": "vllm", "max_batch": 256}))
    assert cfg.rollout.engine == "vllm" and cfg.rollout.sleep == "none" and cfg.rollout.max_batch == 256


@pytest.mark.parametrize("over,needle", [
    ({"samples_per_prompt": 4, "temperature": 0}, "samples_per_prompt=4 with temperature 0"),
    ({"max_tokens": 300, "max_new_tokens": 200}, "max_tokens (300) > max_new_tokens (200)"),
    ({"min_tokens": 50, "max_tokens": 40}, "min_tokens (50) > max_tokens (40)"),
    ({"min_tokens": 50, "max_new_tokens": 40}, "min_tokens (50) > max_tokens (40)"),
    ({"max_per_prompt": 0}, "max_per_prompt"),
    ({"samples_per_prompt": 0}, "samples_per_prompt"),
    ({"min_score": 0}, "min_score"),
    ({"min_score": 1.5}, "min_score"),
    ({"min_rows": -1}, "min_rows"),
    ({"batch_prompts": 0}, "batch_prompts"),
    ({"data": []}, "give at least one file"),
    ({"family_field": ""}, "family_field"),
    ({"rollout": {"gpus": 1}}, "rollout.gpus: distill runs one engine"),
    ({"rollout": {"device": "gpu"}}, "a device is cpu, auto, cuda or cuda:N"),
    ({"max_new_token": 5}, "max_new_token"),
    ({"teacher": None}, "teacher"),
])
def test_bad_configs_name_the_key(over, needle):
    with pytest.raises(ValidationError) as e:
        DistillConfig.model_validate(config(**over))
    assert needle in str(e.value)


def test_a_recipe_error_names_the_file_line_and_key(tmp_path):
    from pipeline.loader import RecipeError

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nstages:\n  cold:\n    kind: distill\n    teacher: /models/t\n"
                      "    data: rl.jsonl\n    max_per_prompt: 0\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe)
    assert "max_per_prompt" in str(e.value) and "r.yaml:7" in str(e.value)


def test_checkpoint_every_stays_out_of_the_stage_hash():
    schema = DistillConfig.model_json_schema()["properties"]
    assert schema["checkpoint_every"].get("cosmetic") is True
    assert not schema["batch_prompts"].get("cosmetic")  # it sets each batch's seed: results change

"""The optimizer / ZeRO / schedule settings are declared once (stages/common/training_settings.py)
and every training kind takes them with its own defaults, under the same flat YAML keys."""
from __future__ import annotations

import pydantic
import pytest

from stages.common.training_settings import OptimizerSettings, SupervisedSettings, optimizer_settings
from stages.registry import STAGE_KINDS

SUPERVISED = ("sft", "reward_model")
RL = ("reasoning_rl", "general_rl")


@pytest.mark.parametrize("kind", SUPERVISED + RL)
def test_no_kind_declares_the_shared_settings_again(kind):
    config = STAGE_KINDS[kind].config
    shared = SupervisedSettings if kind in SUPERVISED else OptimizerSettings
    assert issubclass(config, shared)
    for klass in config.__mro__:
        if klass.__module__.startswith("stages.") and klass.__module__ != "stages.common.training_settings":
            assert not set(getattr(klass, "__annotations__", {})) & set(shared.model_fields), klass


def test_each_kind_keeps_its_defaults_and_the_shared_checks():
    sft, rm, rl = (STAGE_KINDS[k].config for k in ("sft", "reward_model", "reasoning_rl"))
    assert (sft.model_fields["lr"].default, sft.model_fields["warmup_steps"].default) == (2e-4, 30)
    assert (rm.model_fields["lr"].default, rm.model_fields["min_lr_ratio"].default) == (9e-6, 0.1)
    assert rl.model_fields["adam_betas"].default == (0.9, 0.999)
    assert sft.model_fields["checkpoint_every"].json_schema_extra == {"cosmetic": True}
    for config, extra in ((sft, {"data": "d.jsonl"}), (rm, {"data": "p.jsonl"})):
        with pytest.raises(pydantic.ValidationError, match=r"warmup_steps \(5\) exceeds max_steps \(3\)"):
            config(model="m", max_steps=3, warmup_steps=5, **extra)
        with pytest.raises(pydantic.ValidationError, match="lr"):
            config(model="m", lr=0, **extra)
        with pytest.raises(pydantic.ValidationError, match="zero_stage"):
            config(model="m", zero_stage=4, **extra)


def test_a_default_for_a_setting_that_does_not_exist_is_refused():
    with pytest.raises(TypeError, match="no such settings"):
        optimizer_settings(lr=1e-5, adam_betas=(0.9, 0.95), weight_decay=0.0, learning_rate=1e-3)


def test_frozen_param_patterns_is_shared_and_each_kind_hashes_it_as_it_always_did():
    """Every training kind freezes the MoE router bias by default; the RL kinds had the setting
    before it was shared and still hash it at its default, sft and reward_model hash it only
    when written (their stage hashes from before it existed hold)."""
    from pipeline.plan import result_config

    configs = {"sft": {"model": "m", "data": "d.jsonl"}, "reward_model": {"model": "m", "data": "p.jsonl"},
               "reasoning_rl": {"model": "m", "data": "d.jsonl", "steps": 1}}
    for kind, values in configs.items():
        config = STAGE_KINDS[kind].config
        default = config(**values)
        assert default.frozen_param_patterns == ["*.gate.e_score_correction_bias", "*expert_bias*"]
        assert ("frozen_param_patterns" in result_config(default)) == (kind == "reasoning_rl"), kind
        assert result_config(config(**values, frozen_param_patterns=[]))["frozen_param_patterns"] == [], kind
        with pytest.raises(pydantic.ValidationError, match="empty pattern"):
            config(**values, frozen_param_patterns=[" "])

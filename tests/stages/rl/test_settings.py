"""The shared RL settings (stages/rl/settings.py): a correction that compares pi_infer with the
trainer's untruncated pi_train is refused with truncated sampling unless the engine reports
untruncated log-probs; both RL kinds validate alike."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from stages.general_rl.config import GeneralRLConfig
from stages.reasoning_rl.config import ReasoningRLConfig
from stages.rl.settings import STOCHASTIC_ROUNDING_ENGINES, UNTRUNCATED_LOGPROB_ENGINES

REASONING = {"kind": "reasoning_rl", "model": "m", "data": "d.jsonl", "steps": 1}
VLLM = {"engine": "vllm", "options": {"enable_sleep_mode": True}}
GENERAL = {"kind": "general_rl", "model": "m", "data": {"chat": {"path": "p"}}, "steps": 1, "reward_model": "rm",
           "reasoning_eval": None}


@pytest.mark.parametrize("config_cls,base", [(ReasoningRLConfig, REASONING), (GeneralRLConfig, GENERAL)])
@pytest.mark.parametrize("correction", ["icepop", "tis"])
@pytest.mark.parametrize("truncation,keys", [({"top_p": 0.9}, "top_p=0.9"), ({"top_k": 20}, "top_k=20"),
                                             ({"top_p": 0.95, "top_k": 5}, "top_p=0.95 and top_k=5")])
def test_truncated_sampling_with_a_correction_needs_untruncated_logprobs(config_cls, base, correction,
                                                                          truncation, keys):
    vllm = {**base, **truncation, "correction": correction, "rollout": VLLM}
    with pytest.raises(ValidationError, match=rf"{keys} truncate the sampling distribution, and "
                                              rf"correction='{correction}'.*rollout.engine 'vllm'.*\(torch\)"):
        config_cls.model_validate(vllm)
    config_cls.model_validate({**vllm, "correction": "none"})  # nothing to correct: allowed
    config_cls.model_validate({**vllm, "rollout": {"engine": "torch"}})  # reports untruncated log-probs
    config_cls.model_validate({**base, "correction": correction, "rollout": VLLM})  # no truncation


def test_the_engines_declare_what_the_settings_assume():
    from stages.rl.engines.torch_engine import TorchEngine
    from stages.rl.engines.vllm_engine import VllmEngine

    declared = {c.name: c.reports_untruncated_logprobs for c in (TorchEngine, VllmEngine)}
    assert declared == {"torch": True, "vllm": False}
    assert set(UNTRUNCATED_LOGPROB_ENGINES) == {n for n, untruncated in declared.items() if untruncated}
    rounding = {c.name: c.takes_stochastic_rounding for c in (TorchEngine, VllmEngine)}
    assert rounding == {"torch": True, "vllm": False}
    assert set(STOCHASTIC_ROUNDING_ENGINES) == {n for n, takes in rounding.items() if takes}


@pytest.mark.parametrize("config_cls,base", [(ReasoningRLConfig, REASONING), (GeneralRLConfig, GENERAL)])
def test_a_colocated_engine_that_sleeps_must_be_built_to_sleep(config_cls, base):
    """vLLM sleeps only when built with enable_sleep_mode: refused at validation, not at the
    first sleep after a whole rollout phase."""
    with pytest.raises(ValidationError, match=r"rollout.engine 'vllm' is colocated.*rollout.sleep: cache.*"
                                              r"\{enable_sleep_mode: true\}.*rollout.sleep: none"):
        config_cls.model_validate({**base, "rollout": {"engine": "vllm"}})
    for ok in (VLLM, {"engine": "vllm", "sleep": "none"}, {"engine": "vllm", "gpus": 1}, {"engine": "torch"}):
        config_cls.model_validate({**base, "rollout": ok})

"""The settings of a model sampled and its responses verified are declared once
(stages/rl/settings.py: VerifierSettings < SamplingSettings < GenerationSettings) and every kind
that samples takes them with its own defaults and words; `generate_and_score`
(stages/rl/verified_sampling.py) is the one generate-then-verify step of eval, distill and
general_rl's reasoning guard."""
from __future__ import annotations

import pydantic
import pytest

from stages.common.training_settings import with_defaults
from stages.registry import STAGE_KINDS
from stages.rl.decoding import make_decoder
from stages.rl.engines import RolloutUpdate, SamplingParams
from stages.rl.settings import GenerationSettings, SamplingSettings, VerifierSettings
from stages.rl.verified_sampling import generate_and_score

SHARED = {"distill": GenerationSettings, "eval": GenerationSettings,
          "reasoning_rl": SamplingSettings, "general_rl": SamplingSettings}

SHARING_MODULES = ("stages.rl.settings", "stages.common.training_settings")


@pytest.mark.parametrize("kind", sorted(SHARED))
def test_no_kind_declares_the_sampling_settings_again(kind):
    config, shared = STAGE_KINDS[kind].config, SHARED[kind]
    assert issubclass(config, shared)
    for klass in config.__mro__:
        # a kind's own classes; with_defaults' (made in training_settings) only restate a default or words
        if klass.__module__.startswith("stages.") and klass.__module__ not in SHARING_MODULES:
            assert not set(getattr(klass, "__annotations__", {})) & set(shared.model_fields), klass


def test_each_kind_keeps_its_defaults_and_words():
    """What `ring-pipeline schema` showed before the settings were shared, field by field."""
    fields = {k: STAGE_KINDS[k].config.model_fields for k in SHARED}
    assert {k: f["prompt_max_len"].default for k, f in fields.items()} == {
        "distill": 1024, "eval": 1024, "reasoning_rl": 4096, "general_rl": 4096}
    assert fields["distill"]["rollout"].default.sleep == "none" and fields["eval"]["rollout"].default.sleep == "cache"
    assert fields["reasoning_rl"]["rollout"].description is None
    assert fields["distill"]["rollout"].description.endswith("it never sleeps (no trainer beside it)")
    assert fields["distill"]["max_new_tokens"].description == "response tokens per sample (longer ones are cut)"
    assert fields["eval"]["max_new_tokens"].description == "response tokens per row (longer ones are cut)"
    assert fields["distill"]["prompt_max_len"].description == "longer prompts are skipped (counted per family)"
    assert fields["general_rl"]["verifier_workers"].description == "verifier processes (0 = in the trainer)"
    assert fields["eval"]["verifier_workers"].description == "verifier processes (0 = in the stage)"
    assert fields["distill"]["data"].description.startswith("prompt rows with verifiable answers")
    assert fields["reasoning_rl"]["data"].description.startswith("RL rows: data inputs")
    for kind in ("distill", "reasoning_rl"):  # the shared data check, in both
        with pytest.raises(pydantic.ValidationError, match="data: give at least one file or directory"):
            STAGE_KINDS[kind].config.model_validate({"data": [], "model": "m", "teacher": "t", "steps": 1})


def test_a_description_keeps_the_field_checks_and_an_unknown_field_is_refused():
    words = with_defaults(VerifierSettings, "Words", descriptions={"verifier_workers": "other words"})
    assert words.model_fields["verifier_workers"].description == "other words"
    with pytest.raises(pydantic.ValidationError, match="verifier_workers"):
        words(verifier_workers=-1)
    with pytest.raises(TypeError, match=r"no such settings \['workers'\]"):
        with_defaults(VerifierSettings, descriptions={"workers": "?"})


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


class _EchoEngine:
    """Answers each request with the digits of its row (EOS 0 ended), every third one cut."""

    def __init__(self):
        self.requests = []

    def generate(self, requests, sampling):
        self.requests += requests
        out = []
        for n, r in enumerate(requests):
            ids = [ord(c) for c in r.uid.split("/")[0].removeprefix("q")] + ([0] if n % 3 else [])
            out.append(RolloutUpdate(uid=r.uid, token_ids=ids, logprobs=[0.0] * len(ids), finished=True))
        return out


def test_generate_and_score_names_orders_and_verifies_every_sample():
    rows = [{"domain": "math", "reference": str(i), "id": f"r{i}"} for i in range(4)]
    engine = _EchoEngine()
    settings = VerifierSettings(verifier_workers=0)
    scored = generate_and_score(engine, make_decoder(_Tokenizer(), [0]), rows, [[1], [2], [3], [4]],
                                SamplingParams(seed=3), max_new_tokens=5, verifier=settings, samples=2,
                                which=[3, 1], uid="q{row}/{sample}")
    assert [r.uid for r in engine.requests] == ["q3/0", "q3/1", "q1/0", "q1/1"]
    assert [(r.prompt_ids, r.max_new_tokens) for r in engine.requests] == [([4], 5)] * 2 + [([2], 5)] * 2
    assert [(s.row, s.sample, str(s.text)) for s in scored] == [(3, 0, "3"), (3, 1, "3"), (1, 0, "1"), (1, 1, "1")]
    assert [s.reward.score for s in scored] == [1.0] * 4  # each row's answer is its own reference
    assert [s.text.ended_by_eos for s in scored] == [False, True, True, False]
    wrong = generate_and_score(engine, make_decoder(_Tokenizer(), [0]), rows[::-1], [[1]] * 4, SamplingParams(),
                               max_new_tokens=5, verifier=settings, which=[0])
    assert [(s.row, s.reward.score) for s in wrong] == [(0, 0.0)]  # row 0 is now the one whose reference is 3

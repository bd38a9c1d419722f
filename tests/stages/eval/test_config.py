"""The eval stage's config: what a user can get wrong is refused with the key named."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from stages.eval.config import EvalConfig


def config(**over) -> dict:
    return {"kind": "eval", "models": {"sft": "${stages.sft.output}"}, "sets": {"heldout": "data/heldout.jsonl"},
            **over}


def test_defaults_are_greedy_and_sets_accept_a_path_list_or_mapping():
    cfg = EvalConfig.model_validate(config(sets={"a": "a.jsonl", "b": ["b1.jsonl", "b2"],
                                                 "c": {"path": "c.jsonl", "limit": 5}}))
    assert {k: (s.paths, s.limit) for k, s in cfg.sets.items()} == {
        "a": (["a.jsonl"], None), "b": (["b1.jsonl", "b2"], None), "c": (["c.jsonl"], 5)}
    (name, dec), = cfg.decodings.items()
    assert name == "greedy" and dec.temperature == 0 and dec.samples == 1


@pytest.mark.parametrize("over,needle", [
    ({"decodings": {"g": {"samples": 4}}}, "samples=4 with temperature 0"),
    ({"decodings": {"s": {"temperature": 1.0, "samples": 4, "pass_at": [8]}}}, "pass_at [8]"),
    ({"decodings": {"s": {"temperature": 1.0, "pass_at": [0]}}}, "pass_at [0]"),
    ({"models": {"my model": "x"}}, "model names ['my model']"),
    ({"sets": {"a/b": "x.jsonl"}}, "set names ['a/b']"),
    ({"models": {}}, "models"),
    ({"sets": {"a": {"path": "x.jsonl", "limit": 0}}}, "limit"),
    ({"rollout": {"device": "gpu"}}, "a device is cpu, auto, cuda or cuda:N"),
    ({"max_new_token": 5}, "max_new_token"),
])
def test_bad_configs_name_the_key(over, needle):
    with pytest.raises(ValidationError) as e:
        EvalConfig.model_validate(config(**over))
    assert needle in str(e.value)

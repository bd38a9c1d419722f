"""The prompt sampler: weighted groups, one permutation of a group's rows per epoch, resume."""
from __future__ import annotations

import json

import pytest

from stages.rl.prompt_sampler import PromptSampler


def test_prompt_sampler_weights_epochs_and_resume():
    rows = {"a": list(range(6)), "b": list(range(6, 8)), "c": [8]}
    s = PromptSampler(rows, {"a": 3.0, "b": 1.0}, seed=3)
    draws = [s.next() for _ in range(4000)]
    share_a = sum(d < 6 for d in draws) / len(draws)
    assert 0.72 < share_a < 0.78
    assert 8 not in draws  # no weight -> not sampled
    a_draws = [d for d in draws if d < 6]
    for e in range(5):  # each epoch of a domain is a permutation of its rows
        assert sorted(a_draws[6 * e:6 * e + 6]) == list(range(6))
    s1 = PromptSampler(rows, {"a": 3.0, "b": 1.0}, seed=3)
    [s1.next() for _ in range(17)]
    state = json.loads(json.dumps(s1.state_dict()))
    s2 = PromptSampler(rows, {"a": 3.0, "b": 1.0}, seed=3)
    s2.load_state_dict(state)
    assert [s1.next() for _ in range(50)] == [s2.next() for _ in range(50)] == draws[17:67]
    with pytest.raises(ValueError, match="no rows in the data"):
        PromptSampler(rows, {"a": 1.0, "zzz": 1.0})

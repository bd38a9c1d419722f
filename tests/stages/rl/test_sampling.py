"""The torch engine's sampler (stages/rl/engines/torch_engine/sampling.py): Gumbel-max over
drawn or hashed Exp(1) noise samples from softmax(logits / T), and reports log-probs of the
untruncated distribution.

The hashed noise is deterministic, so these checks are exact reruns, not flaky: a chi-square
statistic is compared with its expectation plus six standard deviations (dof + 6 sqrt(2 dof)),
which a sound sampler passes and a biased or correlated one (a few percent off on 10^5 draws)
does not.
"""
from __future__ import annotations

import math

import pytest
import torch

from stages.rl.engines.torch_engine.sampling import SamplingMode, hashed_exponential, sample


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def _bound(dof: int) -> float:
    return dof + 6 * math.sqrt(2 * dof)


def _key(k: int) -> torch.Tensor:
    return torch.tensor([k], dtype=torch.int64)


def _hashed_tokens(logits_row: torch.Tensor, rows: int, key: int, temperature: float = 1.0) -> torch.Tensor:
    logits = logits_row.expand(rows, -1)
    noise = hashed_exponential(_key(key), rows, logits.shape[1])
    tok, _ = sample(logits, SamplingMode(greedy=False, temperature=temperature), noise)
    return tok


def test_hashed_noise_is_exponential_and_a_function_of_key_row_and_column():
    e = hashed_exponential(_key(12345), 64, 4096)
    assert e.shape == (64, 4096) and e.dtype == torch.float32 and bool((e > 0).all())
    assert torch.equal(e, hashed_exponential(_key(12345), 64, 4096))
    assert torch.equal(e[:8, :100], hashed_exponential(_key(12345), 8, 100))  # not a function of the shape
    # Exp(1): mean 1, P(E > t) = exp(-t) at a few t
    assert abs(float(e.mean()) - 1.0) < 0.01
    for t in (0.1, 1.0, 3.0):
        assert abs(float((e > t).float().mean()) - math.exp(-t)) < 0.005, t
    # another key, another row, another column: other values
    other = hashed_exponential(_key(12346), 64, 4096)
    assert float((other == e).float().mean()) < 1e-3
    assert float((e[1:] == e[:-1]).float().mean()) < 1e-3
    assert float((e[:, 1:] == e[:, :-1]).float().mean()) < 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_hashed_gumbel_max_samples_the_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5, 0.2, -0.1, 0.9, -2.0])
    p = torch.softmax(logits / temperature, dim=-1)
    rows = 60_000
    tok = _hashed_tokens(logits, rows, key=7, temperature=temperature)
    counts = torch.bincount(tok, minlength=len(logits)).double()
    assert _chi2(counts, p.double() * rows) < _bound(len(logits) - 1)
    # the same over keys (steps) for one row: what one rollout sees over its tokens
    n = 2500
    per_key = torch.stack([_hashed_tokens(logits, 1, key=k * 7919, temperature=temperature)[0] for k in range(n)])
    counts = torch.bincount(per_key, minlength=len(logits)).double()
    assert _chi2(counts, p.double() * n) < _bound(len(logits) - 1)


def test_rows_of_one_step_sample_independently():
    """A GRPO group's rows start from identical logits: their tokens must be independent draws.
    Pairs of rows (2i, 2i + 1) over a uniform 6-word vocabulary, joint counts vs uniform over
    the 36 pairs; also rows far apart (i, i + 1024)."""
    v, rows = 6, 72_000
    tok = _hashed_tokens(torch.zeros(v), rows, key=99)
    for a, b in ((tok[0::2], tok[1::2]), (tok[:rows - 1024], tok[1024:])):
        joint = torch.bincount(a * v + b, minlength=v * v).double()
        assert _chi2(joint, torch.full((v * v,), len(a) / (v * v), dtype=torch.float64)) < _bound(v * v - 1)


def test_sample_reports_untruncated_logprobs_and_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 3
    noise = torch.empty(5, 50).exponential_(generator=g)
    for mode in (SamplingMode(greedy=False, temperature=0.7), SamplingMode(greedy=False, top_k=3),
                 SamplingMode(greedy=False, top_p=0.5)):
        tok, lp = sample(logits, mode, noise)
        want = torch.log_softmax(logits / mode.temperature, dim=-1).gather(-1, tok[:, None])[:, 0]
        torch.testing.assert_close(lp, want)
        if mode.top_k:
            assert all(t in torch.topk(logits[i], 3).indices for i, t in enumerate(tok.tolist()))
    tok, lp = sample(logits, SamplingMode(greedy=True), None)
    assert torch.equal(tok, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).max(-1).values)

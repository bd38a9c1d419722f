"""The torch engine's sampler (stages/rl/engines/torch_engine/sampling.py): Gumbel-max over
Exp(1) noise samples from softmax(logits / T), and reports log-probs of the untruncated
distribution (its scaled logit minus the row's logsumexp, never a log_softmax over the
vocabulary).

The noise comes from a seeded generator, so the distribution check is an exact rerun, not
flaky: a chi-square statistic is compared with its expectation plus six standard deviations
(dof + 6 sqrt(2 dof)), which a sound sampler passes and a biased one (a few percent off on
6 x 10^4 draws, e.g. a temperature applied twice or not at all) does not.
"""
from __future__ import annotations

import math

import pytest
import torch

from stages.rl.engines.torch_engine.sampling import SamplingMode, sample


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_gumbel_max_samples_the_tempered_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5, 0.2, -0.1, 0.9, -2.0])
    p = torch.softmax(logits / temperature, dim=-1).double()
    rows = 60_000
    noise = torch.empty(rows, len(logits)).exponential_(generator=torch.Generator().manual_seed(7))
    tok, lp = sample(logits.expand(rows, -1), SamplingMode(greedy=False, temperature=temperature), noise)
    counts = torch.bincount(tok, minlength=len(logits)).double()
    dof = len(logits) - 1
    assert _chi2(counts, p * rows) < dof + 6 * math.sqrt(2 * dof)
    torch.testing.assert_close(lp, p.log().float()[tok])


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

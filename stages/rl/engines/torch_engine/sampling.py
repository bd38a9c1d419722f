"""Sampling of the torch engine: a `SamplingMode` (what a captured decode graph bakes in) and
`sample`, one token per row with the log-prob the engine reports (pi_infer).

temperature / top-k / top-p; Gumbel-max via exponential noise (argmax(p / E), E ~ Exp(1)),
the noise drawn by the caller (eagerly, outside a CUDA graph) from a seeded generator.
temperature <= 0 means greedy. The reported log-prob is log_softmax(logits / temperature) of
the token, in fp32, *before* top-k / top-p truncation: the probability the IcePop ratio
compares with the trainer's log_softmax(logits / temperature) of the same token (at
temperature 1.0, the recipe's, just the model's log-probability). Greedy reports
log_softmax(logits).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.rl.engines.protocol import SamplingParams


@dataclass(frozen=True)
class SamplingMode:
    """A sampling setting, baked into a captured decode graph."""

    greedy: bool
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def of(cls, s: SamplingParams, vocab: int) -> "SamplingMode":
        if s.top_p <= 0 or s.top_p > 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {s.top_p}")
        if s.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {s.top_k}")
        if s.temperature <= 0:
            return cls(greedy=True)
        top_k = 0 if s.top_k >= vocab else int(s.top_k)
        return cls(greedy=False, temperature=float(s.temperature), top_p=float(s.top_p), top_k=top_k)


def sample(logits: torch.Tensor, mode: SamplingMode, noise: torch.Tensor | None):
    """(token, logprob) per row of `logits` [rows, vocab]; `noise` [rows, vocab] ~ Exp(1)
    unless greedy.

    The token is an argmax over the scaled logits themselves and its log-prob is its scaled
    logit minus the row's logsumexp: log_softmax differs from the logits by a constant per
    row, so it need not be materialised over the vocabulary."""
    z = logits if mode.greedy else logits / mode.temperature
    lse = torch.logsumexp(z, dim=-1)
    if mode.greedy:
        tok = z.argmax(dim=-1)
    else:
        scores = z
        if mode.top_k > 0:
            kth = torch.topk(scores, mode.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if mode.top_p < 1.0:
            srt, idx = torch.sort(scores, dim=-1, descending=True)
            probs = torch.softmax(srt, dim=-1)
            drop_sorted = (probs.cumsum(dim=-1) - probs) > mode.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        # Gumbel-max: argmax(log p - log E) with E ~ Exp(1) samples from softmax(scores)
        tok = (scores - noise.clamp_min(1e-30).log()).argmax(dim=-1)
    lp = z.gather(-1, tok[:, None])[:, 0] - lse
    return tok, lp

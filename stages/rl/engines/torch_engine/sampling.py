"""Sampling of the torch engine: a `SamplingMode` (what a captured decode graph bakes in) and
`sample`, one token per row with the log-prob the engine reports (pi_infer).

temperature / top-k / top-p; Gumbel-max via exponential noise (argmax(p / E), E ~ Exp(1)),
the noise drawn by the caller (eagerly, outside a CUDA graph) from a seeded generator.
temperature <= 0 means greedy. The reported log-prob is log_softmax(logits / temperature) of
the token, in fp32, *before* top-k / top-p truncation: the probability the IcePop ratio
compares with the trainer's log_softmax(logits / temperature) of the same token (at
temperature 1.0, the recipe's, just the model's log-probability). Greedy reports
log_softmax(logits).

Where the Exp(1) noise comes from (`SAMPLING_NOISE`, the engine's `sampling_noise`):
- "drawn": `exponential_` from the engine's seeded generator into a [rows, vocab] buffer,
  eagerly before each step (a graph replays over the buffer);
- "hashed": a counter-based hash of (a per-step key, row, vocabulary index), computed inside
  the step (`hashed_exponential`). Under torch.compile it fuses into the sampling reduction,
  so no [rows, vocab] noise tensor is written or read: at batch 256 and a 151,936-word
  vocabulary the drawn noise is 155 MB written and read again every decode step, on a step
  whose whole memory-bandwidth bound is ~0.75 ms (0.5B shape). Eagerly it is a chain of
  integer ops over [rows, vocab] (slower than drawing), hence "auto" = hashed only for the
  compiled step. The key is drawn from the same seeded generator, so a seed still fixes
  the samples.
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


SAMPLING_NOISE = ("auto", "drawn", "hashed")

_M32 = 0xFFFF_FFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit integers with strong avalanche (Wellons' "lowbias32"), on int64
    tensors holding values in [0, 2^32): every product is masked back to 32 bits, so no
    int64 overflow happens on any backend."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB_352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846C_A68B) & _M32
    return x ^ (x >> 16)


def hashed_exponential(key: torch.Tensor, rows: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] as a pure function of `key` (an int64 tensor of one element,
    in [0, 2^31)), the row and the vocabulary index: graph-safe and, under torch.compile,
    fused into its consumer (module docstring).

    Per element two mixing rounds, the second keyed per row: a single round of col ^ h(row)
    would make two rows whose hashes share their high bits see the same noise values in
    permuted columns (correlated samples, e.g. a GRPO group's identical first steps)."""
    r = torch.arange(rows, device=key.device, dtype=torch.int64)[:, None]
    c = torch.arange(vocab, device=key.device, dtype=torch.int64)[None, :]
    row_a = _mix32((key + r * 0x9E37_79B9) & _M32)
    row_b = _mix32(row_a ^ 0x5BD1_E995)
    x = _mix32(_mix32(c ^ row_a) ^ row_b)
    u = ((x >> 8).to(torch.float32) + 0.5) * (2.0 ** -24)  # 24 bits: exact in float32, in (0, 1)
    return -torch.log(u)


def sample(logits: torch.Tensor, mode: SamplingMode, noise: torch.Tensor | None):
    """(token, logprob) per row of `logits` [rows, vocab]; `noise` [rows, vocab] ~ Exp(1)
    unless greedy (drawn, or `hashed_exponential`).

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

"""Losses on a language-model head that never hold the full-vocabulary logits of a whole batch.

With a 151,936-token vocabulary the logits of one 16k-token pack are 16k x 152k = 10 GB in
float32 (plus their gradient): more than the model. Both functions here take the last hidden
states and the head instead, and run the head chunk by chunk of `chunk_tokens` tokens:

- `linear_cross_entropy_sum`: the SFT loss, sum of token cross-entropies (ignore_index -100).
- `token_logprobs`: the RL learner's log pi(y_t) of given tokens under softmax(logits / T)
  (optionally tanh-softcapped first), and the entropy at each token.

A chunk's logits are computed in the head's dtype and upcast to float32, exactly as
`head(hidden).float()` followed by the plain loss would do it, so the values equal the plain
computation row for row. With grad enabled and more than one chunk, each chunk runs under
non-reentrant activation checkpointing: autograd keeps only the chunk's hidden states, and the
chunk's logits are recomputed in the backward pass (one extra head matmul, the price of never
storing [tokens, vocab]). With a single chunk nothing is recomputed.

Under ZeRO-3 every call of the head gathers its partitioned weight, a collective: every rank
must call it equally often, in the forward and in the recomputing backward, or the ranks hang
(seen on 2 GPUs: the RL learner's ranks had different response-token counts, so different
chunk counts). `head_calls` fixes that count from a number every rank agrees on (the chunks
of the largest micro batch of any rank, or of the configured capacity): a rank with fewer
tokens makes its last calls on empty chunks, which gather the weight and compute nothing.

The math on a chunk's logits (upcast, softcap, temperature, logsumexp, gather, entropy; the
cross-entropy) is ~6 full passes over a [chunk, vocab] float32 tensor in eager mode, and as
many again in the backward: on a GPU it took ~23% of the RL learner's step at 1.5B (a 2,048 x
151,936 float32 chunk is 1.2 GB per pass). On CUDA it runs through torch.compile (one function,
dynamic shapes, compiled once per process and grad mode): inductor fuses it into a few
reductions that read the head's bf16 logits. The head's matmul stays outside (cuBLAS, and
ZeRO-3's gather hooks). `RING_COMPILE_LOSS` (environment): `auto` (default: compiled on CUDA
when Triton is there), `on` (every device, for tests with `RING_COMPILE_BACKEND=aot_eager`),
`off` (eager: the benchmark's baseline).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from stages.common.compile_layers import compile_backend

IGNORE_INDEX = -100
LOSS_COMPILE_ENV = "RING_COMPILE_LOSS"
LOSS_COMPILE_MODES = ("auto", "on", "off")


def _ce_sum_math(z: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(z.float(), tc, ignore_index=IGNORE_INDEX, reduction="sum")


def _logprob_math(z: torch.Tensor, tc: torch.Tensor, temperature: float, softcap: float | None,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    z = z.float()
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, tc.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return lp, None
    return lp, lse - (F.softmax(z, dim=-1) * z).sum(-1)


_compiled: dict[tuple[Callable, str], Callable] = {}


def _math(fn: Callable, logits: torch.Tensor) -> Callable:
    """`fn` itself, or its compiled version where RING_COMPILE_LOSS says so for this device."""
    mode = os.environ.get(LOSS_COMPILE_ENV) or "auto"
    if mode not in LOSS_COMPILE_MODES:
        raise ValueError(f"${LOSS_COMPILE_ENV}={mode!r}: expected one of {', '.join(LOSS_COMPILE_MODES)}")
    if mode == "off" or (mode == "auto" and not (logits.is_cuda and _has_triton())):
        return fn
    key = (fn, compile_backend())
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=True, backend=key[1])
    return _compiled[key]


def _has_triton() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def chunks_for(tokens: int, chunk_tokens: int) -> int:
    """Head calls needed for `tokens` tokens in chunks of `chunk_tokens`."""
    return -(-tokens // chunk_tokens)


def _chunked(fn: Callable, n: int, chunk_tokens: int, head_calls: int | None, *tensors: torch.Tensor) -> list:
    """fn(*chunk of each tensor along dim 0) for consecutive chunks (exactly `head_calls` of
    them when given, the last ones empty); checkpointed when there is more than one."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (got {chunk_tokens})")
    calls = chunks_for(n, chunk_tokens) if head_calls is None else head_calls
    if calls < chunks_for(n, chunk_tokens):
        raise ValueError(f"{n} tokens need {chunks_for(n, chunk_tokens)} chunks of {chunk_tokens}, "
                         f"head_calls is {head_calls}")
    # decided from the call count, not this rank's tokens: ranks then recompute alike
    recompute = torch.is_grad_enabled() and calls > 1
    outs = []
    for c in range(calls):
        parts = [t[c * chunk_tokens:(c + 1) * chunk_tokens] for t in tensors]
        outs.append(checkpoint(fn, *parts, use_reentrant=False) if recompute else fn(*parts))
    return outs


def linear_cross_entropy_sum(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                             chunk_tokens: int, head_calls: int | None = None) -> torch.Tensor:
    """Sum over tokens of cross_entropy(head(hidden).float(), targets), ignore_index -100.

    hidden: [..., H]; targets: [...] (the same leading shape). Returns a float32 scalar.
    `head_calls`: call the head exactly this often (module docstring: ZeRO-3)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens, targets {t.shape[0]}")

    def chunk_loss(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        z = head(hc)
        return _math(_ce_sum_math, z)(z, tc)

    if h.shape[0] == 0 and head_calls is None:
        return h.sum(dtype=torch.float32) * 0.0
    return torch.stack(_chunked(chunk_loss, h.shape[0], chunk_tokens, head_calls, h, t)).sum()


def token_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, chunk_tokens: int, *,
                   temperature: float = 1.0, softcap: float | None = None,
                   with_entropy: bool = False, head_calls: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z / temperature)[target] per token, z = head(hidden) in float32 (tanh-capped by
    `softcap` first when given); and the entropy of that distribution when `with_entropy`.

    hidden: [..., H]; targets: [...]. Returns tensors of targets' shape (float32).
    `head_calls`: call the head exactly this often (module docstring: ZeRO-3)."""
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)

    def chunk_lp(hc: torch.Tensor, tc: torch.Tensor):
        z = head(hc)
        return _math(_logprob_math, z)(z, tc, float(temperature), softcap, with_entropy)

    if h.shape[0] == 0 and head_calls is None:
        empty = h.sum(dtype=torch.float32) * 0.0 + torch.zeros(shape, device=h.device)
        return empty, (empty.detach().clone() if with_entropy else None)
    outs = _chunked(chunk_lp, h.shape[0], chunk_tokens, head_calls, h, t)
    lp = torch.cat([o[0] for o in outs]).view(shape)
    ent = torch.cat([o[1] for o in outs]).view(shape) if with_entropy else None
    return lp, ent

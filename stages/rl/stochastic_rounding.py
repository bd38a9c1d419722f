"""Stochastic rounding of the trainer's fp32 weights into a bf16 rollout engine
(`rollout.sync_rounding: stochastic`).

Why: AdamW moves a weight by about lr per step, far below bf16's spacing (2^-8 of the weight),
so a bf16 copy rounded to nearest at every sync stays where it was while the fp32 trainer
drifts away: the train-inference mismatch grows through a run (benchmarks/mismatch_growth.py
measures it). Rounded stochastically the copy is unbiased, E[bf16] = fp32, and
follows the trainer on average; the CPU experiment cut the mismatch KL 2.8x at step 8.

The rounding (`stochastic_round_bf16`): bf16 is the top 16 bits of the fp32 pattern, so adding a
uniform random integer in [0, 2^16) to the pattern and truncating the low 16 bits rounds up with
probability (low bits) / 2^16, i.e. (x - down) / (up - down): unbiased, within one binade and
across its edge, for negative numbers (sign and magnitude: the carry grows the magnitude) and
subnormals alike. bf16 values come out exactly; NaN and +-inf pass through; a finite value
that would carry into inf gets the largest finite bf16 of its sign instead.

Reproducibility (`SyncRounding`): every tensor of a sync draws from its own generator seeded
from (stage seed, policy version, tensor name) (`tensor_seed`): a resumed run pushing version v
rounds exactly as the first run did, every engine of a colocated placement rounds alike, and
neither the bucket size nor the order of the tensors matters. The draws come from a generator
on the tensor's device: CPU and CUDA streams differ (the same seed on the same kind of device
gives the same bits). Draws are made in chunks of `CHUNK` elements, which bounds the
temporaries at ~8 bytes per chunk element whatever the tensor's size.

A LoRA policy's adapted layers are merged in fp32 (W + scale * B @ A) and that merge is rounded,
whatever W's dtype: with a bf16 trainer the adapters' small steps would otherwise vanish in the
merge's round to nearest exactly as an fp32 trainer's do (weight_sync.py `_rounded`).

Only what training changes is rounded stochastically (`MergedTensor.changed`: a frozen
parameter, e.g. the MoE router bias, is sent as before and rounded to nearest by the engine,
the same value it loaded: re-drawing a constant at every sync would only add noise).
"""
from __future__ import annotations

import hashlib

import torch

from stages.common.contract import StageError
from stages.rl.engines.protocol import RolloutEngine

CHUNK = 1 << 24  # elements drawn at once (part of the definition: the random stream depends on it)
_POS_INF, _NEG_INF = 0x7F80, -0x80  # bf16 +inf / -inf as the top 16 bits (arithmetic shift) of fp32
_POS_MAX, _NEG_MAX = 0x7F7F, -0x81  # the largest finite bf16 of each sign, likewise


def stochastic_round_bf16(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`t` (fp32) as bf16, each element rounded up or down at random with the probability that
    makes it unbiased (module docstring). `generator` is on `t`'s device."""
    if t.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16: an fp32 tensor is rounded, not {t.dtype}")
    src = t.detach().contiguous().view(-1)
    out = torch.empty(src.shape, dtype=torch.bfloat16, device=src.device)
    for start in range(0, src.numel(), CHUNK):
        x = src[start:start + CHUNK]
        special = ~torch.isfinite(x)
        bits = torch.randint(0, 1 << 16, x.shape, generator=generator, dtype=torch.int32, device=x.device)
        bits.masked_fill_(special, 0)  # no carry out of a NaN's payload (it could pass int32's largest)
        bits.add_(x.view(torch.int32))
        bits >>= 16  # arithmetic: a negative pattern keeps its sign bits, its low 16 are bf16's
        bits.masked_fill_(bits == _POS_INF, _POS_MAX).masked_fill_(bits == _NEG_INF, _NEG_MAX)
        out[start:start + CHUNK] = torch.where(special, x.to(torch.bfloat16), bits.to(torch.int16).view(torch.bfloat16))
    return out.view(t.shape)


def tensor_seed(seed: int, version: int, name: str) -> int:
    """The seed of tensor `name`'s draws in the sync of policy `version` (stage seed `seed`)."""
    digest = hashlib.blake2b(f"sync_rounding/{seed}/{version}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch seeds are below 2^63


class SyncRounding:
    """What the weight sync does to a trained fp32 tensor on its way to a bf16 engine:
    `rollout.sync_rounding: stochastic` with the stage's `seed` (None for `nearest`: `of`)."""

    def __init__(self, seed: int):
        self.seed = int(seed)

    @classmethod
    def of(cls, mode: str, seed: int) -> "SyncRounding | None":
        return cls(seed) if mode == "stochastic" else None

    @staticmethod
    def rounds(dtype: torch.dtype, changed: bool) -> bool:
        """Whether a tensor of `dtype` is rounded here (else the engine's copy rounds it to nearest)."""
        return changed and dtype == torch.float32

    def apply(self, name: str, value: torch.Tensor, changed: bool, version: int) -> torch.Tensor:
        if not self.rounds(value.dtype, changed):
            return value
        generator = torch.Generator(device=value.device).manual_seed(tensor_seed(self.seed, version, name))
        return stochastic_round_bf16(value, generator)

    @staticmethod
    def check_engine(engine: RolloutEngine) -> None:
        """An engine that holds its weights in another dtype than bf16 has nothing to gain (fp32:
        it takes the trainer's weights exactly) or would get the wrong values, and so would an
        engine that keeps some tensors in another dtype than its own (`takes_stochastic_rounding`)."""
        if not engine.takes_stochastic_rounding:
            raise StageError(f"rollout.sync_rounding: stochastic rounds the weights by the engine's dtype, and this "
                             f"rank's {engine.name} engine keeps some tensors in other dtypes: set "
                             f"rollout.sync_rounding: nearest")
        if engine.dtype != torch.bfloat16:
            raise StageError(f"rollout.sync_rounding: stochastic rounds the weights into a bf16 engine, and this "
                             f"rank's {engine.name} engine holds {engine.dtype} weights (rollout.dtype auto is fp32 "
                             f"on a CPU rank): set rollout.dtype: bf16, or rollout.sync_rounding: nearest")

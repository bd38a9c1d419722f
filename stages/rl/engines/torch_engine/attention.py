"""Attention of the torch engine's decode step: one new token per cache row, over that row's
cached positions.

Two implementations (`decode_attention`):
- "varlen" (CUDA default) reads only each row's own cached positions: every (row, kv head) is
  one variable-length sequence of the cache, cu_seqlens = row offsets, seqused_k = the row's
  length, read by the fused varlen kernel (flash for bf16/fp16, memory-efficient for fp32;
  aten's `_flash_attention_forward` / `_efficient_attention_forward`), the `groups` query
  heads of a kv head riding as its query rows. Cost follows the actual lengths, not the
  longest row's, and the shapes stay static (graph-safe).
- "sdpa_masked" (CPU default, and the fallback when the varlen kernel is unavailable) runs
  SDPA over the whole kv-length bucket with a boolean mask: every row pays for the longest row.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

DECODE_ATTENTION = ("auto", "varlen", "sdpa_masked")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class DecodeAttention:
    def __init__(self, choice: str, device: torch.device, dtype: torch.dtype, n_heads: int, n_kv: int,
                 head_dim: int, scaling: float):
        self.device, self.dtype = device, dtype
        self.n_heads, self.n_kv, self.head_dim, self.scaling = n_heads, n_kv, head_dim, scaling
        self.kind = self._pick(choice)

    def _varlen_kernel(self) -> str:
        return "flash" if self.dtype in (torch.bfloat16, torch.float16) else "efficient"

    def _pick(self, choice: str) -> str:
        if choice not in DECODE_ATTENTION:
            raise ValueError(f"torch engine: decode_attention must be one of "
                             f"{', '.join(DECODE_ATTENTION)}; got {choice!r}")
        if choice == "sdpa_masked" or (choice == "auto" and self.device.type != "cuda"):
            return "sdpa_masked"
        if self.device.type != "cuda":
            raise ValueError(f"torch engine: decode_attention={choice!r} needs a CUDA device "
                             f"(the fused varlen kernels are CUDA-only); use sdpa_masked or auto")
        try:  # a tiny probe against the masked reference: the private op may be missing
            self._probe_varlen()
        except Exception as e:
            if choice == "varlen":
                raise RuntimeError(f"torch engine: decode_attention='varlen' unusable on this "
                                   f"torch/GPU: {type(e).__name__}: {e}") from e
            log.warning("torch engine: varlen decode attention unavailable (%s: %s); using "
                        "masked SDPA over the kv-length bucket", type(e).__name__, e)
            return "sdpa_masked"
        return "varlen"

    def _probe_varlen(self) -> None:
        g = torch.Generator(device=self.device).manual_seed(0)
        groups, d, rows, cap = self.n_heads // self.n_kv, self.head_dim, 3, 32
        kc = torch.randn(rows, self.n_kv, cap, d, generator=g, device=self.device).to(self.dtype)
        vc = torch.randn(rows, self.n_kv, cap, d, generator=g, device=self.device).to(self.dtype)
        q = torch.randn(rows, self.n_kv, groups, d, generator=g, device=self.device).to(self.dtype)
        pos = torch.tensor([0, 9, cap - 1], device=self.device)
        got = self.varlen(q, kc, vc, pos, rows, cap)
        mask = (torch.arange(cap, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        want = F.scaled_dot_product_attention(q.float(), kc.float(), vc.float(), attn_mask=mask,
                                              scale=self.scaling)
        err = (got.float() - want).abs().max().item()
        if not err < (1e-2 if self.dtype != torch.float32 else 1e-4):
            raise RuntimeError(f"varlen probe disagrees with masked SDPA (max abs error {err:.3g})")

    def varlen(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               pos: torch.Tensor, nb: int, kvb: int) -> torch.Tensor:
        """Attention of q [nb, n_kv, groups, d] over each row's positions [0, pos] of the cache
        kc/vc [rows >= nb, n_kv, capacity, d] (contiguous); returns [nb, n_kv, groups, d].

        Each (row, kv head) is one sequence of the flattened cache (offset = its index x
        capacity, length = pos + 1): the kernel reads only the positions a row has. The
        `groups` query heads sharing a kv head are that sequence's query rows (no causal
        mask: they all see the same keys). Static shapes; no host sync (graph-safe).
        """
        groups, d = q.shape[2], q.shape[3]
        cap = kc.shape[2]
        n_seq = nb * self.n_kv
        ar = torch.arange(n_seq + 1, device=q.device, dtype=torch.int32)
        cu_q, cu_k = ar * groups, ar * cap
        used = (pos[:nb] + 1).to(torch.int32)[:, None].expand(nb, self.n_kv).contiguous().view(n_seq)
        kf, vf = kc.view(-1, 1, d), vc.view(-1, 1, d)  # [rows x n_kv x capacity, 1 head, d]
        qf = q.reshape(n_seq * groups, 1, d).contiguous()
        if self._varlen_kernel() == "flash":
            o = torch.ops.aten._flash_attention_forward(
                qf, kf, vf, cu_q, cu_k, groups, kvb, 0.0, False, False,
                scale=self.scaling, seqused_k=used)[0]
        else:
            o = torch.ops.aten._efficient_attention_forward(
                qf[None], kf[None], vf[None], None, cu_q, cu_k, groups, kvb, 0.0, 0,
                scale=self.scaling, seqlen_k=used)[0][0]
        return o.view(nb, self.n_kv, groups, d)

    @staticmethod
    def mask(positions: torch.Tensor, pos: torch.Tensor, kvb: int) -> torch.Tensor:
        """The boolean mask of `masked` (made once per decode step, shared by the layers);
        `positions` = arange(capacity) on the device, `pos` = each row's new position."""
        return (positions[:kvb][None, :] <= pos[:, None])[:, None, None, :]

    def masked(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor,
               kvb: int) -> torch.Tensor:
        """What `varlen` computes, by SDPA over the first `kvb` cached positions of kc/vc
        (rows [0, nb)) under `mask`."""
        return F.scaled_dot_product_attention(q, kc[:, :, :kvb], vc[:, :, :kvb], attn_mask=mask,
                                              scale=self.scaling)

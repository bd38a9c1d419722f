"""The feed-forward part of a decoder layer in the torch rollout engine: a dense MLP runs as
the model's own module; a Mixture-of-Experts block runs here, with static shapes, so the
decode step that holds it can be captured as a CUDA graph (cuda_graphs.py).

Which blocks (a structural check, not a list of model types): a block with `gate` (the
router: `forward(h [n, d]) -> (logits, top_k_weights [n, k], top_k_index [n, k])`) and
`experts` holding fused 3-D weights `gate_up_proj [E, 2*ff, d]`, `down_proj [E, d, ff]`
(transformers 5.x's layout: qwen2_moe, qwen3_moe, init_model's ring_moe), optionally with a
`shared_expert` (gated by `sigmoid(shared_expert_gate(h))` when the block has that gate).
The router is the model's own module, so its routing rule (softmax or sigmoid scores, an
expert bias, normalisation, scaling) is exactly the trainer's. Experts with biases, or with
transposed or interleaved weights, are refused.

The routed experts, for n tokens choosing k experts each (N = n*k token-expert pairs):
1. the pairs are sorted by expert (a stable argsort), each pair's token row gathered;
2. per-expert counts come from a device-side scatter-add and their cumsum gives each
   expert's end offset: no value ever goes to the host, so nothing breaks graph capture;
3. the experts run on their rows:
   - `grouped`: `grouped_mm` (CUDA, bf16, SM80+, dims multiple of 8): one kernel per
     projection over the sorted rows, reading each expert's weights once;
   - `padded` (everywhere else: CPU, fp32, tests): every expert gets a fixed block of n
     rows (a token picks an expert at most once, so n rows always suffice), filled by
     scatter, and two batched matmuls run all blocks; the unused rows cost compute, not
     correctness. Tokens are taken in chunks so that the blocks stay within
     PADDED_BLOCK_ELEMENTS (a long prefill is cut into several chunks).
4. the outputs are weighted by the router's weights, put back in pair order and summed over
   each token's k experts (a fixed-order sum: deterministic, no atomics).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# the padded path keeps E x chunk x max(2*ff, d) elements per block
PADDED_BLOCK_ELEMENTS = 1 << 26

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def is_moe_block(mlp: nn.Module) -> bool:
    experts = getattr(mlp, "experts", None)
    return (isinstance(getattr(mlp, "gate", None), nn.Module) and experts is not None
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor))


def is_dense_mlp(mlp: nn.Module) -> bool:
    return all(isinstance(getattr(mlp, p, None), nn.Module) for p in ("gate_proj", "up_proj", "down_proj"))


def feed_forward(mlp: nn.Module, where: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the engine calls for a layer's MLP: the module itself when dense, an
    `MoEFeedForward` for a supported MoE block; ValueError naming `where` otherwise."""
    if is_moe_block(mlp):
        return MoEFeedForward(mlp, where)
    if is_dense_mlp(mlp):
        return mlp
    raise ValueError(f"torch engine: {where} ({type(mlp).__name__}) is neither a dense gate/up/down MLP nor "
                     "a supported MoE block (gate + experts.gate_up_proj / down_proj); use the vllm engine")


class MoEFeedForward:
    """A MoE block's forward on the engine's path (module docstring); reads the block's
    parameters by reference, so in-place weight updates reach it."""

    def __init__(self, block: nn.Module, where: str):
        experts = block.experts
        for flag, bad in (("has_bias", True), ("is_transposed", True), ("is_concatenated", False)):
            if getattr(experts, flag, not bad) == bad:
                raise ValueError(f"torch engine: {where}: experts with {flag}={bad} are not supported; "
                                 "use the vllm engine")
        E, two_ff, d = experts.gate_up_proj.shape
        if tuple(experts.down_proj.shape) != (E, d, two_ff // 2):
            raise ValueError(f"torch engine: {where}: expert weights gate_up_proj {tuple(experts.gate_up_proj.shape)} "
                             f"and down_proj {tuple(experts.down_proj.shape)} are not [E, 2*ff, d] / [E, d, ff]")
        self.router, self.experts = block.gate, experts
        self.shared = getattr(block, "shared_expert", None)
        self.shared_gate = getattr(block, "shared_expert_gate", None)
        self.num_experts, self.hidden, self.ff = E, d, two_ff // 2
        self.gated = getattr(experts, "_apply_gate", None)
        self.top_k = int(getattr(block.gate, "top_k", 0) or getattr(block, "top_k", 0) or 0)
        self.device = experts.gate_up_proj.device
        # where the router's top-k index is copied when set (route_log.py: routing replay)
        self.sink: torch.Tensor | None = None

    @property
    def grouped(self) -> bool:
        w = self.experts.gate_up_proj
        return (_grouped_mm is not None and w.is_cuda and w.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(w.device) >= (8, 0)
                and self.hidden % 8 == 0 and self.ff % 8 == 0)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, self.hidden)
        _, weights, index = self.router(x)
        if self.sink is not None:
            self.sink[:index.shape[0]].copy_(index)
        y = routed_experts(self, x, index, weights)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            y = y + s
        return y.view(shape)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.gated is not None:
            return self.gated(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.experts.act_fn(gate) * up


def routed_experts(ffn: MoEFeedForward, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                   grouped: bool | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{index[t, j]}(x[t]) for every token t (static shapes)."""
    grouped = ffn.grouped if grouped is None else grouped
    if grouped:
        return _routed(ffn, x, index, weights, _grouped_rows)
    chunk = max(1, PADDED_BLOCK_ELEMENTS // (ffn.num_experts * max(2 * ffn.ff, ffn.hidden)))
    if x.shape[0] <= chunk:
        return _routed(ffn, x, index, weights, _padded_rows)
    return torch.cat([_routed(ffn, x[i:i + chunk], index[i:i + chunk], weights[i:i + chunk], _padded_rows)
                      for i in range(0, x.shape[0], chunk)])


def _routed(ffn: MoEFeedForward, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, run_rows):
    n, k = index.shape
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)            # pairs sorted by expert
    expert = flat[order]
    rows = x[order // k]                                 # [N, d] the pairs' token rows
    counts = torch.zeros(ffn.num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)   # expert e's rows: [ends[e] - counts[e], ends[e])
    out = run_rows(ffn, rows, expert, counts, ends, n)   # [N, d]
    out = out * weights.reshape(-1)[order, None].to(out.dtype)
    pairs = torch.empty_like(out)
    pairs[order] = out                                   # back to (token, j) order
    return pairs.view(n, k, -1).sum(dim=1).to(x.dtype)


def _grouped_rows(ffn, rows, expert, counts, ends, n):
    e = ffn.experts
    h = _grouped_mm(rows, e.gate_up_proj.transpose(-2, -1), offs=ends)
    return _grouped_mm(ffn.activation(h), e.down_proj.transpose(-2, -1), offs=ends)


def _padded_rows(ffn, rows, expert, counts, ends, n):
    e = ffn.experts
    slot = torch.arange(rows.shape[0], device=rows.device) - (ends - counts)[expert]  # rank within its expert
    blocks = rows.new_zeros(ffn.num_experts, n, ffn.hidden)
    blocks[expert, slot] = rows
    h = torch.bmm(blocks, e.gate_up_proj.transpose(-2, -1))      # [E, n, 2*ff]
    out = torch.bmm(ffn.activation(h), e.down_proj.transpose(-2, -1))  # [E, n, d]
    return out[expert, slot]

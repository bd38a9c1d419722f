"""One GEMM for the projections of a layer that read the same input: attention's q / k / v,
a dense MLP's gate / up (what vLLM's QKVParallelLinear and MergedColumnParallelLinear do).

At decode time a projection is a [batch, hidden] x [hidden, out] GEMM; for small models
(hidden 896, 2 kv heads of 64) k and v are 128-wide and run far below the GPU's bandwidth, and
each is one more kernel per layer per token. Packed, the layer reads one weight matrix once.

The packed weight (and bias) is one buffer whose row slices *are* the modules' parameters
(`param.data` is a view into it), so everything that writes parameters by name (the engine's
`update_weights`, the trainer's weight sync) writes into the packed buffer without knowing it.
`release` / `restore` free and reallocate the buffer for the engine's `sleep(weights=True)` /
`wake` (re-pointing the views), where per-parameter storage would break them.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinear:
    """`linears` (nn.Linear, same input, dtype and device) as one matmul; build with `pack`."""

    def __init__(self, linears: Sequence[nn.Linear]):
        self.weights = [m.weight for m in linears]
        self.biases = [m.bias for m in linears] if linears[0].bias is not None else None
        self.sizes = [int(m.out_features) for m in linears]
        self.weight = torch.cat([w.data for w in self.weights], dim=0)
        self.bias = None if self.biases is None else torch.cat([b.data for b in self.biases], dim=0)
        self.matmul: Callable[[torch.Tensor], torch.Tensor] | None = None  # FP8 rollouts: fp8.py
        self._point_views()

    @classmethod
    def pack(cls, linears: Sequence[nn.Module]) -> "FusedLinear | None":
        """None when they cannot share one matmul (not plain nn.Linear, other input sizes,
        dtypes or devices, a bias on some only): the caller keeps the modules."""
        if len(linears) < 2 or any(type(m) is not nn.Linear for m in linears):
            return None
        first = linears[0]
        same = all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
                   and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
                   for m in linears)
        return cls(linears) if same else None

    @property
    def params(self) -> list[nn.Parameter]:
        return self.weights + (self.biases or [])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.matmul(x) if self.matmul is not None else F.linear(x, self.weight, self.bias)
        return y.split(self.sizes, dim=-1)

    def release(self) -> None:
        """Free the packed storage (the views go with it) until `restore`."""
        self.weight = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        if self.bias is not None:
            self.bias = torch.empty(0, dtype=self.bias.dtype, device=self.bias.device)
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def restore(self) -> None:
        """New packed storage, contents undefined (until the weights are written by name)."""
        if self.weight.numel():
            return
        self.weight = torch.empty(sum(self.sizes), self._in_features, dtype=self.weight.dtype,
                                  device=self.weight.device)
        if self.bias is not None:
            self.bias = torch.empty(sum(self.sizes), dtype=self.bias.dtype, device=self.bias.device)
        self._point_views()

    def _point_views(self) -> None:
        self._in_features = int(self.weight.shape[1])
        start = 0
        for i, size in enumerate(self.sizes):
            self.weights[i].data = self.weight[start:start + size]
            if self.biases is not None:
                self.biases[i].data = self.bias[start:start + size]
            start += size


class PackedGateUpMLP:
    """A dense gated MLP, `down(act(gate(x)) * up(x))`, with gate and up as one matmul."""

    def __init__(self, mlp: nn.Module, gate_up: FusedLinear):
        self.act, self.down, self.gate_up = mlp.act_fn, mlp.down_proj, gate_up

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(self.act(gate) * up)


def pack_dense_mlp(mlp: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], FusedLinear | None]:
    """(what the engine calls for this MLP, its packed projections or None). The packed form is
    used only where it computes what the module's own forward does, checked on a probe input:
    a model whose MLP is not `down(act(gate(x)) * up(x))` keeps its module."""
    if not callable(getattr(mlp, "act_fn", None)) or not isinstance(getattr(mlp, "down_proj", None), nn.Module):
        return mlp, None
    w = mlp.gate_proj.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(4, w.shape[1], generator=gen).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        expected = mlp(probe)
        packed = PackedGateUpMLP(mlp, _Unpacked(mlp))(probe)
    if expected.shape != packed.shape or not torch.allclose(expected.float(), packed.float(), rtol=1e-3, atol=1e-3):
        return mlp, None
    gate_up = FusedLinear.pack([mlp.gate_proj, mlp.up_proj])
    return (mlp, None) if gate_up is None else (PackedGateUpMLP(mlp, gate_up), gate_up)


class _Unpacked:
    """gate / up as two matmuls: the probe's reference for the packed formula."""

    def __init__(self, mlp: nn.Module):
        self.gate, self.up = mlp.gate_proj, mlp.up_proj

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x), self.up(x)

"""FP8 rollouts in the torch engine (`rollout.dtype: fp8`): the linear layers of
every decoder layer hold their weights as scaled e4m3 (`torch.float8_e4m3fn`) and multiply in
FP8 through `torch._scaled_mm` (the Hopper / Ada FP8 tensor cores), activations quantised on
the fly per call. What verl, slime, NeMo-RL and AReaL do to speed up generation; it also
enlarges the train-inference mismatch that IcePop corrects (the trainer stays bf16).

Scales (`fp8_scaling`):
- `tensor`: one scale per weight matrix, amax / 448 (e4m3's largest finite value), and one
  per activation matrix;
- `row`: one scale per output row of the weight (per channel) and one per token of the
  activations (`_scaled_mm`'s row-wise mode): a row of small weights keeps its precision
  when another row is large.
A weight is stored as round(w / scale) in e4m3 (relative rounding error <= 2^-4 for values
in e4m3's normal range), so dequantised |w - q * s| <= 2^-4 |w| + s * 2^-9 (the subnormal
step); tests/stages/rl/test_fp8.py checks those bounds.

What is FP8: q/k/v (packed: fused_linear.py), o_proj, a dense MLP's gate/up (packed) and down,
an MoE block's shared expert. What is not: embeddings, norms, the lm_head (the sampled
distribution's logits stay bf16), MoE routers (fp32 routing), the routed experts (3-D weights
through grouped_mm; FP8 grouped GEMMs are not wired in), and any linear whose dimensions are
not multiples of 16 (`_scaled_mm`'s requirement, e.g. the shared-expert gate [1, d]).

The engine keeps its bf16 weights: they are what the weight sync writes into by name
(`update_weights`), after which `Fp8Weights.requantize` rebuilds every FP8 copy from them in
place (CUDA graphs captured over the copies stay valid). Memory: weights cost 1.5x bf16, not
0.5x; the speed-up is the FP8 GEMMs' (decode reads the e4m3 copy only).

Where `_scaled_mm` cannot run (CPU, a GPU older than compute capability 8.9) the engine
refuses fp8 at set-up, naming the device. `fp8_reference=True` (tests only) dequantises the
weights on the fly and multiplies in the compute dtype: the same weights' rounding, none of
the speed.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
SCALINGS = ("tensor", "row")
_TINY = 1e-12  # the scale of an all-zero weight (any positive number keeps it zero)


def weight_scale(w: torch.Tensor, scaling: str) -> torch.Tensor:
    """float32 scale: [] (tensor) or [out, 1] (row), amax / E4M3_MAX."""
    if scaling not in SCALINGS:
        raise ValueError(f"fp8_scaling must be one of {SCALINGS}, not {scaling!r}")
    amax = w.detach().abs().amax() if scaling == "tensor" else w.detach().abs().amax(dim=-1, keepdim=True)
    return (amax.float() / E4M3_MAX).clamp(min=_TINY)


def quantize(w: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale) with w ~= q * scale."""
    scale = weight_scale(w, scaling)
    return (w.detach().float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def scaled_mm_unavailable(device: torch.device) -> str | None:
    """Why FP8 matmuls cannot run on `device` (None when they can)."""
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_mm"
    if device.type != "cuda":
        return f"device {device} is not a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"device {device} ({torch.cuda.get_device_name(device)}) has compute capability {major}.{minor}; "
                f"FP8 tensor cores need 8.9+ (Ada, Hopper)")
    return None


def fits(weight: torch.Tensor) -> bool:
    """`_scaled_mm` needs both dimensions of the weight to be multiples of 16."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


class Fp8Matmul:
    """x @ W^T (+ b) with W's scaled e4m3 copy; `source` / `bias` read the engine's bf16
    tensors (they move on sleep / wake, so they are read through callables)."""

    def __init__(self, source: Callable[[], torch.Tensor], bias: Callable[[], torch.Tensor | None],
                 scaling: str, reference: bool):
        self.source, self.bias, self.scaling, self.reference = source, bias, scaling, reference
        self.q, self.scale = quantize(source(), scaling)

    def requantize(self) -> None:
        q, scale = quantize(self.source(), self.scaling)
        if q.shape == self.q.shape and self.q.numel():
            self.q.copy_(q)          # in place: CUDA graphs hold these addresses
            self.scale.copy_(scale)
        else:
            self.q, self.scale = q, scale

    def release(self) -> None:
        self.q = torch.empty(0, dtype=E4M3, device=self.q.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias()
        if self.reference:
            return F.linear(x, dequantize(self.q, self.scale, x.dtype), bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.scaling == "tensor":
            sx = (x2.abs().amax().float() / E4M3_MAX).clamp(min=_TINY)
            sw = self.scale
        else:  # per token x per output channel
            sx = (x2.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp(min=_TINY)
            sw = self.scale.t()
        xq = (x2.float() / sx).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        y = torch._scaled_mm(xq, self.q.t(), scale_a=sx, scale_b=sw, bias=bias, out_dtype=x.dtype)
        return y.reshape(*shape[:-1], y.shape[-1])


class Fp8Weights:
    """Every FP8 matmul of one engine (module docstring): attach, re-quantise, release."""

    def __init__(self, matmuls: list[Fp8Matmul], skipped: list[str]):
        self.matmuls, self.skipped = matmuls, skipped

    @classmethod
    def attach(cls, layers: Sequence[nn.Module], packs: Sequence, scaling: str, reference: bool) -> "Fp8Weights":
        """FP8 for `packs` (FusedLinear: their `matmul`) and every other nn.Linear of `layers`
        (its `forward`), where the weight fits `_scaled_mm`."""
        if scaling not in SCALINGS:
            raise ValueError(f"torch engine: fp8_scaling must be one of {SCALINGS}, not {scaling!r}")
        matmuls, skipped = [], []
        packed = {id(p) for pack in packs for p in pack.weights}
        for pack in packs:
            if fits(pack.weight):
                pack.matmul = Fp8Matmul(lambda pack=pack: pack.weight, lambda pack=pack: pack.bias, scaling, reference)
                matmuls.append(pack.matmul)
        for i, layer in enumerate(layers):
            for name, m in layer.named_modules():
                if type(m) is not nn.Linear or id(m.weight) in packed:
                    continue
                if not fits(m.weight):
                    skipped.append(f"layers.{i}.{name}")
                    continue
                m.forward = Fp8Matmul(lambda m=m: m.weight, lambda m=m: m.bias, scaling, reference)
                matmuls.append(m.forward)
        return cls(matmuls, skipped)

    @torch.no_grad()
    def requantize(self) -> None:
        """After the bf16 weights changed (the weight sync): every FP8 copy rebuilt from them."""
        for mm in self.matmuls:
            mm.requantize()

    def release(self) -> None:
        for mm in self.matmuls:
            mm.release()

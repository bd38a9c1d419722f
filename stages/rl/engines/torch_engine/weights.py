"""What the torch engine does with its weights: release them while its rank trains
(`sleep(weights=True)`), get storage back (`wake`), and take the trainer's tensors in place
(`update_weights`: CUDA graphs captured over the parameters stay valid)."""
from __future__ import annotations

import time
from typing import Iterable

import torch

from stages.rl.engines.protocol import IGNORED_PREFIXES


def on_device(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """`model` on `device` with its parameters in `dtype` and its buffers as the loader made them:
    the rotary frequencies (`inv_freq`) stay fp32, as the trainer has them (transformers' loader
    and DeepSpeed's bf16 mode keep them so). `model.to(dtype)` rounded them to bf16, 0.33%
    relative, which turns the rotation between positions 400 apart by up to 0.56 rad (SmolLM2,
    theta 1e5): the engine runs another function than the trainer."""
    model.to(device=device)
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


class EngineWeights:
    """Mixin of TorchEngine: needs `_params` (name -> parameter, tied names included), `_packs`
    (FusedLinear packs owning some parameters' storage), `fp8` (Fp8Weights or None), `_released`, `_stale_weights`,
    `device`, `free_cache` and SyncTiming's `_record_sync`."""

    def sleep(self, weights: bool = False) -> None:
        """The protocol's: the KV cache and the graphs captured over it go (`free_cache`); with
        `weights` every parameter's storage goes too (its shape is kept for `wake`)."""
        self.free_cache()
        if weights and self._released is None:
            packed = {id(p) for pack in self._packs for p in pack.params}
            unique = {id(p): p for p in self._params.values() if id(p) not in packed}.values()  # a tied lm_head once
            self._released = [(p, p.shape) for p in unique]
            for pack in self._packs:
                pack.release()
            if self.fp8 is not None:
                self.fp8.release()
            for p, _ in self._released:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def wake(self) -> None:
        """The protocol's: released weights get storage back (undefined until update_weights)."""
        if self._released is None:
            return
        for p, shape in self._released:
            p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
        for pack in self._packs:
            pack.restore()
        self._released = None
        self._stale_weights = True

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """Copy full tensors by name into this engine's parameters, in place.

        Names are the trainer model's `named_parameters()` (a leading `module.` of a
        DeepSpeed engine or `_orig_mod.` of torch.compile is ignored). Every engine
        parameter must be covered (a tied lm_head is covered by the embedding); unknown
        names and shape mismatches raise. Sets `last_sync_seconds`. `partial`: only some
        parameters come (the rest are kept), which needs weights that were never released.
        """
        t0 = time.perf_counter()
        if partial and self._stale_weights:
            raise ValueError("torch engine: update_weights(partial=True) after its weights were released "
                             "(sleep(weights=True)): every parameter must be sent")
        seen: set[int] = set()
        unknown: list[str] = []
        for name, tensor in named_tensors:
            key = name
            while key not in self._params and key.startswith(IGNORED_PREFIXES):
                key = key.split(".", 1)[1]
            param = self._params.get(key)
            if param is None:
                unknown.append(name)
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                hint = (" (an empty tensor: under ZeRO-3 gather the parameters first)"
                        if tensor.numel() == 0 else "")
                raise ValueError(f"torch engine: update_weights: {name} has shape "
                                 f"{tuple(tensor.shape)}, the engine's {key} has "
                                 f"{tuple(param.shape)}{hint}")
            param.copy_(tensor.detach())
            seen.add(id(param))
        if unknown:
            raise ValueError(f"torch engine: update_weights: {len(unknown)} names match no "
                             f"engine parameter, e.g. {unknown[:5]}")
        missing = sorted({k for k, p in self._params.items() if id(p) not in seen})
        if missing and not partial:
            raise ValueError(f"torch engine: update_weights: {len(missing)} engine parameters "
                             f"were not sent, e.g. {missing[:5]}")
        if self.fp8 is not None:  # the FP8 copies follow the weights just written
            self.fp8.requantize()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._stale_weights = False
        self._record_sync(t0)

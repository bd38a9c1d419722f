"""DeepSpeed setup shared by the training stages: the DeepSpeed config, AdamW parameter
groups (no decay on 1-D params), a torch AdamW handed to `deepspeed.initialize`, and the
warmup + cosine learning-rate factor."""
from __future__ import annotations

import contextlib
import functools
import importlib
import math
import sys
import types
from fnmatch import fnmatchcase
from typing import Any, Callable, Iterable

import torch

from stages.common.training_settings import SupervisedSettings


def ds_config(zero_stage: int, grad_clip: float, precision: str, *, micro_batch: int = 1, grad_accum: int = 1,
              world: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config. `precision` is resolved ("bf16", "bf16-mixed" or "fp32",
    precision.PRECISION_HELP): "bf16-mixed" keeps the weights in fp32 (load them so) and
    runs the engine's forward under torch.autocast, so the torch AdamW steps the weights
    themselves; DeepSpeed's bf16 mode instead wraps the optimizer with fp32 master copies it
    keeps in step with per-parameter copies and checks (an SFT step's profile at 1.5B on an
    H100: thousands of copies and a norm, amax and amin kernel per parameter;
    benchmarks/sft_throughput.py measures it). `train_batch_size` is set only when `world` is
    given (stages that let DeepSpeed count micro-batches); the optimizer is a torch AdamW passed
    in (DS's own CPU Adam is a JIT build), hence `zero_allow_untested_optimizer`."""
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 12,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16-mixed":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if world is not None:
        cfg["train_batch_size"] = micro_batch * grad_accum * world
    return cfg


def freeze_parameters(model: torch.nn.Module, patterns: Iterable[str]) -> list[str]:
    """requires_grad=False on parameters whose name matches an fnmatch pattern (the
    `frozen_param_patterns` setting: MoE router bias held fixed); returns their names. Before
    the optimizer is built (it takes trainable parameters only, so weight decay cannot move them)
    and before the layers are compiled (a compiled layer hands a parameter that gets no gradient
    a gradient hook call with none, which DeepSpeed's ZeRO-1/2 hook cannot take)."""
    patterns = list(patterns)
    frozen = []
    for name, p in model.named_parameters():
        if any(fnmatchcase(name, pat) for pat in patterns):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (linear and embedding weights), none on 1-D params (norms,
    biases). Under ZeRO-3 parameters are already partitioned (flat, empty) when this runs:
    their real shape is `ds_shape`."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_factor(cfg: SupervisedSettings, total_steps: int) -> Callable[[int], float]:
    """Multiplier of `lr` after `step` optimizer steps (LambdaLR): linear warmup to 1 over
    `cfg.warmup_steps`, then cosine down to `cfg.min_lr_ratio` at the last step (or constant
    when `cfg.lr_schedule == "constant"`)."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def initialize(model: torch.nn.Module, params: Iterable, ds_cfg: dict[str, Any], *, lr: float,
               betas, weight_decay: float = 0.0, factor: Callable[[int], float] | None = None):
    """A torch AdamW over `params` (tensors, or groups carrying their own weight_decay; fused on
    the GPU) and the DeepSpeed engine; with `factor`, a LambdaLR built on DeepSpeed's wrapped
    optimizer (ZeRO regroups params). Returns (engine, scheduler or None)."""
    _muon_loaded_on_first_use()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    if device.type == "cuda" and ds_cfg["zero_optimization"]["stage"] != 3:
        # where DeepSpeed moves the model anyway (ZeRO-3 partitions onto the GPU while loading);
        # done first because the fused AdamW checks its tensors' device when it is built
        model.to(device)
    params = list(params)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                  fused=_all_on_cuda(params))
    schedule = None if factor is None else (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor))
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg,
                                                   lr_scheduler=schedule)
    return engine, scheduler


# DeepSpeed's Muon optimizer: every ZeRO engine imports it (an isinstance check when it is built
# and in each step's gradient reduction), and its `torch.compile` decorators load torch's
# inductor, ~1.3 CPU-s per rank before the first step. The stages hand DeepSpeed a torch AdamW,
# never Muon, so until Muon is really used these stand-ins answer for the two modules.
_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"
_ORIGINAL_MUON = "deepspeed.runtime.zero.muon.original_muon"


class _MuonNotLoaded:
    """Stands for DeepSpeed's MuonWithAuxAdam: no optimizer is an instance of it, as none is of
    the real class (the stages' optimizer is a torch AdamW)."""

    def __new__(cls, *args, **kwargs):  # DeepSpeed builds Muon only for a config naming it
        return _real_muon(_MUON).MuonWithAuxAdam(*args, **kwargs)


def _muon_update(*args, **kwargs):
    """DeepSpeed's Muon update, the real one (only a Muon optimizer's parameters reach it)."""
    return _real_muon(_ORIGINAL_MUON).muon_update(*args, **kwargs)


def _real_muon(name: str) -> types.ModuleType:
    """The real module `name`, imported now in place of both stand-ins."""
    for stand_in in (_MUON, _ORIGINAL_MUON):
        if getattr(sys.modules.get(stand_in), "__stand_in__", False):
            del sys.modules[stand_in]
    return importlib.import_module(name)


def _real_attribute(module: str, attribute: str):
    """A stand-in's missing `attribute`, from the real `module`; the import system's probes of
    dunder names (`__path__`, `__spec__`, ...) are answered by the stand-in alone."""
    if attribute.startswith("__"):
        raise AttributeError(attribute)
    return getattr(_real_muon(module), attribute)


def _muon_loaded_on_first_use() -> None:
    """Put the stand-ins where DeepSpeed imports its Muon modules from, unless they are loaded."""
    for name, attr, value in ((_MUON, "MuonWithAuxAdam", _MuonNotLoaded), (_ORIGINAL_MUON, "muon_update", _muon_update)):
        if name not in sys.modules:
            module = types.ModuleType(name, "stand-in until DeepSpeed's Muon is used (deepspeed_setup.py)")
            module.__stand_in__ = True
            setattr(module, attr, value)
            # any other name (a DeepSpeed release that imports more of them): the real module's
            module.__getattr__ = functools.partial(_real_attribute, name)
            sys.modules[name] = module


def _all_on_cuda(params: list) -> bool:
    """Whether every tensor in `params` (tensors or groups) is on CUDA: torch's fused AdamW (one
    kernel over all tensors instead of a loop of small ones) needs that. DeepSpeed's bf16 and ZeRO
    1/2/3 optimizers swap fp32 CUDA master copies into the client optimizer's param_groups and call
    its step(), which the fused kernel serves the same way; on CPU the foreach/for-loop path stays."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return bool(tensors) and all(t.is_cuda for t in tensors)


def hf_zero3_context(ds_cfg: dict[str, Any]):
    """Under ZeRO-3, the HfDeepSpeedConfig that makes `from_pretrained` partition the weights
    while loading (keep a reference to it until the model is built); None otherwise."""
    if ds_cfg["zero_optimization"]["stage"] != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_cfg)


def gathered(params: list[torch.Tensor], zero3: bool):
    """The full parameters inside the block: ZeRO-3 all-gathers them (every rank of their
    data-parallel group joins), otherwise they are full already."""
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

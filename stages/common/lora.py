"""LoRA (the `lora:` block of sft, reward_model, reasoning_rl and general_rl, LoraSettings in
training_settings.py) through peft, and the two ways its result leaves the trainer.

`apply_lora` injects peft's adapters into the Hugging Face model in place: the model keeps its
class, its forward and its module names (what the fused loss, the RL learner and DeepSpeed
see); each target Linear becomes peft's `lora.Linear` around it (`<name>.base_layer`,
`<name>.lora_A.default`, `<name>.lora_B.default`), each fully trained module a
`ModulesToSaveWrapper` (`<name>.modules_to_save.default` is the trained copy); every other
parameter is frozen, so the optimizer (built over trainable parameters) holds state for the
adapters only, and so does a checkpoint's optimizer state.

`merged_tensors` names the model's weights as the base model names them, each computed from
what the trainer holds: W + (alpha / r) * B @ A for an adapted layer, the trained copy of a
fully trained module, the parameter itself otherwise. The same list serves the two readers:
- a published merged model (`lora_state_dict(..., "merged")`, written by hf_io.save_hf_model:
  what the next stage and any HF tool load);
- the RL weight sync (stages/rl/weight_sync.py), which sends the engines only what changes
  (`changed_only`): the merged adapted layers and the fully trained modules.
`lora_state_dict(..., "adapter")` is peft's adapter file (`adapter_model.safetensors`, loaded
by `PeftModel.from_pretrained` onto the base) and `write_adapter_config` its
`adapter_config.json`, which names the base model's artifact.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Iterator

import torch

from data_curation.urls import normalise_url
from stages.common.artifact_inputs import read_manifest
from stages.common.contract import StageError
from stages.common.deepspeed_setup import gathered
from stages.common.hf_io import save_hf_model
from stages.common.training_settings import LoraSettings

ADAPTER = "default"  # peft's name of the one adapter a stage trains
_LORA_WEIGHTS = (f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}.")
_TRAINED_COPY = f".modules_to_save.{ADAPTER}."


@dataclass(frozen=True)
class LoraPlan:
    """Which modules of a model get adapters and which train fully (names in the model)."""

    targets: list[str]
    train_fully: list[str]


def plan_lora(model: torch.nn.Module, settings: LoraSettings, always_train: tuple[str, ...] = (),
              what: str = "lora") -> LoraPlan:
    """The module names `settings` (and the kind's `always_train`) select in `model`. A pattern
    that matches nothing, or a module both adapted and trained fully, is a StageError."""
    modules = dict(model.named_modules())
    # nn.Linear only (W stored [out, in]); a layer stored transposed (GPT-2's Conv1D) is no target
    linear = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
    for pattern in settings.target_modules:
        if not any(fnmatchcase(n, pattern) for n in linear):
            raise StageError(f"{what}.target_modules: {pattern!r} matches no linear layer of the model "
                             f"(some of its linear layers: {', '.join(linear[:6])})")
    targets = [n for n in linear if any(fnmatchcase(n, p) for p in settings.target_modules)]
    present = [p for p in always_train if p in modules]
    if always_train and not present:
        raise StageError(f"{what}: the model has none of the modules {list(always_train)} that this kind "
                         "always trains fully (its new head)")
    full_patterns = [*settings.train_fully, *present]
    for pattern in settings.train_fully:
        if not any(fnmatchcase(n, pattern) for n in modules if n):
            raise StageError(f"{what}.train_fully: {pattern!r} matches no module of the model")
    train_fully = [n for n in modules if n and any(fnmatchcase(n, p) for p in full_patterns)]
    train_fully = [n for n in train_fully if not any(n.startswith(f"{f}.") for f in train_fully)]  # outermost
    both = [t for t in targets if any(t == f or t.startswith(f"{f}.") for f in train_fully)]
    if both:
        raise StageError(f"{what}: {both[0]!r} is both a target module and inside a module trained fully "
                         f"({what}.train_fully); pick one")
    _refuse_tied(model, train_fully, f"{what}.train_fully", "training one copy fully would untie them")
    # an adapted layer whose weight is tied: the merged model and the weight sync name the shared
    # tensor once, under the other module's name, and would drop the adapter's change
    _refuse_tied(model, targets, f"{what}.target_modules", "its adapter's change would be lost when merged")
    return LoraPlan(targets, train_fully)


def _refuse_tied(model: torch.nn.Module, selected: list[str], key: str, why: str) -> None:
    """A selected module whose weight is tied to another (lm_head and the embeddings of a model
    with tie_word_embeddings) is refused, saying `why`."""
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    for names in shared.values():
        inside = [n for n in names if any(n.startswith(f"{f}.") for f in selected)]
        if inside and len(inside) < len(names):
            raise StageError(f"{key}: {inside[0]} is tied to {sorted(set(names) - set(inside))[0]} "
                             f"(tie_word_embeddings): {why}; leave it out")


def peft_config(settings: LoraSettings, plan: LoraPlan, base: str | None = None):
    """peft's LoraConfig of the plan: target modules as one exact regex of their names."""
    from peft import LoraConfig

    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout, bias="none",
                      target_modules="^(" + "|".join(re.escape(t) for t in plan.targets) + ")$",
                      modules_to_save=plan.train_fully or None, base_model_name_or_path=base)


def apply_lora(model: torch.nn.Module, settings: LoraSettings, always_train: tuple[str, ...] = (),
               what: str = "lora") -> LoraPlan:
    """Adapters injected into `model` in place (module docstring); every other parameter frozen."""
    import warnings

    from peft import get_peft_model

    plan = plan_lora(model, settings, always_train, what)
    with warnings.catch_warnings():  # peft's notes on tied layers: checked above
        warnings.simplefilter("ignore")
        # adapters in the base layer's dtype: peft's default upcasts them to fp32 in a bf16 model,
        # and every adapted layer then copies its input to fp32 (saved for backward): +6 GiB and
        # 0.57x the learner's tokens/s at 0.5B on an H200 (benchmarks/sft_throughput.py --lora). DeepSpeed's bf16
        # mode casts them to bf16 anyway (its optimizer keeps the fp32 masters); fp32 models keep fp32.
        get_peft_model(model, peft_config(settings, plan), autocast_adapter_dtype=False)  # wraps in place
    if hasattr(model, "enable_input_require_grads"):
        # the frozen embeddings' output needs a grad for reentrant gradient checkpointing to
        # reach the adapters
        model.enable_input_require_grads()
    return plan


def has_lora(model: torch.nn.Module) -> bool:
    return any(_LORA_WEIGHTS[0] in n for n, _ in model.named_parameters())


@dataclass(frozen=True)
class MergedTensor:
    """One weight under the base model's name, and what it is computed from (ZeRO-3 gathers
    `parts` before `value()` reads them)."""

    name: str
    parts: tuple[torch.nn.Parameter, ...]  # (W, A, B) of an adapted layer; (p,) otherwise
    scale: float | None = None  # alpha / r of an adapted layer
    changed: bool = True  # trained (an adapted layer, a fully trained module) or not

    def value(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight in `dtype` (default: the parameter's own); an adapted layer's merge is
        computed in fp32 and rounded to nearest once, into `dtype`."""
        if self.scale is None:
            return self.parts[0].data if dtype is None else self.parts[0].data.to(dtype)
        w, a, b = (p.data for p in self.parts)
        delta = (b.float() @ a.float()) * self.scale
        return (w.float() + delta).to(dtype or w.dtype)  # W is [out, in]: only nn.Linear layers get adapters (plan_lora)

    @property
    def exact_dtype(self) -> torch.dtype:
        """The dtype that holds the weight exactly: fp32 for an adapted layer (W + scale * B @ A
        of a bf16 W is not a bf16 number), the parameter's own otherwise."""
        return torch.float32 if self.scale is not None else self.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        p = self.parts[0]
        return tuple(getattr(p, "ds_shape", p.shape))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype


def merged_tensors(model: torch.nn.Module, changed_only: bool = False) -> list[MergedTensor]:
    """The model's weights under the base model's names (module docstring), in parameter order;
    without adapters, its parameters as they are. `changed_only`: the trained ones only."""
    modules = dict(model.named_modules())
    out: list[MergedTensor] = []
    for name, p in model.named_parameters():
        if any(marker in name for marker in _LORA_WEIGHTS) or ".original_module." in name:
            continue  # read with their base layer / replaced by the trained copy
        if name.endswith(".base_layer.weight"):
            layer = modules[name.removesuffix(".base_layer.weight")]
            out.append(MergedTensor(name.replace(".base_layer.", "."),
                                    (p, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight),
                                    layer.scaling[ADAPTER]))
        elif _TRAINED_COPY in name:
            out.append(MergedTensor(name.replace(_TRAINED_COPY, "."), (p,)))
        else:
            out.append(MergedTensor(name.replace(".base_layer.", "."), (p,), changed=p.requires_grad))
    return [t for t in out if t.changed] if changed_only else out


def adapter_key(name: str) -> str | None:
    """peft's key in adapter_model.safetensors of a trained parameter's name, None for the rest."""
    if any(marker in name for marker in _LORA_WEIGHTS):
        return f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}"
    if _TRAINED_COPY in name:
        return f"base_model.model.{name.replace(_TRAINED_COPY, '.')}"
    return None


def lora_state_dict(model: torch.nn.Module, publish: str, zero3: bool, rank: int) -> dict[str, torch.Tensor] | None:
    """What a stage publishes of a LoRA-trained `model`: the merged weights under the base's
    names ("merged") or peft's adapter file ("adapter"). Every rank calls it (ZeRO-3 gathers
    each tensor's parts); rank 0 gets the tensors (on the CPU), the others None."""
    out: dict[str, torch.Tensor] = {}
    tensors = merged_tensors(model) if publish == "merged" else [
        MergedTensor(adapter_key(n), (p,)) for n, p in model.named_parameters() if adapter_key(n) is not None]
    for t in tensors:
        with gathered(list(t.parts), zero3):
            if rank == 0:
                out[t.name] = t.value().detach().to("cpu", copy=True)
    if publish == "merged" and rank == 0:
        persistent = set(model.state_dict())
        out.update({n.replace(".base_layer.", "."): b.detach().cpu() for n, b in model.named_buffers()
                    if n in persistent and ".original_module." not in n and _TRAINED_COPY not in n})
    return out if rank == 0 else None


def write_adapter(state_dict: dict[str, torch.Tensor], settings: LoraSettings, plan: LoraPlan, out: Path,
                  base: str, dtype: torch.dtype | None) -> None:
    """peft's adapter directory: adapter_config.json (naming the base model `base`) and
    adapter_model.safetensors."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    peft_config(settings, plan, base).save_pretrained(str(out))
    save_file({k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
               for k, v in state_dict.items()}, str(out / "adapter_model.safetensors"))


def base_reference(model_url: str, upstream: dict[str, str], storage_options: dict | None) -> dict:
    """The base model an adapter belongs to: its URL and, when it is (inside) an upstream
    artifact, that artifact's URL and stage hash."""
    url = normalise_url(model_url)
    for art in sorted((normalise_url(a) for a in upstream.values()), key=len, reverse=True):
        if url == art or url.startswith(art + "/"):
            manifest = read_manifest(art, storage_options)
            return {"base_model": url, "base_artifact": art, "base_stage": manifest.get("stage"),
                    "base_hash": manifest.get("hash")}
    return {"base_model": url, "base_artifact": None, "base_stage": None, "base_hash": None}


def injected_plan(model: torch.nn.Module) -> LoraPlan:
    """The LoraPlan a model was given (read back from its peft modules)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    modules = list(model.named_modules())
    return LoraPlan([n for n, m in modules if isinstance(m, LoraLayer)],
                    [n for n, m in modules if isinstance(m, ModulesToSaveWrapper)])


def publish_trained_model(job, base_model: str, engine, module: torch.nn.Module, settings: LoraSettings | None,
                          model_dir: Path, zero_stage: int, rank: int, dtype: torch.dtype | None) -> dict | None:
    """The trained model into `job.output_dir` (every rank calls it; ZeRO-3 gathers): without
    LoRA, as hf_io.save_hf_model writes it; with LoRA, what `settings.publish` says: the merged
    model (a HF directory with the input model's tokenizer files), or the adapter naming its
    base (`base_model`, the config's `model` reference, fetched into `model_dir`). Returns, on
    rank 0 of a LoRA stage, the stage summary's `lora` record."""
    out = Path(job.output_dir)
    if settings is None:
        save_hf_model(engine, module, model_dir, out, zero_stage, rank, dtype)
        return None
    state_dict = lora_state_dict(module, settings.publish, zero_stage == 3, rank)
    if rank != 0:
        return None
    plan = injected_plan(module)
    base = base_reference(base_model, job.upstream, job.storage_options)
    if settings.publish == "merged":
        save_hf_model(None, module, model_dir, out, 0, rank, dtype, state_dict=state_dict)
    else:
        write_adapter(state_dict, settings, plan, out, base["base_model"], dtype)
    return {"publish": settings.publish, **base, "rank": settings.rank, "alpha": settings.alpha,
            "target_modules": len(plan.targets), "train_fully": plan.train_fully,
            "trainable_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters()
                                        if p.requires_grad)}


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block `model` computes as its base: every adapter off, every fully trained
    module's original in place of its trained copy (the RL reference pass)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper))]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)

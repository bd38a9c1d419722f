"""`init_model` from an architecture: a causal LM built from a config with seeded random
weights; its vocabulary is the tokenizer's size, eos/pad ids set in its config.

Dense Qwen2 / Llama are transformers' own classes. `ring_moe` (the paper's MoE design,
stages/init_model/ring_moe/) is custom code: its two source files are written next to the
weights and config.json's `auto_map` names them, so later stages load it with
`trust_remote_code: true`, as they would a hub model that brings its own code."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from stages.init_model.config import TinyArchitecture
from stages.init_model.tokenizer import IM_END, PAD


@dataclass(frozen=True)
class ModelKind:
    classes: Callable[[], tuple[type, type]]  # () -> (config class, causal LM class)
    custom_code: tuple[Path, ...] = ()       # source files written next to the weights
    auto_map: dict[str, str] = field(default_factory=dict)  # config.json's pointers into them


def _transformers_classes(config_name: str, model_name: str) -> Callable[[], tuple[type, type]]:
    def classes():
        import transformers  # only the chosen architecture's modules are imported (lazily)

        return getattr(transformers, config_name), getattr(transformers, model_name)
    return classes


def _ring_moe_classes() -> tuple[type, type]:
    from stages.init_model.ring_moe.configuration_ring_moe import RingMoeConfig  # transformers + torch: only for this arch
    from stages.init_model.ring_moe.modeling_ring_moe import RingMoeForCausalLM  # as above

    return RingMoeConfig, RingMoeForCausalLM


_RING_MOE = Path(__file__).parent / "ring_moe"
MODEL_KINDS = {
    "qwen2": ModelKind(_transformers_classes("Qwen2Config", "Qwen2ForCausalLM")),
    "llama": ModelKind(_transformers_classes("LlamaConfig", "LlamaForCausalLM")),
    "ring_moe": ModelKind(
        _ring_moe_classes,
        custom_code=(_RING_MOE / "configuration_ring_moe.py", _RING_MOE / "modeling_ring_moe.py"),
        auto_map={"AutoConfig": "configuration_ring_moe.RingMoeConfig",
                  "AutoModel": "modeling_ring_moe.RingMoeModel",
                  "AutoModelForCausalLM": "modeling_ring_moe.RingMoeForCausalLM",
                  "AutoModelForSequenceClassification": "modeling_ring_moe.RingMoeForSequenceClassification"}),
}


def build_model(arch: TinyArchitecture, tokenizer, seed: int):
    import torch
    from transformers import GenerationConfig

    kind = MODEL_KINDS[arch.model_type]
    config_cls, model_cls = kind.classes()
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads, intermediate_size=arch.intermediate_size,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
        **(arch.moe.model_dump() if arch.moe is not None else {}))
    if kind.auto_map:
        config.auto_map = dict(kind.auto_map)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    return model


def save_model(model, model_type: str, out: Path) -> None:
    """Weights + config, and the custom code files its auto_map names."""
    model.save_pretrained(out)
    for src in MODEL_KINDS[model_type].custom_code:
        shutil.copy2(src, out / src.name)

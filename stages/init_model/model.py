"""`init_model` from an architecture: a causal LM (Qwen2 / Llama) built from a config with
seeded random weights; its vocabulary is the tokenizer's size, eos/pad ids set in its config."""
from __future__ import annotations

from stages.init_model.config import TinyArchitecture
from stages.init_model.tokenizer import IM_END, PAD

MODEL_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}


def build_model(arch: TinyArchitecture, tokenizer, seed: int):
    import torch
    import transformers
    from transformers import GenerationConfig

    # only the chosen architecture's modules are imported (transformers imports lazily)
    config_cls, model_cls = (getattr(transformers, name) for name in MODEL_CLASSES[arch.model_type])
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads, intermediate_size=arch.intermediate_size,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    return model

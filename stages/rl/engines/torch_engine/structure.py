"""Which models the torch engine runs, decided by structure rather than by model type.

The engine drives a model's own modules around its static KV cache (engine.py), so it needs
a Llama-style decoder: `model.embed_tokens / layers / norm / rotary_emb`, and per layer
`input_layernorm`, `self_attn.{q,k,v,o}_proj` (optional q/k norms), `post_attention_layernorm`
and an `mlp` that is a dense gate/up/down MLP or a supported MoE block (moe.py). Layers with
extra norms around the MLP (Gemma 2/3's pre/post feed-forward norms), or attention variants
without these projections (MLA, fused qkv), are refused. The check runs on a meta-device
copy built from the config, before any weight is read, so a refusal is immediate.
"""
from __future__ import annotations

import torch

from .moe import is_dense_mlp, is_moe_block

MODEL_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
# norms some decoders add around the MLP, which the engine's layer loop would skip
UNSUPPORTED_LAYER_PARTS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the engine cannot run `model` (a causal LM), or None."""
    inner = getattr(model, "model", None)
    missing = [f"model.{p}" for p in MODEL_PARTS if not hasattr(inner, p)]
    if missing:
        return f"it has no {', '.join(missing)}"
    for i, layer in enumerate(inner.layers):
        missing = [p for p in LAYER_PARTS if not hasattr(layer, p)]
        missing += [f"self_attn.{p}" for p in ATTENTION_PARTS if not hasattr(getattr(layer, "self_attn", None), p)]
        if missing:
            return f"layer {i} has no {', '.join(missing)}"
        extra = [p for p in UNSUPPORTED_LAYER_PARTS if hasattr(layer, p)]
        if extra:
            return f"layer {i} has {', '.join(extra)}, which this engine does not apply"
        if not (is_dense_mlp(layer.mlp) or is_moe_block(layer.mlp)):
            return (f"layer {i}'s mlp ({type(layer.mlp).__name__}) is neither a dense gate/up/down MLP "
                    "nor a MoE block with fused experts (gate + experts.gate_up_proj / down_proj)")
    return None


def check_structure(config, model_dir: str, trust_remote_code: bool) -> None:
    """ValueError naming the model type and the reason when the engine cannot run it."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as e:  # not a causal LM transformers knows
        reason = str(e).splitlines()[0]
    else:
        reason = unsupported_reason(skeleton)
    if reason:
        raise ValueError(f"torch engine: model_type {config.model_type!r} of {model_dir} is not supported: "
                         f"{reason}; use the vllm engine for other architectures")

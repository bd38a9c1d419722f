"""Hugging Face model I/O of the DeepSpeed-trained stages: the attention implementation to
load with, and the final model written as a HF directory with the input's tokenizer files."""
from __future__ import annotations

import shutil
from pathlib import Path

# files of the input model dir that the trained model replaces
_MODEL_FILES = ("config.json", "generation_config.json", "stage_summary.json", "manifest.json", "_SUCCESS")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def choose_attn(attn_implementation: str, on_gpu: bool) -> str:
    """`attn_implementation` unless "auto": then flash_attention_2 on a GPU with flash_attn
    installed, else sdpa."""
    if attn_implementation != "auto":
        return attn_implementation
    if on_gpu:
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def save_hf_model(engine, model_dir: Path, out: Path, zero_stage: int, rank: int) -> None:
    """The final weights as a HF directory + the input model's tokenizer files. Every rank
    calls it (ZeRO-3 gathers the weights); rank 0 writes."""
    state_dict = engine._zero3_consolidated_16bit_state_dict() if zero_stage == 3 else None
    if rank != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and not p.name.startswith(".") and p.name not in _MODEL_FILES \
                and not p.name.endswith(_WEIGHT_SUFFIXES) and not p.name.endswith(".index.json") \
                and p.suffix != ".lock":
            shutil.copy2(p, out / p.name)
    module = engine.module
    module.config.use_cache = True  # training ran without a cache; inference wants one
    module.save_pretrained(out, state_dict=state_dict)

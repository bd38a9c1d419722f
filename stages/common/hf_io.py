"""Hugging Face model I/O of the training stages: the attention implementation to load with,
loading a causal LM, and the one way a trained model is written (a HF directory with the input
model's tokenizer files)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

# files of the input model dir that the trained model replaces, or that are a stage's
# bookkeeping rather than part of the model
_NOT_COPIED = ("config.json", "generation_config.json", "stage_summary.json", "manifest.json", "_SUCCESS",
               "metrics.jsonl")
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


def load_causal_lm(model_dir: str | Path, dtype, **kwargs):
    """AutoModelForCausalLM from a HF directory in `dtype` (transformers >= 4.56 names the
    keyword `dtype`)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kwargs)


def save_hf_model(engine, module, model_dir: Path, out: Path, zero_stage: int, rank: int) -> None:
    """`module` (the HF model inside the DeepSpeed `engine`) written to `out` as a HF directory,
    with the input model dir's tokenizer files. Every rank calls it (ZeRO-3 gathers the weights
    onto rank 0); rank 0 writes."""
    state_dict = None
    if zero_stage == 3:
        full = engine._zero3_consolidated_16bit_state_dict()
        prefix = next(f"{name}." if name else "" for name, m in engine.module.named_modules() if m is module)
        state_dict = {k.removeprefix(prefix): v for k, v in full.items()} if rank == 0 else None
    if rank != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    for p in sorted(Path(model_dir).iterdir()):
        if p.is_file() and not p.name.startswith(".") and p.name not in _NOT_COPIED \
                and not p.name.endswith(_WEIGHT_SUFFIXES) and not p.name.endswith(".index.json") \
                and p.suffix != ".lock":
            shutil.copy2(p, out / p.name)
    module.config.use_cache = True  # training ran without a cache; inference wants one
    module.save_pretrained(out, state_dict=state_dict)


def eos_token_ids_of(model_dir: str | Path) -> list[int]:
    """EOS ids of an HF model dir: generation_config.json, config.json and the tokenizer's."""
    path = Path(model_dir)
    ids: list[int] = []

    def add(v):
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if x is not None and int(x) not in ids:
                ids.append(int(x))

    for name in ("generation_config.json", "config.json"):
        if (path / name).exists():
            add(json.loads((path / name).read_text()).get("eos_token_id"))
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        try:
            from transformers import AutoTokenizer
            add(AutoTokenizer.from_pretrained(str(path)).eos_token_id)
        except Exception as e:  # a model dir without a loadable tokenizer still decodes
            log.warning("could not load the tokenizer of %s (%s); EOS ids from the configs only: %s", path, e, ids)
    return ids

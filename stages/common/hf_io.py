"""Hugging Face model I/O of the stages and the rollout engines: the attention implementation
to load with, every load of a model directory (config, tokenizer, causal LM, sequence
classifier), and the one way a trained model is written (a HF directory with the input model's
tokenizer and custom code files).

Custom code: a model directory whose config.json (or tokenizer_config.json) has an `auto_map`
brings its own modelling code (`*.py` files next to the weights). Running it is the user's
decision, per stage: `trust_remote_code: true` in the stage's config (recorded with the config
in the manifest). Every load here takes that decision as an argument; a directory with custom
code loaded without it is refused with a StageError naming the files and the setting, before
transformers is asked (which would prompt on a terminal, or fail with a message about hub
repositories)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from pydantic import Field

from stages.common.contract import StageError

log = logging.getLogger(__name__)

TRUST_REMOTE_CODE_HELP = (
    "run the modelling code that a model directory brings (`auto_map` in its config.json, e.g. "
    "init_model's ring_moe, or a hub model with custom code); off by default, recorded in the manifest")


def trust_remote_code_field() -> Any:
    """The `trust_remote_code` field of every stage config that loads a model."""
    return Field(False, description=TRUST_REMOTE_CODE_HELP)


def custom_code(model_dir: str | Path) -> dict[str, str]:
    """The `auto_map` entries of a model directory (config.json and tokenizer_config.json):
    auto class -> `module.Class` of its own code; empty for a model transformers knows."""
    out: dict[str, str] = {}
    for name in ("config.json", "tokenizer_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            try:
                auto_map = json.loads(path.read_text()).get("auto_map") or {}
            except (json.JSONDecodeError, AttributeError):
                continue  # the load that follows reports the broken file
            for k, v in auto_map.items():
                out[k] = v if isinstance(v, str) else next((x for x in v if x), "")
    return out


def check_code_trust(model_dir: str | Path, trust_remote_code: bool, what: str = "model") -> None:
    """StageError when `model_dir` brings custom code and the stage does not trust it."""
    code = custom_code(model_dir)
    if code and not trust_remote_code:
        files = sorted({f"{v.split('.')[0]}.py" for v in code.values() if "." in v})
        raise StageError(
            f"{what} {model_dir} brings its own modelling code ({', '.join(files)}; auto_map in its "
            f"config: {', '.join(sorted(code))}): set `trust_remote_code: true` on this stage to run it")


def require_model_dir(model_dir: str | Path, where: str) -> Path:
    """`model_dir` when it is a Hugging Face model directory (config.json); else a StageError
    that names `where` (the config key and its value) and what the directory is instead: a LoRA
    adapter alone (a stage with `lora.publish: adapter`) loads nowhere a model is expected."""
    path = Path(model_dir)
    if (path / "config.json").is_file():
        return path
    if (path / "adapter_config.json").is_file():
        raise StageError(f"{where} {path} holds a LoRA adapter alone (its stage has lora.publish: adapter), "
                         "not a model: publish it merged (lora.publish: merged, the default)")
    raise StageError(f"{where} {path} is not a Hugging Face model dir (no config.json)")


def load_config(model_dir: str | Path, *, trust_remote_code: bool, what: str = "model"):
    from transformers import AutoConfig

    check_code_trust(model_dir, trust_remote_code, what)
    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)


def load_tokenizer(model_dir: str | Path, *, trust_remote_code: bool, what: str = "model"):
    from transformers import AutoTokenizer

    check_code_trust(model_dir, trust_remote_code, what)
    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)

# files of the input model dir that the trained model replaces, or that are a stage's
# bookkeeping rather than part of the model
_NOT_COPIED = ("config.json", "generation_config.json", "stage_summary.json", "manifest.json", "_SUCCESS",
               "metrics.jsonl")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def load_causal_lm(model_dir: str | Path, dtype, *, trust_remote_code: bool, **kwargs):
    """AutoModelForCausalLM from a HF directory in `dtype` (transformers >= 4.56 names the
    keyword `dtype`)."""
    from transformers import AutoModelForCausalLM

    check_code_trust(model_dir, trust_remote_code)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, trust_remote_code=trust_remote_code,
                                                **kwargs)


def load_sequence_classifier(model_dir: str | Path, dtype, *, trust_remote_code: bool, **kwargs):
    """AutoModelForSequenceClassification (the reward model) from a HF directory in `dtype`."""
    from transformers import AutoModelForSequenceClassification

    check_code_trust(model_dir, trust_remote_code)
    return AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)


def save_hf_model(engine, module, model_dir: Path, out: Path, zero_stage: int, rank: int,
                  dtype: Any = None, state_dict: dict[str, Any] | None = None) -> None:
    """`module` (the HF model inside the DeepSpeed `engine`) written to `out` as a HF directory,
    with the input model dir's tokenizer files and custom code (`*.py`, which config.json's
    `auto_map` names: the written model loads like its input). Every rank calls it (ZeRO-3
    gathers the weights onto rank 0); rank 0 writes. `dtype`: the weights are written in it
    (a bf16-mixed run trains fp32 weights and publishes bf16 ones, like a bf16 run).
    `state_dict`: the weights to write, already full on rank 0 (a LoRA model's merged ones,
    stages/common/lora.py); else the module's own."""
    if state_dict is None and zero_stage == 3:
        full = engine._zero3_consolidated_16bit_state_dict()
        prefix = next(f"{name}." if name else "" for name, m in engine.module.named_modules() if m is module)
        state_dict = {k.removeprefix(prefix): v for k, v in full.items()} if rank == 0 else None
    if rank != 0:
        return
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v
                      for k, v in (state_dict if state_dict is not None else module.state_dict()).items()}
    out.mkdir(parents=True, exist_ok=True)
    for p in sorted(Path(model_dir).iterdir()):
        if p.is_file() and not p.name.startswith(".") and p.name not in _NOT_COPIED \
                and not p.name.endswith(_WEIGHT_SUFFIXES) and not p.name.endswith(".index.json") \
                and p.suffix != ".lock":
            shutil.copy2(p, out / p.name)
    module.config.use_cache = True  # training ran without a cache; inference wants one
    module.save_pretrained(out, state_dict=state_dict)
    if dtype is not None:  # save_pretrained writes the module's own (training) dtype into the config
        config = json.loads((out / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def eos_token_ids_of(model_dir: str | Path, *, trust_remote_code: bool) -> list[int]:
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
        check_code_trust(path, trust_remote_code)
        try:
            add(load_tokenizer(path, trust_remote_code=trust_remote_code).eos_token_id)
        except Exception as e:  # a model dir without a loadable tokenizer still decodes
            log.warning("could not load the tokenizer of %s (%s); EOS ids from the configs only: %s", path, e, ids)
    return ids

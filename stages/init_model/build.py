"""The `init_model` stage: the base model every later stage starts from.

Two sources (exactly one per recipe):
- `pretrained`: an existing Hugging Face model directory (local path, URL or an upstream
  artifact), fetched and checked (config.json, weights, tokenizer present; config and
  tokenizer load) and copied into the output as it is.
- `architecture` + `tokenizer`: a byte-level BPE trained locally on the corpus files
  (every string field of every jsonl row), with the chat special tokens and template, and
  a causal LM (Qwen2 / Llama) built from a config with seeded random weights; the model's
  vocabulary is the tokenizer's size, eos/pad ids are set in its config.

Run: `python -m stages.init_model.build --job job.json` (one process).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

from pipeline.artifacts import ArtifactError
from pipeline.stage_api import StageJob
from pipeline.tracking import StageLogger, info
from stages.init_model.config import InitModelConfig, TinyArchitecture, TokenizerSpec

# The chat format every stage shares (see notes/HELPERS.md).
IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"
THINK, END_THINK = "<think>", "</think>"
# ids 0..4 in that order: pad, im_start, im_end, think, /think
SPECIAL_TOKENS = (PAD, IM_START, IM_END, THINK, END_THINK)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                     r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
MODEL_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}
# bookkeeping of a published artifact, not part of a model directory
ARTIFACT_FILES = {"_SUCCESS", "_FAILED", "manifest.json", "stage_summary.json"}
ARTIFACT_DIRS = {"logs", "checkpoints"}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json",
                   "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


class InitModelError(RuntimeError):
    """A problem with the stage's inputs that the user can fix."""


# -- pretrained ------------------------------------------------------------------------------
def check_hf_model_dir(path: Path, source: str) -> list[str]:
    """Raise InitModelError naming what is missing; return warnings (e.g. no chat template)."""
    if not path.is_dir():
        raise InitModelError(f"pretrained model {source}: {path} is not a directory "
                             "(expected a Hugging Face model directory)")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(any(path.glob(p)) for p in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append("tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if missing:
        found = sorted(p.name for p in path.iterdir())
        raise InitModelError(f"pretrained model {source} ({path}) is missing: {', '.join(missing)}. "
                             f"Files found: {found[:20]}")
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise InitModelError(f"pretrained model {source}: {path / 'config.json'} does not load: {e}") from e
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise InitModelError(f"pretrained model {source}: the tokenizer in {path} does not load: {e}") from e
    warnings = []
    if not getattr(tok, "chat_template", None):
        warnings.append("the tokenizer has no chat template: the sft stage needs one")
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tok) > vocab:
        raise InitModelError(f"pretrained model {source}: tokenizer has {len(tok)} tokens but the "
                             f"model's vocab_size is {vocab}")
    return warnings


def copy_pretrained(src: Path, out: Path) -> int:
    n = 0
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file() or p.suffix == ".lock" \
                or rel.as_posix() in ARTIFACT_FILES or rel.parts[0] in ARTIFACT_DIRS:
            continue  # fetch markers (.verified/), locks, hidden files, artifact bookkeeping
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        try:  # large checkpoints: a hard link when input and output share a filesystem
            os.link(p, out / rel)
        except OSError:
            shutil.copy2(p, out / rel)
        n += 1
    return n


# -- tokenizer -------------------------------------------------------------------------------
def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        if isinstance(value.get("role"), str) and isinstance(value.get("content"), str):
            # a chat message: the role as it appears in the rendered template, then the content
            yield f"{value['role']}\n{value['content']}"
            rest = {k: v for k, v in value.items() if k not in ("role", "content")}
        else:
            rest = value
        for v in rest.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def corpus_files(path: Path, source: str) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if not any(
            part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise InitModelError(f"tokenizer corpus {source}: directory {path} holds no .jsonl file")
        return files
    if path.suffix != ".jsonl":
        raise InitModelError(f"tokenizer corpus {source}: {path.name} is not a .jsonl file")
    return [path]


def iter_corpus(files: list[Path], stats: dict[str, int]) -> Iterator[str]:
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InitModelError(f"tokenizer corpus {f}:{lineno}: not valid JSON ({e.msg})") from e
                stats["rows"] += 1
                for s in _strings(row):
                    stats["chars"] += len(s)
                    yield s


def train_tokenizer(files: list[Path], spec: TokenizerSpec, model_max_length: int):
    """A byte-level BPE over the corpus; returns a transformers fast tokenizer with the
    chat special tokens and template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # The pipeline of transformers' Qwen2Tokenizer (NFC; split off each digit, words,
    # punctuation runs, newlines; then bytes): AutoTokenizer rebuilds a `qwen2` model's
    # tokenizer with exactly this pipeline whatever tokenizer.json says, so training with
    # it keeps the tokenisation identical after loading (checked in `check_reload`).
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    stats = {"rows": 0, "chars": 0}
    tok.train_from_iterator(iter_corpus(files, stats), trainer)
    if stats["chars"] == 0:
        raise InitModelError(f"tokenizer corpus {[str(f) for f in files]} holds no text")
    # the chat markers are special (skipped when decoding with skip_special_tokens);
    # <think> / </think> stay in decoded text but are never split
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, IM_START, IM_END)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=None,
                                 extra_special_tokens=[IM_START], model_max_length=model_max_length)
    hf.chat_template = CHAT_TEMPLATE
    return hf, stats


def check_reload(out: Path, trained, files: list[Path], n_texts: int = 200) -> None:
    """The saved tokenizer, loaded the way every later stage loads it, must tokenise like
    the trained one and have the same size (model vocab = tokenizer size)."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(out)
    texts = [t for _, t in zip(range(n_texts), iter_corpus(files, {"rows": 0, "chars": 0}))]
    texts.append(f"{IM_START}user\nWhat is 12 + 30?{IM_END}\n{IM_START}assistant\n{THINK}\nx\n{END_THINK}\n")
    if len(loaded) != len(trained):
        raise RuntimeError(f"tokenizer saved to {out} loads with {len(loaded)} tokens, trained with "
                           f"{len(trained)} ({type(loaded).__name__}); added: {loaded.get_added_vocab()}")
    for t in texts:
        a = trained(t, add_special_tokens=False)["input_ids"]
        b = loaded(t, add_special_tokens=False)["input_ids"]
        if a != b:
            raise RuntimeError(f"tokenizer saved to {out} loads as {type(loaded).__name__} and "
                               f"tokenises {t[:60]!r} differently from the trained one")


# -- model -----------------------------------------------------------------------------------
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


def main(job: StageJob) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = InitModelConfig.model_validate(job.config)
    log = StageLogger.for_job(job)
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.pretrained is not None:
        src = job.fetch(cfg.pretrained)
        warnings = check_hf_model_dir(src, cfg.pretrained)
        for w in warnings:
            info(f"init_model: warning: {w}")
        n = copy_pretrained(src, out)
        summary: dict[str, Any] = {"source": "pretrained", "pretrained": cfg.pretrained,
                                   "files": n, "warnings": warnings}
        info(f"init_model: copied {n} files of {cfg.pretrained}")
    else:
        assert cfg.architecture is not None and cfg.tokenizer is not None  # the config guarantees it
        files = [f for ref in cfg.tokenizer.corpus for f in corpus_files(job.fetch(ref), ref)]
        tokenizer, stats = train_tokenizer(files, cfg.tokenizer, cfg.architecture.max_position_embeddings)
        info(f"init_model: trained a byte-level BPE of {len(tokenizer)} tokens on "
             f"{stats['rows']} rows ({stats['chars']} chars) of {len(files)} file(s)")
        model = build_model(cfg.architecture, tokenizer, cfg.seed)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out, save_jinja_files=False)  # template inline in tokenizer_config
        check_reload(out, tokenizer, files)
        n_params = sum(p.numel() for p in model.parameters())
        summary = {"source": "architecture", "model_type": cfg.architecture.model_type,
                   "parameters": n_params, "vocab_size": len(tokenizer),
                   "tokenizer_corpus_rows": stats["rows"], "tokenizer_corpus_chars": stats["chars"]}
        info(f"init_model: built {cfg.architecture.model_type} with {n_params:,} parameters, "
             f"vocab {len(tokenizer)}")
        log.params({"model.parameters": n_params, "model.vocab_size": len(tokenizer)})
    (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def cli(argv: list[str] | None = None) -> int:
    job = StageJob.from_argv(argv)
    try:
        main(job)
    except (InitModelError, ArtifactError) as e:
        print(f"init_model failed: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())

"""The chat format every stage shares, and the tokenizer `init_model` trains for it: a
byte-level BPE over every string field of the corpus rows, with the chat special tokens and
template (`<|im_start|>role\ncontent<|im_end|>\n`, a `<think>` section in assistant turns)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

from stages.common.contract import StageError
from stages.common.hf_io import custom_code, load_tokenizer
from stages.common.rows import Row
from stages.init_model.config import TokenizerSpec

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


# () -> the corpus rows, from the start (read with stages.common.rows.input_rows)
Corpus = Callable[[], Iterator[Row]]


def iter_corpus(corpus: Corpus, stats: dict[str, int]) -> Iterator[str]:
    """Every string of every row of the corpus."""
    for row in corpus():
        stats["rows"] += 1
        for s in _strings(row.data):
            stats["chars"] += len(s)
            yield s


def train_tokenizer(corpus: Corpus, spec: TokenizerSpec, model_max_length: int):
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
    tok.train_from_iterator(iter_corpus(corpus, stats), trainer)
    if stats["chars"] == 0:
        raise StageError(f"tokenizer corpus {spec.corpus} holds no text")
    # the chat markers are special (skipped when decoding with skip_special_tokens);
    # <think> / </think> stay in decoded text but are never split
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, IM_START, IM_END)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=None,
                                 extra_special_tokens=[IM_START], model_max_length=model_max_length)
    hf.chat_template = CHAT_TEMPLATE
    return hf, stats


def check_reload(out: Path, trained, corpus: Corpus, n_texts: int = 200) -> None:
    """The saved tokenizer, loaded the way every later stage loads it, must tokenise like
    the trained one and have the same size (model vocab = tokenizer size). A model built
    with custom code (ring_moe) is loaded trusting it: it is this stage's own code."""
    loaded = load_tokenizer(out, trust_remote_code=bool(custom_code(out)))
    texts = [t for _, t in zip(range(n_texts), iter_corpus(corpus, {"rows": 0, "chars": 0}))]
    texts.append(f"{IM_START}user\nWhat is 12 + 30?{IM_END}\n{IM_START}assistant\n{THINK}\nx\n{END_THINK}\n")
    if len(loaded) != len(trained):
        raise RuntimeError(f"tokenizer saved to {out} loads with {len(loaded)} tokens, trained with "
                           f"{len(trained)} ({type(loaded).__name__}); added: {loaded.get_added_vocab()}")
    differs = first_difference(trained, loaded, texts)
    if differs is not None:
        raise RuntimeError(f"tokenizer saved to {out} loads as {type(loaded).__name__} and "
                           f"tokenises {differs[:60]!r} differently from the trained one")


def first_difference(expected, loaded, texts: list[str]) -> str | None:
    """The first text the two tokenizers turn into different ids (None: they agree on all)."""
    for t in texts:
        if expected(t, add_special_tokens=False)["input_ids"] != loaded(t, add_special_tokens=False)["input_ids"]:
            return t
    return None

"""A tiny random causal LM with a WordLevel tokenizer, saved as a Hugging Face directory: what
the engine and data-parallel tests decode with."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300
EOS, PAD = 1, 0


def save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(out)


def build_model(model_type: str = "qwen2", seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
        max_position_embeddings=256, tie_word_embeddings=(model_type == "qwen2"),
        eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None, initializer_range=0.2)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def save_model(model, out: Path) -> Path:
    model.save_pretrained(out)
    save_tokenizer(out)
    return out

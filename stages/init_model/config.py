"""Config of the `init_model` stage: the base model every later stage starts from."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.stage_api import StageConfig, Strict
from stages.registry import StageKind, register


class TinyArchitecture(Strict):
    """A causal LM built from a config (random init), for smoke runs and tests."""

    model_type: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(64, ge=8)
    num_hidden_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(128, ge=8)
    max_position_embeddings: int = Field(2048, ge=16)
    tie_word_embeddings: bool = True

    @model_validator(mode="after")
    def _heads(self) -> "TinyArchitecture":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


class TokenizerSpec(Strict):
    """A byte-level BPE trained locally (nothing is downloaded)."""

    corpus: list[str] = Field(min_length=1, description="jsonl files/refs whose text trains the BPE")
    vocab_size: int = Field(512, ge=300, le=262144, description=(
        "at most this many tokens, specials included (fewer when the corpus has fewer merges); "
        "the model's vocabulary is the trained tokenizer's size"))


class InitModelConfig(StageConfig):
    kind: Literal["init_model"] = "init_model"
    pretrained: str | None = Field(
        None, description="existing HF model dir/URI (cluster recipes); else built from `architecture`")
    architecture: TinyArchitecture | None = None
    tokenizer: TokenizerSpec | None = None
    seed: int = 0

    @model_validator(mode="after")
    def _one_source(self) -> "InitModelConfig":
        if (self.pretrained is None) == (self.architecture is None):
            raise ValueError("give exactly one of `pretrained` or `architecture`")
        if self.architecture is not None and self.tokenizer is None:
            raise ValueError("`architecture` needs `tokenizer` (a locally trained tokenizer)")
        if self.pretrained is not None and self.tokenizer is not None:
            raise ValueError("`tokenizer` is only used with `architecture`; a `pretrained` model "
                             "brings its own tokenizer")
        return self


KIND = register(StageKind(
    name="init_model", config=InitModelConfig, version=1,
    sources=("stages.init_model", "stages.common"), distributed=False,
    description="base model: a pretrained HF dir, or a config-built model + local tokenizer"))

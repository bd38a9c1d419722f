"""Config of the `sft` stage (Long-CoT supervised fine-tuning)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from data_curation.discovery import DataInput
from stages.common.compile_layers import check_zero_stage, compile_layers_field
from stages.common.contract import StageConfig, Strict, auto_setting, cosmetic
from stages.common.hf_io import trust_remote_code_field
from stages.common.kind_metrics import Curve, KindMetrics
from stages.common.step_profile import ProfileSettings
from stages.common.training_settings import supervised_settings
from stages.registry import StageKind, register

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system", "tool": "tool",
                  "function": "tool", "observation": "tool"}


class SFTFields(Strict):
    """Where each format keeps its parts (the common names by default)."""

    messages: str = "messages"
    role: str = "role"
    content: str = "content"
    conversations: str = "conversations"
    sharegpt_from: str = "from"
    sharegpt_value: str = "value"
    sharegpt_roles: dict[str, str] = Field(default_factory=lambda: dict(SHAREGPT_ROLES), description=(
        "ShareGPT `from` value -> chat role (user / assistant / system / tool)"))
    instruction: str = "instruction"
    input: str = "input"
    output: str = "output"
    system: str = Field("system", description="alpaca / prompt-completion rows: an optional system prompt field")
    prompt: str = "prompt"
    completion: str = "completion"


class SFTData(DataInput):
    """SFT rows and their format (stages/sft/data.py turns each into chat `messages`):
    messages: `{messages: [{role, content}, ...]}`; sharegpt: `{conversations: [{from, value}]}`;
    alpaca: `{instruction, input?, output, system?}`; prompt_completion: `{prompt, completion}`
    (each a string, or a list of messages); auto: the first of these whose field the row has."""

    format: Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion"] = "auto"
    fields: SFTFields = SFTFields()


class SFTConfig(StageConfig, supervised_settings(
        lr=2e-4, adam_betas=(0.9, 0.95), weight_decay=0.1, epochs=3, warmup_steps=30, min_lr_ratio=0.0,
        checkpoint_every=50)):
    kind: Literal["sft"] = "sft"
    model: str = Field(description="HF model dir: ${stages.X.output} or a URI")
    trust_remote_code: bool = trust_remote_code_field()
    data: str | SFTData = Field(description="chat samples: a data input (file, dir, saved dataset, hub "
                                "dataset; see SFTData for `split`, `format` and field names) or its path")
    max_seq_len: int = Field(65536, ge=8, description="packed sequence length (paper: 64k)")
    packing: bool = True
    seed: int = 0
    on_bad_row: Literal["fail", "skip"] = Field(
        "fail", description="a malformed row stops the stage (naming file/row/reason), or is "
                            "left out and counted in the summary")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "auto", description="auto = flash_attention_2 on GPU when flash-attn is installed, else flex_attention "
                            "when packing (sdpa without packing, and on CPU); flex_attention (GPU only): a "
                            "document-masked FlexAttention kernel instead of sdpa's dense mask "
                            "(stages/common/packed_attention.py)")
    gradient_checkpointing: Literal["auto"] | bool = auto_setting(
        False, description="recompute each decoder layer's activations in the backward pass: less memory "
                           "for longer packs or larger micro batches, ~1/3 more compute; auto = on only "
                           "when the estimated memory needs it (stages/common/speed_defaults.py)")
    compile_layers: Literal["auto"] | bool = compile_layers_field()
    loss_chunk_tokens: Literal["auto"] | Annotated[int, Field(ge=1)] = auto_setting(8192, description=(
        "tokens per chunk of the LM-head + cross-entropy: the full-vocabulary logits of a micro batch are "
        "never held at once (stages/common/fused_loss.py); auto = one chunk over a micro batch of 4 packs of up "
        "to 4,096 tokens on a GPU whose memory estimate fits them (16,384 tokens, measured on an H200), "
        "else 8,192"))
    async_micro_batches: Literal["auto"] | bool = auto_setting(False, added_later=True, description=(
        "no device sync between a step's micro batches, so the host queues the next one while the GPU "
        "runs the last: DeepSpeed's throughput timer off (it synchronizes the device at every forward and "
        "every engine step), the step's micro batches copied to the GPU at its start (a pageable copy "
        "waits for the GPU), and with flex_attention the document mask built on the GPU from the position "
        "ids (transformers' builder reads on the host whether a row holds several samples). The same "
        "training; auto = on with GPUs (measured with lean_optimizer_step and 4 packs per micro batch: "
        "benchmarks/sft_throughput.py), off on CPU ranks"))
    lean_optimizer_step: Literal["auto"] | bool = auto_setting(False, added_later=True, description=(
        "at ZeRO-0 with bf16-mixed or fp32 (elsewhere DeepSpeed's optimizer wrapper clips, and this does "
        "nothing): clip with torch's foreach clip_grad_norm_ (a few multi-tensor kernels instead of "
        "DeepSpeed's norm and multiply per parameter), skip DeepSpeed's gradient all-reduce on a world of "
        "one rank (a flatten and copy back of every gradient) and read the loss and gradient norm in one "
        "host sync at the step's end instead of two. The same update to float rounding; auto = on with GPUs "
        "where it applies (measured with async_micro_batches and 4 packs per micro batch), "
        "else off"))
    profile: ProfileSettings | None = cosmetic(None, description=(
        "torch.profiler over some optimizer steps of rank 0 (e.g. {start_step: 5, steps: 2}): an operator "
        "table and a chrome trace in the output's logs/profile/, next to stage.log (stages/common/step_profile.py)"))

    @property
    def data_input(self) -> SFTData:
        return self.data if isinstance(self.data, SFTData) else SFTData(path=self.data)

    @model_validator(mode="after")
    def _compile_fits(self) -> "SFTConfig":
        check_zero_stage(self.compile_layers, self.zero_stage)
        return self

    @model_validator(mode="after")
    def _lean_step_fits(self) -> "SFTConfig":
        # `auto` resolves to off where it cannot apply (stages/common/speed_defaults.py); only an explicit
        # `true` is refused
        if self.lean_optimizer_step is True and (self.zero_stage not in ("auto", 0) or self.precision == "bf16"):
            raise ValueError(f"lean_optimizer_step needs zero_stage 0 (or auto) and precision bf16-mixed, fp32 "
                             f"or auto (got zero_stage {self.zero_stage}, precision {self.precision}): at "
                             "ZeRO 1-3 and with DeepSpeed's bf16 mode its optimizer wrapper clips")
        return self

    @model_validator(mode="after")
    def _profile_fits(self) -> "SFTConfig":
        if self.profile is not None and self.max_steps is not None and self.profile.start_step > self.max_steps:
            raise ValueError(f"profile.start_step ({self.profile.start_step}) is after max_steps "
                             f"({self.max_steps}): nothing would be profiled")
        return self


KIND = register(StageKind(
    name="sft", config=SFTConfig, version=2, sources=("stages.sft", "stages.common"), speed="sft",
    distributed=True, description="Long-CoT SFT: packed sequences, DeepSpeed ZeRO, resumable",
    metrics=KindMetrics(headline=(Curve("loss"),),
                        curves=(Curve("loss"), Curve("lr"), Curve("grad_norm"), Curve("tokens_per_s")))))

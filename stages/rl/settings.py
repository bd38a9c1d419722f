"""The settings every RL stage shares (reasoning_rl, general_rl): policy, rollout engine,
scheduler (C3PO++ / sync), loss and its correction, DeepSpeed, checkpoints. A stage's config
subclasses `RLConfig` and adds its prompt data and reward settings. The rollout engine and
verifier settings are declared once (`VerifierSettings` < `SamplingSettings` <
`GenerationSettings`) for every kind that samples a model and scores its responses: the RL
kinds, `eval` and `distill` (stages/rl/verified_sampling.py is the job side).

Defaults are the paper's reasoning-RL numbers (arXiv 2510.18855): AdamW b1 0.9, b2 0.999,
wd 0.01, lr 2e-6, KL coef 0, temperature 1.0, 480 prompts x 8 rollouts, max length 65,536,
IcePop alpha 0.5 / beta 5, MoE router bias held fixed. The paper gives no numbers for
C3PO++'s Omega / Phi / sigma; ours are documented on `C3POSettings`.
No torch import here: validating a recipe stays fast.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from stages.common.compile_layers import check_zero_stage, compile_layers_field
from stages.common.contract import StageConfig, Strict, added_later, auto_setting, cosmetic
from stages.common.hf_io import trust_remote_code_field
from stages.common.kind_metrics import Curve, KindMetrics
from stages.common.training_settings import optimizer_settings, with_defaults

# engines whose reported log-prob of a sampled token is that of the untruncated
# softmax(logits / T), whatever top_p / top_k do to the sampling (each engine class declares
# `reports_untruncated_logprobs`; tests/stages/rl/test_settings.py keeps the two in step)
UNTRUNCATED_LOGPROB_ENGINES = ("torch",)
# engines that record each token's MoE routes (RolloutUpdate.routes): what routing_replay needs
ROUTE_RECORDING_ENGINES = ("torch",)
# engines that take stochastically rounded weights (rollout.sync_rounding: stochastic): each holds
# every tensor the sync sends in its one `dtype` (each engine class declares
# `takes_stochastic_rounding`; tests/stages/rl/test_settings.py keeps the two in step)
STOCHASTIC_ROUNDING_ENGINES = ("torch",)
# engines that stage the weight sync in buckets of their own, of rollout.sync_bucket_mb (option sync_bucket_mb)
BUCKETED_SYNC_ENGINES = ("vllm",)
# engines that can sleep only when built for it, and the option (rollout.options) that builds
# them so: without it a colocated engine fails at its first sleep, after a whole rollout phase
SLEEP_OPTION = {"vllm": "enable_sleep_mode"}
# The learner's micro batch when the recipe does not size it. One rollout per micro batch
# (prompt_max_len + max_len, the old default) made a step of 256 short rollouts ~100
# forward/backward calls, each paying DeepSpeed's fixed cost: 6 of a 7.5 s step on an H100
# for a 24M model (recipes/gpu-small.yaml's RL). 16k padded tokens per GPU is what the GPU
# benchmarks use for a 0.5B policy and verl's default token cap per micro batch; a longer
# rollout still gets a micro batch of its own. A large policy without gradient checkpointing
# may need less (activations grow with the micro batch's tokens): set micro_batch_tokens.
DEFAULT_MICRO_BATCH_TOKENS = 16384

_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


def _device_name(v: str) -> str:
    if not _DEVICE_RE.match(v):
        raise ValueError(f"a device is cpu, auto, cuda or cuda:N, not {v!r}")
    return v


# where a model of the stage runs (rollout engine, reward model); auto = the rank's own device
# (stages.common.distributed.resolve_device)
Device = Annotated[str, AfterValidator(_device_name)]


class RolloutSettings(Strict):
    """Who generates (stages/rl/placement.py): by default every rank runs a rollout engine next
    to its trainer on its own GPU (colocated); with `gpus: k` the last k ranks only generate
    and the others only train (split). Either way the prompts are sharded over the engines
    and C3PO++ keeps one token budget for all of them (stages/rl/scheduler.py)."""

    engine: str = Field("torch", description="rollout engine name (stages.rl.engines.ENGINES)")
    gpus: int | None = Field(None, ge=1, description=(
        "split placement: the last `gpus` ranks (GPUs; CPU ranks on CPU) generate and the others "
        "train; unset: colocated, every rank generates and trains"))
    device: Device = Field("auto", description="cpu | cuda:N | auto (each engine rank's own device: "
                                                 "its GPU, cpu on CPU ranks); cuda:N only with one engine")
    dtype: str = Field("auto", description=(
        "engine weights dtype (auto = bf16 on GPU, fp32 on CPU); fp8: FP8 (e4m3) rollouts, the linear "
        "layers' weights scaled e4m3 and their matmuls in FP8 (torch: a GPU of compute capability 8.9+, "
        "rollout.options fp8_scaling: tensor | row; vllm: its quantization='fp8')"))
    max_batch: int = Field(64, ge=1, description="sequences the engine decodes at once")
    sleep: Literal["none", "cache", "weights"] = Field("cache", description=(
        "colocated: what each engine releases while its rank trains: none, its KV cache (and "
        "CUDA graphs), or the KV cache and its copy of the weights (the weight sync refills it)"))
    sync_bucket_mb: int = Field(512, ge=1, description="weight sync: MiB of parameters gathered and "
                                                       "sent to the engines at once")
    options: dict[str, Any] = Field({}, description="engine-specific keyword options")
    sync_rounding: Literal["nearest", "stochastic"] = added_later("nearest", description=(
        "how the RL weight sync rounds the fp32 trainer's trained weights into a bf16 engine: nearest (the "
        "engine's copy), or stochastic (unbiased, E[bf16] = fp32, so AdamW's sub-bf16 steps reach the engine on "
        "average; seeded from seed and the policy version; stages/rl/stochastic_rounding.py). stochastic needs "
        "precision: fp32 (or a LoRA policy: its merges are computed in fp32) and a bf16 torch engine (rollout.dtype "
        "bf16, or auto on a GPU)"))

    @model_validator(mode="after")
    def _sync_rounding_applies(self) -> "RolloutSettings":
        problem = self.sync_rounding == "stochastic" and _stochastic_rounding_problem(self.engine, self.dtype,
                                                                                     self.device)
        if problem:
            raise ValueError(f"rollout.sync_rounding: stochastic rounds fp32 weights into a bf16 engine, and {problem}; "
                             f"set rollout.sync_rounding: nearest")
        return self

    @model_validator(mode="after")
    def _sleep_is_possible(self) -> "RolloutSettings":
        option = SLEEP_OPTION.get(self.engine)
        if option and self.gpus is None and self.sleep != "none" and not self.options.get(option):
            raise ValueError(
                f"rollout.engine {self.engine!r} is colocated (no rollout.gpus), so it sleeps while its "
                f"rank trains (rollout.sleep: {self.sleep}), and it can only sleep when built with "
                f"rollout.options {{{option}: true}}: set that, or rollout.sleep: none (the engine keeps "
                f"its memory while the trainer steps)")
        return self


# rollout.dtype's names of a weights dtype -> the torch dtype's attribute name: one table for the
# recipe's checks and the engines (torch_engine, vllm_engine); `auto` and `fp8` are each engine's own
WEIGHT_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                      "float16": "float16", "fp16": "float16"}


def _stochastic_rounding_problem(engine: str, dtype: str, device: str) -> str | None:
    """Why a rollout `engine` of `dtype` on `device` cannot take stochastically rounded weights."""
    if engine not in STOCHASTIC_ROUNDING_ENGINES:
        return (f"rollout.engine {engine} does not take it (engines that do: {', '.join(STOCHASTIC_ROUNDING_ENGINES)}): "
                "the sync rounds by the engine's dtype as a whole, and a tensor the engine keeps in another dtype "
                "(vLLM's MoE routers' gates in fp32) would get a rounded value instead of the exact one")
    if dtype == "fp8":
        return "rollout.dtype fp8 is not supported (the engine quantises its own FP8 copies)"
    if dtype == "auto":
        return ("rollout.dtype auto is fp32 on rollout.device cpu: nothing to round (set rollout.dtype: bf16)"
                if device == "cpu" else None)
    weights = WEIGHT_DTYPE_NAMES.get(dtype)
    if weights == "float32":
        return f"rollout.dtype {dtype} holds the trainer's fp32 weights exactly: nothing to round"
    if weights != "bfloat16":
        return f"rollout.dtype {dtype} is not bf16, the only dtype it rounds to"
    return None


class VerifierSettings(Strict):
    """How the verifiers score a stage's responses (`verifiers.verify_batch`)."""

    verifier_workers: int = Field(2, ge=0, description="verifier processes (0 = in the stage)")
    verifier_timeout_s: float = Field(10.0, gt=0)


class SamplingSettings(VerifierSettings):
    """A model sampled through the rollout engine (stages.rl.engines), its responses scored by
    the verifiers. A kind says what a setting means for it through `with_defaults`."""

    trust_remote_code: bool = trust_remote_code_field()
    prompt_max_len: int = Field(1024, ge=1, description="longer prompts are skipped (counted)")
    rollout: RolloutSettings = Field(RolloutSettings(), description="the rollout engine that generates "
                                     "(device auto = cuda when there is one, else cpu)")
    seed: int = 0


class GenerationSettings(SamplingSettings):
    """Sampling with one cap on every response's length (eval, distill; the RL kinds' cap is
    `max_len`, which C3PO++ carries over partitions)."""

    max_new_tokens: int = Field(1024, ge=1, description="response tokens per row (longer ones are cut)")

    @model_validator(mode="after")
    def _no_weight_sync(self) -> "GenerationSettings":
        if self.rollout.sync_rounding != "nearest":
            raise ValueError(f"rollout.sync_rounding: {self.rollout.sync_rounding} rounds the RL weight sync; this "
                             f"stage samples a fixed model (no weight sync): remove it")
        return self


class C3POSettings(Strict):
    """C3PO++ (paper Algorithm 1). Unset sizes derive from the step size:
    pool_capacity (Omega) = prompts_per_step x rollouts_per_prompt (the inference pool holds
    one sync step's rollouts); token_budget (Phi) = Omega x max_len // 4 (a sync step's
    tokens when responses average a quarter of the cap); retention_limit (sigma) = 4, so a
    rollout at the length cap (about max_len / (Phi / Omega) = 4 partitions) still finishes."""

    pool_capacity: int | None = Field(None, ge=1, description="Omega: unfinished rollouts decoded in parallel")
    token_budget: int | None = Field(None, ge=1, description="Phi: finished-rollout tokens per partition")
    retention_limit: int = Field(4, ge=0, description="sigma: partitions an unfinished rollout may live through")
    min_group_size: int = Field(2, ge=1, description="finished members a GRPO group needs after purges")


# the RL kinds sample with an engine per engine rank, on that rank's own device (RolloutSettings
# says so): `rollout` keeps no one-engine description here, as before the settings were shared
_RL_SAMPLING = with_defaults(SamplingSettings, "RLSamplingSettings", prompt_max_len=4096, descriptions={
    "verifier_workers": "verifier processes (0 = in the trainer)", "rollout": None})


class RLConfig(StageConfig, optimizer_settings(lr=2e-6, adam_betas=(0.9, 0.999), weight_decay=0.01,
                                                hashed_at_default=("frozen_param_patterns",)), _RL_SAMPLING):
    """The fields of both RL kinds (see the module docstring); subclasses add `kind` and `data`."""

    model: str = Field(description="HF policy dir: ${stages.X.output} or a URI")
    steps: int = Field(ge=1, description="training steps (one optimizer update each, x updates_per_batch)")
    prompts_per_step: int = Field(480, ge=1, description="sync: prompts per step (C3PO++ sizes from it)")
    rollouts_per_prompt: int = Field(8, ge=1, description="G, the GRPO group size")
    max_len: int = Field(65536, ge=1, description="max response tokens of a rollout")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 = off")
    kl_coef: float = Field(0.0, ge=0, description="KL to the initial policy (k3 estimator)")
    clip_eps: float = Field(0.2, ge=0, description="PPO clip (low side; both sides unless clip_eps_high)")
    clip_eps_high: float | None = Field(None, ge=0)
    correction: Literal["icepop", "tis", "none"] = "icepop"
    icepop_alpha: float = Field(0.5, gt=0)
    icepop_beta: float = Field(5.0, gt=0)
    tis_cap: float = Field(2.0, gt=0, description="truncation of the TIS weight")
    adv_eps: float = Field(1e-6, gt=0, description="std epsilon of the group-normalised advantage")
    scheduler: Literal["c3po", "sync"] = "c3po"
    c3po: C3POSettings = C3POSettings()
    updates_per_batch: int = Field(1, ge=1, description="optimizer steps per training batch (mini-batches)")
    ppo_epochs: int = Field(1, ge=1)
    micro_batch_tokens: int | None = Field(
        None, ge=1, description=f"padded tokens per micro-batch; default the larger of {DEFAULT_MICRO_BATCH_TOKENS} "
                                "and prompt_max_len + max_len (one whole rollout)")
    logit_chunk: int = Field(2048, ge=1, description="response tokens per lm-head chunk")
    gradient_checkpointing: Literal["auto"] | bool = auto_setting(False, description=(
        "recompute the policy's layer activations in the backward pass; auto = on only when the estimated "
        "memory needs it (stages/common/speed_defaults.py)"))
    compile_layers: Literal["auto"] | bool = compile_layers_field()  # the policy's layers; not the reference model's
    precision: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto = bf16 on GPU, fp32 on CPU "
                                                       "(decided before launch: stages/common/speed_defaults.py)")
    routing_replay: bool = added_later(False, description=(
        "MoE policies: the learner routes each token to the experts the rollout engine chose for it "
        "(R3; stages/rl/routing.py), in the theta_old pass and the update; needs rollout.engine torch "
        "and a router type with a replay rule (ring_moe)"))
    grading: Literal["strict", "reference"] | None = added_later(None, description=(
        "how the reward grades rows that name no grading, in every domain (verifiers/grading.py): strict (an "
        "RL reward: an answer stating several candidates, i.e. alternatives, a list or a range where one value "
        "is asked, several answers that disagree, gets 0; IFEval's lookalike characters, padding, keywords "
        "inside words, empty shapes too) or reference (each domain's own verdict, as evaluation uses). "
        "Unset: ifeval_grading's value, strict by default"))
    ifeval_grading: Literal["strict", "reference"] = Field("strict", description=(
        "the earlier name of `grading`, from when only IFEval rows had a grading; read where `grading` is unset, "
        "so recipes that set it keep loading with their stage hashes"))
    checkpoint_every: int = cosmetic(10, ge=1, description="steps between checkpoints")
    sample_rollouts: int = cosmetic(4, ge=0, description="rollouts per step logged as text to MLflow")

    @model_validator(mode="after")
    def _consistent(self) -> "RLConfig":
        if not self.icepop_alpha < self.icepop_beta:
            raise ValueError(f"icepop_alpha ({self.icepop_alpha}) must be below icepop_beta ({self.icepop_beta})")
        if self.pool_capacity < self.rollouts_per_prompt:
            raise ValueError(f"c3po.pool_capacity ({self.pool_capacity}) must hold at least one GRPO group "
                             f"(rollouts_per_prompt = {self.rollouts_per_prompt})")
        if self.c3po.min_group_size > self.rollouts_per_prompt:
            raise ValueError(f"c3po.min_group_size ({self.c3po.min_group_size}) exceeds rollouts_per_prompt "
                             f"({self.rollouts_per_prompt})")
        check_zero_stage(self.compile_layers, self.zero_stage)
        if self.lora is not None and self.lora.dropout > 0:
            raise ValueError(f"lora.dropout ({self.lora.dropout}): the RL kinds train with every dropout off "
                             "(pi_train(theta_old) must be the policy the engines sample); set lora.dropout: 0")
        self._check_truncated_sampling()
        # a LoRA policy's merges are computed in fp32 whatever the precision, so they always have
        # something to round (stages/rl/stochastic_rounding.py)
        if self.rollout.sync_rounding == "stochastic" and self.precision != "fp32" and self.lora is None:
            auto = " (bf16 on a GPU)" if self.precision == "auto" else ""
            raise ValueError(f"rollout.sync_rounding: stochastic rounds an fp32 trainer's weights, and precision is "
                             f"{self.precision}{auto}: bf16 weights reach the engine as they are. Set precision: fp32, "
                             f"train LoRA adapters (their fp32 merge is rounded), or rollout.sync_rounding: nearest")
        if self.routing_replay and self.rollout.engine not in ROUTE_RECORDING_ENGINES:
            raise ValueError(f"routing_replay: true needs an engine that records the experts it routed to "
                             f"({', '.join(ROUTE_RECORDING_ENGINES)}); rollout.engine is {self.rollout.engine!r}")
        return self

    @model_validator(mode="after")
    def _one_grading(self) -> "RLConfig":
        if self.grading is not None and "ifeval_grading" in self.model_fields_set and self.grading != self.ifeval_grading:
            raise ValueError(f"grading ({self.grading}) and ifeval_grading ({self.ifeval_grading}), its earlier "
                             "name, disagree: set only grading")
        return self

    def _check_truncated_sampling(self) -> None:
        """IcePop and TIS compare pi_infer with the trainer's pi_train, the untruncated
        softmax(logits / T): an engine that reports log-probs after top-p / top-k truncation
        (renormalised) would feed them another distribution's probabilities."""
        truncated = [f"top_p={self.top_p}"] * (self.top_p < 1) + [f"top_k={self.top_k}"] * (self.top_k > 0)
        if not truncated or self.correction == "none" or self.rollout.engine in UNTRUNCATED_LOGPROB_ENGINES:
            return
        raise ValueError(
            f"{' and '.join(truncated)} truncate the sampling distribution, and correction={self.correction!r} "
            f"needs the engine's log-probs of the untruncated distribution, but rollout.engine "
            f"{self.rollout.engine!r} reports them after truncation. Set top_p: 1 and top_k: 0, or "
            f"correction: none, or use an engine that reports untruncated log-probs "
            f"({', '.join(UNTRUNCATED_LOGPROB_ENGINES)})")

    # derived sizes ---------------------------------------------------------------------------
    @property
    def pool_capacity(self) -> int:
        return self.c3po.pool_capacity or self.prompts_per_step * self.rollouts_per_prompt

    @property
    def token_budget(self) -> int:
        return self.c3po.token_budget or max(1, self.pool_capacity * self.max_len // 4)

    @property
    def micro_tokens(self) -> int:
        return self.micro_batch_tokens or max(DEFAULT_MICRO_BATCH_TOKENS, self.prompt_max_len + self.max_len)


def reward_grading(cfg: Any) -> str:
    """The grading an RL reward gives rows that name none: `grading`, else `ifeval_grading`."""
    return getattr(cfg, "grading", None) or cfg.ifeval_grading


def rl_metrics(*extra_headline: Curve) -> KindMetrics:
    """The headline and curves every RL kind shows (its own headline numbers added)."""
    reward = Curve("reward/mean", ("reward_mean",))
    return KindMetrics(
        headline=(reward, *extra_headline),
        curves=(reward,
                Curve("icepop/masked_fraction", ("masked_fraction",)),
                Curve("icepop/mismatch_kl", ("mismatch_kl",)),
                Curve("icepop/abs_log_k_p99", ("abs_log_k_p99",)),
                Curve("loss/pg", ("pg_loss",)),
                Curve("loss/grad_norm", ("grad_norm",)),
                Curve("rollout/response_len_mean", ("response_len_mean",)),
                Curve("perf/step_seconds", ("step_seconds",))))

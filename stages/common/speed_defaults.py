"""What `auto` means for the training stages' speed settings: the fastest configuration measured
(benchmarks/sft_throughput.py) for the hardware, the model size, the sequence length and the
number of GPUs. Decided once, before launch, by the pipeline (pipeline/speed.py
gathers the facts, `resolve_speed` decides, the job gets the values in its config and the
manifest records them as `resolved_speed`); a setting the user wrote is never changed.

The settings: `zero_stage`, `precision`, `compile_layers`, `attn_implementation`,
`micro_batch_size` (sft packs per micro batch; `grad_accum` is re-split so that the packs per
optimizer step stay what the config says), `gradient_checkpointing` (on only when the
estimated memory needs it), and sft's `loss_chunk_tokens`, `async_micro_batches` and
`lean_optimizer_step` (measured together: a faster step). A kind resolves the ones its config has (its
`StageKind.speed` names the profile: sft, reward_model, rl).

Every rule below is a row of `RULES`: a name, the setting, when it applies, the value, and
`because`: the measurement that chose it (shape, card, tokens/s; or, where none exists, that it
keeps what the stage did before). The first rule of a setting that applies wins.

Stage hashes: a setting left at `auto` hashes as the value it had before `auto` existed
(`contract.auto_setting`), so recipes keep their hashes; the resolved values are not hashed,
like `resources`: moving a stage to other hardware reuses its artifact (see README, "What reruns
a stage"). No torch here: the pipeline imports this module.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from stages.common.contract import AUTO_LEGACY

GIB = 1024 ** 3
MEMORY_BUDGET = 0.85  # of a GPU's memory: the CUDA context, NCCL buffers and fragmentation get the rest
# Activation bytes per token, decoder layer and hidden unit, fitted to the sft stage's measured peaks
# (Qwen2-1.5B shape, bf16-mixed, chunked loss, one head chunk per micro batch) after the 22.9 GiB of
# weights, gradients and AdamW state and the 2.9 GiB of autocast's bf16 weight copies
# (AUTOCAST_COPY_BYTES): compiled layers 35.9 GiB at 4,096 tokens per micro batch, 48.1 at 8,192,
# 70.3 at 16,384, 108.9 at 32,768: 62-68, the largest taken; eager layers 40.5 GiB at 4,096: ~90.
ACT_BYTES_COMPILED, ACT_BYTES_EAGER = 68, 90
AUTOCAST_COPY_BYTES = 2  # per parameter under bf16-mixed: each weight's bf16 copy, alive through forward and backward
# With gradient checkpointing a layer keeps only its input (fp32 under autocast) and one layer's
# activations are alive during its recomputation: an estimate, no checkpointed stage peak is measured.
ACT_BYTES_CHECKPOINTED = 4
PACK_TOKENS_MEASURED = 4096  # the longest packs the several-packs rules were measured with (1.5B@4096)
LOSS_CHUNK_BEFORE = 8192  # sft's loss_chunk_tokens before `auto` existed


@dataclass(frozen=True)
class HardwareFacts:
    """The machine a stage's ranks run on (stages/common/hardware.py detects it there)."""

    device: str  # "cuda", "cpu", or "unknown": GPUs the pipeline cannot see before launch
    gpu_name: str | None = None
    capability: tuple[int, int] | None = None
    memory_gib: float | None = None  # of one GPU
    gpus: int = 0  # visible on the node
    cpus: int = 1
    flash_attn: bool = False  # the flash-attn package imports there
    note: str = ""  # how the facts were learned, or why they are unknown

    def describe(self) -> str:
        if self.device == "cuda":
            return f"{self.gpu_name} ({self.memory_gib:.0f} GiB, sm{''.join(map(str, self.capability or ()))})"
        return "CPU ranks" if self.device == "cpu" else f"GPU unknown: {self.note}"


@dataclass(frozen=True)
class ModelFacts:
    """The model's size, from its config.json (`from_config`)."""

    params: int
    hidden: int
    layers: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelFacts":
        c = config.get("text_config") or config
        h, n_layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
        heads = c.get("num_attention_heads") or 1
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or h // heads
        inter = c.get("intermediate_size") or 4 * h
        attention = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h
        experts = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts") or 0
        if experts:  # routed experts + the shared expert + the router
            mlp = 3 * h * (c.get("moe_intermediate_size") or inter) * experts + h * experts \
                + 3 * h * (c.get("shared_expert_intermediate_size") or 0)
        else:
            mlp = 3 * h * inter
        embeddings = vocab * h * (1 if c.get("tie_word_embeddings", config.get("tie_word_embeddings")) else 2)
        return cls(n_layers * (attention + mlp + 2 * h) + embeddings, h, n_layers, vocab)


@dataclass
class Situation:
    """What the rules look at: the kind's profile, its config (settings decided so far filled in),
    the hardware, the model (None: not built yet, memory not checked) and the training ranks."""

    profile: str
    config: dict[str, Any]
    hw: HardwareFacts
    model: ModelFacts | None
    world: int

    @property
    def gpu(self) -> bool:
        return self.hw.device == "cuda"

    def is_set(self, setting: str, value: Any) -> bool:
        return self.config.get(setting) == value

    def micro_tokens(self, micro_batch: int | None = None) -> int:
        c = self.config
        if self.profile == "rl":  # RLConfig.micro_tokens (stages/rl/settings.py, which common/ must not import)
            return c.get("micro_batch_tokens") or max(16384, c.get("prompt_max_len", 4096) + c.get("max_len", 65536))
        mb = micro_batch or (c["micro_batch_size"] if isinstance(c.get("micro_batch_size"), int) else 1)
        return mb * c.get("max_seq_len", 4096) * (2 if self.profile == "reward_model" else 1)  # a pair: 2 sides

    def peak_gib(self, zero: int, precision: str, micro_batch: int | None = None, checkpointed: bool = False,
                 compiled: bool | None = None) -> float:
        """Estimated peak memory of one training rank (weights, gradients, AdamW state by ZeRO stage,
        activations at the micro batch's tokens, and a colocated rollout engine's bf16 weights)."""
        m = self.model
        assert m is not None
        w, g, opt = (2, 2, 12) if precision == "bf16" else (4, 4, 8)  # bf16: fp32 masters in the optimizer
        n = max(self.world, 1)
        per_param = {0: w + g + opt, 1: w + g + opt / n, 2: w + (g + opt) / n, 3: (w + g + opt) / n}[zero]
        if precision == "bf16-mixed":
            per_param += AUTOCAST_COPY_BYTES
        if self.profile == "rl" and not (self.config.get("rollout") or {}).get("gpus"):
            per_param += 2  # the colocated engine's copy of the weights
        if self.profile == "rl" and self.config.get("kl_coef") and not self.config.get("lora"):
            per_param += 2  # the KL reference model
        compiled = self.config.get("compile_layers") is True if compiled is None else compiled
        per_token_layer = (ACT_BYTES_CHECKPOINTED + (ACT_BYTES_COMPILED if compiled else ACT_BYTES_EAGER) / m.layers
                           if checkpointed else ACT_BYTES_COMPILED if compiled else ACT_BYTES_EAGER)
        activations = self.micro_tokens(micro_batch) * m.layers * m.hidden * per_token_layer
        return (m.params * per_param + activations) / GIB

    def fits(self, zero: int, precision: str, **kw: Any) -> bool:
        """Whether the estimate fits the GPU's budget; True when the model is not known yet."""
        if self.model is None or self.hw.memory_gib is None:
            return True
        return self.peak_gib(zero, precision, **kw) <= MEMORY_BUDGET * self.hw.memory_gib


@dataclass(frozen=True)
class Rule:
    name: str
    setting: str
    when: Callable[[Situation], bool]
    value: Callable[[Situation], Any]
    because: str
    profiles: tuple[str, ...] = ("sft", "reward_model", "rl")


def _planned_precision(s: Situation, zero: int) -> str:
    p = s.config.get("precision", "auto")
    return p if p != "auto" else ("bf16-mixed" if zero == 0 and s.profile != "rl" else "bf16")


def _zero_candidates(s: Situation) -> list[int]:
    """ZeRO stages in the order of measured speed for the precision (1.5B@4096 on an H100: the
    numbers of the rule `fastest-zero-that-fits`)."""
    mixed = s.config.get("precision") in ("auto", "bf16-mixed", "fp32") and s.profile != "rl"
    order = [0, 1, 2, 3] if mixed else [1, 0, 2, 3]
    return [z for z in order if not (z == 3 and s.config.get("compile_layers") is True)]


def _fastest_zero(s: Situation) -> int:
    """The first ZeRO stage (measured order) that fits without gradient checkpointing, else with
    it; where none fits, the one with the smallest estimate (the fastest among equals)."""
    order = _zero_candidates(s)

    def estimate(zero: int, checkpointed: bool) -> dict[str, Any]:
        return dict(zero=zero, precision=_planned_precision(s, zero), micro_batch=1, checkpointed=checkpointed,
                    compiled=zero != 3 and s.config.get("compile_layers") is not False)

    for checkpointed in (False, True):
        for zero in order:
            if s.fits(**estimate(zero, checkpointed)):
                return zero
    return min(order, key=lambda zero: s.peak_gib(**estimate(zero, True)))


def _cpu(s: Situation) -> bool:
    return s.hw.device == "cpu"


def _unknown(s: Situation) -> bool:
    return s.hw.device == "unknown"


def _packs_fit(s: Situation, packs: int) -> bool:
    """`packs` packs per micro batch are no longer than measured and fit the memory estimate."""
    c = s.config
    return (s.micro_tokens(packs) <= packs * PACK_TOKENS_MEASURED
            and s.fits(c["zero_stage"], c["precision"], micro_batch=packs,
                       checkpointed=c.get("gradient_checkpointing") is True))


def _packs_split(s: Situation, packs: int) -> bool:
    """sft can take `packs` packs per micro batch: packed rows, the step's packs (grad_accum) a
    multiple of them, and they fit."""
    c = s.config
    return (s.gpu and s.profile == "sft" and c.get("packing", True) and c.get("grad_accum", 1) % packs == 0
            and _packs_fit(s, packs))


def _one_head_chunk(s: Situation) -> bool:
    """The fastest measured micro batches (FOUR_PACK_STEP, EIGHT_PACK_STEP): 4 or 8 packs that fit
    without gradient checkpointing (the estimate's activation bytes hold the head's chunk only
    without it)."""
    mb = s.config.get("micro_batch_size")
    return s.gpu and mb in (4, 8) and s.is_set("gradient_checkpointing", False) and _packs_fit(s, mb)


def _lean_step_applies(s: Situation) -> bool:
    """Where sft's lean_optimizer_step works: ZeRO-0 without DeepSpeed's bf16 optimizer wrapper."""
    return s.gpu and s.is_set("zero_stage", 0) and s.config.get("precision") in ("bf16-mixed", "fp32")


def _needs_checkpointing(s: Situation) -> bool:
    c = s.config
    return s.model is not None and not s.fits(c["zero_stage"], _planned_precision(s, c["zero_stage"]),
                                              checkpointed=False)


KEEP_CPU = "CPU ranks: what the stage ran before `auto` existed (the tiny recipe is unchanged)"
KEEP_UNKNOWN = ("the pipeline cannot see this stage's GPUs before launch (launcher ray, several nodes, or "
                "none visible here): the value before `auto` existed")
FOUR_PACK_STEP = ("1.5B@4096, 8 packs a step, one H200: async_micro_batches + lean_optimizer_step + 4 packs per "
                  "micro batch with loss_chunk_tokens 16,384 ran 51,758 tok/s (48.6% MFU, peak 70.3 GiB) vs the "
                  "earlier defaults (2 packs) 47,096 (44.3%, 48.1 GiB), the same training (losses within 2.5e-5 over "
                  "11 steps); the three are measured only together")
EIGHT_PACK_STEP = ("1.5B@4096, 8 packs a step, one H200, two machines: 8 packs per micro batch (one micro batch a "
                   "step, loss_chunk_tokens 32,768) ran 55,099 tok/s (51.8% MFU, peak 108.9 GiB) vs 4 packs' 53,510 "
                   "(50.3%, 70.3 GiB) on one, 55,424 and 55,756 (52.1-52.4%) vs 53,787 (50.5%) on the other; the "
                   "same training (losses within 7.4e-5 relative over 13 steps)")
RULES: tuple[Rule, ...] = (
    # -- zero_stage ---------------------------------------------------------------------------
    Rule("cpu-zero2", "zero_stage", _cpu, lambda s: 2, KEEP_CPU),
    Rule("unknown-zero2", "zero_stage", _unknown, lambda s: 2, KEEP_UNKNOWN),
    Rule("fastest-zero-that-fits", "zero_stage", lambda s: s.gpu, _fastest_zero,
         "1.5B@4096 on one H100: ZeRO-0 + bf16-mixed 20,633 tok/s vs ZeRO-1 + bf16-mixed 15,637; with "
         "DeepSpeed's bf16 optimizer ZeRO-1 14,638 > ZeRO-0 13,206 > ZeRO-2 12,051; the first stage of that "
         "order whose estimated memory fits, ZeRO-2/3 partitioning state over ranks (ZeRO-3 scaled 94.3% on "
         "4 H200s). Several GPUs at ZeRO-0/1: not measured yet"),
    # -- precision ----------------------------------------------------------------------------
    Rule("cpu-fp32", "precision", _cpu, lambda s: "fp32", KEEP_CPU + " (bf16 needs a GPU)"),
    Rule("unknown-auto", "precision", _unknown, lambda s: "auto",
         "GPUs unknown before launch: the job decides on its device, as before (bf16 on GPU, fp32 on CPU)"),
    Rule("zero0-bf16-mixed", "precision", lambda s: s.gpu and s.is_set("zero_stage", 0), lambda s: "bf16-mixed",
         "1.5B@4096, ZeRO-0, one H100: bf16-mixed 20,633 tok/s vs bf16 (DeepSpeed's optimizer wrapper, "
         "ZeRO-1) 17,732; compiled: 26,936 vs 20,378", ("sft", "reward_model")),
    Rule("gpu-bf16", "precision", lambda s: s.gpu, lambda s: "bf16",
         "under ZeRO-1 bf16-mixed is slower than bf16: 15,637 vs 17,732 tok/s (1.5B@4096, one H100); the RL "
         "kinds have no bf16-mixed"),
    # -- compile_layers -----------------------------------------------------------------------
    Rule("cpu-eager", "compile_layers", _cpu, lambda s: False,
         KEEP_CPU + " (inductor's C++ build of CPU graphs takes minutes)"),
    Rule("unknown-eager", "compile_layers", _unknown, lambda s: False, KEEP_UNKNOWN),
    Rule("zero3-eager", "compile_layers", lambda s: s.is_set("zero_stage", 3), lambda s: False,
         "compiled layers do not run ZeRO-3's parameter hooks (compile_layers.check_zero_stage)"),
    Rule("gpu-compiled", "compile_layers", lambda s: s.gpu, lambda s: True,
         "sft 1.5B@4096 bf16-mixed on one H100: 19,017 -> 26,936 tok/s compiled (1.42x); RL learner "
         "0.5B 42,659 -> 52,141 (1.22x), 1.5B 21,529 -> 27,340 (1.27x)"),
    # -- attn_implementation (sft, reward_model) ------------------------------------------------
    Rule("cpu-sdpa", "attn_implementation", _cpu, lambda s: "sdpa", KEEP_CPU),
    Rule("unknown-auto", "attn_implementation", _unknown, lambda s: "auto",
         "GPUs unknown before launch: the job decides on its device (packed_attention.choose_attention)"),
    Rule("flash-attn-installed", "attn_implementation", lambda s: s.gpu and s.hw.flash_attn,
         lambda s: "flash_attention_2",
         "not measured here (no GPU session had flash-attn): choose_attention's order, kept"),
    Rule("packed-flex", "attn_implementation", lambda s: s.gpu and s.config.get("packing", False),
         lambda s: "flex_attention",
         "sft 1.5B@4096 on an H100: FlexAttention's document mask 13,376 tok/s vs sdpa's dense mask 8,662 "
         "(1.55x)", ("sft",)),
    Rule("gpu-sdpa", "attn_implementation", lambda s: s.gpu, lambda s: "sdpa",
         "unpacked rows need no document mask: sdpa (choose_attention's choice before)"),
    # -- micro_batch_size (sft packs, reward_model pairs) ------------------------------------------
    Rule("eight-packs", "micro_batch_size", lambda s: _packs_split(s, 8), lambda s: 8,
         EIGHT_PACK_STEP + "; only where the estimate fits 8 packs of <= 4,096 tokens (an H200 at 1.5B; not an "
         "80 GiB H100); grad_accum divided by 8: the same packs per step"),
    Rule("four-packs", "micro_batch_size", lambda s: _packs_split(s, 4), lambda s: 4,
         FOUR_PACK_STEP + "; only where the estimate fits 4 packs of <= 4,096 tokens (on an 80 GiB H100 they run "
         "out of memory); grad_accum quartered: the same packs per step"),
    Rule("two-packs", "micro_batch_size", lambda s: _packs_split(s, 2), lambda s: 2,
         "1.5B@4096, 8 packs a step, one H100: 2 packs per micro batch 39,808 tok/s vs 1 pack 31,108; with the "
         "stage's other defaults 46,884-47,096 tok/s (44.1-44.3% MFU) on an H200; where 4 packs do not fit "
         "(out of memory on an H100); grad_accum halves: the same packs per step"),
    Rule("one-item", "micro_batch_size", lambda s: True, lambda s: 1,
         "the value before `auto` existed (larger micro batches not measured for this case)"),
    # -- gradient_checkpointing -------------------------------------------------------------------
    Rule("memory-needs-checkpointing", "gradient_checkpointing", lambda s: s.gpu and _needs_checkpointing(s),
         lambda s: True,
         "the estimated peak exceeds the GPU's budget without it (4 packs of 4,096 at 1.5B run out of memory "
         "on an H100); recomputation costs ~1/3 more compute, so only then"),
    Rule("no-checkpointing", "gradient_checkpointing", lambda s: True, lambda s: False,
         "fits without recomputation (or CPU / unknown GPUs: the value before `auto` existed)"),
    # -- sft's loss_chunk_tokens, async_micro_batches, lean_optimizer_step (measured together) -----
    Rule("one-head-chunk", "loss_chunk_tokens", _one_head_chunk,
         lambda s: max(LOSS_CHUNK_BEFORE, s.micro_tokens()),
         FOUR_PACK_STEP + "; " + EIGHT_PACK_STEP + ": the loss over the micro batch in one head chunk (no recomputed "
         "chunk)", ("sft",)),
    Rule("chunk-8192", "loss_chunk_tokens", lambda s: True, lambda s: LOSS_CHUNK_BEFORE,
         "the value before `auto` existed: at 2 packs of 4,096 tokens one chunk already",
         ("sft",)),
    Rule("cpu-sync", "async_micro_batches", _cpu, lambda s: False, KEEP_CPU, ("sft",)),
    Rule("unknown-sync", "async_micro_batches", _unknown, lambda s: False, KEEP_UNKNOWN, ("sft",)),
    Rule("gpu-async", "async_micro_batches", lambda s: s.gpu, lambda s: True, FOUR_PACK_STEP, ("sft",)),
    Rule("lean-step", "lean_optimizer_step", _lean_step_applies, lambda s: True, FOUR_PACK_STEP, ("sft",)),
    Rule("deepspeed-step", "lean_optimizer_step", lambda s: True, lambda s: False,
         "CPU ranks, unknown GPUs, ZeRO-1 to ZeRO-3 or DeepSpeed's bf16 mode (its optimizer wrapper clips: "
         "the lean step does not apply there): the value before `auto` existed", ("sft",)),
)
# zero_stage first (precision and memory depend on it), the micro batch before the memory check, the
# loss chunk after both (one chunk only at 4 packs without checkpointing), lean after zero and precision
ORDER = ("zero_stage", "precision", "compile_layers", "attn_implementation", "micro_batch_size",
         "gradient_checkpointing", "loss_chunk_tokens", "async_micro_batches", "lean_optimizer_step")


@dataclass(frozen=True)
class Choice:
    setting: str
    value: Any
    rule: str
    because: str


@dataclass
class Resolution:
    """The decided values of a stage's `auto` speed settings, and why."""

    choices: list[Choice]
    updates: dict[str, Any]  # config keys -> values (grad_accum too when the micro batch was re-split)
    hw: HardwareFacts
    model: ModelFacts | None
    world: int
    notes: list[str] = field(default_factory=list)

    def apply(self, config: dict[str, Any]) -> dict[str, Any]:
        return {**config, **self.updates}

    def record(self) -> dict[str, Any]:
        """What the manifest keeps (`resolved_speed`)."""
        return {"settings": {c.setting: {"value": c.value, "rule": c.rule, "because": c.because}
                             for c in self.choices},
                "config_updates": dict(self.updates), "hardware": asdict(self.hw),
                "model": asdict(self.model) if self.model else None, "world_size": self.world, "notes": self.notes}

    def summary(self) -> str:
        """One line: `precision auto -> bf16-mixed, ...`."""
        parts = [f"{c.setting} auto -> {_show(c.value)}" if c.value != "auto"
                 else f"{c.setting} auto (the job decides on its device)" for c in self.choices]
        if "grad_accum" in self.updates:
            parts.append(f"grad_accum -> {self.updates['grad_accum']}")
        return ", ".join(parts)


def _show(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def resolve_speed(profile: str, config: dict[str, Any], hw: HardwareFacts, model: ModelFacts | None,
                  world: int) -> Resolution:
    """The `auto` speed settings of a stage of `profile` (sft / reward_model / rl) with `config`
    (as data), decided by the first applying rule of each; explicit settings stay as written.
    `world`: the ranks that train."""
    s = Situation(profile, dict(config), hw, model, world)
    choices: list[Choice] = []
    for setting in ORDER:
        if s.config.get(setting) != "auto":
            continue
        rule = next(r for r in RULES if r.setting == setting and profile in r.profiles and r.when(s))
        value = rule.value(s)
        s.config[setting] = value
        choices.append(Choice(setting, value, rule.name, rule.because))
    updates = {c.setting: c.value for c in choices}
    if updates.get("micro_batch_size", 1) > 1:  # the packs per optimizer step stay as configured
        updates["grad_accum"] = config.get("grad_accum", 1) // updates["micro_batch_size"]
    notes = []
    if model is None and hw.device == "cuda":
        notes.append("model size unknown (no readable config.json yet, e.g. its stage has not run): memory "
                     "not checked; `plan` decides again once it exists, as the launch does")
    elif model is not None and hw.device == "cuda":
        c = s.config
        peak = s.peak_gib(c.get("zero_stage", 2), _planned_precision(s, c.get("zero_stage", 2)),
                          checkpointed=c.get("gradient_checkpointing") is True)
        notes.append(f"estimated peak {peak:.1f} GiB of {hw.memory_gib:.0f} GiB per GPU")
        if peak > MEMORY_BUDGET * hw.memory_gib:
            notes.append("over the GPU's budget even so: expect out of memory (shorter sequences, fewer "
                         "tokens per micro batch or more GPUs)")
    return Resolution(choices, updates, hw, model, world, notes)


def settle_auto(cfg: Any) -> Any:
    """`cfg` (a training config model) with every setting still at `auto` that a job cannot take
    as it is (a stage started without the pipeline's resolution: a test, a direct `run_job`) at
    the value it had before `auto` existed; precision and attention keep `auto`, which the job
    decides on its device."""
    updates = {}
    for name, f in type(cfg).model_fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        if AUTO_LEGACY in extra and getattr(cfg, name) == "auto":
            updates[name] = extra[AUTO_LEGACY]
    return cfg.model_copy(update=updates) if updates else cfg

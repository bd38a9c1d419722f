"""What every training stage (sft, reward_model, reasoning_rl, general_rl) does first, once:
join the process group, seed, fetch the input model and load its tokenizer; and how the
supervised stages put their model under DeepSpeed with their optimizer settings."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from stages.common.chat import require_chat_template
from stages.common.contract import StageError, StageJob
from stages.common.deepspeed_setup import ds_config, hf_zero3_context, initialize, lr_factor, param_groups
from stages.common.distributed import Ranks, init_distributed, seed_all
from stages.common.hf_io import load_tokenizer, require_model_dir
from stages.common.packed_attention import choose_attention
from stages.common.precision import resolve_precision
from stages.common.stage_log import StageLogger
from stages.common.training_settings import SupervisedSettings


class TrainingConfig(Protocol):
    """What `start_training_job` reads of a training kind's config (every training kind has these)."""

    model: str
    trust_remote_code: bool
    precision: str
    seed: int


@dataclass(frozen=True)
class TrainingJob:
    ranks: Ranks
    precision: str    # resolved: "bf16", "bf16-mixed" or "fp32" (precision.PRECISION_HELP)
    log: StageLogger
    model_dir: Path   # the input model, a local Hugging Face directory
    tokenizer: Any    # its tokenizer (it has a chat template)
    pad_id: int | None  # the pad token, else eos; None when it has neither
    trust_remote_code: bool  # the stage runs the model dir's own code (stages/common/hf_io.py)

    @property
    def deepspeed_bf16(self) -> bool:
        """DeepSpeed's bf16 mode (bf16 weights; its optimizer wrapper keeps the fp32 masters)."""
        return self.precision == "bf16"

    @property
    def published_dtype(self) -> torch.dtype | None:
        """The dtype the stage's model is written in: bf16 for both bf16 modes, else as trained."""
        return torch.bfloat16 if self.precision in ("bf16", "bf16-mixed") else None


def start_training_job(job: StageJob, cfg: TrainingConfig, split_last: int = 0) -> TrainingJob:
    """Join the process group, seed, fetch the input model, load its tokenizer. A process started
    without a launcher is a world of one. `split_last`: the ranks' role worlds
    (stages/common/distributed.py)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if cfg.precision == "bf16" and not torch.cuda.is_available():
        # DeepSpeed's bf16 optimizer wrapper is GPU-only; bf16-mixed (torch.autocast) runs on CPU too
        raise StageError("precision bf16 needs a GPU; use auto, bf16-mixed or fp32 on CPU")
    ranks = init_distributed(world_of_one_without_launcher=True, split_last=split_last)
    seed_all(cfg.seed)
    model_dir = require_model_dir(job.fetch(cfg.model), f"model = {cfg.model}:")
    tokenizer = load_tokenizer(model_dir, trust_remote_code=cfg.trust_remote_code, what=f"model {cfg.model}:")
    require_chat_template(tokenizer, cfg.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TrainingJob(ranks, resolve_precision(cfg.precision, ranks.on_gpu), StageLogger.for_job(job), model_dir,
                       tokenizer, pad_id, cfg.trust_remote_code)


def supervised_engine(cfg: SupervisedSettings, setup: TrainingJob, total_steps: int, load_model: Callable[[str], torch.nn.Module],
                      packed: bool = False, ds_updates: dict[str, Any] | None = None):
    """The model `load_model(attn_implementation)` under DeepSpeed (ZeRO-3 partitions it while it
    loads), with a torch AdamW (no decay on 1-D params) and the warmup + cosine schedule of
    `cfg` (its SupervisedSettings, and the kind's `attn_implementation`). Returns (engine,
    lr scheduler, the attention implementation used); an attention implementation that cannot
    run here is a StageError. `packed`: the batches pack several samples per row (the choice of
    "auto" depends on it). `ds_updates`: top-level keys of the DeepSpeed config the task sets
    itself (sft's speed options: its `lean_optimizer_step` clips outside DeepSpeed)."""
    attn = choose_attention(cfg.attn_implementation, setup.ranks.on_gpu, packed=packed)
    ds_cfg = ds_config(cfg.zero_stage, cfg.grad_clip, setup.precision, micro_batch=cfg.micro_batch_size,
                       grad_accum=cfg.grad_accum, world=setup.ranks.world) | (ds_updates or {})
    zero3_ctx = hf_zero3_context(ds_cfg)  # noqa: F841 - kept alive while from_pretrained partitions
    model = load_model(attn)
    model.config.use_cache = False
    engine, scheduler = initialize(model, param_groups(model, cfg.weight_decay), ds_cfg, lr=cfg.lr,
                                   betas=cfg.adam_betas, factor=lr_factor(cfg, total_steps))
    return engine, scheduler, attn

"""The `sft` stage: Long-CoT supervised fine-tuning with DeepSpeed ZeRO.

Run by the deepspeed launcher (`python -m stages.sft.job --job job.json` on every
rank; CPU ranks on gloo, GPUs on nccl). The loop, resume, checkpoints and saving are the supervised
trainer's (stages/common/supervised_trainer.py); this module is the kind's `SupervisedTask`.
Top to bottom:

1. read the chat rows, tokenise them with the chat template, mask everything but the
   assistant turns, pack them into `max_seq_len` sequences (stages/sft/data.py: the rules
   for malformed rows, truncation and packing are written there);
2. build the model (HF dir from `model`; attention that keeps packed samples apart,
   stages/common/packed_attention.py; gradient checkpointing when configured), wrapped in
   `PackedLMLoss` (the LM head and cross-entropy run in chunks of `loss_chunk_tokens`, so
   the full-vocabulary logits of a micro batch never exist at once), torch AdamW (no decay
   on 1-D params: norms, biases), warmup + cosine (or constant) schedule, DeepSpeed engine
   (ZeRO stage, gradient clipping, bf16 on GPU / fp32 on CPU with `precision: auto`);
3. resume from the stage's latest complete checkpoint if there is one (stages/common/
   checkpoint.py): weights, optimizer, scheduler, `SFTProgress` (step, data position, token
   counts), RNG of every rank; refused when the world size or the pack count changed;
4. train: each step takes `grad_accum` micro batches of `micro_batch_size` packs per
   rank (a deterministic order from the seed; the same number of packs on every rank).
   The loss of a step is the mean over all trained tokens of all ranks and micro
   batches (not a mean of per-batch means). Every step logs loss, lr, grad_norm,
   tokens/s and tokens; every `checkpoint_every` steps a checkpoint is written locally by
   DeepSpeed, uploaded by each node's local rank 0 and marked complete by rank 0;
5. rank 0 writes the final model as a HF directory (ZeRO-3 weights gathered first), the
   input model's tokenizer files, and stage_summary.json.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stages.common.compile_layers import compile_decoder_layers
from stages.common.contract import StageError, StageJob
from stages.common.deepspeed_setup import freeze_parameters
from stages.common.distributed import local_first
from stages.common.entry import run_job
from stages.common.fused_loss import chunks_for, linear_cross_entropy_sum
from stages.common.hf_io import load_causal_lm
from stages.common.lora import apply_lora
from stages.common.packed_attention import document_block_mask, flattens_micro_batch, pad_packed_batch, static_width
from stages.common.rows import input_rows
from stages.common.speed_defaults import settle_auto
from stages.common.stage_log import info
from stages.common.step_profile import StepProfiler
from stages.common.supervised_trainer import StepReport, SupervisedRun, TrainingProgress, train_supervised
from stages.common.training_job import TrainingJob
from stages.sft.config import SFTConfig
from stages.sft.data import build_samples, collate, pack_samples


@dataclass
class SFTProgress(TrainingProgress):
    """Where training stands (checkpointed): optimizer steps, data position, tokens seen."""

    tokens: int = 0
    target_tokens: int = 0
    first_loss: float | None = None


# -- the forward and the loss ----------------------------------------------------------------
def packed_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Logits of packed sequences with no attention across samples.

    transformers (5.x) builds a block-diagonal causal mask from position ids that restart
    at 0 for each sample, but only when there is no attention mask and no cache: with
    `use_cache` left to the config's default (True) a cache is created and the packed
    samples attend to each other (seen with transformers 5.24; tests/stages/test_sft.py
    checks that this function keeps samples apart)."""
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                 use_cache=False).logits


class PackedLMLoss(torch.nn.Module):
    """The causal LM `lm` with a forward that returns the summed cross-entropy of packed
    sequences, its head run chunk by chunk (stages/common/fused_loss.py) so that the
    full-vocabulary logits of a micro batch are never held at once. It is the module put under
    DeepSpeed, so one engine forward covers the whole computation (ZeRO-3 keeps per-micro-step
    state in its forward)."""

    def __init__(self, lm: torch.nn.Module, chunk_tokens: int, max_tokens: int | None = None,
                 document_mask: bool = False):
        """`max_tokens`: the most tokens a micro batch can hold; the head is then called
        ceil(max_tokens / chunk_tokens) times for every micro batch, as ZeRO-3 needs every rank
        to (stages/common/fused_loss.py), however full this rank's batch is. `document_mask`
        (flex_attention only): the FlexAttention mask is built here on the device, not by
        transformers (packed_attention.document_block_mask: no host sync per forward)."""
        super().__init__()
        self.lm, self.chunk_tokens, self.document_mask = lm, chunk_tokens, document_mask
        self.head_calls = chunks_for(max_tokens, chunk_tokens) if max_tokens else None

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        mask = document_block_mask(position_ids) if self.document_mask else None
        out = self.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                    use_cache=False)
        return linear_cross_entropy_sum(out.last_hidden_state, self.lm.get_output_embeddings(), targets,
                                        self.chunk_tokens, self.head_calls)


def packed_loss_sum(model, batch: dict[str, torch.Tensor], device: torch.device,
                    flatten: bool = False) -> torch.Tensor:
    """Sum of the token cross-entropies of a collated batch (targets are pre-shifted) under
    `model`: a PackedLMLoss (or the engine around one), else a plain causal LM (full logits).
    `flatten` puts the micro batch in one row: flash-attention's varlen path detects
    packing from the position ids of a single row only."""
    ids, pos, tgt = (batch[k].to(device) for k in ("input_ids", "position_ids", "targets"))
    if flatten:
        ids, pos, tgt = ids.view(1, -1), pos.view(1, -1), tgt.view(1, -1)
    if isinstance(getattr(model, "module", model), PackedLMLoss):
        return model(ids, pos, tgt)
    logits = packed_logits(model, ids, pos)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.view(-1),
                           ignore_index=-100, reduction="sum")


def load_packed_lm(model_dir: Path, cfg: SFTConfig, attn: str) -> PackedLMLoss:
    """The input model in float32 (DeepSpeed casts it), with the configured attention, LoRA
    adapters, frozen parameters, gradient checkpointing and compiled layers, wrapped for the chunked loss. A setting
    still at `auto` (a config not launched by the pipeline) takes its old default."""
    cfg = settle_auto(cfg)
    lm = load_causal_lm(model_dir, torch.float32, attn_implementation=attn,
                        trust_remote_code=cfg.trust_remote_code)
    if cfg.lora is not None:
        apply_lora(lm, cfg.lora)
    freeze_parameters(lm, cfg.frozen_param_patterns)
    if cfg.gradient_checkpointing:  # transformers >= 5.20 renamed it (the old name warns)
        enable = getattr(lm, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile_layers:
        compile_decoder_layers(lm, cfg.model)
    width = static_width(attn, cfg.max_seq_len) or cfg.max_seq_len  # a pack's most tokens, padding included
    return PackedLMLoss(lm, cfg.loss_chunk_tokens, max_tokens=cfg.micro_batch_size * width,
                        document_mask=cfg.async_micro_batches and attn == "flex_attention")


def batch_on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """`batch` on `device`, copied without waiting for the device (pinned host memory, non-blocking):
    a pageable copy is ordered after every kernel already queued and blocks the host until they ran."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


# `off` turns off the prefetch of the next step's host batches (train_step): the benchmark's
# baseline for what it saves (benchmarks/sft_throughput.py, variant stage_no_prefetch)
PREFETCH_ENV = "RING_SFT_PREFETCH"


def prefetch_on() -> bool:
    mode = os.environ.get(PREFETCH_ENV) or "on"
    if mode not in ("on", "off"):
        raise StageError(f"${PREFETCH_ENV}={mode!r}: expected on or off")
    return mode == "on"


@dataclass
class HostStep:
    """One step's micro batches as host tensors, and its token counts on this rank."""

    key: tuple[tuple[int, ...], ...]  # the packs of each micro batch
    batches: list[dict[str, torch.Tensor]]
    targets: int  # trained (assistant) tokens
    tokens: int  # every sample token, padding left out


def _key(micro: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(mb) for mb in micro)


# -- the stage -------------------------------------------------------------------------------
class SFTTask:
    """The sft kind's part of the supervised loop (stages/common/supervised_trainer.py)."""

    name = "sft"

    def __init__(self, job: StageJob, cfg: SFTConfig, setup: TrainingJob):
        if setup.tokenizer.eos_token is None:
            raise StageError(f"model {cfg.model}: its tokenizer has no eos token")
        self.cfg, self.setup = cfg, setup
        # the speed options (config.py); lean_optimizer_step where DeepSpeed's own step clips
        # parameter by parameter: ZeRO-0 without its bf16 optimizer wrapper
        self.lean_step = cfg.lean_optimizer_step and cfg.zero_stage == 0 and not setup.deepspeed_bf16
        if cfg.lean_optimizer_step and not self.lean_step and setup.ranks.rank == 0:
            info(f"sft: lean_optimizer_step does nothing at ZeRO-{cfg.zero_stage} with precision "
                 f"{setup.precision} (DeepSpeed's optimizer wrapper clips)")
        self.ds_config_updates = {
            **({"gradient_clipping": 0.0} if self.lean_step else {}),  # train_step clips instead
            **({"timers": {"throughput": {"enabled": False}}} if cfg.async_micro_batches else {})}

        def load_data():
            rows = input_rows(job.fetch, cfg.data_input, "sft data", keep_bad=True)
            return build_samples(rows, setup.tokenizer, cfg.max_seq_len, cfg.on_bad_row, cfg.data_input)

        self.samples, self.stats = local_first(setup.ranks.local_rank, load_data)
        if not self.samples:
            raise StageError(f"sft data {cfg.data}: no usable sample ({self.stats.rows} rows read)")
        self.packs = pack_samples([len(s) for s in self.samples], cfg.max_seq_len, cfg.seed, cfg.packing)
        self.items, self.packed = len(self.packs), cfg.packing
        self.fingerprint = {"packs": len(self.packs)}
        self.progress = SFTProgress()
        self.loss: float | None = None
        self.prefetched: HostStep | None = None  # the next step's host batches, made during this one
        self.prefetch = cfg.async_micro_batches and prefetch_on()
        self.profiler = StepProfiler(cfg.profile, Path(job.output_dir) / "logs" / "profile",
                                     active=setup.ranks.rank == 0)

    def describe(self, run: SupervisedRun) -> None:
        cfg, stats, plan, total_steps = self.cfg, self.stats, run.plan, run.total_steps
        if cfg.profile is not None and cfg.profile.start_step > total_steps:  # max_steps is checked with the config
            raise StageError(f"profile.start_step ({cfg.profile.start_step}) is after the run's last step "
                             f"({total_steps}: {cfg.epochs} epochs of {plan.steps_per_epoch} steps): nothing "
                             "would be profiled")
        if self.setup.ranks.rank != 0:
            return
        bad, world = sum(stats.bad_rows.values()), self.setup.ranks.world
        info(f"sft: {stats.rows} rows -> {stats.samples} samples ({stats.target_tokens} trained of "
             f"{stats.tokens} tokens) -> {len(self.packs)} packs of <= {cfg.max_seq_len} tokens; "
             f"{plan.steps_per_epoch} steps/epoch, {total_steps} steps on {world} ranks")
        if cfg.warmup_steps >= total_steps:
            info(f"sft: warning: warmup_steps={cfg.warmup_steps} >= total steps {total_steps}: the "
                 "learning rate never reaches `lr`")
        if stats.truncated:
            info(f"sft: {stats.truncated} samples longer than max_seq_len={cfg.max_seq_len} were "
                 f"truncated to it; {stats.no_target_after_truncation} of them had no assistant "
                 "token left and were left out")
        if bad:
            info(f"sft: {bad} malformed rows left out (on_bad_row=skip): {dict(stats.bad_rows)}; "
                 f"first: {stats.bad_examples[:3]}")
        self.setup.log.params({"data.samples": stats.samples, "data.packs": len(self.packs),
                               "data.steps_per_epoch": plan.steps_per_epoch, "train.total_steps": total_steps,
                               "train.world_size": world})

    def load_model(self, attn: str) -> PackedLMLoss:
        return load_packed_lm(self.setup.model_dir, self.cfg, attn)

    def before_training(self, run: SupervisedRun) -> None:
        self.flatten = flattens_micro_batch(run.attn)
        self.width = static_width(run.attn, self.cfg.max_seq_len)
        if self.lean_step and self.setup.ranks.world == 1:
            # one rank's all-reduce is the identity; DeepSpeed still flattens every gradient into
            # buckets, reduces them and copies them back at each optimizer step
            run.engine.enable_backward_allreduce = False

    def _host_step(self, micro: list[list[int]]) -> HostStep:
        """The step's micro batches collated on the host (padded to the static width; pinned where
        they are copied to the GPU without waiting) and the step's trained and total token counts."""
        samples, packs, pad_id = self.samples, self.packs, self.setup.pad_id
        batches = [collate(samples, [packs[i] for i in mb], pad_id) for mb in micro]
        if self.width is not None:
            batches = [pad_packed_batch(b, self.width, pad_id) for b in batches]
        if self.cfg.async_micro_batches and self.setup.ranks.on_gpu:
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        targets = sum(int((b["targets"] != -100).sum()) for b in batches)
        tokens = sum(len(samples[i]) for mb in micro for p in mb for i in packs[p])
        return HostStep(_key(micro), batches, targets, tokens)

    def train_step(self, run: SupervisedRun, micro: list[list[int]], upcoming: list[list[int]] | None
                   ) -> tuple[float, int, int, float | None]:
        """(loss per trained token, trained tokens, tokens, grad norm when DeepSpeed reports none)."""
        cfg = self.cfg
        engine, device, world = run.engine, self.setup.ranks.device, self.setup.ranks.world
        self.profiler.before(self.progress.step + 1)
        host, self.prefetched = self.prefetched, None
        if host is None or host.key != _key(micro):
            host = self._host_step(micro)
        counts = torch.tensor([float(host.targets), float(host.tokens)], dtype=torch.float64, device=device)
        dist.all_reduce(counts)
        step_targets, step_tokens = (int(c) for c in counts.tolist())  # one host sync, not two
        batches = host.batches
        if cfg.async_micro_batches:  # every copy queued now, none waits for the GPU later in the step
            batches = [batch_on(b, device) for b in batches]
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        grad_norm = None
        for j, b in enumerate(batches):
            ce = packed_loss_sum(engine, b, device, self.flatten)
            # DeepSpeed divides by grad_accum and averages over ranks: this makes the step's
            # gradient that of the mean over every trained token of the global batch
            engine.backward(ce * (cfg.grad_accum * world / max(step_targets, 1)))
            if j == len(batches) - 1:
                grad_norm = self._norm_before_step(engine)
            engine.step()
            loss_sum += ce.detach().double()
        if self.prefetch and upcoming is not None:
            # the GPU is still running this step's queued work: collating the next step now takes
            # its Python (38 ms for 8 packs of 4,096 tokens on a 2-core CI machine) off the GPU's
            # critical path, where the next step's first kernels would wait for it
            self.prefetched = self._host_step(upcoming)
        dist.all_reduce(loss_sum)
        if isinstance(grad_norm, torch.Tensor):  # the lean step's: read with the loss, one host sync
            loss, grad_norm = torch.stack([loss_sum, grad_norm.double()]).tolist()
        else:
            loss = loss_sum.item()
        return loss / max(step_targets, 1), step_targets, step_tokens, grad_norm

    def _norm_before_step(self, engine) -> torch.Tensor | float | None:
        """The gradient norm of the step, taken after the last micro batch's backward (gradients
        all-reduced) and before DeepSpeed's step: with `lean_optimizer_step` the foreach clip's (it
        clips here; a tensor, read later), at ZeRO-0 without DeepSpeed's bf16 mode its value (plain
        DeepSpeed clips without reporting the norm), else None (DeepSpeed's wrapper reports it)."""
        if not (self.lean_step or (self.cfg.zero_stage == 0 and not self.setup.deepspeed_bf16)):
            return None
        params = [p for p in engine.module.parameters() if p.grad is not None]
        if self.lean_step:
            # DeepSpeed's clip_grad_norm_ math (coefficient max_norm / (norm + 1e-6), at most 1)
            return torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params]).item()

    def report(self, run: SupervisedRun, trained, lr: float, seconds: float) -> StepReport:
        loss, step_targets, step_tokens, grad_norm = trained
        p, total_steps = self.progress, run.total_steps
        self.loss = loss
        p.tokens += step_tokens
        p.target_tokens += step_targets
        p.first_loss = loss if p.first_loss is None else p.first_loss
        ds_norm = run.engine.get_global_grad_norm()
        grad_norm = float(ds_norm) if ds_norm is not None else grad_norm
        grad_norm = float("nan") if grad_norm is None else grad_norm
        table = self.profiler.after(p.step, last=p.step == total_steps)
        if table is not None:
            info(f"sft: profile of steps up to {p.step} written: {table}, {self.profiler.trace_path}")
        metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": step_tokens / seconds,
                   "tokens": p.tokens, "target_tokens": p.target_tokens,
                   "epoch": p.epoch + p.step_in_epoch / run.plan.steps_per_epoch}
        if self.setup.ranks.on_gpu:  # what the step needs at most (benchmarks/sft_throughput.py reads it)
            metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.setup.ranks.device) / 2 ** 30
        return StepReport(metrics, f"epoch {p.epoch + 1} | loss {loss:.4f} | lr {lr:.3e} | grad_norm "
                                   f"{grad_norm:.3f} | {step_tokens / seconds:,.0f} tok/s | tokens {p.tokens:,}")

    def trained_module(self, engine) -> torch.nn.Module:
        return engine.module.lm

    def outputs(self, run: SupervisedRun, out: Path) -> dict[str, Any]:
        p, loss = self.progress, self.loss
        summary = {"steps": p.step, "first_loss": p.first_loss, "final_loss": loss,
                   "tokens_trained": p.tokens, "target_tokens_trained": p.target_tokens,
                   "epochs": round(p.epoch + p.step_in_epoch / run.plan.steps_per_epoch, 4),
                   "resumed_from_step": run.resumed_from, "world_size": self.setup.ranks.world,
                   "packs": len(self.packs), "precision": self.setup.precision, "zero_stage": self.cfg.zero_stage,
                   "attn_implementation": run.attn, "data": self.stats.as_dict()}
        info(f"sft: done, {p.step} steps, loss {p.first_loss:.4f} -> "
             f"{loss if loss is not None else float('nan'):.4f}; model saved to {out}")
        return summary


def main(job: StageJob, cfg: SFTConfig) -> dict[str, Any] | None:
    cfg = settle_auto(cfg)  # `auto` left only without the pipeline
    return train_supervised(job, cfg, lambda setup: SFTTask(job, cfg, setup))


if __name__ == "__main__":
    sys.exit(run_job(main, SFTConfig))

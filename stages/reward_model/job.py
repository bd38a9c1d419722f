"""The `reward_model` stage: a Bradley-Terry reward model with DeepSpeed ZeRO.

Run by the deepspeed launcher on every rank (`python -m stages.reward_model.job --job
job.json`; CPU ranks on gloo, GPUs on nccl). The loop, resume, checkpoints and saving are the supervised
trainer's (stages/common/supervised_trainer.py); this module is the kind's `SupervisedTask`.
Top to bottom:

1. read the preference rows (stages/reward_model/data.py: formats, quarantine rules,
   truncation), hold out `eval_data` or `eval_fraction` of the pairs (content hash);
   quarantined rows go to `quarantine.jsonl` with their reasons; too many of them fail
   the stage (`max_bad_fraction`);
2. the model: the input HF causal LM with a one-label sequence-classification head
   (`AutoModelForSequenceClassification`, pad token set so the head reads each sequence's
   last token), torch AdamW, warmup + cosine schedule, DeepSpeed engine (stages/common:
   the SFT stage's ZeRO / precision / checkpoint handling);
3. resume from the stage's latest checkpoint (weights, optimizer, schedule, `RewardModelProgress`,
   RNG) if there is one; refused when the world size or the number of train pairs changed;
4. train: a step = `grad_accum` micro-batches of `micro_batch_size` pairs per rank, each
   pair's chosen and rejected sequences in one forward; loss = mean Bradley-Terry loss
   (bt.py) over the global batch; held-out pairwise accuracy / loss / margin at step 0,
   every `eval_every` steps and at the end, logged to MLflow;
5. rank 0 writes the HF directory (weights, config with pad_token_id, tokenizer files),
   `reward_model.json` (how the model reads its input: strip_thinking, max_seq_len; read by
   stages.reward_model.scoring), `quarantine.jsonl` and stage_summary.json.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stages.common.contract import StageError, StageJob
from stages.common.deepspeed_setup import freeze_parameters
from stages.common.distributed import local_first
from stages.common.entry import run_job
from stages.common.hf_io import load_sequence_classifier
from stages.common.lora import apply_lora
from stages.common.rows import input_rows
from stages.common.speed_defaults import settle_auto
from stages.common.stage_log import info
from stages.common.supervised_trainer import StepReport, SupervisedRun, TrainingProgress, train_supervised
from stages.common.training_job import TrainingJob
from stages.reward_model.bt import PairwiseCounts, bradley_terry_loss
from stages.reward_model.config import RewardModelConfig
from stages.reward_model.data import EncodedPair, PairStats, encode_pairs, split_heldout
from stages.reward_model.scoring import META


@dataclass
class RewardModelProgress(TrainingProgress):
    """Where training stands (checkpointed): optimizer steps, data position, the held-out
    metrics of the untrained model."""

    initial_eval: dict[str, float] | None = None


# -- data ------------------------------------------------------------------------------------
def load_pairs(job: StageJob, source: str, tokenizer, cfg: RewardModelConfig
               ) -> tuple[list[tuple[Any, EncodedPair]], PairStats, list[dict]]:
    stats, quarantine = PairStats(), []
    rows = input_rows(job.fetch, source, "reward_model data", keep_bad=True)
    pairs = list(encode_pairs(rows, tokenizer, strip=cfg.strip_thinking,
                              max_len=cfg.max_seq_len, ties=cfg.ties, stats=stats, quarantine=quarantine))
    bad = sum(stats.quarantined.values())
    if stats.rows and bad / stats.rows > cfg.max_bad_fraction:
        raise StageError(
            f"reward_model data {source}: {bad} of {stats.rows} rows are unusable "
            f"({dict(stats.quarantined)}), more than max_bad_fraction={cfg.max_bad_fraction}; "
            f"first: {stats.examples[:3]}")
    if not pairs:
        raise StageError(f"reward_model data {source}: no usable pair ({stats.rows} rows read, "
                               f"{bad} quarantined, {stats.ties_dropped} ties dropped)")
    return pairs, stats, quarantine


# the head a sequence classifier of transformers scores with (llama, qwen, mistral: `score`)
RM_HEADS = ("score", "classifier")


def collate_pairs(pairs: list[EncodedPair], pad_id: int, device: torch.device):
    """[2B, L] input ids / attention mask (chosen rows first, then rejected), labels [B]."""
    seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        att[i, :len(s)] = 1
    labels = torch.tensor([p.label for p in pairs], dtype=torch.float32)
    return ids.to(device), att.to(device), labels.to(device)


def pair_scores(engine, pairs: list[EncodedPair], pad_id: int, device: torch.device):
    ids, att, labels = collate_pairs(pairs, pad_id, device)
    scores = engine(input_ids=ids, attention_mask=att, use_cache=False).logits[:, 0].float()
    return scores[:len(pairs)], scores[len(pairs):], labels


def evaluate(engine, pairs: list[EncodedPair], batch: int, pad_id: int, device: torch.device,
             rank: int, world: int) -> dict[str, float]:
    """Held-out metrics over all ranks. Every rank runs the same number of forwards (ZeRO-3
    gathers inside forward), the padding items are not counted."""
    engine.eval()
    counts = PairwiseCounts()
    per_rank = math.ceil(len(pairs) / world)
    mine = [rank + world * j for j in range(per_rank)]
    with torch.no_grad():
        for s in range(0, per_rank, batch):
            idx = mine[s:s + batch]
            real = [i < len(pairs) for i in idx]
            c, r, y = pair_scores(engine, [pairs[i if i < len(pairs) else 0] for i in idx], pad_id, device)
            keep = torch.tensor(real, device=c.device)
            if keep.any():
                counts.add(c[keep], r[keep], y[keep])
    engine.train()
    t = counts.as_tensor().to(device)
    dist.all_reduce(t)
    return PairwiseCounts.from_tensor(t.cpu()).finalize()


# -- the stage -------------------------------------------------------------------------------
class RewardModelTask:
    """The reward_model kind's part of the supervised loop (stages/common/supervised_trainer.py)."""

    name = "reward_model"
    packed = False
    ds_config_updates: dict[str, Any] = {}  # none: DeepSpeed's config as planned (read, never changed)

    def __init__(self, job: StageJob, cfg: RewardModelConfig, setup: TrainingJob):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the new head's "newly initialized weights" warning is expected
        if setup.pad_id is None:
            raise StageError(f"model {cfg.model}: its tokenizer has neither a pad nor an eos token; "
                             "the classification head needs one to find each sequence's last token")
        self.cfg, self.setup = cfg, setup

        def load_data():
            pairs, stats, quarantine = load_pairs(job, cfg.data, setup.tokenizer, cfg)
            if cfg.eval_data is not None:
                held, eval_stats, eval_q = load_pairs(job, cfg.eval_data, setup.tokenizer, cfg)
                return [e for _, e in pairs], [e for _, e in held], stats, eval_stats, quarantine + eval_q
            train_pairs, eval_pairs = split_heldout(pairs, cfg.eval_fraction, cfg.seed)
            return train_pairs, eval_pairs, stats, None, quarantine

        (self.train_pairs, self.eval_pairs, self.stats, self.eval_stats,
         self.quarantine) = local_first(setup.ranks.local_rank, load_data)
        if not self.eval_pairs:
            raise StageError(f"reward_model data {cfg.data}: only {len(self.train_pairs)} usable pair(s), "
                             "none left to hold out; give more pairs or eval_data")
        self.items = len(self.train_pairs)
        self.fingerprint = {"train pairs": len(self.train_pairs)}
        self.progress = RewardModelProgress()
        self.train_metrics: dict[str, float] = {}

    def describe(self, run: SupervisedRun) -> None:
        if self.setup.ranks.rank != 0:
            return
        stats, cfg, world = self.stats, self.cfg, self.setup.ranks.world
        bad = sum(stats.quarantined.values())
        info(f"reward_model: {stats.rows} rows -> {len(self.train_pairs)} train / {len(self.eval_pairs)} held-out "
             f"pairs; {bad} quarantined {dict(stats.quarantined)}, {stats.ties} ties "
             f"({stats.ties_dropped} dropped), {stats.truncated} truncated to {cfg.max_seq_len} tokens; "
             f"{run.plan.steps_per_epoch} steps/epoch, {run.total_steps} steps on {world} ranks")
        for line in stats.examples[:5]:
            info(f"reward_model: quarantined {line}")
        self.setup.log.params({"data.train_pairs": len(self.train_pairs), "data.eval_pairs": len(self.eval_pairs),
                               "data.quarantined": bad, "train.total_steps": run.total_steps,
                               "train.world_size": world})

    def load_model(self, attn: str) -> torch.nn.Module:
        model = load_sequence_classifier(self.setup.model_dir, torch.float32, num_labels=1, attn_implementation=attn,
                                         trust_remote_code=self.cfg.trust_remote_code)
        model.config.pad_token_id = self.setup.pad_id
        if self.cfg.lora is not None:  # the score head is new: it always trains in full
            apply_lora(model, self.cfg.lora, always_train=RM_HEADS)
        freeze_parameters(model, self.cfg.frozen_param_patterns)
        return model

    def evaluate(self, run: SupervisedRun) -> dict[str, float]:
        ranks = self.setup.ranks
        return evaluate(run.engine, self.eval_pairs, self.cfg.micro_batch_size, self.setup.pad_id, ranks.device,
                        ranks.rank, ranks.world)

    def before_training(self, run: SupervisedRun) -> None:
        p = self.progress
        if p.initial_eval is None:
            p.initial_eval = self.evaluate(run)
            self.setup.log.metrics(0, {f"eval/{k}": v for k, v in p.initial_eval.items()})
            if self.setup.ranks.rank == 0:
                info(f"reward_model: held-out before training: accuracy {p.initial_eval['accuracy']:.3f}, "
                     f"loss {p.initial_eval['loss']:.4f}")
        self.final_eval = p.initial_eval

    def train_step(self, run: SupervisedRun, micro: list[list[int]], upcoming: list[list[int]] | None
                   ) -> dict[str, float]:
        # `upcoming` unused: each micro batch's scores are read back (PairwiseCounts) before the next
        engine, device = run.engine, self.setup.ranks.device
        counts = PairwiseCounts()
        for mb in micro:
            c, r, y = pair_scores(engine, [self.train_pairs[i] for i in mb], self.setup.pad_id, device)
            # every micro-batch has micro_batch_size pairs and DeepSpeed averages over
            # micro-batches and ranks: the step's gradient is that of the global mean
            engine.backward(bradley_terry_loss(c, r, y, "mean"))
            engine.step()
            counts.add(c.detach(), r.detach(), y)
        t = counts.as_tensor().to(device)
        dist.all_reduce(t)
        return PairwiseCounts.from_tensor(t.cpu()).finalize()

    def report(self, run: SupervisedRun, trained: dict[str, float], lr: float, seconds: float) -> StepReport:
        p, tm = self.progress, trained
        self.train_metrics = tm
        gn = run.engine.get_global_grad_norm()
        metrics = {f"train/{k}": v for k, v in tm.items() if k != "pairs"}
        metrics.update({"lr": lr, "grad_norm": float(gn) if gn is not None else float("nan"),
                        "epoch": p.epoch + p.step_in_epoch / run.plan.steps_per_epoch,
                        "pairs_per_s": tm["pairs"] / seconds})
        evaluated = p.step % self.cfg.eval_every == 0 or p.step == run.total_steps
        if evaluated:
            self.final_eval = self.evaluate(run)
            metrics.update({f"eval/{k}": v for k, v in self.final_eval.items()})
        ev = f" | eval acc {self.final_eval['accuracy']:.3f}" if evaluated else ""
        return StepReport(metrics, f"loss {tm['loss']:.4f} | acc {tm['accuracy']:.3f} | margin {tm['margin']:.3f} | "
                                   f"lr {lr:.3e}{ev}", log_now=evaluated)

    def trained_module(self, engine) -> torch.nn.Module:
        return engine.module

    def outputs(self, run: SupervisedRun, out: Path) -> dict[str, Any]:
        cfg, p, tm = self.cfg, self.progress, self.train_metrics
        initial, final = p.initial_eval, self.final_eval
        meta = {"format": 1, "head": "AutoModelForSequenceClassification/num_labels=1",
                "loss": "bradley_terry", "strip_thinking": cfg.strip_thinking, "max_seq_len": cfg.max_seq_len,
                "chat_template": "tokenizer", "pad_token_id": self.setup.pad_id}
        (out / META).write_text(json.dumps(meta, indent=2))
        qpath = out / "quarantine.jsonl"
        with qpath.open("w") as f:
            for q in self.quarantine:
                f.write(json.dumps(q, default=str) + "\n")
        if self.quarantine:
            self.setup.log.artifact(qpath)
        info(f"reward_model: done, {p.step} steps; held-out accuracy {initial['accuracy']:.3f} -> "
             f"{final['accuracy']:.3f}; model saved to {out}")
        return {"steps": p.step, "resumed_from_step": run.resumed_from, "world_size": self.setup.ranks.world,
                "train_pairs": len(self.train_pairs), "eval_pairs": len(self.eval_pairs),
                "eval_accuracy_initial": initial["accuracy"], "eval_loss_initial": initial["loss"],
                "eval_accuracy": final["accuracy"], "eval_loss": final["loss"],
                "eval_margin": final["margin"], "train_loss": tm.get("loss"),
                "train_accuracy": tm.get("accuracy"),
                "precision": self.setup.precision, "zero_stage": cfg.zero_stage,
                "data": self.stats.as_dict(), "eval_data": self.eval_stats.as_dict() if self.eval_stats else None}


def main(job: StageJob, cfg: RewardModelConfig) -> dict[str, Any] | None:
    cfg = settle_auto(cfg)  # `auto` left only without the pipeline
    return train_supervised(job, cfg, lambda setup: RewardModelTask(job, cfg, setup))


if __name__ == "__main__":
    sys.exit(run_job(main, RewardModelConfig))

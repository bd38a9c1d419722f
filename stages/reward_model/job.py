"""The `reward_model` stage: a Bradley-Terry reward model with DeepSpeed ZeRO.

Run by the deepspeed launcher on every rank (`python -m stages.reward_model.job --job
job.json`; CPU ranks on gloo, GPUs on nccl). Top to bottom:

1. read the preference rows (stages/reward_model/data.py: formats, quarantine rules,
   truncation), hold out `eval_data` or `eval_fraction` of the pairs (content hash);
   quarantined rows go to `quarantine.jsonl` with their reasons; too many of them fail
   the stage (`max_bad_fraction`);
2. the model: the input HF causal LM with a one-label sequence-classification head
   (`AutoModelForSequenceClassification`, pad token set so the head reads each sequence's
   last token), torch AdamW, warmup + cosine schedule, DeepSpeed engine (stages/common:
   the SFT stage's ZeRO / precision / checkpoint handling);
3. resume from the stage's latest checkpoint (weights, optimizer, schedule, `Progress`,
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stages.common.checkpoint import Checkpointer, StatefulDataclass
from stages.common.contract import StageError, StageJob
from stages.common.data_plan import DataPlan
from stages.common.distributed import local_first
from stages.common.entry import run_job
from stages.common.hf_io import load_sequence_classifier, save_hf_model
from stages.common.rows import input_rows
from stages.common.stage_log import info
from stages.common.training_job import start_training_job, supervised_engine
from stages.reward_model.bt import PairwiseCounts, bradley_terry_loss
from stages.reward_model.config import RewardModelConfig
from stages.reward_model.data import EncodedPair, PairStats, encode_pairs, split_heldout
from stages.reward_model.scoring import META


@dataclass
class Progress(StatefulDataclass):
    """Where training stands (checkpointed): optimizer steps, data position, the held-out
    metrics of the untrained model."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
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
def main(job: StageJob) -> dict[str, Any] | None:
    from transformers.utils import logging as hf_logging

    cfg = RewardModelConfig.model_validate(job.config)
    setup = start_training_job(job, cfg)
    hf_logging.set_verbosity_error()  # the new head's "newly initialized weights" warning is expected
    ranks, log, model_dir, tokenizer, pad_id = setup.ranks, setup.log, setup.model_dir, setup.tokenizer, setup.pad_id
    rank, world, local_rank, device = ranks.rank, ranks.world, ranks.local_rank, ranks.device

    # 1. data
    if pad_id is None:
        raise StageError(f"model {cfg.model}: its tokenizer has neither a pad nor an eos token; "
                         "the classification head needs one to find each sequence's last token")

    def load_data():
        pairs, stats, quarantine = load_pairs(job, cfg.data, tokenizer, cfg)
        if cfg.eval_data is not None:
            held, eval_stats, eval_q = load_pairs(job, cfg.eval_data, tokenizer, cfg)
            return [e for _, e in pairs], [e for _, e in held], stats, eval_stats, quarantine + eval_q
        train_pairs, eval_pairs = split_heldout(pairs, cfg.eval_fraction, cfg.seed)
        return train_pairs, eval_pairs, stats, None, quarantine

    train_pairs, eval_pairs, stats, eval_stats, quarantine = local_first(local_rank, load_data)
    if not eval_pairs:
        raise StageError(f"reward_model data {cfg.data}: only {len(train_pairs)} usable pair(s), "
                               "none left to hold out; give more pairs or eval_data")
    plan = DataPlan(len(train_pairs), world, cfg.micro_batch_size, cfg.grad_accum, cfg.seed)
    total_steps = cfg.max_steps or cfg.epochs * plan.steps_per_epoch
    if rank == 0:
        bad = sum(stats.quarantined.values())
        info(f"reward_model: {stats.rows} rows -> {len(train_pairs)} train / {len(eval_pairs)} held-out "
             f"pairs; {bad} quarantined {dict(stats.quarantined)}, {stats.ties} ties "
             f"({stats.ties_dropped} dropped), {stats.truncated} truncated to {cfg.max_seq_len} tokens; "
             f"{plan.steps_per_epoch} steps/epoch, {total_steps} steps on {world} ranks")
        for line in stats.examples[:5]:
            info(f"reward_model: quarantined {line}")
        log.params({"data.train_pairs": len(train_pairs), "data.eval_pairs": len(eval_pairs),
                    "data.quarantined": bad, "train.total_steps": total_steps, "train.world_size": world})

    # 2. model, optimizer, schedule, engine
    def load_model(attn: str):
        model = load_sequence_classifier(model_dir, torch.float32, num_labels=1, attn_implementation=attn,
                                         trust_remote_code=cfg.trust_remote_code)
        model.config.pad_token_id = pad_id
        return model

    engine, scheduler, _ = supervised_engine(cfg, setup, total_steps, load_model)

    # 3. resume
    p = Progress()
    ckpt = Checkpointer(job, engine, ranks, {"progress": p}, fingerprint={"train pairs": len(train_pairs)})
    resumed_from = ckpt.resume()
    if resumed_from is not None and rank == 0:
        info(f"reward_model: resumed from checkpoint step {p.step}")
    log.progress(p.step, total=total_steps)  # the console's ETA

    eval_batch = cfg.micro_batch_size
    if p.initial_eval is None:
        p.initial_eval = evaluate(engine, eval_pairs, eval_batch, pad_id, device, rank, world)
        log.metrics(0, {f"eval/{k}": v for k, v in p.initial_eval.items()})
        if rank == 0:
            info(f"reward_model: held-out before training: accuracy {p.initial_eval['accuracy']:.3f}, "
                 f"loss {p.initial_eval['loss']:.4f}")
    initial_eval = p.initial_eval

    # 4. train
    engine.train()
    final_eval, train_metrics = initial_eval, {}
    while p.step < total_steps:
        if p.step_in_epoch >= plan.steps_per_epoch:
            p.epoch, p.step_in_epoch = p.epoch + 1, 0
        t0 = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        counts = PairwiseCounts()
        for mb in plan.step_micro_batches(p.epoch, p.step_in_epoch, rank):
            c, r, y = pair_scores(engine, [train_pairs[i] for i in mb], pad_id, device)
            # every micro-batch has micro_batch_size pairs and DeepSpeed averages over
            # micro-batches and ranks: the step's gradient is that of the global mean
            engine.backward(bradley_terry_loss(c, r, y, "mean"))
            engine.step()
            counts.add(c.detach(), r.detach(), y)
        t = counts.as_tensor().to(device)
        dist.all_reduce(t)
        train_metrics = PairwiseCounts.from_tensor(t.cpu()).finalize()
        p.step, p.step_in_epoch = p.step + 1, p.step_in_epoch + 1
        step = p.step
        gn = engine.get_global_grad_norm()
        metrics = {f"train/{k}": v for k, v in train_metrics.items() if k != "pairs"}
        metrics.update({"lr": lr, "grad_norm": float(gn) if gn is not None else float("nan"),
                        "epoch": p.epoch + p.step_in_epoch / plan.steps_per_epoch,
                        "pairs_per_s": train_metrics["pairs"] / (time.perf_counter() - t0)})
        if step % cfg.eval_every == 0 or step == total_steps:
            final_eval = evaluate(engine, eval_pairs, eval_batch, pad_id, device, rank, world)
            metrics.update({f"eval/{k}": v for k, v in final_eval.items()})
        if rank == 0:
            ev = f" | eval acc {final_eval['accuracy']:.3f}" if "eval/accuracy" in metrics else ""
            info(f"reward_model step {step}/{total_steps} | loss {train_metrics['loss']:.4f} | "
                 f"acc {train_metrics['accuracy']:.3f} | margin {train_metrics['margin']:.3f} | "
                 f"lr {lr:.3e}{ev}")
        if step % cfg.log_every == 0 or step == total_steps or "eval/accuracy" in metrics:
            log.metrics(step, metrics)
        if step % cfg.checkpoint_every == 0 and step < total_steps:
            ckpt.save(step)

    # 5. outputs
    out = Path(job.output_dir)
    save_hf_model(engine, engine.module, model_dir, out, cfg.zero_stage, rank, setup.published_dtype)
    if rank != 0:
        return None
    meta = {"format": 1, "head": "AutoModelForSequenceClassification/num_labels=1",
            "loss": "bradley_terry", "strip_thinking": cfg.strip_thinking, "max_seq_len": cfg.max_seq_len,
            "chat_template": "tokenizer", "pad_token_id": pad_id}
    (out / META).write_text(json.dumps(meta, indent=2))
    qpath = out / "quarantine.jsonl"
    with qpath.open("w") as f:
        for q in quarantine:
            f.write(json.dumps(q, default=str) + "\n")
    if quarantine:
        log.artifact(qpath)
    summary = {"steps": p.step, "resumed_from_step": resumed_from, "world_size": world,
               "train_pairs": len(train_pairs), "eval_pairs": len(eval_pairs),
               "eval_accuracy_initial": initial_eval["accuracy"], "eval_loss_initial": initial_eval["loss"],
               "eval_accuracy": final_eval["accuracy"], "eval_loss": final_eval["loss"],
               "eval_margin": final_eval["margin"], "train_loss": train_metrics.get("loss"),
               "train_accuracy": train_metrics.get("accuracy"),
               "precision": setup.precision, "zero_stage": cfg.zero_stage,
               "data": stats.as_dict(), "eval_data": eval_stats.as_dict() if eval_stats else None}
    (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
    info(f"reward_model: done, {p.step} steps; held-out accuracy {initial_eval['accuracy']:.3f} -> "
         f"{final_eval['accuracy']:.3f}; model saved to {out}")
    return summary


if __name__ == "__main__":
    sys.exit(run_job(main))

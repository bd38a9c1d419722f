"""The `general_rl` stage's job: `python -m stages.general_rl.train --job job.json`.

RLHF after reasoning RL, on the reasoning-RL machinery (stages/reasoning_rl): the same
rollout engines, C3PO++ / sync scheduler, GRPO loss with IcePop / TIS / no correction,
learner and DeepSpeed backend. What is general-RL's own:

1. prompts: every `data` source is read (stages/general_rl/data.py) and sampled by its
   weight (the scheduler's PromptSampler over sources instead of domains);
2. reward: `rewards.GeneralReward` on rank 0: reward-model scores (RewardScorer, batched on
   `reward.rm_device`: CPU here, a GPU of rank 0's node at scale), verifier scores for rows
   with a reference (instruction constraints, math, ...), format and length penalties,
   combined per group;
3. the reasoning guard: before the first step and after the last one, rank 0 decodes the
   `reasoning_eval` set with the rollout engine (greedy by default; the engine holds the
   current policy) and scores it with the verifier; before / after / delta go to MLflow
   and to stage_summary.json. The "before" score is kept in every checkpoint, so a resumed
   run reports the delta against the policy the stage started from;
4. checkpoints (every `checkpoint_every` steps and at the end) through the shared
   DeepSpeed `Checkpointer` (stages/common/checkpoint.py) (all ranks' DeepSpeed state + RNG, uploaded per node); the
   scheduler state (pools, open groups, sampler position), the metric history and the
   "before" score ride in rank 0's client state. A restarted job resumes from the latest.

Outputs (rank 0): the policy as a HF dir + tokenizer, `metrics.jsonl`, stage_summary.json.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.artifacts import ArtifactError
from pipeline.stage_api import StageJob
from pipeline.tracking import StageLogger, info
from stages.common.checkpoint import CheckpointError, Checkpointer
from stages.common.distributed import broadcast, init_distributed, rank0_do, use_bf16
from stages.common.rows import DataError, data_files, read_rows
from stages.general_rl.config import GeneralRLConfig
from stages.general_rl.data import PromptDataError, load_sources, reasoning_rows, render_prompts
from stages.reasoning_rl import trainer as rl


# -- setup pieces ----------------------------------------------------------------------------------
def _reader(job: StageJob):
    cache = Path(job.work_dir) / "hf_datasets"

    def read(path: Path, written: str):
        try:
            yield from read_rows(data_files(path, written, "general_rl data"), cache, "general_rl data")
        except DataError as e:
            raise PromptDataError(str(e)) from None
    return read


def load_prompts(job: StageJob, cfg: GeneralRLConfig, tokenizer) -> dict[str, Any]:
    from verifiers import VERIFIERS

    sources = {name: [(p, job.fetch(p)) for p in src.paths] for name, src in cfg.data.items()}
    try:
        rows, by_source, skipped = load_sources(sources, _reader(job), set(VERIFIERS))
        kept, prompt_ids, index = render_prompts(rows, tokenizer, cfg.prompt_max_len)
    except PromptDataError as e:
        raise rl.RLStageError(str(e)) from None
    new_pos = {old: new for new, old in enumerate(index)}
    by_source = {s: [new_pos[i] for i in idx if i in new_pos] for s, idx in by_source.items()}
    too_long = len(rows) - len(kept)
    empty = sorted(s for s, idx in by_source.items() if not idx and cfg.data[s].weight > 0)
    if empty:
        raise rl.RLStageError(f"prompt sources {empty}: every prompt is longer than prompt_max_len="
                              f"{cfg.prompt_max_len} tokens")
    return {"rows": kept, "prompt_ids": prompt_ids, "by_source": {s: v for s, v in by_source.items() if v},
            "skipped": {**dict(skipped), **({"longer than prompt_max_len": too_long} if too_long else {})}}


def load_reasoning_set(job: StageJob, cfg: GeneralRLConfig, tokenizer) -> dict[str, Any]:
    from verifiers import VERIFIERS

    ev = cfg.reasoning_eval
    if ev.domain not in VERIFIERS:
        raise rl.RLStageError(f"reasoning_eval.domain {ev.domain!r} has no verifier; known: {sorted(VERIFIERS)}")
    try:
        raw = [row for _, _, row in _reader(job)(job.fetch(ev.data), ev.data)]
        rows = reasoning_rows(raw, ev, ev.data)
    except PromptDataError as e:
        raise rl.RLStageError(str(e)) from None
    kept, ids, _ = render_prompts([{**r, "messages": [{"role": "user", "content": r["prompt"]}]} for r in rows],
                                  tokenizer, cfg.prompt_max_len)
    if not kept:
        raise rl.RLStageError(f"reasoning_eval data {ev.data}: every prompt is longer than prompt_max_len="
                              f"{cfg.prompt_max_len} tokens")
    return {"rows": [{k: v for k, v in r.items() if k != "messages"} for r in kept], "prompt_ids": ids,
            "skipped": len(rows) - len(kept)}


def reasoning_check(engine, eval_set: dict[str, Any], decode, cfg: GeneralRLConfig) -> dict[str, float]:
    """Decode the held-out reasoning set with the engine's current weights and verify it."""
    from stages.reasoning_rl.engines.base import RolloutRequest, SamplingParams
    from verifiers import verify_batch

    ev = cfg.reasoning_eval
    n_new = ev.max_new_tokens or cfg.max_len
    t0 = time.perf_counter()
    requests = [RolloutRequest(uid=f"eval{i}", prompt_ids=list(ids), max_new_tokens=n_new)
                for i, ids in enumerate(eval_set["prompt_ids"])]
    updates = engine.generate(requests, SamplingParams(temperature=ev.temperature, seed=cfg.seed))
    texts = [decode(list(u.token_ids)) for u in updates]
    rewards = verify_batch(eval_set["rows"], [str(t) for t in texts], num_workers=cfg.verifier_workers,
                           timeout_s=cfg.verifier_timeout_s)
    n = len(rewards)
    return {"accuracy": sum(r.score for r in rewards) / n, "n": float(n),
            "response_len_mean": sum(len(u.token_ids) for u in updates) / n,
            "truncated_fraction": sum(not t.ended_by_eos for t in texts) / n,
            "seconds": time.perf_counter() - t0}


def reward_metrics(reward_fn) -> dict[str, float]:
    """Means of the reward's parts over the last batch, overall and per source."""
    rows, results = reward_fn.last_batch
    if not results:
        return {}
    out: dict[str, float] = {}
    keys = sorted({k for r in results for k in r.parts})
    for k in keys:
        vals = [r.parts[k] for r in results if k in r.parts]
        out[f"reward_part/{k}"] = sum(vals) / len(vals)
        out[f"reward_part_rate/{k}"] = len(vals) / len(results)
    per: dict[str, list[float]] = {}
    for row, r in zip(rows, results):
        per.setdefault(row["source"], []).append(r.score)
    for s, v in sorted(per.items()):
        out[f"reward_mean_source/{s}"] = sum(v) / len(v)
    out.update(reward_fn.last_seconds)
    return out


def build_rollout(job: StageJob, cfg: GeneralRLConfig, model_dir: Path, device, tokenizer, data: dict[str, Any]):
    """Rank 0: rollout engine, reward function (RM scorer + verifiers) and scheduler."""
    import torch

    from stages.reasoning_rl.c3po import PromptSampler, SchedulerConfig, make_scheduler
    from stages.reasoning_rl.engines.base import SamplingParams
    from stages.reasoning_rl.engines.torch_engine import eos_token_ids_of
    from stages.general_rl.rewards import GeneralReward, make_decoder
    from verifiers import verify_batch

    engine = rl.make_engine(cfg, model_dir, rl.rollout_device(cfg, device))
    scorer = None
    if cfg.reward.rm_weight > 0:
        from stages.reward_model.scoring import RewardScorer

        rm_device = cfg.reward.rm_device
        if rm_device == "auto":
            rm_device = str(device) if device.type == "cuda" else "cpu"
        elif rm_device.startswith("cuda") and not torch.cuda.is_available():
            raise rl.RLStageError(f"reward.rm_device is {rm_device!r} but this machine has no CUDA device")
        try:
            scorer = RewardScorer(job.fetch(cfg.reward_model), device=rm_device, batch_size=cfg.reward.rm_batch_size)
        except FileNotFoundError as e:
            raise rl.RLStageError(f"reward_model {cfg.reward_model}: {e}") from None
    reward = GeneralReward(cfg.reward, cfg.max_len, scorer=scorer, verify_batch=verify_batch,
                           verifier_workers=cfg.verifier_workers, verifier_timeout_s=cfg.verifier_timeout_s)
    eos = sorted(set(eos_token_ids_of(model_dir)) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None
                                                      else set()))
    decode = make_decoder(tokenizer, eos)
    weights = {s: cfg.data[s].weight for s in data["by_source"]}
    sampler = PromptSampler(data["by_source"], weights, seed=cfg.seed)
    sched_cfg = SchedulerConfig(rollouts_per_prompt=cfg.rollouts_per_prompt, max_new_tokens=cfg.max_len,
                                prompts_per_step=cfg.prompts_per_step, pool_capacity=cfg.pool_capacity,
                                token_budget=cfg.token_budget, retention_limit=cfg.c3po.retention_limit,
                                min_group_size=cfg.c3po.min_group_size, adv_eps=cfg.adv_eps)
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)
    scheduler = make_scheduler(cfg.scheduler, engine, sched_cfg, data["rows"], data["prompt_ids"], sampler,
                               sampling, decode, reward)
    return engine, scheduler, reward, decode


# -- the job ---------------------------------------------------------------------------------------
def main(job: StageJob) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    cfg = GeneralRLConfig.model_validate(job.config)
    if cfg.precision == "bf16" and not torch.cuda.is_available():
        raise rl.RLStageError("precision bf16 needs a GPU; use auto or fp32 on CPU")
    ranks = init_distributed(world_of_one_without_launcher=True)
    rank, world, local_rank, device = ranks.rank, ranks.world, ranks.local_rank, ranks.device
    bf16 = use_bf16(cfg.precision, ranks.on_gpu)

    def on_rank0(fn, what: str):  # rank 0 does it; its failure stops every rank with one RLStageError
        return rank0_do(rank, fn, what, rl.RLStageError)

    zero3 = cfg.zero_stage == 3
    torch.manual_seed(cfg.seed)
    log = StageLogger.for_job(job)
    out = Path(job.output_dir)

    model_dir = Path(job.fetch(cfg.model))
    if not (model_dir / "config.json").is_file():
        raise rl.RLStageError(f"model {cfg.model}: {model_dir} is not a Hugging Face model dir (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def load_all():
        data = load_prompts(job, cfg, tokenizer)
        return data, (load_reasoning_set(job, cfg, tokenizer) if cfg.reasoning_eval else None)

    # rank 0 owns the data, the rollout engine, the reward model and the scheduler
    loaded = on_rank0(load_all, "loading the prompts")
    data, eval_set = loaded if rank == 0 else (None, None)
    ds_engine, learner, frozen = rl.build_policy(cfg, model_dir, device, bf16, pad_id)
    built = on_rank0(lambda: build_rollout(job, cfg, model_dir, device, tokenizer, data),
                         "starting the rollout engine and the reward model")
    engine, scheduler, reward_fn, decode = built if rank == 0 else (None, None, None, None)

    # resume
    ckpt = Checkpointer(job, ds_engine, rank, local_rank)
    latest = ckpt.latest()
    history: list[dict[str, float]] = []
    before: dict[str, float] | None = None
    start = 0
    if latest is not None:
        state = ckpt.load(latest)
        if state["world_size"] != world:
            raise rl.RLStageError(f"checkpoint step {latest} of {job.stage_url} was written with world size "
                                  f"{state['world_size']}; this run has {world}. Resume with the same resources, "
                                  "or delete its checkpoints/")
        start = state["step"]
        if rank == 0:
            scheduler.load_state_dict(state["scheduler"])
            history, before = state["history"], state["reasoning_before"]
        sync_s = rl.push_weights(ds_engine, engine, rank, zero3)
        if rank == 0:
            info(f"general_rl: resumed from step {latest} with {len(scheduler.pool)} unfinished rollouts "
                 f"(weights pushed to the engine in {sync_s:.2f}s)")
    if rank == 0:
        info(f"general_rl: {len(data['rows'])} prompts from sources "
             f"{ {s: len(v) for s, v in data['by_source'].items()} } (skipped {data['skipped']}), scheduler "
             f"{cfg.scheduler}, correction {cfg.correction}, world {world}, steps {start}..{cfg.steps}")
        if cfg.reasoning_eval is None:
            info("general_rl: warning: reasoning_eval is null, the stage does not check what it costs reasoning")
    if cfg.reasoning_eval is not None and broadcast(before is None if rank == 0 else None):
        before = on_rank0(lambda: reasoning_check(engine, eval_set, decode, cfg),
                              "the reasoning check before training")
        if rank == 0:
            log.metrics(0, {f"reasoning_eval/{k}_before": v for k, v in before.items()})
            info(f"general_rl: reasoning set before training: accuracy {before['accuracy']:.4f} "
                 f"on {int(before['n'])} rows of {cfg.reasoning_eval.data} "
                 f"({eval_set['skipped']} longer than prompt_max_len skipped)")

    def save(step: int) -> None:
        ckpt.save(step, {"step": step, "world_size": world, "history": history if rank == 0 else None,
                         "scheduler": scheduler.state_dict() if rank == 0 else None,
                         "reasoning_before": before})
        if rank == 0:
            info(f"general_rl: checkpoint step {step} saved")

    # the loop
    for step in range(start, cfg.steps):
        t_step = time.perf_counter()
        batch = on_rank0(lambda: scheduler.next_batch(step), f"step {step + 1}: rollouts")
        samples = broadcast(batch.samples if rank == 0 else None)
        t0 = time.perf_counter()
        stats = learner.train(samples, step)
        t_train = time.perf_counter() - t0
        sync_s = rl.push_weights(ds_engine, engine, rank, zero3)
        if rank == 0:
            m = {**batch.stats, **stats, **rl.batch_metrics(samples), **reward_metrics(reward_fn),
                 "train_seconds": t_train, "weight_sync_seconds": sync_s,
                 "step_seconds": time.perf_counter() - t_step, "policy_version": float(step + 1)}
            history.append(m)
            log.metrics(step + 1, m)
            if cfg.sample_rollouts:
                log.text(rl.sample_text(tokenizer, samples, cfg.sample_rollouts, step + 1),
                         f"rollouts/step_{step + 1:06d}.txt")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save(step + 1)

    # the reasoning guard, after
    guard: dict[str, Any] | None = None
    after = None
    if cfg.reasoning_eval is not None:
        after = on_rank0(lambda: reasoning_check(engine, eval_set, decode, cfg),
                             "the reasoning check after training")
    if rank == 0 and after is not None:
        delta = after["accuracy"] - before["accuracy"]
        guard = {"data": cfg.reasoning_eval.data, "domain": cfg.reasoning_eval.domain, "rows": int(after["n"]),
                 "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"], "delta": delta,
                 "response_len_before": before["response_len_mean"], "response_len_after": after["response_len_mean"],
                 "truncated_before": before["truncated_fraction"], "truncated_after": after["truncated_fraction"]}
        log.metrics(cfg.steps, {**{f"reasoning_eval/{k}_after": v for k, v in after.items()},
                                "reasoning_eval/delta": delta})
        info(f"general_rl: reasoning set accuracy {before['accuracy']:.4f} -> {after['accuracy']:.4f} "
             f"(delta {delta:+.4f})")

    rl.save_hf(ds_engine, tokenizer, out, rank, zero3, cfg.gradient_checkpointing)
    if rank != 0:
        dist.barrier()
        return None
    summary = rl.summarize(history, scheduler.totals, {
        "scheduler": cfg.scheduler, "correction": cfg.correction, "world_size": world, "resumed_from_step": latest,
        "frozen_params": len(frozen), "prompts": len(data["rows"]), "prompts_skipped": data["skipped"],
        "prompts_per_source": {s: len(v) for s, v in data["by_source"].items()},
        "source_weights": {s: cfg.data[s].weight for s in data["by_source"]},
        "reward_model": cfg.reward_model, "pool_capacity": cfg.pool_capacity, "token_budget": cfg.token_budget,
        "reasoning_eval": guard, "reasoning_delta": guard["delta"] if guard else None})
    with open(out / "metrics.jsonl", "w") as f:
        for i, h in enumerate(history, 1):
            f.write(json.dumps({"step": i, **{k: v for k, v in h.items() if math.isfinite(v)}}) + "\n")
    (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
    info(f"general_rl: done, {summary['steps']} steps, reward {summary['reward_first']} -> {summary['reward_last']}")
    dist.barrier()
    return summary


def entry(argv: list[str] | None = None) -> int:
    job = StageJob.from_argv(argv)
    try:
        main(job)
    except (rl.RLStageError, CheckpointError, ArtifactError) as e:
        print(f"general_rl: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(entry())

"""The `reasoning_rl` stage's job: `python -m stages.reasoning_rl.trainer --job job.json`.

Process layout (N ranks under the deepspeed launcher; CPU ranks on gloo, GPUs on nccl):
- rank 0 owns the rollout engine (`rollout.engine` on `rollout.device`; `auto` = rank 0's
  own device, i.e. colocated) and the scheduler (C3PO++ or sync, `c3po.py`), which calls the
  verifiers (`verifiers.verify_batch`) for rewards;
- every step rank 0 broadcasts the training batch (token ids, pi_infer, advantages,
  policy versions) with `broadcast_object_list`; all ranks compute pi_train(theta_old) and
  the update (`learner.py`) under DeepSpeed (ZeRO stage from the config, a torch AdamW
  passed in);
- after the update rank 0 pushes the new weights into the engine (`update_weights`; under
  ZeRO-3 every rank joins the per-parameter gathers) and logs the sync time.
A later multi-GPU setup puts the engine on its own device with `rollout.device: cuda:N`.

Policy versions: v = number of updates applied; the rollout engine holds v when step v+1
generates; a rollout carried over keeps the versions of its earlier tokens (c3po.py).

Checkpoints (every `checkpoint_every` steps and at the end, through CheckpointStore): the
DeepSpeed state (module, optimizer) + `scheduler.json.gz` (inference pool, training pool,
open groups, sampler position, counters, metric history). Every node's local rank 0 uploads
its ranks' files, rank 0 marks the step complete; on restart every node's local rank 0
restores the latest complete step and the job resumes with the same unfinished rollouts.

Outputs (rank 0, job.output_dir): the final policy as a Hugging Face dir + tokenizer,
`metrics.jsonl` (one line per step), `stage_summary.json`. Metrics per step and a few
sample rollouts go to MLflow (StageLogger).
"""
from __future__ import annotations

import gzip
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.artifacts import CheckpointStore
from pipeline.stage_api import StageJob
from pipeline.tracking import StageLogger, info
from stages.common.deepspeed_setup import ds_config as _ds_config, initialize
from stages.common.distributed import broadcast, init_distributed, rank0_do, use_bf16
from stages.reasoning_rl.config import ReasoningRLConfig


class RLStageError(RuntimeError):
    """A problem the user can fix (data, model, engine choice); printed without a traceback."""


# -- distributed plumbing ---------------------------------------------------------------------------
def _rank0_do(rank: int, fn, what: str) -> Any:
    """`stages.common.distributed.rank0_do` with this stage's user error (RLStageError)."""
    return rank0_do(rank, fn, what, RLStageError)


class DeepSpeedBackend:
    """learner.Backend over a DeepSpeed engine: gradient accumulation with a caller-chosen
    boundary (the number of micro-batches varies from step to step)."""

    def __init__(self, engine, device, dist):
        self.engine, self.module, self.device, self.dist = engine, engine.module, device, dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def forward(self, mb, temperature: float, chunk: int, with_entropy: bool):
        # through the engine's forward: ZeRO-3 counts micro-steps there (gradient accumulation)
        return self.engine(mb.input_ids, mb.attention_mask, mb.resp_pos, mb.targets, temperature, chunk,
                           with_entropy)

    def backward(self, loss, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss)

    def step(self) -> float:
        import torch

        self.engine.set_gradient_accumulation_boundary(True)
        manual = None
        if not self.engine.zero_optimization():  # DS keeps no norm for plain fp32 data parallel
            grads = [p.grad.detach().float().norm() for p in self.module.parameters() if p.grad is not None]
            manual = float(torch.stack(grads).norm()) if grads else 0.0
        self.engine.step()
        if manual is not None:
            return manual
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    def all_reduce(self, t, op: str):
        if self.world_size > 1:
            self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM if op == "sum" else self.dist.ReduceOp.MAX)
        return t


def push_weights(ds_engine, rollout_engine, rank: int, zero3: bool) -> float:
    """Policy weights -> rollout engine (rank 0). Under ZeRO-3 all ranks join each gather."""
    import deepspeed

    module = ds_engine.module.lm  # the Hugging Face model inside learner.PolicyHead
    t0 = time.perf_counter()

    def named():
        for name, p in module.named_parameters():
            if zero3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    if rank == 0:
                        yield name, p.data.detach().clone()
            else:
                yield name, p.detach()

    if rank == 0:
        rollout_engine.update_weights(named())
    elif zero3:
        for _ in named():
            pass
    return time.perf_counter() - t0


# -- setup pieces ----------------------------------------------------------------------------------
def load_data(job: StageJob, cfg: ReasoningRLConfig, tokenizer):
    from pipeline.artifacts import ArtifactError
    from stages.reasoning_rl.data import RLDataError, load_rows, render_prompts, rows_by_domain
    from verifiers import VERIFIERS

    try:
        sources = [(src, job.fetch(src)) for src in cfg.data_list]
        rows = load_rows(sources)
        rows, prompt_ids, skipped = render_prompts(rows, tokenizer, cfg.prompt_max_len)
    except (RLDataError, ArtifactError) as e:
        raise RLStageError(f"RL data: {e}") from e
    if not rows:
        raise RLStageError(f"every RL prompt is longer than prompt_max_len={cfg.prompt_max_len} tokens")
    domains = rows_by_domain(rows)
    unknown = sorted(d for d in domains if d not in VERIFIERS)
    if unknown:
        first = {d: rows[domains[d][0]]["id"] for d in unknown}
        raise RLStageError(f"RL data has domains with no registered verifier: {first} "
                           f"(first row of each); known domains: {sorted(VERIFIERS)}")
    if cfg.domain_weights is not None:
        missing = sorted(set(cfg.domain_weights) - set(domains))
        if missing:
            raise RLStageError(f"domain_weights name domains absent from the RL data: {missing} "
                               f"(data domains: {sorted(domains)})")
    return rows, prompt_ids, skipped, domains


def make_engine(cfg: ReasoningRLConfig, model_dir: Path, device: str):
    import stages.reasoning_rl.engines  # noqa: F401  (registers the engines it ships)
    from stages.reasoning_rl.engines.base import ENGINES, UNAVAILABLE

    name = cfg.rollout.engine
    if name not in ENGINES:
        why = f" ({UNAVAILABLE[name]})" if name in UNAVAILABLE else ""
        raise RLStageError(f"rollout.engine {name!r} is not available{why}; available: {sorted(ENGINES)}")
    return ENGINES[name](str(model_dir), device=device, dtype=cfg.rollout.dtype, max_batch=cfg.rollout.max_batch,
                         max_len=cfg.prompt_max_len + cfg.max_len, seed=cfg.seed, **cfg.rollout.options)


def rollout_device(cfg: ReasoningRLConfig, train_device) -> str:
    import torch

    d = cfg.rollout.device
    if d == "auto":
        return str(train_device)
    if d.startswith("cuda") and not torch.cuda.is_available():
        raise RLStageError(f"rollout.device is {d!r} but this machine has no CUDA device")
    return "cuda:0" if d == "cuda" else d


def ds_config(cfg: ReasoningRLConfig, bf16: bool) -> dict[str, Any]:
    """One micro-batch per DeepSpeed step: accumulation boundaries are set by the learner."""
    return _ds_config(cfg.zero_stage, cfg.grad_clip, bf16)


def build_policy(cfg, model_dir, device, bf16: bool, pad_id: int):
    """The policy (`cfg.model` loaded, `frozen_param_patterns` frozen) under DeepSpeed, wrapped
    in the learner's PolicyHead, with a torch AdamW over its trainable params; the reference
    model when `kl_coef > 0`; the learner over both. Shared with general_rl (its config
    carries the same policy/loss fields). Returns (ds_engine, learner, frozen names)."""
    import torch
    import torch.distributed as dist

    from stages.reasoning_rl.icepop import LossConfig
    from stages.reasoning_rl.learner import Learner, LearnerConfig, PolicyHead, freeze_parameters

    dtype = torch.bfloat16 if bf16 else torch.float32
    model = load_policy(model_dir, dtype)
    frozen = freeze_parameters(model, cfg.frozen_param_patterns)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    trainable = [p for p in model.parameters() if p.requires_grad]
    ds_engine, _ = initialize(PolicyHead(model), trainable, ds_config(cfg, bf16), lr=cfg.lr, betas=cfg.adam_betas,
                              weight_decay=cfg.weight_decay)
    ref_model = None
    if cfg.kl_coef > 0:
        ref_model = load_policy(model_dir, dtype).to(device).eval()
        ref_model.requires_grad_(False)
    high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps
    loss_cfg = LossConfig(correction=cfg.correction, alpha=cfg.icepop_alpha, beta=cfg.icepop_beta,
                          clip_eps_low=cfg.clip_eps, clip_eps_high=high, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef)
    learner = Learner(DeepSpeedBackend(ds_engine, device, dist),
                      LearnerConfig(loss=loss_cfg, pad_id=pad_id, temperature=cfg.temperature,
                                    micro_batch_tokens=cfg.micro_tokens, updates_per_batch=cfg.updates_per_batch,
                                    ppo_epochs=cfg.ppo_epochs, logit_chunk=cfg.logit_chunk),
                      ref_model=ref_model)
    return ds_engine, learner, frozen


def load_policy(model_dir, dtype):
    """AutoModelForCausalLM in `dtype` (the keyword is `dtype` from transformers 4.56, before
    that `torch_dtype`)."""
    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(model_dir, **{key: dtype})


def save_hf(ds_engine, tokenizer, out: Path, rank: int, zero3: bool, grad_ckpt: bool) -> None:
    module = ds_engine.module.lm
    state = None
    if zero3:  # gathered onto rank 0; keys carry PolicyHead's "lm." prefix
        full = ds_engine._zero3_consolidated_16bit_state_dict()
        state = {k.removeprefix("lm."): v for k, v in full.items()} if rank == 0 else None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if grad_ckpt:
            module.gradient_checkpointing_disable()
        module.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)


def sample_text(tokenizer, samples, n: int, step: int) -> str:
    parts = []
    for s in samples[:n]:
        versions = sorted({v for _, v in s.segments})
        parts.append(f"### {s.uid} (row {s.row_index}, domain {s.domain}) reward {s.reward:.3f} "
                     f"adv {s.advantage:+.3f} finish {s.finish_reason} policy versions {versions}\n"
                     f"reason: {s.reward_reason}\n--- prompt ---\n"
                     f"{tokenizer.decode(s.prompt_ids, skip_special_tokens=False)}\n--- response ---\n"
                     f"{s.response_text}\n")
    return f"step {step}\n\n" + "\n".join(parts)


def batch_metrics(samples) -> dict[str, float]:
    out: dict[str, float] = {}
    by_dom: dict[str, list[float]] = {}
    for s in samples:
        by_dom.setdefault(s.domain, []).append(s.reward)
    rewards = [s.reward for s in samples]
    out["reward_mean"] = sum(rewards) / len(rewards)
    for d, r in sorted(by_dom.items()):
        out[f"reward_mean/{d}"] = sum(r) / len(r)
    lens = [len(s.response_ids) for s in samples]
    out["response_len_mean"] = sum(lens) / len(lens)
    out["response_len_max"] = float(max(lens))
    out["finished_by_length_fraction"] = sum(s.finish_reason == "length" for s in samples) / len(samples)
    out["zero_advantage_fraction"] = sum(s.advantage == 0 for s in samples) / len(samples)
    out["carried_over_trained"] = float(sum(s.carried for s in samples))
    return out


def summarize(history: list[dict[str, float]], sched_totals: dict[str, int], extra: dict[str, Any]) -> dict:
    def mean(key):
        vals = [h[key] for h in history if key in h and math.isfinite(h[key])]
        return sum(vals) / len(vals) if vals else None

    return {
        **extra,
        "steps": len(history),
        "reward_first": history[0]["reward_mean"] if history else None,
        "reward_last": history[-1]["reward_mean"] if history else None,
        "masked_fraction_mean": mean("masked_fraction"),
        "mismatch_kl_mean": mean("mismatch_kl"),
        "weight_sync_seconds_mean": mean("weight_sync_seconds"),
        "rollout_seconds_mean": mean("rollout_seconds"),
        "step_seconds_mean": mean("step_seconds"),
        "carried_over_finished": int(sched_totals.get("carried_over_finished", 0)),
        "carried_over_trained": int(sum(h.get("carried_over_trained", 0) for h in history)),
        "purged": int(sched_totals.get("purged", 0)),
        "groups_dropped": int(sched_totals.get("groups_dropped", 0)),
        "groups_trained": int(sched_totals.get("groups_trained", 0)),
        "rollouts_trained": int(sum(h.get("train_rollouts", 0) for h in history)),
        "tokens_trained": int(sum(h.get("train_tokens", 0) for h in history)),
        "generated_tokens": int(sched_totals.get("generated_tokens", 0)),
    }


# -- the job --------------------------------------------------------------------------------------
def main(job: StageJob) -> None:
    cfg = ReasoningRLConfig.model_validate(job.config)
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from stages.reasoning_rl.c3po import PromptSampler, SchedulerConfig, make_scheduler
    from stages.reasoning_rl.engines.base import SamplingParams

    if cfg.precision == "bf16" and not torch.cuda.is_available():
        raise RLStageError("precision bf16 needs a GPU; use auto or fp32 on CPU")
    ranks = init_distributed(world_of_one_without_launcher=True)
    rank, world, local_rank, device = ranks.rank, ranks.world, ranks.local_rank, ranks.device
    bf16 = use_bf16(cfg.precision, ranks.on_gpu)
    zero3 = cfg.zero_stage == 3
    torch.manual_seed(cfg.seed)
    log = StageLogger.for_job(job)
    work = Path(job.work_dir)
    out = Path(job.output_dir)

    model_dir = job.fetch(cfg.model)
    if not (Path(model_dir) / "config.json").is_file():
        raise RLStageError(f"model {cfg.model}: {model_dir} is not a Hugging Face model dir (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = _rank0_do(rank, lambda: load_data(job, cfg, tokenizer), "loading the RL data")

    # -- policy under DeepSpeed ------------------------------------------------------------------
    ds_engine, learner, frozen = build_policy(cfg, model_dir, device, bf16, pad_id)

    # -- rollout side (rank 0) -----------------------------------------------------------------------
    def build_rollout():
        from verifiers import verify_batch

        rows, prompt_ids, skipped, domains = data
        engine = make_engine(cfg, Path(model_dir), rollout_device(cfg, device))
        sampler = PromptSampler(domains, cfg.domain_weights, seed=cfg.seed)
        sched_cfg = SchedulerConfig(rollouts_per_prompt=cfg.rollouts_per_prompt, max_new_tokens=cfg.max_len,
                                    prompts_per_step=cfg.prompts_per_step, pool_capacity=cfg.pool_capacity,
                                    token_budget=cfg.token_budget, retention_limit=cfg.c3po.retention_limit,
                                    min_group_size=cfg.c3po.min_group_size, adv_eps=cfg.adv_eps)
        sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)

        def reward_fn(rws, texts):
            return verify_batch(rws, texts, num_workers=cfg.verifier_workers, timeout_s=cfg.verifier_timeout_s)

        def decode(ids):
            return tokenizer.decode(ids, skip_special_tokens=True)

        sched = make_scheduler(cfg.scheduler, engine, sched_cfg, rows, prompt_ids, sampler, sampling, decode,
                               reward_fn)
        return engine, sched

    built = _rank0_do(rank, build_rollout, "starting the rollout engine")
    rollout_engine, scheduler = built if rank == 0 else (None, None)

    # -- resume -------------------------------------------------------------------------------------
    store = CheckpointStore(job.stage_url, job.storage_options)
    latest = broadcast(store.latest() if rank == 0 else None)
    history: list[dict[str, float]] = []
    start = 0
    resumed: dict[str, int] = {}
    if latest is not None:
        local = work / "resume"
        if local_rank == 0:
            store.restore(latest, local)
        dist.barrier()
        load_path, _ = ds_engine.load_checkpoint(str(local / "ds"), tag="state")
        if load_path is None:
            raise RLStageError(f"checkpoint step {latest} under {job.stage_url}/checkpoints has no DeepSpeed state")
        if rank == 0:
            with gzip.open(local / "scheduler.json.gz", "rt") as f:
                state = json.load(f)
            scheduler.load_state_dict(state["scheduler"])
            history = state["history"]
            resumed = {"resumed_pool_rollouts": len(scheduler.pool),
                       "resumed_pool_tokens": sum(len(r.token_ids) for r in scheduler.pool.values()),
                       "resumed_waiting_rollouts": len(scheduler.waiting)}
        start = latest
        sync_s = push_weights(ds_engine, rollout_engine, rank, zero3)
        if rank == 0:
            info(f"reasoning_rl: resumed from step {latest} with {resumed['resumed_pool_rollouts']} unfinished "
                 f"rollouts in the pool (weights pushed to the engine in {sync_s:.2f}s)")
    if rank == 0:
        info(f"reasoning_rl: {len(data[0])} prompts ({data[2]} skipped as too long), domains "
             f"{ {d: len(v) for d, v in data[3].items()} }, scheduler {cfg.scheduler}, correction "
             f"{cfg.correction}, world {world}, frozen {len(frozen)} params, steps {start}..{cfg.steps}")

    def save_checkpoint(step: int) -> None:
        import shutil

        local = work / "checkpoint" / f"step-{step:08d}"
        if local_rank == 0:  # leftovers of a killed run must not mix into this checkpoint
            shutil.rmtree(local, ignore_errors=True)
        dist.barrier()
        ds_engine.save_checkpoint(str(local / "ds"), tag="state")
        if rank == 0:
            with gzip.open(local / "scheduler.json.gz", "wt") as f:
                json.dump({"scheduler": scheduler.state_dict(), "history": history, "step": step}, f)
        if rank == 0:
            store.clear(step)  # a stale, never completed upload of this step
        dist.barrier()
        if local_rank == 0:  # each node uploads its own ranks' files (one node: all of them)
            store.upload(local, step)
        dist.barrier()
        if rank == 0:
            store.mark_complete(step)
        dist.barrier()
        if local_rank == 0:  # the store has it now; local copies would pile up
            shutil.rmtree(local, ignore_errors=True)

    # -- the loop -----------------------------------------------------------------------------------
    for step in range(start, cfg.steps):
        t_step = time.perf_counter()
        version = step  # updates applied so far

        batch = _rank0_do(rank, lambda: scheduler.next_batch(version), f"step {step + 1}: rollouts")
        samples = broadcast(batch.samples if rank == 0 else None)
        t_train = time.perf_counter()
        stats = learner.train(samples, version)
        t_train = time.perf_counter() - t_train
        sync_s = push_weights(ds_engine, rollout_engine, rank, zero3)
        if rank == 0:
            m = {**batch.stats, **stats, **batch_metrics(samples)}
            m["train_seconds"] = t_train
            m["weight_sync_seconds"] = sync_s
            engine_sync = getattr(rollout_engine, "last_sync_seconds", None)
            if engine_sync is not None:
                m["engine_sync_seconds"] = float(engine_sync)
            m["step_seconds"] = time.perf_counter() - t_step
            m["generated_tokens_per_second"] = (m["generated_tokens"] / m["rollout_seconds"]
                                                if m["rollout_seconds"] else 0.0)
            m["policy_version"] = float(version + 1)
            history.append(m)
            log.metrics(step + 1, m)
            if cfg.sample_rollouts:
                log.text(sample_text(tokenizer, samples, cfg.sample_rollouts, step + 1),
                         f"rollouts/step_{step + 1:06d}.txt")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(step + 1)

    # -- outputs ------------------------------------------------------------------------------------
    save_hf(ds_engine, tokenizer, out, rank, zero3, cfg.gradient_checkpointing)
    if rank == 0:
        summary = summarize(history, scheduler.totals, {
            "scheduler": cfg.scheduler, "correction": cfg.correction, "world_size": world,
            "resumed_from_step": latest, "frozen_params": len(frozen), "frozen_param_names": frozen[:20], "prompts": len(data[0]),
            "prompts_skipped": data[2], "pool_capacity": cfg.pool_capacity, "token_budget": cfg.token_budget,
            "retention_limit": cfg.c3po.retention_limit, **resumed})
        with open(out / "metrics.jsonl", "w") as f:
            for i, h in enumerate(history, 1):
                f.write(json.dumps({"step": i, **h}) + "\n")
        (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
        info(f"reasoning_rl: done: {json.dumps({k: summary[k] for k in ('steps', 'reward_first', 'reward_last', 'carried_over_trained', 'purged')})}")
    dist.barrier()
    dist.destroy_process_group()


def entry(argv: list[str] | None = None) -> int:
    from pipeline.artifacts import ArtifactError

    job = StageJob.from_argv(argv)
    try:
        main(job)
    except (RLStageError, ArtifactError) as e:
        print(f"reasoning_rl: error: {e}", file=sys.stderr, flush=True)
        _shutdown_distributed()  # every rank got the same error; leave the group cleanly
        return 2
    return 0


def _shutdown_distributed() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


if __name__ == "__main__":
    sys.exit(entry())

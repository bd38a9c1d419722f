"""What each rank of the data-parallel tests (test_data_parallel.py) runs: gloo processes
started with torch.multiprocessing, each writing what it saw to `out/rank{r}.json`."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# the torch engine stops a rollout on any of these (a random policy's tokens are near-uniform,
# so lengths spread like a geometric distribution up to the cap)
STOP_IDS = list(range(2, 300, 15))


def join_env(rank: int, world: int, port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)


class RecordingEngine:
    """The torch engine, with every call's budget, request uids and finished tokens recorded."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, sampling, finished_token_budget=None):
        updates = self.engine.generate(requests, sampling, finished_token_budget=finished_token_budget)
        self.calls.append({"budget": finished_token_budget, "uids": [r.uid for r in requests],
                           "finished_tokens": sum(len(r.generated_ids) + len(u.token_ids)
                                                  for r, u in zip(requests, updates) if u.finished)})
        return updates


def _samples(batch) -> list[dict]:
    return [{"uid": s.uid, "group": s.group_id, "row": s.row_index, "response": s.response_ids,
             "logprobs": s.infer_logprobs, "advantage": s.advantage} for s in batch.samples]


def colocated(rank: int, world: int, port: int, model_dir: str, out: str, cfg: dict) -> None:
    """Every rank an engine: the scheduler shards (`scheduler_shards`), then the weight sync; then
    the weight sync into one engine for all ranks (a tensor-parallel group: rank 0's)."""
    from stages.common.distributed import init_distributed

    join_env(rank, world, port)
    ranks = init_distributed()
    record = {"shards": scheduler_shards(rank, model_dir, cfg), "sync": weight_sync(ranks, model_dir, split=False),
              "sync_tp": weight_sync(ranks, model_dir, split=False, tp=world)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    ranks.everyone.barrier()
    _leave()


def split(rank: int, world: int, port: int, model_dir: str, out: str, _: None) -> None:
    """The last rank an engine, the others trainers in a world of their own: the weight sync,
    then the end of the job, the engine rank a second after the trainers."""
    from stages.common.distributed import init_distributed, wait_for_every_rank

    join_env(rank, world, port)
    ranks = init_distributed(split_last=1)
    record = {"sync": weight_sync(ranks, model_dir, split=True, rounding_seed=7)}
    if rank == world - 1:
        time.sleep(1.0)  # the engine's role world ends last: the trainers' end must wait for it
    record["finished_at"] = time.time()
    wait_for_every_rank()  # what a stage job's ranks do at its end (stages/common/entry.py)
    record["left_at"] = time.time()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    _leave()


def scheduler_shards(rank: int, model_dir: str, cfg: dict) -> dict:
    """C3PO++ over the world's engines (3 steps, the third replayed from the state saved
    before it), then the sync baseline for one step."""
    from stages.common.groups import WorldGroup
    from stages.rl.engines import SamplingParams, create_engine
    from stages.rl.prompt_sampler import PromptSampler
    from stages.rl.rollout_records import SchedulerConfig
    from stages.rl.scheduler import make_scheduler
    from tests.stages.rl.fakes import decode, parity_reward

    engine = RecordingEngine(create_engine("torch", model_dir, device="cpu", max_batch=4, max_len=64, seed=0,
                                           eos_token_ids=STOP_IDS))
    rows = [{"id": f"r{i}", "domain": "toy"} for i in range(10)]
    prompt_ids = [[3 + i, 40 + i] for i in range(10)]

    def make(mode: str):
        sampler = PromptSampler({"toy": list(range(10))}, None, seed=0)
        return make_scheduler(mode, engine, SchedulerConfig(**cfg), rows, prompt_ids, sampler, SamplingParams(seed=7),
                              decode, parity_reward if rank == 0 else None, peers=WorldGroup())

    record: dict = {"steps": []}
    sched = make("c3po")
    for step in range(3):
        if step == 2:
            state = json.loads(json.dumps(sched.state_dict()))
            record["pool_before_step_3"] = sorted(sched.pool)
        first = len(engine.calls)
        batch = sched.next_batch(step)
        record["steps"].append({"calls": engine.calls[first:], "samples": _samples(batch), "stats": batch.stats})
    again = make("c3po")
    again.load_state_dict(state)
    record["replayed"] = _samples(again.next_batch(2))
    first = len(engine.calls)
    batch = make("sync").next_batch(0)
    record["sync"] = {"calls": engine.calls[first:], "samples": _samples(batch)}
    return record


def weight_sync(ranks, model_dir: str, split: bool, tp: int = 1, rounding_seed: int | None = None) -> dict:
    """A ZeRO-3 policy on the trainer ranks takes one optimizer step; the weights are pushed
    to the engine ranks (colocated: every rank, or every `tp`-th; split: the last one), each
    engine having slept and woken without its weights; each engine reports where it differs
    from the trainer's gathered weights. `rounding_seed`: then pushed again into new bf16
    engines with stochastic sync rounding (`stochastic_sync`)."""
    # this spawned rank never logs to MLflow: skip DeepSpeed's ~4 s import of it, as stage ranks do
    # (stages/common/entry.py)
    sys.modules.setdefault("mlflow", None)
    import deepspeed

    from stages.common.deepspeed_setup import ds_config, initialize
    from stages.common.hf_io import load_causal_lm
    from stages.rl.engines import create_engine
    from stages.rl.placement import Placement
    from stages.rl.weight_sync import make_weight_sync

    rank, world = ranks.rank, ranks.world
    trainers = range(world - 1) if split else range(world)
    engines = range(world - 1, world) if split else range(0, world, tp)
    placement = Placement(rank, world, trainers, engines, tp)
    module = None
    if placement.is_trainer:
        model = load_causal_lm(model_dir, torch.float32, trust_remote_code=False)
        ds_engine, _ = initialize(model, model.parameters(), ds_config(3, 1.0, "fp32"), lr=0.05, betas=(0.9, 0.99))
        ids = torch.randint(2, 300, (2, 12), generator=torch.Generator().manual_seed(rank))
        ds_engine.backward(ds_engine(input_ids=ids, labels=ids).loss)
        ds_engine.step()
        module = ds_engine.module
    engine = create_engine("torch", model_dir, device="cpu", max_batch=4, max_len=64) if placement.is_engine else None
    sync = make_weight_sync(placement, ranks, module, engine, zero3=True, bucket_bytes=64 << 10)
    if engine is not None:
        engine.sleep(weights=True)
        engine.wake()
    seconds = sync.push(1)

    trained = None
    if module is not None:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            trained = {n: p.detach().clone() for n, p in module.named_parameters()}
    trained = ranks.everyone.broadcast_object(trained if rank == 0 else None, 0)
    record = {"seconds": seconds, "bytes": sync.bytes}
    if engine is not None:
        params = dict(engine.model.named_parameters())
        record["differs"] = sorted(n for n, t in trained.items() if not torch.equal(params[n], t))
        record["compared"] = len(trained)
        base = dict(load_causal_lm(model_dir, torch.float32, trust_remote_code=False).named_parameters())
        record["moved"] = sorted(n for n, t in trained.items() if not torch.equal(base[n], t))
        record["buckets"] = len(getattr(sync, "layout", None) or sync.buckets)
    if rounding_seed is not None:
        record["stochastic"] = stochastic_sync(ranks, placement, module, model_dir, trained, rounding_seed)
    return record


FROZEN = "model.layers.0.post_attention_layernorm.weight"  # between trained fp32 tensors: a bucket of its own


def stochastic_sync(ranks, placement, module, model_dir: str, trained: dict, seed: int) -> dict:
    """The trained weights pushed (version 1) into a bf16 engine per engine rank with
    `rollout.sync_rounding: stochastic` and stage seed `seed`, one of them frozen (sent as it is,
    rounded to nearest by the engine); each engine reports where it differs from the trainer's
    weights rounded under the documented seed."""
    from stages.rl.engines import create_engine
    from stages.rl.stochastic_rounding import SyncRounding, stochastic_round_bf16, tensor_seed
    from stages.rl.weight_sync import make_weight_sync

    engine = (create_engine("torch", model_dir, device="cpu", dtype="bfloat16", max_batch=4, max_len=64)
              if placement.is_engine else None)
    if module is not None:
        dict(module.named_parameters())[FROZEN].requires_grad_(False)
    sync = make_weight_sync(placement, ranks, module, engine, zero3=True, bucket_bytes=64 << 10,
                            rounding=SyncRounding(seed))
    sync.push(1)
    record = {"bytes": sync.bytes}
    if engine is not None:
        want = {n: t.to(torch.bfloat16) if n == FROZEN else
                stochastic_round_bf16(t, torch.Generator().manual_seed(tensor_seed(seed, 1, n)))
                for n, t in trained.items()}
        params = dict(engine.model.named_parameters())
        record["differs"] = sorted(n for n, t in want.items() if not torch.equal(params[n], t))
        record["compared"], record["frozen_numel"] = len(want), trained[FROZEN].numel()
        record["not_nearest"] = sorted(n for n, t in trained.items() if not torch.equal(params[n], t.to(torch.bfloat16)))
    return record


def _leave() -> None:
    """End a rank once its record is written and every rank passed the last barrier: leave
    the process group, then exit without the interpreter's teardown, where a background
    thread of the gloo/DeepSpeed stack now and then aborts the process ("terminate called
    without an active exception") on a loaded machine, after all the work is checked in."""
    dist.destroy_process_group()
    os._exit(0)

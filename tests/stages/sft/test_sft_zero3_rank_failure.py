"""What the multi-GPU issue asks, at the scale this machine allows (2 CPU ranks on gloo):
ZeRO-3 SFT consolidates a loadable HF model from the shards, and a rank killed mid-run
fails the stage cleanly (the launcher stops the other ranks; no hang)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.live_processes import running_below_us

pytestmark = pytest.mark.slow

CONFIG = {"model": "${stages.base.output}", "data": "${stages.data.output}/sft.jsonl",
          "max_seq_len": 512, "epochs": 1, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 2,
          "zero_stage": 3}


def _kwargs(stage_env, data_artifact, base_artifact, recipe, launcher="deepspeed"):
    from stages.common.contract import Resources

    return dict(stage="sft", storage=stage_env["storage"], recipe=recipe, launcher=launcher,
                upstream={"base": base_artifact.url, "data": data_artifact.url},
                work_root=stage_env["work_root"], resources=Resources(cpu_ranks=2))


def test_zero3_two_ranks_consolidates_a_loadable_model(stage_env, data_artifact, base_artifact):
    import torch
    from transformers import AutoModelForCausalLM

    from data_curation.urls import local_path
    from pipeline.execute import run_stage

    # torchrun starts the ranks faster than deepspeed's runner; the consolidation is the job's
    # (the deepspeed launcher's ZeRO-3 ranks are the rank-kill test's below)
    run = run_stage("sft", {**CONFIG, "max_steps": 6},
                    **_kwargs(stage_env, data_artifact, base_artifact, "zero3", launcher="torchrun"))
    assert run.summary["zero_stage"] == 3 and run.summary["world_size"] == 2
    trained = AutoModelForCausalLM.from_pretrained(Path(local_path(run.url)))
    base = AutoModelForCausalLM.from_pretrained(Path(local_path(base_artifact.url)))
    # full (not partitioned) tensors, and they moved away from the base weights
    for (name, p), (_, q) in zip(trained.named_parameters(), base.named_parameters()):
        assert p.shape == q.shape, name
    assert any(not torch.equal(p, q) for p, q in zip(trained.parameters(), base.parameters()))


def test_killing_one_rank_fails_the_stage_without_hanging(stage_env, data_artifact, base_artifact):
    from pipeline.execute import run_stage
    from pipeline.hang import rank_processes
    from stages.common.contract import StageFailed

    outcome: dict = {}

    def run() -> None:
        try:
            run_stage("sft", {**CONFIG, "max_steps": 400},
                      **_kwargs(stage_env, data_artifact, base_artifact, "rankkill"))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcome["error"] = e

    def training() -> bool:
        """Rank 0 logged a step: both ranks are in the training loop (each step all-reduces)."""
        return any("[metrics] " in log.read_text()
                   for log in Path(stage_env["work_root"]).glob("rankkill/sft-*/*/stage.log"))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    victim = None
    deadline = time.time() + 240
    while victim is None and time.time() < deadline and worker.is_alive():
        if training():
            for rank, pid in rank_processes(os.getpid()):  # the ranks as the hang report finds them
                if rank == "1":
                    victim = psutil.Process(pid)  # rank 1, mid-run (of its 400 steps)
        time.sleep(0.2)
    assert victim is not None, outcome
    victim.kill()
    killed_at = time.time()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the stage hung after a rank died"
    assert isinstance(outcome.get("error"), StageFailed), outcome
    assert time.time() - killed_at < 120
    leftovers = running_below_us("stages.sft.job")
    assert not leftovers, leftovers

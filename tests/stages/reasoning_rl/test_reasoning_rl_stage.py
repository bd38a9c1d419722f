"""The reasoning_rl stage end to end on a tiny policy (CPU, gloo, DeepSpeed ZeRO-2).

C3PO++ + IcePop steps; a killed job resumes from its checkpoint with the same unfinished
rollouts (and refuses to resume on another world size); at least one rollout is carried
across an update and finished by the newer policy; outputs published; metrics and sample
rollouts in MLflow.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.mlflow_db import tracking_uri

pytestmark = pytest.mark.slow


def rl_config(policy: dict[str, Path], **over) -> dict:
    cfg = {
        "model": str(policy["model"]), "data": str(policy["data"]), "steps": 4,
        "prompts_per_step": 4, "rollouts_per_prompt": 4, "max_len": 24, "prompt_max_len": 64,
        "lr": 1e-3, "c3po": {"pool_capacity": 8, "token_budget": 40, "retention_limit": 3},
        "rollout": {"engine": "torch", "device": "cpu", "max_batch": 8}, "verifier_workers": 0,
        "checkpoint_every": 2, "zero_stage": 2, "seed": 0,
    }
    cfg.update(over)
    return cfg


def test_stage_runs_c3po_icepop_resumes_after_kill_and_publishes(tiny_policy, tmp_path):
    """ZeRO-2 on one CPU rank (the suite's time; two ranks are exercised by the tiny recipe).
    The stage's job is started by hand (plain process) on the artifact directory run_stage
    will use and killed (process group, SIGKILL) once step 2 is checkpointed; run_stage
    then runs the same stage under torchrun: it resumes from that checkpoint with the same
    unfinished rollouts, finishes, and publishes. (torchrun starts ranks ~20 s sooner than
    deepspeed's runner on 2 cores; tests/stages/sft/test_sft_zero3_rank_failure.py runs a stage
    under the deepspeed launcher, which is the same command for every stage kind.)"""
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from pipeline.execute import adhoc_target, run_stage
    from pipeline.launch import build_command
    from stages.common.checkpoint import rank_state_file, read_state
    from stages.common.checkpoint_store import CheckpointStore
    from stages.common.contract import Resources, StageFailed, StageJob
    from stages.registry import STAGE_KINDS

    # an fp32 trainer syncing into a bf16 engine with stochastic rounding (issue 34): the resumed
    # run pushes the restored weights as the version it resumes from
    config = rl_config(tiny_policy, precision="fp32", rollout={"engine": "torch", "device": "cpu", "max_batch": 8,
                                                               "dtype": "bf16", "sync_rounding": "stochastic"})
    storage, resources = str(tmp_path / "store"), Resources(cpu_ranks=1)
    spec = STAGE_KINDS["reasoning_rl"]
    cfg = spec.config.model_validate({"kind": "reasoning_rl", **config})
    target = adhoc_target("reasoning_rl", config, stage="rl", storage=storage)
    h, url = target.hash, target.url  # where run_stage will put it

    # 1) the job, killed after its first checkpoint. It is told to stop after step 3 (it
    #    writes to run_stage's artifact directory all the same), so however fast the tiny
    #    steps run, the kill finds it short of run_stage's 4 steps: latest is 2 or 3.
    killed_cfg = {**cfg.model_dump(mode="json"), "steps": 3}
    job = StageJob(recipe="adhoc", stage="rl", kind="reasoning_rl", hash=h, config=killed_cfg,
                   stage_url=url, output_dir=str(tmp_path / "killed_out"), work_dir=str(tmp_path / "killed_scratch"))
    job.write(tmp_path / "job.json")
    cmd = build_command(spec.entry, tmp_path / "job.json", resources, "local", True)
    repo = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false"}
    store = CheckpointStore(url, {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=repo,
                            start_new_session=True, text=True)
    deadline = time.time() + 300
    while store.latest() is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    log = proc.communicate()[0]
    latest = store.latest()
    assert latest in (2, 3), log[-3000:]
    restored = store.restore(latest, tmp_path / "inspect")
    saved = read_state(restored)
    assert saved["step"] == latest
    assert saved["fingerprint"] == {"world size": 1, "rollout placement": "colocated: 1 engine"}
    state = read_state(restored, rank_state_file(0))["rollouts"]  # the engine rank's pools

    # 2) the checkpoint was written by one rank: two ranks refuse it, naming both world sizes
    #    (the job checks, not the launcher: torchrun, which starts ranks faster than deepspeed's)
    kw = dict(stage="rl", storage=storage, work_root=tmp_path / "work")
    with pytest.raises(StageFailed, match="world size 1, .*; this run has world size 2"):
        run_stage("reasoning_rl", config, resources=Resources(cpu_ranks=2), launcher="torchrun", **kw)

    # 3) run_stage: resumes, finishes, publishes
    uri = tracking_uri(tmp_path)
    kw.update(resources=resources, tracking_uri=uri, launcher="torchrun")
    run = run_stage("reasoning_rl", config, **kw)
    assert run.status == "ran" and run.url == url
    s = run.summary
    assert s["resumed_from_step"] == latest and s["world_size"] == 1
    assert s["resumed_pool_rollouts"] == len(state["pool"])
    assert s["resumed_pool_tokens"] == sum(len(r["token_ids"]) for r in state["pool"])
    assert s["resumed_waiting_rollouts"] == len(state["waiting"])
    assert s["steps"] == 4 and s["scheduler"] == "c3po" and s["correction"] == "icepop"
    assert s["sync_rounding"] == "stochastic"
    # a rollout crossed a weight update, was finished by the newer policy and trained
    assert s["carried_over_finished"] >= 1 and s["carried_over_trained"] >= 1
    assert s["rollouts_trained"] > 0 and s["tokens_trained"] > 0
    assert 0.0 <= s["masked_fraction_mean"] < 0.5 and s["mismatch_kl_mean"] >= 0.0

    out = Path(run.url.removeprefix("file://"))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "stage_summary.json"):
        assert (out / f).is_file(), f
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for key in ("masked_fraction", "mismatch_kl", "abs_log_k_max", "abs_log_k_mean", "entropy_all", "grad_norm",
                "reward_mean/math", "weight_sync_seconds", "rollout_seconds", "purged", "carried_over"):
        assert all(key in m for m in lines), key
    assert lines[0]["stale_token_fraction"] == 0.0  # nothing can be stale before the first update
    # the published policy loads and moved away from the SFT model
    trained = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_policy["model"])
    assert any(not (p == q).all() for p, q in zip(trained.parameters(), base.parameters()))

    client = MlflowClient(uri)
    hist = client.get_metric_history(run.run_id, "icepop/masked_fraction")  # its MLflow section
    assert sorted(m.step for m in hist) == list(range(latest + 1, 5))  # this run's steps
    arts = [a.path for a in client.list_artifacts(run.run_id, "rollouts")]
    assert f"rollouts/step_{latest + 1:06d}.txt" in arts

    assert run_stage("reasoning_rl", config, **kw).status == "skipped"

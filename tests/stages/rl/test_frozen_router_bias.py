"""The recipe holds the MoE router's expert bias fixed during RL (paper: aux-loss-free
balancing is not trained by the RL objective): a reasoning_rl run on a ring_moe policy
(custom code, trust_remote_code) leaves every `expert_bias` bit-identical while every other
parameter moved.

The policy's bias is set non-zero first, as a pre-trained router's is: a zero bias would
stay zero under weight decay even if it were trained, and the test could not fail. The
task is one a random policy sometimes passes (IFEval: fewer than 3 words), so GRPO groups
have reward variance and the update has a gradient; its rows name their fields differently
and carry no domain (RLData's field mapping and default domain).

The run replays the engine's routes in the learner (`routing_replay`, stages/rl/routing.py):
the router weights still get their gradient (through the weights of the replayed experts),
and every step reports the expert-choice disagreement and the |log k| quantiles."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


def test_reasoning_rl_keeps_the_router_bias_and_moves_the_rest(stage_env, moe_base_artifact, tmp_path):
    from safetensors.torch import load_file, save_file

    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    policy = tmp_path / "policy"
    shutil.copytree(Path(local_path(moe_base_artifact.url)), policy, ignore=shutil.ignore_patterns("_SUCCESS", "manifest.json"))
    before = load_file(policy / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in before:
        if name.endswith("expert_bias"):
            before[name] = torch.randn(before[name].shape, generator=g)
    save_file(before, policy / "model.safetensors", metadata={"format": "pt"})

    short = {"instruction_id_list": ["length_constraints:number_words"],
             "kwargs": [{"relation": "less than", "num_words": 3}]}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"Say something about the number {i}.", "check": short})
                             + "\n" for i in range(8)))
    run = run_stage("reasoning_rl", {
        "model": str(policy), "trust_remote_code": True,
        "data": {"path": str(tasks), "fields": {"prompt": "question", "reference": "check"},
                 "default_domain": "ifeval"},
        "steps": 2, "prompts_per_step": 2, "rollouts_per_prompt": 4, "max_len": 6, "prompt_max_len": 96,
        "lr": 1e-3, "scheduler": "sync", "rollout": {"engine": "torch", "device": "cpu", "max_batch": 4},
        "verifier_workers": 0, "checkpoint_every": 2, "zero_stage": 2, "routing_replay": True},
        stage="moe_rl", storage=stage_env["storage"], recipe=stage_env["recipe"],
        # one rank: the job itself, no launcher process (the stage is the same under any launcher)
        work_root=stage_env["work_root"], resources=Resources(cpu_ranks=1), launcher="local")
    after = load_file(Path(local_path(run.url)) / "model.safetensors")
    assert after.keys() == before.keys()
    bias = [n for n in before if n.endswith("expert_bias")]
    assert bias == ["model.layers.1.mlp.gate.expert_bias"]
    for name in before:  # zero-initialised biases move only with a gradient
        same = torch.equal(before[name], after[name])
        assert same == (name in bias), name
    for f in ("modeling_ring_moe.py", "configuration_ring_moe.py"):  # the code travels with the model
        assert (Path(local_path(run.url)) / f).read_bytes() == (policy / f).read_bytes()
    steps = [json.loads(line) for line in (Path(local_path(run.url)) / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:  # fp32 engine and trainer on the same weights: they route alike
        assert m["expert_disagreement"] == 0.0 and m["abs_log_k_p99"] < 1e-3

"""reasoning_rl with `lora:` on the tiny policy (one CPU rank, ZeRO-2): the reference pass is
the policy with its adapters off (the KL to it is exactly 0 at the first step, when the
adapters' B is still 0, and positive once they moved), the engine samples with the merged
adapters after each update (the train-inference mismatch stays at fp32 rounding), only the
adapted layers travel in the weight sync, and the published model is the merged one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
TARGETS = ("q_proj", "v_proj")


@pytest.mark.timeout(300)
def test_lora_reasoning_rl_reference_sync_and_merged_model(tiny_policy, tmp_path):
    from safetensors.torch import load_file

    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    config = {"model": str(tiny_policy["model"]), "data": str(tiny_policy["data"]), "steps": 3,
              "prompts_per_step": 4, "rollouts_per_prompt": 4, "max_len": 16, "prompt_max_len": 64,
              "lr": 2e-2, "kl_coef": 0.05, "updates_per_batch": 1, "ppo_epochs": 1, "scheduler": "sync",
              "rollout": {"engine": "torch", "device": "cpu", "max_batch": 16}, "verifier_workers": 0,
              "checkpoint_every": 10, "zero_stage": 2, "seed": 0,
              "lora": {"rank": 4, "alpha": 16, "target_modules": [f"*.{m}" for m in TARGETS]}}
    run = run_stage("reasoning_rl", config, stage="rl", storage=str(tmp_path / "store"), resources=Resources(),
                    launcher="local", work_root=tmp_path / "work")
    out = Path(local_path(run.url))
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert history[0]["kl_ref"] == 0.0  # B = 0: the adapted policy is its reference, exactly
    assert history[-1]["kl_ref"] > 0  # the adapters moved it away from the base
    # the engine sampled from the merged adapters: its log-probs match the trainer's to rounding
    assert all(h["abs_log_k_max"] < 1e-3 for h in history), [h["abs_log_k_max"] for h in history]

    weights, base = load_file(str(out / "model.safetensors")), load_file(str(tiny_policy["model"] / "model.safetensors"))
    assert weights.keys() == base.keys()
    moved = {n for n, w in weights.items() if not torch.equal(w, base[n].to(w.dtype))}
    assert moved and all(n.endswith(tuple(f"{m}.weight" for m in TARGETS)) for n in moved), moved
    changed_bytes = sum(base[n].numel() * 4 for n in base if n.endswith(tuple(f"{m}.weight" for m in TARGETS)))
    s = run.summary
    assert s["weight_sync_bytes"] == changed_bytes  # the merged adapted layers, nothing else
    assert s["lora"]["publish"] == "merged" and s["lora"]["base_artifact"] is None
    assert s["lora"]["base_model"].endswith("policy")

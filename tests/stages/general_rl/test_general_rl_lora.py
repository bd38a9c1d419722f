"""general_rl with `lora:` publishing the adapter alone (one CPU rank, rule rewards): the
artifact is peft's adapter, naming the base model's artifact and stage hash, and loads with
peft onto that base."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_lora_general_rl_publishes_the_adapter_of_its_base(rlhf_data, base_artifact, stage_env):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    config = {"model": "${stages.base.output}", "data": {"math": {"path": str(rlhf_data.math)}},
              "steps": 2, "prompts_per_step": 2, "rollouts_per_prompt": 4, "max_len": 12, "prompt_max_len": 128,
              "c3po": {"pool_capacity": 8, "token_budget": 32}, "lr": 1e-2, "rollout": {"max_batch": 8},
              "verifier_workers": 0, "checkpoint_every": 10, "sample_rollouts": 0, "reward": {"rm_weight": 0},
              "reasoning_eval": None,
              "lora": {"rank": 2, "target_modules": ["*.o_proj"], "train_fully": ["model.norm"],
                       "publish": "adapter"}}
    run = run_stage("general_rl", config, stage="grllora", storage=stage_env["storage"], recipe="grllora",
                    work_root=stage_env["work_root"], launcher="local", resources=Resources(),
                    upstream={"base": base_artifact.url})
    out = Path(local_path(run.url))
    assert not (out / "model.safetensors").exists() and (out / "adapter_model.safetensors").is_file()
    lora = run.summary["lora"]
    assert lora["publish"] == "adapter" and lora["base_hash"] == base_artifact.hash
    assert lora["train_fully"] == ["model.norm"] and lora["target_modules"] == 2
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == lora["base_model"] == base_artifact.url.rstrip("/")
    keys = set(load_file(str(out / "adapter_model.safetensors")))
    assert keys == {f"base_model.model.model.layers.{i}.self_attn.o_proj.lora_{ab}.weight"
                    for i in (0, 1) for ab in "AB"} | {"base_model.model.model.norm.weight"}
    base = AutoModelForCausalLM.from_pretrained(Path(local_path(base_artifact.url)))
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        after = PeftModel.from_pretrained(base, str(out))(input_ids=ids).logits
    assert not torch.allclose(before, after)  # the adapter holds what RL trained

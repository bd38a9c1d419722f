"""reward_model with `lora:` under ZeRO-3 (one CPU rank): the new score head trains fully beside
the adapters, the published merged model is a plain sequence classifier whose adapted layers
and head moved while the rest is the base's, and a run resumed from its ZeRO-3 checkpoint (the
adapters and the head, no frozen weight) publishes the same weights."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.stages.conftest import RM_CONFIG

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_lora_reward_model_zero3_trains_the_head_and_publishes_merged(rlhf_data, base_artifact, stage_env):
    from safetensors.torch import load_file

    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    config = {**RM_CONFIG, "data": str(rlhf_data.prefs), "max_steps": 4, "zero_stage": 3, "checkpoint_every": 2,
              "lora": {"rank": 4, "target_modules": ["*.k_proj", "*.up_proj"]}}
    kwargs = dict(stage="rmlora", storage=stage_env["storage"], recipe="rmlora", work_root=stage_env["work_root"],
                  launcher="local", resources=Resources(), upstream={"base": base_artifact.url})
    run = run_stage("reward_model", config, **kwargs)
    out = Path(local_path(run.url))
    weights = load_file(str(out / "model.safetensors"))
    # as if the job had died after its step-2 checkpoint: the rerun resumes there, to the same weights
    (out / "_SUCCESS").unlink()
    (out / "model.safetensors").unlink()  # what the rerun publishes, not what is left
    again = run_stage("reward_model", config, **kwargs)
    assert again.status == "ran" and again.summary["resumed_from_step"] == 2
    for name, w in load_file(str(out / "model.safetensors")).items():
        torch.testing.assert_close(w, weights[name], rtol=0, atol=1e-6, msg=name)
    base = load_file(str(Path(local_path(base_artifact.url)) / "model.safetensors"))
    assert "score.weight" in weights and not any("lora" in k or "modules_to_save" in k for k in weights)
    for name, w in weights.items():
        if name.startswith("model."):
            adapted = name.endswith(("k_proj.weight", "up_proj.weight"))
            assert torch.equal(w, base[name].to(w.dtype)) != adapted, name
    lora = run.summary["lora"]
    assert lora["train_fully"] == ["score"] and lora["publish"] == "merged" and run.summary["zero_stage"] == 3
    assert lora["trainable_parameters"] > weights["score.weight"].numel()

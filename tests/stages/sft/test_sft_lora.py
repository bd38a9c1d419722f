"""The sft stage with `lora:` on the tiny base (one CPU rank, ZeRO-2): a run killed with SIGKILL
after its first checkpoint (which holds the adapters and their optimizer state, not the frozen
base) resumes to the same published model as an uninterrupted run; the
published model is the merged one (a plain HF directory, only the adapted layers moved), and
the summary says so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.stages.stage_kill import kill_after_first_checkpoint

REPO = Path(__file__).resolve().parents[3]
LORA_SFT = {"model": "${stages.base.output}", "data": "${stages.data.output}/sft.jsonl",
            "max_seq_len": 256, "epochs": 1, "max_steps": 24, "micro_batch_size": 2, "lr": 2e-2,
            "warmup_steps": 2, "min_lr_ratio": 0.1, "zero_stage": 2, "checkpoint_every": 4,
            "lora": {"rank": 4, "alpha": 8, "target_modules": ["*.q_proj", "*.v_proj", "*.down_proj"]}}


def _run_args(stage_env, recipe, base_artifact, data_artifact) -> dict:
    return dict(stage="sft", storage=stage_env["storage"], recipe=recipe, launcher="local",
                upstream={"base": base_artifact.url, "data": data_artifact.url},
                work_root=str(stage_env["work_root"]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_sft_killed_and_resumed_publishes_what_an_uninterrupted_run_does(stage_env, data_artifact,
                                                                              base_artifact):
    from safetensors.torch import load_file

    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    # the same stage in two stores: one killed after its first checkpoint (in its own process) and
    # run again, one straight through
    one = Resources(cpu_ranks=1)
    kwargs = _run_args(stage_env, "lorasft2", base_artifact, data_artifact)
    runner = ("import json, sys; from pathlib import Path; from pipeline.execute import run_stage; "
              "from stages.common.contract import Resources; a = json.loads(sys.argv[1]); "
              "a['work_root'] = Path(a['work_root']); run_stage('sft', a.pop('config'), resources=Resources(), **a)")
    proc = subprocess.Popen([sys.executable, "-c", runner, json.dumps({**kwargs, "config": LORA_SFT})], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    kill_after_first_checkpoint(proc, Path(local_path(stage_env["storage"])) / "lorasft2", "sft-*", 200, "sft")
    straight = run_stage("sft", LORA_SFT, resources=one,
                         **_run_args(stage_env, "lorasft1", base_artifact, data_artifact))
    stage_dir = next((Path(local_path(stage_env["storage"])) / "lorasft2").glob("sft-*"))
    ckpt_bytes = sum(f.stat().st_size for f in next(stage_dir.glob("checkpoints/step-*")).rglob("*.pt"))
    resumed = run_stage("sft", LORA_SFT, resources=one, **kwargs)
    assert resumed.summary["resumed_from_step"] in (4, 8, 12, 16, 20) and resumed.summary["steps"] == 24

    out, out2, base = (Path(local_path(u)) for u in (straight.url, resumed.url, base_artifact.url))
    weights, weights2, base_w = (load_file(str(d / "model.safetensors")) for d in (out, out2, base))
    assert weights.keys() == base_w.keys()  # the base's names: a plain HF model, no peft keys
    for name, w in weights.items():
        torch.testing.assert_close(weights2[name], w, rtol=0, atol=1e-5, msg=f"{name} after the resume")
        adapted = any(name.endswith(f"{m}.weight") for m in ("q_proj", "v_proj", "down_proj"))
        assert torch.equal(w, base_w[name].to(w.dtype)) != adapted, name  # only the adapted layers moved
    # the checkpoint holds the adapters and their optimizer state, not the frozen base
    assert 0 < ckpt_bytes < (base / "model.safetensors").stat().st_size / 2, ckpt_bytes
    lora = straight.summary["lora"]
    assert lora["publish"] == "merged" and lora["base_artifact"] == base_artifact.url.rstrip("/")
    assert lora["base_hash"] == base_artifact.hash and lora["target_modules"] == 6
    assert straight.summary["final_loss"] < straight.summary["first_loss"] - 0.1  # the adapters learned
    assert json.loads((out / "stage_summary.json").read_text())["lora"]["rank"] == 4

"""`precision: bf16-mixed` (fp32 weights, bf16 compute under torch.autocast, DeepSpeed's
torch_autocast mode): the sft stage trains in it and publishes bf16 weights, and it is not
fp32 under another name. CPU autocast runs bf16 matmuls too, so this runs here."""
from __future__ import annotations

import json

import pytest

from stages.common.deepspeed_setup import ds_config

CONFIG = {"model": "${stages.base.output}", "data": "${stages.data.output}/sft.jsonl",
          "max_seq_len": 256, "epochs": 1, "max_steps": 6, "micro_batch_size": 2, "lr": 3e-3,
          "warmup_steps": 1, "zero_stage": 0}


@pytest.mark.parametrize("precision, bf16, autocast", [
    ("bf16", True, False), ("bf16-mixed", False, True), ("fp32", False, False)])
def test_the_deepspeed_config_of_each_precision(precision, bf16, autocast):
    cfg = ds_config(2, 1.0, precision)
    assert cfg["bf16"]["enabled"] is bf16
    assert ("torch_autocast" in cfg) is autocast
    if autocast:
        assert cfg["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}


def test_bf16_mixed_trains_in_bf16_compute_and_publishes_bf16(stage_env, data_artifact, base_artifact):
    import torch
    from safetensors import safe_open

    from pipeline.artifacts import local_path
    from pipeline.execute import run_stage
    from pipeline.stage_api import Resources

    kw = dict(storage=stage_env["storage"], recipe="sftprecision", launcher="local",
              upstream={"base": base_artifact.url, "data": data_artifact.url},
              work_root=stage_env["work_root"], resources=Resources(cpu_ranks=1))
    runs = {p: run_stage("sft", {**CONFIG, "precision": p}, stage=f"sft-{p}", **kw) for p in ("fp32", "bf16-mixed")}
    fp32, mixed = runs["fp32"].summary, runs["bf16-mixed"].summary
    assert (fp32["precision"], mixed["precision"]) == ("fp32", "bf16-mixed")
    # same data, seed and first weights: the first loss differs only by bf16 rounding of the
    # compute, and it differs (an autocast that never switched on would give fp32's exactly)
    assert mixed["first_loss"] != fp32["first_loss"]
    assert mixed["first_loss"] == pytest.approx(fp32["first_loss"], rel=0.02)
    assert mixed["final_loss"] < mixed["first_loss"] - 0.3
    assert mixed["final_loss"] == pytest.approx(fp32["final_loss"], rel=0.1)

    def weights(run):
        out = local_path(run.url)
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            dtypes = {f.get_tensor(k).dtype for k in f.keys()}
        return dtypes, json.loads((out / "config.json").read_text()).get("dtype")

    assert weights(runs["fp32"]) == ({torch.float32}, "float32")
    assert weights(runs["bf16-mixed"]) == ({torch.bfloat16}, "bfloat16")  # trained fp32, published bf16


def test_bf16_without_a_gpu_is_named_and_bf16_mixed_is_offered(stage_env, data_artifact, base_artifact):
    import torch

    from pipeline.execute import run_stage
    from pipeline.launch import StageFailed
    from pipeline.stage_api import Resources

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: bf16 runs here")
    with pytest.raises(StageFailed, match="precision bf16 needs a GPU; use auto, bf16-mixed or fp32"):
        run_stage("sft", {**CONFIG, "precision": "bf16"}, stage="sft-bf16", storage=stage_env["storage"],
                  recipe="sftprecision", launcher="local", work_root=stage_env["work_root"],
                  upstream={"base": base_artifact.url, "data": data_artifact.url},
                  resources=Resources(cpu_ranks=1))

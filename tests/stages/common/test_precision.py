"""`precision` of the training stages (stages/common/deepspeed_setup.py, training_job.py):
`bf16-mixed` (fp32 weights, bf16 compute under torch.autocast through DeepSpeed's
torch_autocast mode) computes in bf16 and is not fp32 under another name, steps fp32 weights,
and publishes bf16 ones; `bf16` without a GPU is refused by name. CPU autocast runs bf16
matmuls too, so this runs here, with a real DeepSpeed engine on a gloo group of one."""
from __future__ import annotations

import json

import pytest
import torch

from stages.common.deepspeed_setup import ds_config, initialize


@pytest.mark.parametrize("precision, bf16, autocast", [
    ("bf16", True, False), ("bf16-mixed", False, True), ("fp32", False, False)])
def test_the_deepspeed_config_of_each_precision(precision, bf16, autocast):
    cfg = ds_config(2, 1.0, precision)
    assert cfg["bf16"]["enabled"] is bf16
    assert ("torch_autocast" in cfg) is autocast
    if autocast:
        assert cfg["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}


def _model_dir(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def test_bf16_mixed_computes_in_bf16_steps_fp32_weights_and_publishes_bf16(tmp_path, gloo_group):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from stages.common.hf_io import save_hf_model
    from stages.sft.job import PackedLMLoss

    base = _model_dir(tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 97, (1, 48), generator=g)
    batch = (ids, torch.arange(48)[None], torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1))
    engines = {}
    for precision in ("fp32", "bf16-mixed"):
        model = PackedLMLoss(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), chunk_tokens=16)
        engines[precision], _ = initialize(model, model.parameters(), ds_config(0, 1.0, precision),
                                           lr=1e-2, betas=(0.9, 0.95))
    fp32, mixed = engines["fp32"], engines["bf16-mixed"]
    want, got = fp32(*batch), mixed(*batch)
    # the same weights and tokens: the loss differs only by bf16 rounding of the compute, and it
    # differs (an autocast that never switched on would give fp32's loss exactly)
    assert got.dtype == torch.float32 and got.item() != want.item()
    assert got.item() == pytest.approx(want.item(), rel=0.02)
    before = [p.detach().clone() for p in mixed.module.parameters()]
    mixed.backward(got)
    mixed.step()
    after = list(mixed.module.parameters())
    assert all(p.dtype == torch.float32 for p in after)  # the optimizer steps the weights themselves
    assert any(not torch.equal(a, b) for a, b in zip(after, before))

    out = tmp_path / "out"
    save_hf_model(mixed, mixed.module.lm, base, out, zero_stage=0, rank=0, dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert next(reloaded.parameters()).dtype == torch.bfloat16


def test_bf16_without_a_gpu_is_refused_by_name_and_bf16_mixed_is_offered(stage_env, data_artifact, base_artifact):
    from pipeline.execute import run_stage
    from stages.common.contract import Resources, StageFailed

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: bf16 runs here")
    config = {"model": "${stages.base.output}", "data": "${stages.data.output}/sft.jsonl", "max_steps": 2, "warmup_steps": 1,
              "precision": "bf16"}
    with pytest.raises(StageFailed, match="precision bf16 needs a GPU; use auto, bf16-mixed or fp32"):
        run_stage("sft", config, stage="sft-bf16", storage=stage_env["storage"], recipe="precision",
                  launcher="local", work_root=stage_env["work_root"], resources=Resources(cpu_ranks=1),
                  upstream={"base": base_artifact.url, "data": data_artifact.url})

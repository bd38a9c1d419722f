"""benchmarks/sft_throughput.py: the card's peak is read from its name, and the learner case
runs end to end on CPU, writing each variant's result (before / causal / causal_compiled) to OUT."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import sft_throughput


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                       ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                       ("Tesla T4", None)])
def test_peak_flops_from_the_device_name(name, peak):
    assert sft_throughput.peak_flops(name) == peak


def test_an_unknown_variant_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        sft_throughput.parse(["--variants", "plain", "stage_z9"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown --variants ['stage_z9']" in err and "stage_z1 stage_z2" in err


def test_same_training_compares_variants_that_saw_the_same_packs_per_step():
    """A variant's per-step losses and gradient norms against stage_defaults': the largest relative
    difference; a variant with other packs per step (other data in each step) is not compared."""
    base = {"loss_by_step": [2.0, 1.0], "grad_norm_by_step": [4.0, 2.0], "packs_per_step": 8}
    case = {"plain": {"tokens_per_s": 1.0}, "stage_defaults": base,
            "stage_mfu": {**base, "loss_by_step": [2.0, 1.001]},
            "stage_mb4": {**base, "grad_norm_by_step": [4.0, 1.0]},
            "stage_other": {**base, "packs_per_step": 4},
            "stage_short": {**base, "loss_by_step": [2.0]},
            "stage_failed": {"error": "OutOfMemoryError"}}
    got = sft_throughput.same_training(case)
    assert set(got) == {"stage_mfu", "stage_mb4", "stage_other", "stage_short"}
    assert got["stage_mfu"]["max_rel_loss_diff"] == pytest.approx(1e-3)
    assert got["stage_mfu"]["max_rel_grad_norm_diff"] == 0.0
    assert got["stage_mb4"]["max_rel_grad_norm_diff"] == pytest.approx(0.5)
    assert got["stage_other"] == {"vs": "stage_defaults", "comparable": False, "why": "4 packs per step vs 8"}
    assert got["stage_short"]["max_rel_loss_diff"] == float("inf")


def _settled_on_h200(variant: str) -> dict:
    """The config a variant's 1.5B@4096 stage (8 packs a step) runs with on one H200, after `auto`."""
    from stages.common.speed_defaults import ModelFacts, resolve_speed
    from stages.sft.config import SFTConfig
    from tests.stages.common.test_speed_defaults import H200, QWEN_15B

    config, _ = sft_throughput.stage_config(variant, Path("m"), Path("d.jsonl"), 4096, False,
                                            sft_throughput.parse(["--grad-accum", "8"]), gpu=True)
    config = SFTConfig.model_validate(config).model_dump(mode="json")
    return resolve_speed("sft", config, H200, ModelFacts.from_config(QWEN_15B), 1).apply(config)


SPEED_KEYS = ("zero_stage", "precision", "compile_layers", "attn_implementation", "micro_batch_size", "grad_accum",
              "gradient_checkpointing", "loss_chunk_tokens", "async_micro_batches", "lean_optimizer_step")


def test_stage_defaults_runs_round_22s_row_and_the_pinned_rows_the_defaults_before_it():
    """On an H200 the headline variant is what round 22 measured as stage_mb8; stage_round20 is
    round 20's stage_mfu with the rest auto, stage_round16 what round 16's and round 20's
    stage_defaults resolved to (their resolved_speed)."""
    settled = {v: {k: _settled_on_h200(v)[k] for k in SPEED_KEYS}
               for v in ("stage_defaults", "stage_mb8", "stage_round20", "stage_mfu", "stage_round16")}
    assert settled["stage_defaults"] == settled["stage_mb8"]
    assert settled["stage_round20"] == settled["stage_mfu"] == {
        **settled["stage_defaults"], "micro_batch_size": 4, "grad_accum": 2, "loss_chunk_tokens": 16384}
    assert settled["stage_round16"] == {
        "zero_stage": 0, "precision": "bf16-mixed", "compile_layers": True, "attn_implementation": "flex_attention",
        "micro_batch_size": 2, "grad_accum": 4, "gradient_checkpointing": False, "loss_chunk_tokens": 8192,
        "async_micro_batches": False, "lean_optimizer_step": False}
    # the variants that pin the settings from before `auto`, round 20's too (round 10's rows stay what they were)
    mb2 = _settled_on_h200("stage_mixed_compiled_mb2")
    assert (mb2["loss_chunk_tokens"], mb2["async_micro_batches"], mb2["lean_optimizer_step"]) == (8192, False, False)


@pytest.mark.slow  # builds and trains a model three times (CPU-heavy, ~30 s of CPU)
def test_learner_case_smoke_writes_every_variant(tmp_path, monkeypatch):
    from stages.common.compile_layers import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "aot_eager")  # what the smoke sets; restored after the test
    assert sft_throughput.main(["--smoke", "--only", "learner", "--profile", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sft_throughput.json").read_text())
    learner = data["cases"]["learner"]["tiny"]
    assert data["device"] == "cpu" and data["smoke"] is True
    assert learner["micro_batch_tokens"] > learner["logit_chunk"]
    assert not any(v.endswith("_lora") for v in learner)  # LoRA twins run with --lora only
    for variant in sft_throughput.FULL_LEARNER_VARIANTS:
        how = sft_throughput.LEARNER_VARIANTS[variant]
        assert "error" not in learner[variant], learner[variant]
        assert {k: learner[variant][k] for k in how} == how
        assert learner[variant]["tokens_per_s"] == pytest.approx(learner["tokens"] / learner[variant]["step_seconds"])
    assert 1 <= learner["causal_compiled"]["compiled_graphs"] <= 4
    for variant in sft_throughput.FULL_LEARNER_VARIANTS:  # --profile: one more step's operator table each
        table = (tmp_path / f"profile_learner-tiny_{variant}.txt").read_text()
        assert "aten::addmm" in table or "aten::mm" in table, table[:500]


@pytest.mark.slow
def test_lora_adds_the_twin_of_each_learner_variant(tmp_path, monkeypatch):
    """`--lora`: the learner's step with rank-16 adapters next to the full one (issue 35's table)."""
    from stages.common.compile_layers import BACKEND_ENV

    # what the smoke sets, restored after the test: left set, it changed this worker's later tests
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    assert sft_throughput.main(["--smoke", "--only", "learner", "--learner-variants", "causal", "--lora",
                                "--out", str(tmp_path)]) == 0
    learner = json.loads((tmp_path / "sft_throughput.json").read_text())["cases"]["learner"]["tiny"]
    full, lora = learner["causal"], learner["causal_lora"]
    assert "error" not in lora and lora["lora"] is True, lora
    assert 0 < lora["trainable_params"] < full["trainable_params"] / 2
    assert "stage_mixed_lora" in sft_throughput.VARIANTS
    assert sft_throughput.VARIANTS["stage_mixed_lora"]["lora"] == sft_throughput.LORA

"""The MoE mismatch ablation plan (benchmarks/gpu_mismatch_ablation.py, issue 34): not run on a
GPU yet, so what CPU can check is checked here: its recipe validates, every arm's config passes
the stage's validation with the setting it is about, and the table and the plot come out of a
run's metrics."""
from __future__ import annotations

from pathlib import Path

from benchmarks import gpu_mismatch_ablation as abl
from benchmarks.learning import plots
from pipeline.loader import load_recipe


def test_every_arm_is_a_valid_reasoning_rl_config_with_fp8_rollouts_on_a_moe_policy():
    recipe = load_recipe(str(abl.RECIPE))
    assert recipe.stages["base"].architecture.model_type == "ring_moe"
    arms = abl.validate_arms(recipe)
    assert set(arms) == {"none", "tis", "icepop", "r3", "icepop_r3"}
    assert {n for n, a in arms.items() if a["routing_replay"]} == {"r3", "icepop_r3"}
    assert {a["correction"] for a in arms.values()} == {"none", "tis", "icepop"}
    assert all(a["rollout_dtype"] == "fp8" and a["precision"] == "bf16" for a in arms.values())


def test_the_table_compares_the_first_and_last_quarter(tmp_path: Path):
    metrics = [{"step": s, "mismatch_kl": float(s), "reward_mean": 1.0 if s > 6 else 0.0} for s in range(1, 9)]
    row = abl.table_row(metrics, 0.5)
    assert row["mismatch_kl_early"] == 1.5 and row["mismatch_kl_late"] == 7.5
    assert row["reward_last_quarter"] == 1.0 and row["heldout_accuracy"] == 0.5
    assert row["expert_disagreement_early"] is None  # a dense run has none
    png = plots.corrections({"none": {"metrics": metrics, "accuracy": 0.5}}, tmp_path / "a.png", "t",
                            panels=plots.MISMATCH_PANELS)
    assert png.stat().st_size > 0

"""The MoE mismatch ablation plan (benchmarks/gpu_mismatch_ablation.py, issue 34): not run on a
GPU yet, so what CPU can check is checked here: its recipe validates, every arm's config passes
the stage's validation with the setting it is about, the table and the plot come out of a run's
metrics, a run still training (or cut off) leaves its curve in --out from its stage log, and the
seeds' orderings of the arms are compared. The whole orchestration on a tiny MoE is
`gpu_mismatch_ablation.py --smoke` (~1.5 min on two cores: not in the suite)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks import gpu_mismatch_ablation as abl
from benchmarks.gpu_learning import Run
from benchmarks.learning import plots
from benchmarks.learning.live_metrics import logged_metrics, stage_log
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


def _metrics_line(step: int, **values: float) -> str:
    return "[metrics] " + json.dumps({"step": step, **values}) + "\n"


def _write_log(path: Path, text: str, mtime: float) -> Path:
    path.parent.mkdir(parents=True)
    path.write_text(text)
    os.utime(path, (mtime, mtime))
    return path


def test_live_metrics_come_from_the_newest_attempts_log_with_a_resumed_step_replaced(tmp_path: Path):
    work = tmp_path / "work"
    assert stage_log(work, "r-ablation", "rl_icepop_s0") is None  # not started: nothing, no error
    _write_log(work / "r-ablation" / "rl_icepop_s0-0123456789ab" / "a1" / "stage.log",
               _metrics_line(1, reward_mean=0.1), mtime=1_000)
    # another run whose name starts alike is not this one's
    _write_log(work / "r-ablation" / "rl_icepop_r3_s0-0123456789ab" / "a9" / "stage.log",
               _metrics_line(1, reward_mean=0.9), mtime=3_000)
    newest = _write_log(work / "r-ablation" / "rl_icepop_s0-0123456789ab" / "a2" / "stage.log", "".join([
        "[rank0]: " + _metrics_line(1, reward_mean=0.2),
        "[2026-11-28 10:00:00,000] [INFO] [engine.py:1:init] DeepSpeed chatter\n",
        _metrics_line(2, reward_mean=0.3),
        "[progress] {\"done\": 2, \"total\": 5}\n",
        _metrics_line(2, reward_mean=0.35),  # the step again, after a resume
        '[metrics] {"step": 3, "reward_me',  # still being written
    ]), mtime=2_000)
    assert stage_log(work, "r-ablation", "rl_icepop_s0") == newest
    assert logged_metrics(newest) == [{"step": 1, "reward_mean": 0.2}, {"step": 2, "reward_mean": 0.35}]


def test_a_run_still_training_leaves_its_curve_table_and_plot_in_out(tmp_path: Path):
    args = argparse.Namespace(out=str(tmp_path / "out"), root=str(tmp_path / "root"), set=[], smoke=True,
                              recipe=str(abl.SMOKE_RECIPE))
    board = abl.Board(Run(args, "ablation"), "r-ablation", [("none", 0), ("icepop", 0)])
    board.started("none_s0", "0")
    _write_log(tmp_path / "root" / "work" / "r-ablation" / "rl_none_s0-0123456789ab" / "a1" / "stage.log",
               "".join(_metrics_line(s, mismatch_kl=1e-3 * s, reward_mean=0.5, grad_norm=1.0) for s in (1, 2, 3)),
               mtime=1_000)
    board.refresh()
    out = tmp_path / "out"
    assert len((out / "metrics" / "none_s0.jsonl").read_text().splitlines()) == 3
    assert not (out / "metrics" / "icepop_s0.jsonl").exists()
    result = json.loads((out / "ablation.json").read_text())
    assert result["runs"]["none_s0"]["state"] == "running" and result["runs"]["none_s0"]["steps"] == 3
    assert result["runs"]["icepop_s0"]["state"] == "waiting"
    assert result["table"]["none_s0"]["mismatch_kl_late"] == 3e-3 and result["table"]["none_s0"]["steps"] == 3
    assert (out / "ablation_mismatch_s0.png").stat().st_size > 0


def test_the_seeds_orderings_of_the_arms_are_compared():
    runs = {abl.run_name(a, s): (a, s) for s in (0, 1) for a in ("none", "icepop")}

    def table(acc):
        return {n: {"heldout_accuracy": acc.get(n), "reward_last_quarter": 0.5} for n in runs}

    same = abl.orderings(table({"none_s0": 0.3, "icepop_s0": 0.6, "none_s1": 0.2, "icepop_s1": 0.4}), runs)
    assert same["heldout_accuracy"] == {"by_seed": {"0": [("icepop", 0.6), ("none", 0.3)],
                                                    "1": [("icepop", 0.4), ("none", 0.2)]}, "same_order": True}
    # a tie on one seed only is not the same ordering, whichever way a sort would break it
    tied = abl.orderings(table({"none_s0": 0.3, "icepop_s0": 0.6, "none_s1": 0.4, "icepop_s1": 0.4}), runs)
    assert tied["heldout_accuracy"]["same_order"] is False
    assert same["reward_last_quarter"]["same_order"] is True  # tied on both seeds: alike
    flipped = abl.orderings(table({"none_s0": 0.3, "icepop_s0": 0.6, "none_s1": 0.5, "icepop_s1": 0.4}), runs)
    assert flipped["heldout_accuracy"]["same_order"] is False
    # seed 1's icepop not evaluated yet: not comparable, not a disagreement
    partial = abl.orderings(table({"none_s0": 0.3, "icepop_s0": 0.6, "none_s1": 0.5}), runs)
    assert partial["heldout_accuracy"]["same_order"] is None


def test_ten_runs_spread_over_four_gpus_three_at_most_on_one():
    runs = [(a, s) for s in (0, 1) for a in abl.ARMS]
    where = abl.placement(runs, 4)
    assert sorted(list(where.values()).count(g) for g in range(4)) == [2, 2, 3, 3]
    assert where["none_s0"] != where["none_s1"]  # an arm's two seeds on different GPUs
    assert set(abl.placement(runs, 1).values()) == {0}

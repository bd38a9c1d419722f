"""The show-it-learns recipes: recipes/gpu-small.yaml and its CPU-scale regime validate, the
CPU one keeps the GPU recipe's task and ratios (it extends it), and the stages the GPU driver
names exist in both."""
from __future__ import annotations

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from benchmarks import gpu_learning
from pipeline.cli import app
from pipeline.loader import load_recipe
from tests.conftest import REPO

runner = CliRunner()


@pytest.mark.parametrize("recipe", sorted(gpu_learning.RECIPES.values()), ids=lambda p: p.name)
def test_recipe_validates_and_has_every_stage_the_driver_runs(recipe):
    res = runner.invoke(app, ["validate", str(recipe)])
    assert res.exit_code == 0, res.output
    stages = load_recipe(str(recipe)).stages
    for phase_stages in gpu_learning.PHASE_STAGES.values():
        assert set(phase_stages) <= set(stages)
    assert set(gpu_learning.EVALS) <= set(stages)
    assert all(stages[e].kind == "eval" for e in gpu_learning.EVALS)


def test_gpu_recipe_matches_the_schema():
    schema = yaml.safe_load(runner.invoke(app, ["schema"]).output)
    jsonschema.validate(yaml.safe_load((REPO / "recipes" / "gpu-small.yaml").read_text()), schema)


def test_held_out_sets_come_from_the_other_side_of_the_split():
    files = load_recipe(str(gpu_learning.RECIPES["gpu"])).stages["data"].files
    for name, spec in files.items():
        split = spec.params.get("split")
        if name.startswith("heldout"):
            assert split == "heldout", name
        elif split is not None:
            assert split == "train", name


def test_arm_table_row_summarises_an_arm_and_tolerates_missing_metrics():
    metrics = [{"step": s, "reward_mean": s / 4, "step_seconds": 2.0, "masked_fraction": 0.1 * s} for s in (1, 2, 3, 4)]
    row = gpu_learning.arm_table_row({"metrics": metrics, "accuracy": {gpu_learning.HEADLINE_SET: 0.5}})
    assert row["masked_fraction"] == pytest.approx(0.25)
    assert row["reward_last_quarter"] == pytest.approx(1.0)  # the last of 4 steps
    assert row["rl_seconds"] == pytest.approx(8.0)
    assert row["grad_norm"] is None and row["heldout_accuracy"] == 0.5


def test_unknown_arm_is_refused_by_name():
    with pytest.raises(SystemExit) as exc, pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", ["gpu_learning.py", "phase2", "--arms", "icepop,bogus"])
        gpu_learning.main()
    assert exc.value.code == 2

"""scripts/pick_rgym_mix.py: the mix a probe picks, and the recipe it writes validates."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("pick_rgym_mix", ROOT / "scripts" / "pick_rgym_mix.py")
pick_mix = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = pick_mix  # its dataclasses look their module up
_spec.loader.exec_module(pick_mix)


def _record(family: str, accuracy: float, partly: float) -> dict:
    return {"model": "base", "set": "probe", "decoding": "sampled", "domain": f"reasoning_gym/{family}",
            "accuracy": accuracy, "partly_right": partly, "rows": 32.0}


SUMMARY = {"results": [
    _record("leg_counting", 0.30, 0.50), _record("chain_sum", 0.10, 0.40), _record("gcd", 0.90, 0.60),
    _record("coin_flip", 0.05, 0.10), _record("count_bits", 0.20, 0.40), _record("dice", 0.0, 0.0),
    {"model": "base", "set": "probe", "decoding": "sampled", "domain": "reasoning_gym", "accuracy": 0.2,
     "partly_right": 0.3, "rows": 192.0}]}


def test_the_most_partly_right_families_with_room_to_improve_are_picked():
    scores = pick_mix.family_scores(SUMMARY)
    chosen = pick_mix.pick(scores, k=3, min_partly=0.15, max_accuracy=0.75, min_families=2)
    # gcd is the most partly right but already at 0.90; ties (0.40) go to the lower accuracy
    assert [s.family for s in chosen] == ["leg_counting", "chain_sum", "count_bits"]


def test_too_few_eligible_families_is_an_error_naming_them():
    with pytest.raises(SystemExit, match=r"only 1 families .*\['leg_counting'\]"):
        pick_mix.pick(pick_mix.family_scores(SUMMARY), k=3, min_partly=0.45, max_accuracy=0.75, min_families=2)


def test_a_summary_without_sampled_family_records_is_refused():
    greedy = {"results": [{**_record("gcd", 0.5, 0.0), "decoding": "greedy"}]}
    del greedy["results"][0]["partly_right"]
    with pytest.raises(SystemExit, match="samples > 1"):
        pick_mix.family_scores(greedy)


def test_the_written_recipe_trains_and_evaluates_on_the_mix_with_the_probe_configs(tmp_path, monkeypatch):
    from pipeline.loader import load_recipe

    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    out = tmp_path / "picked.yaml"
    pick_mix.main(["--summary", str(tmp_path / "summary.json"), "--recipe", str(ROOT / "recipes/smollm2-reasoning.yaml"),
                   "--out", str(out), "--families", "2", "--min-families", "2"])
    files = yaml.safe_load(out.read_text())["stages"]["data"]["files"]
    probe = yaml.safe_load((ROOT / "recipes/smollm2-reasoning.yaml").read_text())["stages"]["probe_data"]
    probe_tasks = probe["files"]["probe.jsonl"]["params"]["tasks"]
    for name in ("distill_prompts.jsonl", "rl.jsonl", "heldout.jsonl"):
        assert files[name]["params"]["tasks"] == {f: {"config": probe_tasks[f]["config"]}
                                                  for f in ("leg_counting", "chain_sum")}
    monkeypatch.chdir(ROOT)  # the recipe's relative paths (benchmark lists) resolve from the repo root
    load_recipe(out)  # validates: every stage, every family config

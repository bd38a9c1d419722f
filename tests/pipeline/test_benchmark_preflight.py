"""A run whose stages read hub-named benchmark sets checks them before any stage starts: a set
that is neither in the Hugging Face cache nor under RING_BENCHMARKS_DIR stops it with exit 2,
naming the stage, the set, its hub id and the setting; `plan` lists each set as an input with
where it is read from, and its content is part of the stage hash."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_curation.benchmarks import BENCHMARKS_DIR_ENV
from tests.conftest import REPO

RECIPE = """
name: preflight
defaults: {launcher: local}
stages:
  data:
    kind: synthetic_data
    files:
      sft.jsonl: {generator: arithmetic_cot, n: 20, seed: 0, params: {max_digits: 1}}
  curate:
    kind: curate
    data: ["${stages.data.output}/sft.jsonl"]
    steps:
      - {step: exact_dedup}
      - step: decontaminate
        benchmarks:
          - {name: gsm8k, hub: openai/gsm8k, config: main, split: test, fields: [question, answer]}
"""


def _cli(tmp_path: Path, *args: str, benchmarks: Path | None = None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != BENCHMARKS_DIR_ENV}
    env.update(HF_HUB_CACHE=str(tmp_path / "empty-hub-cache"), HF_HUB_OFFLINE="1")
    if benchmarks is not None:
        env[BENCHMARKS_DIR_ENV] = str(benchmarks)
    recipe = tmp_path / "preflight.yaml"
    recipe.write_text(RECIPE)
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", *args, str(recipe),
                          "--set", f"storage.url=file://{tmp_path}/store",
                          "--set", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                          "--set", f"defaults.work_dir={tmp_path}/work"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr


def test_a_missing_set_stops_the_run_before_any_stage_starts(tmp_path):
    rc, out = _cli(tmp_path, "run")
    assert rc == 2, out
    assert "no stage was started" in out and "stage curate" in out, out
    for needle in ("gsm8k (hub openai/gsm8k, config main, split test)", BENCHMARKS_DIR_ENV, "gsm8k.jsonl"):
        assert needle in out, (needle, out)
    assert " started " not in out and not (tmp_path / "store").exists()  # nothing ran, nothing was written


@pytest.mark.parametrize("copy", ["gsm8k.jsonl", "gsm8k"])
def test_plan_lists_the_local_copy_and_its_content_enters_the_hash(tmp_path, copy):
    local = tmp_path / "benchmarks"
    target = local / copy if copy.endswith(".jsonl") else local / copy / "test.jsonl"
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "#### 4"}) + "\n")
    rc, out = _cli(tmp_path, "plan", benchmarks=local)
    assert rc == 0, out
    (line,) = [ln for ln in out.splitlines() if "input:    benchmark gsm8k" in ln]
    assert f"{BENCHMARKS_DIR_ENV} copy of openai/gsm8k" in line, line
    (first,) = [ln.split()[3] for ln in out.splitlines() if ln.strip().startswith("2. curate")]
    target.write_text(json.dumps({"question": "What is 3 + 3?", "answer": "#### 6"}) + "\n")
    _, again = _cli(tmp_path, "plan", benchmarks=local)
    (second,) = [ln.split()[3] for ln in again.splitlines() if ln.strip().startswith("2. curate")]
    assert first != second  # a new copy of the set reruns decontamination

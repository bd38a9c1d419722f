"""Fixtures for the stage tests: a file:// store with published `data` (synthetic_data)
and `base` (init_model) artifacts, built once per session through `run_stage`."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.artifacts import local_path

SFT_ROWS = 1200


@pytest.fixture(scope="session")
def stage_env(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stages")
    return {"storage": f"file://{root}/store", "work_root": root / "work", "recipe": "stagetests"}


@pytest.fixture(scope="session")
def data_artifact(stage_env):
    from pipeline.execute import run_stage

    config = {"files": {
        "sft.jsonl": {"generator": "arithmetic_cot", "n": SFT_ROWS, "seed": 1,
                      "params": {"max_digits": 2, "ops": ["+", "-"]}},
        "rl.jsonl": {"generator": "arithmetic_rl", "n": 40, "seed": 2},
        "prefs.jsonl": {"generator": "preference_pairs", "n": 40, "seed": 3},
    }}
    return run_stage("synthetic_data", config, stage="data", storage=stage_env["storage"],
                     recipe=stage_env["recipe"], work_root=stage_env["work_root"])


@pytest.fixture(scope="session")
def base_artifact(stage_env, data_artifact):
    from pipeline.execute import run_stage

    config = {"architecture": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "intermediate_size": 128, "max_position_embeddings": 1024},
              "tokenizer": {"corpus": ["${stages.data.output}/sft.jsonl"], "vocab_size": 512},
              "seed": 0}
    return run_stage("init_model", config, stage="base", storage=stage_env["storage"],
                     recipe=stage_env["recipe"], work_root=stage_env["work_root"],
                     upstream={"data": data_artifact.url})


@pytest.fixture(scope="session")
def base_dir(base_artifact) -> Path:
    """The published base model (a file:// artifact is a loadable HF directory)."""
    return local_path(base_artifact.url)


@pytest.fixture(scope="session")
def data_dir(data_artifact) -> Path:
    return local_path(data_artifact.url)

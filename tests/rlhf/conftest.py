"""Fixtures of the RLHF tests: a tiny base model and data, built once per session through
the real `synthetic_data` and `init_model` stages (pipeline.execute.run_stage)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.stage_api import Resources

ONE = Resources(cpu_ranks=1)
TWO = Resources(cpu_ranks=2)


@dataclass
class TinySetup:
    root: Path
    storage: str
    work: Path
    data_url: str
    base_url: str
    tracking_uri: str


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinySetup:
    from pipeline.execute import run_stage

    root = tmp_path_factory.mktemp("rlhf")
    storage, work = f"file://{root}/store", root / "work"
    data = run_stage("synthetic_data", {"files": {
        "sft.jsonl": {"generator": "arithmetic_cot", "n": 200, "seed": 0},
        "prefs.jsonl": {"generator": "preference_pairs", "n": 48, "seed": 2},
        "rl.jsonl": {"generator": "arithmetic_rl", "n": 16, "seed": 1},
    }}, stage="data", storage=storage, resources=ONE, work_root=work)
    base = run_stage("init_model", {
        "architecture": {"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                         "max_position_embeddings": 512},
        "tokenizer": {"corpus": ["${stages.data.output}/sft.jsonl"], "vocab_size": 400},
    }, stage="base", storage=storage, upstream={"data": data.url}, resources=ONE, work_root=work)
    return TinySetup(root, storage, work, data.url, base.url, f"sqlite:///{root}/mlflow.db")


RM_CONFIG = {"model": "${stages.base.output}", "max_seq_len": 256, "micro_batch_size": 4, "epochs": 2,
             "max_steps": 8, "lr": 2e-3, "warmup_steps": 1, "eval_fraction": 0.15, "eval_every": 4,
             "checkpoint_every": 4}


@pytest.fixture(scope="session")
def tiny_rm(tiny: TinySetup):
    """A reward model trained by the stage (2 ranks) on the synthetic pairs plus bad rows."""
    import json

    from pipeline.artifacts import local_path
    from pipeline.execute import run_stage

    from .test_reward_model import BAD_ROWS

    data = tiny.root / "prefs_with_bad.jsonl"
    good = (local_path(tiny.data_url) / "prefs.jsonl").read_text()
    data.write_text(good + "".join(json.dumps(r) + "\n" for r in BAD_ROWS))
    run = run_stage("reward_model", {**RM_CONFIG, "data": str(data)}, stage="rm", storage=tiny.storage,
                    upstream={"base": tiny.base_url}, resources=TWO, work_root=tiny.work, launcher="torchrun",
                    tracking_uri=tiny.tracking_uri)
    return run, tiny

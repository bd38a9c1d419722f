"""The stage tests' one tiny base, built once per session through the real stages
(`pipeline.execute.run_stage`) in a file:// store, and what the later stages' tests derive
from it:

    data_artifact   synthetic_data: sft.jsonl (1200 worked sums), rl.jsonl, prefs.jsonl
    base_artifact   init_model: a tiny Qwen2 + a BPE trained on sft.jsonl (the tiny base)
    moe_base_artifact  init_model: a tiny ring_moe (custom code: trust_remote_code) on the same BPE corpus
    tiny_policy     the base briefly SFT'd (in process) to answer and stop: the RL tests' policy
    rlhf_data       preference pairs with bad rows mixed in, math prompts (general RL's mix)
    tiny_rm         a reward model trained by the reward_model stage (2 ranks) on rlhf_data

On pytest-xdist workers these are built once per run, not once per worker: `stage_env` is one
directory for all the workers of the run, and each fixture is built by the first worker that
asks for it while the others wait (`_once`) and then read what it built.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from data_curation.urls import local_path
from stages.common.contract import Resources

SFT_ROWS = 1200
ONE = Resources(cpu_ranks=1)
TWO = Resources(cpu_ranks=2)


@pytest.fixture(scope="session")
def stage_env(tmp_path_factory) -> dict:
    """The stage tests' store, work dirs and MLflow DB. Under pytest-xdist: beside the workers'
    own tmp dirs (their parent is this run's basetemp, made new by the controller), so every
    worker of the run shares them; the tests' own stages have recipe or stage names of their own."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "stages"
    root.mkdir(exist_ok=True)
    return {"root": root, "storage": f"file://{root}/store", "work_root": root / "work", "recipe": "stagetests",
            "tracking_uri": f"sqlite:///{root}/mlflow.db"}


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _once(stage_env: dict, name: str, build: Callable[[], Any], save: Callable[[Any], Any] = lambda v: v,
          load: Callable[[Any], Any] = lambda v: v) -> Any:
    """`build()` once per run of the suite: the first worker to get here builds and records
    `save(value)` (JSON); a worker that comes later, or waited meanwhile, returns `load(record)`.
    A build that raises records nothing (the next one to ask tries again)."""
    record = stage_env["root"] / f"{name}.built.json"
    with _exclusive(stage_env["root"] / f"{name}.lock"):
        if record.exists():
            return load(json.loads(record.read_text()))
        value = build()
        record.write_text(json.dumps(save(value)))
        return value


def _stage_once(stage_env: dict, name: str, build: Callable[[], Any]) -> Any:
    """`_once` for a `run_stage`: every worker gets the StageRun of the one run."""
    from pipeline.execute import StageRun

    return _once(stage_env, name, build, StageRun.as_dict, lambda d: StageRun(**d))


@pytest.fixture(scope="session")
def data_artifact(stage_env):
    from pipeline.execute import run_stage

    config = {"files": {
        "sft.jsonl": {"generator": "arithmetic_cot", "n": SFT_ROWS, "seed": 1,
                      "params": {"max_digits": 2, "ops": ["+", "-"]}},
        "rl.jsonl": {"generator": "arithmetic_rl", "n": 40, "seed": 2},
        "prefs.jsonl": {"generator": "preference_pairs", "n": 40, "seed": 3},
    }}
    return _stage_once(stage_env, "data", lambda: run_stage(
        "synthetic_data", config, stage="data", storage=stage_env["storage"], recipe=stage_env["recipe"],
        work_root=stage_env["work_root"]))


@pytest.fixture(scope="session")
def base_artifact(stage_env, data_artifact):
    from pipeline.execute import run_stage

    config = {"architecture": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "intermediate_size": 128, "max_position_embeddings": 1024},
              "tokenizer": {"corpus": ["${stages.data.output}/sft.jsonl"], "vocab_size": 512},
              "seed": 0}
    return _stage_once(stage_env, "base", lambda: run_stage(
        "init_model", config, stage="base", storage=stage_env["storage"], recipe=stage_env["recipe"],
        work_root=stage_env["work_root"], upstream={"data": data_artifact.url}))


@pytest.fixture(scope="session")
def moe_base_artifact(stage_env, data_artifact):
    from pipeline.execute import run_stage

    config = {"architecture": {"model_type": "ring_moe", "hidden_size": 32, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                               "moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                       "shared_expert_intermediate_size": 32, "first_k_dense_replace": 1}},
              "tokenizer": {"corpus": ["${stages.data.output}/sft.jsonl"], "vocab_size": 400}}
    return _stage_once(stage_env, "moe_base", lambda: run_stage(
        "init_model", config, stage="moe_base", storage=stage_env["storage"], recipe=stage_env["recipe"],
        work_root=stage_env["work_root"], upstream={"data": data_artifact.url}))


@pytest.fixture(scope="session")
def base_dir(base_artifact) -> Path:
    """The published base model (a file:// artifact is a loadable HF directory)."""
    return Path(local_path(base_artifact.url))


@pytest.fixture(scope="session")
def data_dir(data_artifact) -> Path:
    return Path(local_path(data_artifact.url))


# -- RL: a policy that answers and stops -----------------------------------------------------------
POLICY_SFT_STEPS = 150


def _short_answer(row: dict) -> str:
    q = row["prompt"].split("?")[0].removeprefix("What is ").strip()
    return f"<think>{q}</think>{row['reference']['answer']}"


@pytest.fixture(scope="session")
def tiny_policy(stage_env, base_dir) -> dict[str, Path]:
    """The tiny base SFT'd briefly (in process) on one-step sums with short answers: it learns
    the chat format and, above all, to end answers with <|im_end|>, so rollouts finish at
    different lengths (EOS) as a real policy's do. Returns its dir and 48 RL rows."""
    return _once(stage_env, "tiny_policy", lambda: _train_tiny_policy(stage_env["root"] / "rl_policy", base_dir),
                 lambda d: {k: str(v) for k, v in d.items()}, lambda d: {k: Path(v) for k, v in d.items()})


def _train_tiny_policy(out: Path, base_dir: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.common.chat import encode_text, render_chat
    from verifiers.math_gen import generate_arithmetic

    out.mkdir(exist_ok=True)  # a worker whose build failed may have left it
    rl_rows = generate_arithmetic(48, seed=1, max_operand=9)
    sft_rows = generate_arithmetic(256, seed=2, max_operand=9)
    (out / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rl_rows))
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    seqs = [encode_text(tok, render_chat(tok, [{"role": "user", "content": r["prompt"]},
                                               {"role": "assistant", "content": _short_answer(r)}]))
            for r in sft_rows]
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest and does not fight other tests
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pad = tok.pad_token_id
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(POLICY_SFT_STEPS):
        idx = torch.randint(0, len(seqs), (16,), generator=g).tolist()
        T = max(len(seqs[i]) for i in idx)
        ids = torch.full((16, T), pad)
        for b, i in enumerate(idx):
            ids[b, :len(seqs[i])] = torch.tensor(seqs[i])
        labels = ids.masked_fill(ids == pad, -100)
        loss = model(input_ids=ids, attention_mask=(ids != pad).long(), labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.set_num_threads(threads)
    policy = out / "policy"
    model.eval().save_pretrained(policy)
    tok.save_pretrained(policy, save_jinja_files=False)
    return {"model": policy, "data": out / "rl.jsonl"}


# -- RLHF: preference pairs, a reward model ------------------------------------------------------------
BAD_PAIRS = [
    {"id": "bad-identical", "prompt": "What is 1 + 1?", "chosen": "2", "rejected": "2"},
    {"id": "bad-missing", "prompt": "What is 1 + 2?", "chosen": "3"},
    {"id": "bad-winner", "prompt": "What is 1 + 3?", "response_a": "4", "response_b": "5", "winner": "model_z"},
]
RLHF_PAIRS, RLHF_MATH = 48, 16


@dataclass
class RLHFData:
    prefs: Path             # RLHF_PAIRS good preference pairs
    prefs_with_bad: Path    # the same, then BAD_PAIRS
    math: Path              # RLHF_MATH verifiable math prompts


@pytest.fixture(scope="session")
def rlhf_data(stage_env) -> RLHFData:
    return _once(stage_env, "rlhf_data", lambda: _write_rlhf_data(stage_env["root"] / "rlhf"),
                 lambda d: {k: str(v) for k, v in asdict(d).items()},
                 lambda d: RLHFData(**{k: Path(v) for k, v in d.items()}))


def _write_rlhf_data(root: Path) -> RLHFData:
    from stages.synthetic_data.generators import get_generator

    root.mkdir(exist_ok=True)  # a worker whose build failed may have left it

    def write(name: str, rows: list) -> Path:
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return root / name

    pairs = get_generator("preference_pairs")(RLHF_PAIRS, 2)
    return RLHFData(write("prefs.jsonl", pairs), write("prefs_with_bad.jsonl", pairs + BAD_PAIRS),
                    write("math.jsonl", get_generator("arithmetic_rl")(RLHF_MATH, 1)))


RM_CONFIG = {"model": "${stages.base.output}", "max_seq_len": 256, "micro_batch_size": 4, "epochs": 2,
             "max_steps": 8, "lr": 2e-3, "warmup_steps": 1, "eval_fraction": 0.15, "eval_every": 4,
             "checkpoint_every": 4}


@pytest.fixture(scope="session")
def tiny_rm(stage_env, base_artifact, rlhf_data):
    """A reward model trained by the stage (2 ranks) on the preference pairs plus bad rows."""
    from pipeline.execute import run_stage

    return _stage_once(stage_env, "rm", lambda: run_stage(
        "reward_model", {**RM_CONFIG, "data": str(rlhf_data.prefs_with_bad)}, stage="rm",
        storage=stage_env["storage"], recipe=stage_env["recipe"], upstream={"base": base_artifact.url},
        resources=TWO, work_root=stage_env["work_root"], launcher="torchrun", tracking_uri=stage_env["tracking_uri"]))

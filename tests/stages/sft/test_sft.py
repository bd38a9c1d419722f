"""The sft stage: loss only on assistant turns, packing without cross-sample attention,
the data rules (bad rows, truncation, sharding), and a 2-rank ZeRO-2 run that is killed
with SIGKILL after a checkpoint and resumes where the checkpoint left off (profiling its last
two steps)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages.common.deepspeed_setup import lr_factor
from stages.common.rows import DataError, input_rows
from stages.sft.config import SFTConfig, SFTData
from stages.sft.data import Sample, build_samples, collate, pack_samples, tokenize_chat
from stages.sft.job import packed_logits, packed_loss_sum
from tests.stages.stage_kill import kill_after_first_checkpoint

REPO = Path(__file__).resolve().parents[3]


def chat(q: str, a: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


@pytest.fixture(scope="module")
def tok(base_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_dir)


@pytest.fixture(scope="module")
def model(base_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():  # larger weights than the init: attention patterns that matter
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(8.0)
    return m


# -- labels ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_loss_only_on_assistant_turns_including_think_and_eos(tok):
    msgs = chat("What is 2 + 3?", "<think>\nones: 2 + 3 = 5\n</think>\nThe answer is \\boxed{5}.",
                system="Show your work.") + [
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "<think>\n4 + 4 = 8\n</think>\n\\boxed{8}"}]
    ids, targets = tokenize_chat(tok, msgs)
    assert len(ids) == len(targets) and targets[-1] == -100
    assert ids == tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    trained = [t for t in targets if t != -100]
    assert tok.decode(trained) == ("<think>\nones: 2 + 3 = 5\n</think>\nThe answer is \\boxed{5}.<|im_end|>"
                                   "<think>\n4 + 4 = 8\n</think>\n\\boxed{8}<|im_end|>")
    # targets are shifted: position t predicts token t+1, and only trained tokens count
    for t in range(len(ids) - 1):
        assert targets[t] in (-100, ids[t + 1])
    # the role header, user/system text and the newline after eos are never targets
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in trained
    assert "Show your work" not in tok.decode(trained) and "What is" not in tok.decode(trained)


# -- packing ---------------------------------------------------------------------------------
def _sample(tok, q, a):
    return Sample(*tokenize_chat(tok, chat(q, a)))


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_samples_do_not_attend_to_each_other(tok, model, attn):
    model.set_attn_implementation(attn)
    assert model.config._attn_implementation == attn
    a = _sample(tok, "What is 91 - 17?", "<think>\nborrow\n</think>\nThe answer is \\boxed{74}.")
    a2 = _sample(tok, "What is 5 + 5?", "<think>\nones: 5 + 5 = 10, write 0, carry 1\n</think>\n\\boxed{10}")
    b = _sample(tok, "What is 37 + 48?", "<think>\nones: 7 + 8 = 15\n</think>\nThe answer is \\boxed{85}.")
    samples = [a, b, a2]
    # row 0: A then B (then padding up to row 1's length); row 1: A2 then B then A
    batch = collate(samples, [[0, 1], [2, 1, 0]], pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape[1] == len(a2) + len(b) + len(a)
    with torch.no_grad():
        packed = packed_logits(model, batch["input_ids"], batch["position_ids"])
        alone = packed_logits(model, torch.tensor([b.input_ids]), torch.arange(len(b))[None])
        naive = model(input_ids=batch["input_ids"][:1, :len(a) + len(b)]).logits  # no position ids
    lb = len(b)
    torch.testing.assert_close(packed[0, len(a):len(a) + lb], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1, len(a2):len(a2) + lb], alone[0], atol=1e-5, rtol=1e-5)
    # the check has teeth: with plain causal attention over the pack, B's logits change
    assert (naive[0, len(a):] - alone[0]).abs().max() > 1e-2
    # and the summed loss of a packed batch is the sum of the samples' own losses
    with torch.no_grad():
        total = packed_loss_sum(model, batch, torch.device("cpu"))
        own = sum(packed_loss_sum(model, collate(samples, [[i]], tok.pad_token_id), torch.device("cpu"))
                  for i in (0, 1, 2, 1, 0))
        flat = packed_loss_sum(model, batch, torch.device("cpu"), flatten=True)
    torch.testing.assert_close(total, own, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(flat, own, atol=1e-3, rtol=1e-5)


def test_collate_positions_restart_and_padding_is_its_own_segment():
    s = [Sample([5, 6, 7], [6, 7, -100]), Sample([8, 9], [9, -100]), Sample([1] * 6, [1] * 5 + [-100])]
    b = collate(s, [[0, 1], [2]], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [1] * 6]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], list(range(6))]
    assert b["targets"].tolist() == [[6, 7, -100, 9, -100, -100], [1] * 5 + [-100]]


def test_pack_samples_fills_without_overflow_and_uses_every_sample_once():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(5, 120) for _ in range(500)]
    packs = pack_samples(lengths, 256, seed=3)
    flat = sorted(i for p in packs for i in p)
    assert flat == list(range(500))
    assert all(sum(lengths[i] for i in p) <= 256 for p in packs)
    assert sum(lengths) / (len(packs) * 256) > 0.8  # dense packing
    assert pack_samples(lengths, 256, seed=3) == packs and pack_samples(lengths, 256, seed=4) != packs
    singles = pack_samples(lengths, 256, seed=3, packing=False)
    assert all(len(p) == 1 for p in singles) and sorted(p[0] for p in singles) == list(range(500))
    assert [p[0] for p in singles] == pack_samples(lengths, 10 ** 9, seed=3)[0]  # same shuffle


# -- data rules ------------------------------------------------------------------------------
def _write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {"messages": chat("What is 1 + 1?", "<think>\n1 + 1 = 2\n</think>\n\\boxed{2}")}
MESSAGES = SFTData(path="-")


def rows_of(path) -> list:
    return list(input_rows(Path, str(path), "sft data", keep_bad=True))


@pytest.mark.slow
def test_malformed_rows_fail_naming_file_and_row_or_are_counted(tok, tmp_path):
    rows = [GOOD, GOOD, {"text": "no chat here"},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
            GOOD]
    f = _write_rows(tmp_path / "chats.jsonl", rows)
    with pytest.raises(DataError, match=re.escape(f"{f}:3: no `messages` field")):
        build_samples(rows_of(f), tok, 512, "fail", MESSAGES.model_copy(update={"format": "messages"}))
    samples, stats = build_samples(rows_of(f), tok, 512, "skip", MESSAGES.model_copy(update={"format": "messages"}))
    assert len(samples) == 3 and stats.rows == 5
    assert stats.bad_rows == {"no_messages": 1, "no_assistant": 1}
    assert stats.bad_examples[0] == f"{f}:3: no `messages` field"
    assert stats.as_dict()["bad_rows"] == {"no_messages": 1, "no_assistant": 1}


@pytest.mark.slow
def test_directory_of_jsonl_and_parquet(tok, tmp_path):
    import datasets

    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    _write_rows(d / "a.jsonl", [GOOD, GOOD])
    datasets.Dataset.from_list([GOOD] * 3).to_parquet(str(d / "sub" / "b.parquet"))
    rows = rows_of(d)
    assert [Path(r.file).name for r in rows] == ["a.jsonl"] * 2 + ["b.parquet"] * 3
    samples, stats = build_samples(rows, tok, 512, "fail", MESSAGES)
    assert stats.samples == 5 and len({tuple(s.input_ids) for s in samples}) == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="directory has no .jsonl"):
        rows_of(tmp_path / "empty")
    with pytest.raises(DataError, match="cannot tell its format"):
        rows_of(_write_rows(tmp_path / "rows.csv", [GOOD]))


@pytest.mark.slow
def test_long_samples_are_truncated_and_counted(tok, tmp_path):
    long_answer = "<think>\n" + "ones: 7 + 8 = 15, write 5, carry 1\n" * 40 + "</think>\n\\boxed{1}"
    rows = [GOOD, {"messages": chat("What is 7 + 8?", long_answer)},
            {"messages": chat("x " * 400, "<think>\nshort\n</think>\n\\boxed{0}")}]
    f = _write_rows(tmp_path / "long.jsonl", rows)
    samples, stats = build_samples(rows_of(f), tok, 64, "fail", MESSAGES)
    assert stats.truncated == 2 and stats.no_target_after_truncation == 1 and stats.samples == 2
    assert all(len(s) <= 64 for s in samples)
    cut = max(samples, key=len)
    assert len(cut) == 64 and cut.targets[-1] == -100 and cut.n_targets > 0


# -- the distributed stage: 2 CPU ranks, ZeRO-2, SIGKILL after a checkpoint, resume ---------
SFT_CONFIG = {"model": "${stages.base.output}", "data": "${stages.data.output}/sft.jsonl",
              "max_seq_len": 512, "epochs": 1, "max_steps": 36, "micro_batch_size": 2,
              "grad_accum": 1, "lr": 3e-3, "warmup_steps": 3, "min_lr_ratio": 0.1,
              "zero_stage": 2, "checkpoint_every": 8,
              "profile": {"start_step": 35, "steps": 2}}  # cosmetic: the resume finds the same stage


def _metrics(log: Path) -> list[dict]:
    return [json.loads(line.split("[metrics] ", 1)[1]) for line in log.read_text().splitlines()
            if "[metrics] " in line]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sft_two_ranks_zero2_killed_after_checkpoint_resumes_and_learns(stage_env, data_artifact, base_artifact):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.checkpoint_store import CheckpointStore
    from stages.common.contract import Resources

    recipe = "sftresume"
    # torchrun starts the ranks faster than deepspeed's runner (one launcher process, no
    # deepspeed import before the ranks); the stage is the same either way, and the deepspeed
    # launcher runs sft in the tiny recipe and test_sft_zero3_rank_failure.py
    kwargs = dict(stage="sft", storage=stage_env["storage"], recipe=recipe, launcher="torchrun",
                  upstream={"base": base_artifact.url, "data": data_artifact.url},
                  work_root=str(stage_env["work_root"]))
    # run 1, in its own process so that it can be killed: wait for a complete checkpoint
    runner = ("import json, sys; from pathlib import Path; from pipeline.execute import run_stage; "
              "from stages.common.contract import Resources; a = json.loads(sys.argv[1]); "
              "a['work_root'] = Path(a['work_root']); "
              "run_stage('sft', a.pop('config'), resources=Resources(cpu_ranks=2), **a)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", runner, json.dumps({**kwargs, "config": SFT_CONFIG})],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stage_root = Path(local_path(stage_env["storage"])) / recipe
    stage_dir = kill_after_first_checkpoint(proc, stage_root, "sft-*", 200, "sft")
    assert not (stage_dir / "_SUCCESS").exists()
    resumed_at = CheckpointStore(f"file://{stage_dir}", {}).latest()
    assert resumed_at is not None and resumed_at % 8 == 0 and resumed_at < 36
    log1 = next((Path(stage_env["work_root"]) / recipe).glob("sft-*/*/stage.log"))
    run1 = {m["step"]: m for m in _metrics(log1)}
    assert max(run1) < 36  # it was killed mid-way
    assert sorted(run1) == list(range(1, max(run1) + 1))

    # run 2: same config, same stage directory -> resumes from the checkpoint
    result = run_stage("sft", SFT_CONFIG, resources=Resources(cpu_ranks=2), **kwargs)
    out = Path(local_path(result.url))
    run2 = _metrics(out / "logs" / "stage.log")
    steps2 = [m["step"] for m in run2]
    assert steps2 == list(range(resumed_at + 1, 37)), steps2  # the step counter continued
    s = result.summary
    assert s["resumed_from_step"] == resumed_at and s["steps"] == 36 and s["world_size"] == 2
    # weights, optimizer and schedule were restored, not restarted: the first resumed step
    # repeats what run 1 logged for it (same data position), with the scheduled lr
    first = run2[0]
    cfg = SFTConfig.model_validate({"kind": "sft", **SFT_CONFIG})
    assert first["lr"] == pytest.approx(cfg.lr * lr_factor(cfg, 36)(resumed_at), rel=1e-6)
    if resumed_at + 1 in run1:
        assert first["loss"] == pytest.approx(run1[resumed_at + 1]["loss"], abs=2e-3)
        assert first["lr"] == pytest.approx(run1[resumed_at + 1]["lr"], rel=1e-6)
    assert first["loss"] < run1[1]["loss"] - 0.5
    # it learned: the loss fell measurably from run 1's first step to the end
    assert s["first_loss"] == pytest.approx(run1[1]["loss"])
    assert s["final_loss"] < s["first_loss"] - 1.5, (s["first_loss"], s["final_loss"])
    assert s["tokens_trained"] > 0 and s["data"]["samples"] == 1200 and s["data"]["truncated"] == 0
    # the profiled window's operator table and trace sit next to the stage log (rank 0's only)
    profile = out / "logs" / "profile"
    assert sorted(f.name for f in profile.iterdir()) == ["profile_table.txt", "profile_trace.json"]
    assert (profile / "profile_table.txt").read_text().startswith("torch.profiler: optimizer steps 35..36 of rank 0")
    # the published model is a loadable HF directory with the chat tokenizer
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(tok) and tok.chat_template
    assert model.config.use_cache is True
    base = AutoModelForCausalLM.from_pretrained(Path(local_path(base_artifact.url)))
    # the saved weights are the trained ones: on held-out chats (another seed) the loss
    # of the published model is far below the base model's
    from stages.synthetic_data.generators import get_generator

    held_out = [Sample(*tokenize_chat(tok, r["messages"])) for r in get_generator("arithmetic_cot")(16, 999)]
    batch = collate(held_out, [[i] for i in range(16)], tok.pad_token_id)
    n = sum(x.n_targets for x in held_out)
    with torch.no_grad():
        trained_loss = packed_loss_sum(model.eval(), batch, torch.device("cpu")).item() / n
        base_loss = packed_loss_sum(base.eval(), batch, torch.device("cpu")).item() / n
    assert trained_loss < base_loss - 1.5, (trained_loss, base_loss)
    assert trained_loss == pytest.approx(s["final_loss"], abs=0.6)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 34?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[0] == 1 and gen.shape[1] > prompt["input_ids"].shape[1]

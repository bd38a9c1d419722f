"""The init_model stage: a config-built model + locally trained tokenizer that load with
transformers and speak the shared chat format; a pretrained dir is checked and copied."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from pipeline.stage_api import StageJob
from stages.common.entry import run_job
from stages.init_model import job as init_model_job
from stages.init_model.config import InitModelConfig
from stages.init_model.tokenizer import _strings

CHAT = [{"role": "user", "content": "What is 37 + 48?"},
        {"role": "assistant", "content": "<think>\nones: 7 + 8 = 15\n</think>\nThe answer is \\boxed{85}."}]


def _job(tmp: Path, config: dict, name: str = "base") -> StageJob:
    return StageJob(recipe="t", stage=name, kind="init_model", hash="0" * 16,
                    config={"kind": "init_model", **config}, stage_url=f"file://{tmp}/store/{name}",
                    output_dir=str(tmp / name / "out"), work_dir=str(tmp / name / "work"))


@pytest.mark.slow
def test_built_model_and_tokenizer_load_and_speak_the_chat_format(base_artifact, base_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (base_dir / f).is_file(), f
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 64
    assert model.config.vocab_size == len(tok) == base_artifact.summary["vocab_size"] <= 512
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    # the chat template is inline in tokenizer_config.json (readable by older loaders too)
    assert "chat_template" in json.loads((base_dir / "tokenizer_config.json").read_text())
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert text == ("<|im_start|>user\nWhat is 37 + 48?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\nones: 7 + 8 = 15\n</think>\nThe answer is \\boxed{85}.<|im_end|>\n")
    assert tok.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_end|>\n<|im_start|>assistant\n")
    # every special token is one id, and <think> survives decoding without specials
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|pad|>"):
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1, t
    ids = tok(text, add_special_tokens=False)["input_ids"]
    decoded = tok.decode(ids, skip_special_tokens=True)
    assert "<think>" in decoded and "</think>" in decoded and "<|im_end|>" not in decoded
    assert tok.decode(ids) == text
    # the model runs and generates (random weights: any tokens, but the right shapes)
    prompt = tok.apply_chat_template(CHAT[:1], add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4 or int(out[0, -1]) == tok.eos_token_id


@pytest.mark.slow
def test_same_seed_same_model_and_tokenizer_llama(tmp_path, data_dir):
    """Built twice with one seed: byte-identical tokenizer and weights (llama this time,
    which transformers loads through the generic tokenizer class)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg = {"architecture": {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
                            "num_key_value_heads": 4, "intermediate_size": 64},
           "tokenizer": {"corpus": [str(data_dir / "sft.jsonl"), str(data_dir / "rl.jsonl")],
                         "vocab_size": 400}, "seed": 3}
    outs = []
    for name in ("a", "b"):
        job = _job(tmp_path, cfg, name)
        summary = init_model_job.main(job)
        assert summary["vocab_size"] <= 400
        outs.append(Path(job.output_dir))
    assert (outs[0] / "tokenizer.json").read_bytes() == (outs[1] / "tokenizer.json").read_bytes()
    wa, wb = load_file(outs[0] / "model.safetensors"), load_file(outs[1] / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    other = _job(tmp_path, {**cfg, "seed": 4}, "c")
    init_model_job.main(other)
    wc = load_file(Path(other.output_dir) / "model.safetensors")
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    tok = AutoTokenizer.from_pretrained(outs[0])
    assert json.loads((outs[0] / "config.json").read_text())["vocab_size"] == len(tok)
    # digits are single tokens (the pre-tokenizer splits them), good for column arithmetic
    assert tok.tokenize("1234") == ["1", "2", "3", "4"]


@pytest.mark.slow
def test_pretrained_dir_is_checked_and_copied(tmp_path, base_dir):
    job = _job(tmp_path, {"pretrained": str(base_dir)}, "pre")
    summary = init_model_job.main(job)
    out = Path(job.output_dir)
    assert summary["source"] == "pretrained" and summary["warnings"] == []
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / f).read_bytes() == (base_dir / f).read_bytes()
    assert not (out / ".verified").exists() and not (out / "_SUCCESS").exists()
    assert json.loads((out / "stage_summary.json").read_text())["source"] == "pretrained"


def test_pretrained_dir_missing_parts_fail_clearly(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "README.md").write_text("no weights here")
    job = _job(tmp_path, {"pretrained": str(broken)}, "broken")
    job_path = tmp_path / "job.json"
    job.write(job_path)
    assert run_job(init_model_job.main, ["--job", str(job_path)]) == 2
    err = capsys.readouterr().err
    assert "missing: weights" in err and "tokenizer" in err and str(broken) in err
    assert "README.md" in err  # what *was* found

    job = _job(tmp_path, {"pretrained": str(tmp_path / "nope")}, "missing")
    job.write(job_path)
    assert run_job(init_model_job.main, ["--job", str(job_path)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_corpus_line_names_file_and_line(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": broken\n')
    job = _job(tmp_path, {"architecture": {}, "tokenizer": {"corpus": [str(corpus)]}})
    job_path = tmp_path / "job.json"
    job.write(job_path)
    assert run_job(init_model_job.main, ["--job", str(job_path)]) == 2
    assert f"{corpus}:2: not valid JSON" in capsys.readouterr().err


def test_corpus_strings_cover_every_string_field():
    row = {"id": "x1", "messages": [{"role": "user", "content": "hi"}], "prompt": "p",
           "reference": {"answer": "42", "alts": ["forty-two"]}, "n": 3}
    assert list(_strings(row)) == ["x1", "user\nhi", "p", "42", "forty-two"]


@pytest.mark.parametrize("config,needle", [
    ({}, "exactly one of `pretrained` or `architecture`"),
    ({"pretrained": "x", "architecture": {}}, "exactly one of"),
    ({"architecture": {}}, "`architecture` needs `tokenizer`"),
    ({"pretrained": "x", "tokenizer": {"corpus": ["c.jsonl"]}}, "`tokenizer` is only used with `architecture`"),
    ({"architecture": {"hidden_size": 60, "num_attention_heads": 8}, "tokenizer": {"corpus": ["c"]}},
     "divisible"),
])
def test_config_errors(config, needle):
    with pytest.raises(ValidationError, match=re.escape(needle)):
        InitModelConfig.model_validate({"kind": "init_model", **config})

"""The init_model stage: a config-built model + locally trained tokenizer that load with
transformers and speak the shared chat format; a pretrained dir is checked and copied."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from stages.common.contract import StageJob
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
        summary = init_model_job.main(job, job.typed_config(InitModelConfig))
        assert summary["vocab_size"] <= 400
        outs.append(Path(job.output_dir))
    assert (outs[0] / "tokenizer.json").read_bytes() == (outs[1] / "tokenizer.json").read_bytes()
    wa, wb = load_file(outs[0] / "model.safetensors"), load_file(outs[1] / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    other = _job(tmp_path, {**cfg, "seed": 4}, "c")
    init_model_job.main(other, other.typed_config(InitModelConfig))
    wc = load_file(Path(other.output_dir) / "model.safetensors")
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    tok = AutoTokenizer.from_pretrained(outs[0])
    assert json.loads((outs[0] / "config.json").read_text())["vocab_size"] == len(tok)
    # digits are single tokens (the pre-tokenizer splits them), good for column arithmetic
    assert tok.tokenize("1234") == ["1", "2", "3", "4"]


@pytest.mark.slow
def test_pretrained_dir_is_checked_and_copied(tmp_path, base_dir):
    job = _job(tmp_path, {"pretrained": str(base_dir)}, "pre")
    summary = init_model_job.main(job, job.typed_config(InitModelConfig))
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
    assert run_job(init_model_job.main, InitModelConfig, ["--job", str(job_path)]) == 2
    err = capsys.readouterr().err
    assert "missing: weights" in err and "tokenizer" in err and str(broken) in err
    assert "README.md" in err  # what *was* found

    job = _job(tmp_path, {"pretrained": str(tmp_path / "nope")}, "missing")
    job.write(job_path)
    assert run_job(init_model_job.main, InitModelConfig, ["--job", str(job_path)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_corpus_line_names_file_and_line(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": broken\n')
    job = _job(tmp_path, {"architecture": {}, "tokenizer": {"corpus": [str(corpus)]}})
    job_path = tmp_path / "job.json"
    job.write(job_path)
    assert run_job(init_model_job.main, InitModelConfig, ["--job", str(job_path)]) == 2
    assert f"{corpus}:2: invalid JSON" in capsys.readouterr().err


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
    ({"architecture": {"model_type": "ring_moe"}, "tokenizer": {"corpus": ["c"]}}, "ring_moe needs `moe`"),
    ({"architecture": {"moe": {}}, "tokenizer": {"corpus": ["c"]}}, "`moe` goes with model_type ring_moe"),
    ({"architecture": {"model_type": "ring_moe", "moe": {"num_experts": 4, "num_experts_per_tok": 5}},
      "tokenizer": {"corpus": ["c"]}}, "num_experts_per_tok (5) exceeds num_experts (4)"),
    ({"architecture": {"model_type": "ring_moe", "num_hidden_layers": 2, "moe": {"first_k_dense_replace": 3}},
      "tokenizer": {"corpus": ["c"]}}, "first_k_dense_replace (3) exceeds num_hidden_layers (2)"),
    ({"pretrained": "s3://bucket/model", "revision": "main"}, "`revision` selects a version of a hub model"),
])
def test_config_errors(config, needle):
    with pytest.raises(ValidationError, match=re.escape(needle)):
        InitModelConfig.model_validate({"kind": "init_model", **config})


# -- ring_moe: the paper's MoE design as custom code; hub ids from the local cache -----------------
MOE = {"model_type": "ring_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "intermediate_size": 64,
       "moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
               "shared_expert_intermediate_size": 32, "first_k_dense_replace": 1}}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("moe")
    corpus = tmp / "c.jsonl"
    corpus.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(20)))
    job = _job(tmp, {"architecture": MOE, "tokenizer": {"corpus": [str(corpus)], "vocab_size": 300}})
    summary = init_model_job.main(job, job.typed_config(InitModelConfig))
    assert summary["model_type"] == "ring_moe" and "modeling_ring_moe.RingMoeForCausalLM" in summary["custom_code"]
    return Path(job.output_dir)


def _run(tmp_path, config: dict, name: str) -> tuple[int, str, Path]:
    job = _job(tmp_path, config, name)
    job.write(tmp_path / f"{name}.json")
    from contextlib import redirect_stderr
    from io import StringIO

    err = StringIO()
    with redirect_stderr(err):
        rc = run_job(init_model_job.main, InitModelConfig, ["--job", str(tmp_path / f"{name}.json")])
    return rc, err.getvalue(), Path(job.output_dir)


def test_ring_moe_is_written_with_its_code_and_loads_only_when_trusted(moe_dir):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from stages.common.contract import StageError
    from stages.common.hf_io import load_causal_lm

    for f in ("configuration_ring_moe.py", "modeling_ring_moe.py", "config.json", "model.safetensors"):
        assert (moe_dir / f).is_file(), f
    assert set(json.loads((moe_dir / "config.json").read_text())["auto_map"]) >= {
        "AutoConfig", "AutoModelForCausalLM", "AutoModelForSequenceClassification"}
    with pytest.raises(StageError, match=r"brings its own modelling code .*trust_remote_code: true"):
        load_causal_lm(moe_dir, torch.float32, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, trust_remote_code=True)
    names = dict(model.named_parameters())
    # layer 0 dense (first_k_dense_replace), layer 1 the MoE block in qwen2_moe's layout
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert names["model.layers.1.mlp.gate.weight"].shape == (4, 32)
    assert torch.equal(names["model.layers.1.mlp.gate.expert_bias"], torch.zeros(4))
    assert names["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    assert names["model.layers.1.mlp.experts.down_proj"].shape == (4, 32, 16)
    assert "model.layers.1.mlp.shared_expert_gate.weight" in names
    # the router picks by score + bias but weights by the unbiased, normalised scores
    gate = model.model.layers[1].mlp.gate
    h = torch.randn(5, 32)
    with torch.no_grad():
        gate.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
        logits, weights, index = gate(h)
    assert (index == 3).any(dim=-1).all()  # the bias forces expert 3 into every top-k
    scores = torch.sigmoid(logits)
    torch.testing.assert_close(weights, scores.gather(-1, index) / scores.gather(-1, index).sum(-1, keepdim=True))
    rm = AutoModelForSequenceClassification.from_pretrained(moe_dir, trust_remote_code=True, num_labels=1)
    assert rm(input_ids=torch.tensor([[3, 4, 5]])).logits.shape == (1, 1)


def test_hub_model_from_a_prepopulated_cache_loads_offline(moe_dir, tmp_path, monkeypatch):
    from tests.stages.common.hub_cache import cache_repo

    cache = tmp_path / "hub"
    commit = cache_repo(cache, "model", "org/tiny-moe", moe_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, err, _ = _run(tmp_path, {"pretrained": "org/tiny-moe"}, "untrusted")
    assert rc == 2 and "modeling_ring_moe.py" in err and "trust_remote_code: true" in err
    rc, err, out = _run(tmp_path, {"pretrained": "org/tiny-moe", "trust_remote_code": True}, "hub")
    assert rc == 0, err
    summary = json.loads((out / "stage_summary.json").read_text())
    assert summary["hub_commit"] == commit and summary["trust_remote_code"] is True
    for f in ("modeling_ring_moe.py", "configuration_ring_moe.py", "model.safetensors", "tokenizer.json"):
        assert (out / f).read_bytes() == (moe_dir / f).read_bytes()
    rc, err, _ = _run(tmp_path, {"pretrained": "org/tiny-moe", "revision": commit, "trust_remote_code": True},
                      "pinned")
    assert rc == 0, err
    rc, err, _ = _run(tmp_path, {"pretrained": "org/absent"}, "absent")
    assert rc == 2 and "org/absent" in err and "not in the Hugging Face cache" in err and "HF_HUB_OFFLINE" in err

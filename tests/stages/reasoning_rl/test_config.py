"""The reasoning_rl kind: registration, paper defaults, validation, data errors, prompts, frozen
router bias."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from stages.common.deepspeed_setup import freeze_parameters
from stages.common.rows import DataError
from stages.reasoning_rl.config import ReasoningRLConfig, RLData
from stages.reasoning_rl.data import load_rows, rows_by_domain
from stages.registry import STAGE_KINDS
from stages.rl.prompts import render_prompts

MIN = {"kind": "reasoning_rl", "model": "m", "data": "d.jsonl", "steps": 10}


def test_registered_with_paper_defaults():
    kind = STAGE_KINDS["reasoning_rl"]
    assert kind.entry == "stages.reasoning_rl.job" and kind.distributed and kind.version == 4
    assert kind.sources == ("stages.reasoning_rl", "stages.rl", "stages.common", "verifiers")
    c = ReasoningRLConfig.model_validate(MIN)
    assert (c.lr, c.adam_betas, c.weight_decay, c.kl_coef, c.temperature) == (2e-6, (0.9, 0.999), 0.01, 0.0, 1.0)
    assert (c.prompts_per_step, c.rollouts_per_prompt, c.max_len) == (480, 8, 65536)
    assert (c.correction, c.icepop_alpha, c.icepop_beta, c.scheduler) == ("icepop", 0.5, 5.0, "c3po")
    assert c.pool_capacity == 480 * 8 and c.token_budget == 480 * 8 * 65536 // 4
    assert "*.gate.e_score_correction_bias" in c.frozen_param_patterns


@pytest.mark.parametrize("patch,match", [
    ({"icepop_alpha": 5.0, "icepop_beta": 0.5}, "icepop_alpha"),
    ({"icepop_alpha": 0.0}, "greater than 0"),
    ({"c3po": {"pool_capacity": 4}}, "pool_capacity"),
    ({"c3po": {"token_budget": 0}}, "greater than or equal to 1"),
    ({"c3po": {"min_group_size": 9}}, "min_group_size"),
    ({"rollout": {"device": "gpu0"}}, "rollout.device"),
    ({"correction": "ppo"}, "icepop"),
    ({"scheduler": "async"}, "c3po"),
    ({"domain_weights": {"math": -1.0}}, ">= 0"),
    ({"domain_weights": {"math": 0.0}}, "positive weight"),
    ({"data": []}, "at least one"),
    ({"steps": 0}, "greater than or equal to 1"),
    ({"lr_typo": 1.0}, "Extra inputs"),
])
def test_validation(patch, match):
    with pytest.raises(ValidationError, match=match):
        ReasoningRLConfig.model_validate({**MIN, **patch})


def test_data_errors_name_file_line_and_field(tmp_path):
    good = {"domain": "math", "prompt": "What is 1 + 1?", "reference": {"answer": "2"}}
    f = tmp_path / "rl.jsonl"
    f.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "prompt": ""}) + "\n")
    with pytest.raises(DataError, match=rf"{f}:3: field 'prompt'"):
        load_rows(Path, [RLData(path=str(f))])
    f.write_text(json.dumps({"domain": "math", "prompt": "x"}) + "\n")
    with pytest.raises(DataError, match=rf"{f}:1: field 'reference' is missing"):
        load_rows(Path, [RLData(path=str(f))])
    f.write_text("{not json\n")
    with pytest.raises(DataError, match=rf"{f}:1: invalid JSON"):
        load_rows(Path, [RLData(path=str(f))])
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match="directory has no .jsonl"):
        load_rows(Path, [RLData(path=str(tmp_path / "nothing"))])


def test_rows_from_dirs_and_parquet_get_ids_and_domains(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"domain": "math", "prompt": "p1", "reference": "1"}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"id": "x", "domain": "logic", "prompt": "p2", "reference": "2"}]),
                   d / "b.parquet")
    rows = load_rows(Path, [RLData(path=str(d))])
    assert [r["domain"] for r in rows] == ["math", "logic"]
    assert rows[0]["id"].endswith("a.jsonl:1") and rows[1]["id"] == "x"
    assert rows_by_domain(rows) == {"math": [0], "logic": [1]}


class CharTokenizer:
    """One token per character of the rendered prompt (the user's text, then "> ")."""

    chat_template = "x"

    def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return msgs[-1]["content"] + "> "

    def __call__(self, text, add_special_tokens):
        assert not add_special_tokens
        return {"input_ids": [ord(c) for c in text]}


def test_render_prompts_skips_long_prompts():
    rows = [{"messages": [{"role": "user", "content": "abc"}]}, {"messages": [{"role": "user", "content": "a" * 50}]}]
    kept, ids, index = render_prompts(rows, CharTokenizer(), prompt_max_len=10)
    assert kept == rows[:1] and ids == [[ord(c) for c in "abc> "]] and index == [0]


def test_router_bias_is_held_fixed():
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8))
            self.e_score_correction_bias = torch.nn.Parameter(torch.randn(4))

    class Moe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()
            self.expert_bias = torch.nn.Parameter(torch.randn(4))
            self.up = torch.nn.Linear(8, 8)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Moe(), Moe()])
    frozen = freeze_parameters(model, ReasoningRLConfig.model_validate(MIN).frozen_param_patterns)
    assert sorted(frozen) == sorted([f"layers.{i}.{n}" for i in (0, 1)
                                     for n in ("gate.e_score_correction_bias", "expert_bias")])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.01)
    x = torch.randn(3, 8)
    loss = sum((layer.gate.weight @ x.T).sum() + (layer.gate.e_score_correction_bias.sum() + layer.expert_bias.sum())
               * layer.up(x).sum() for layer in model.layers)
    loss.backward()
    opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, before[n]) and p.grad is None
        else:
            assert not torch.equal(p, before[n])


def test_load_prompts_names_unknown_domains_and_weights(tmp_path):
    from pathlib import Path
    from types import SimpleNamespace

    from stages.common.contract import StageError
    from stages.reasoning_rl.job import load_prompts

    f = tmp_path / "rl.jsonl"
    f.write_text(json.dumps({"domain": "math", "prompt": "p", "reference": "1"}) + "\n"
                 + json.dumps({"domain": "poetry", "prompt": "p", "reference": "1"}) + "\n")
    job = SimpleNamespace(fetch=lambda u: Path(u))

    def ctx(**over):
        return SimpleNamespace(job=job, tokenizer=CharTokenizer(),
                               cfg=ReasoningRLConfig.model_validate({**MIN, "data": str(f), **over}))

    with pytest.raises(StageError, match=rf"RL data: domains with no registered verifier \(first row of each\): {{'poetry': '{f}:2'}}"):
        load_prompts(ctx())
    f.write_text(json.dumps({"domain": "math", "prompt": "p", "reference": "1"}) + "\n")
    prompts = load_prompts(ctx())
    assert len(prompts.rows) == 1 and prompts.prompt_ids == [[ord(c) for c in "p> "]]
    assert prompts.summary == {"prompts": 1, "prompts_skipped": 0} and prompts.groups == {"math": [0]}
    with pytest.raises(StageError, match=r"absent from the RL data: \['code'\]"):
        load_prompts(ctx(domain_weights={"math": 1, "code": 1}))

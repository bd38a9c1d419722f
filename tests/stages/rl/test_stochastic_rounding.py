"""Stochastic rounding of fp32 weights to bf16 (stages/rl/stochastic_rounding.py) and the
weight sync that applies it (`rollout.sync_rounding: stochastic`): unbiased, only ever one of
the two bf16 neighbours, exact where bf16 is, NaN / inf / the largest finite values kept,
reproducible from its seed; a bf16 torch engine synced with it holds exactly the function's
output under the documented seed; the recipe refuses it where it means nothing."""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from stages.common.contract import StageError
from stages.rl import stochastic_rounding
from stages.rl.stochastic_rounding import SyncRounding, stochastic_round_bf16, tensor_seed

BF16_MAX = torch.finfo(torch.bfloat16).max
F32_MAX = torch.finfo(torch.float32).max


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _neighbours(x: float) -> tuple[float, float]:
    """The two bf16 values around fp32 `x` (towards zero, away from zero), as floats."""
    t = torch.tensor([x], dtype=torch.float32)
    down = _bits(t) & -65536
    return float(down.view(torch.float32)), float((down + 65536).view(torch.float32))


def _draw(x: float, n: int, seed: int = 0) -> torch.Tensor:
    return stochastic_round_bf16(torch.full((n,), x), torch.Generator().manual_seed(seed)).double()


@pytest.mark.parametrize("x", [1.0 + 2 ** -10, 1.0 + 3 * 2 ** -12, -0.3, 2.0 - 2 ** -20, 1e-3, -7.77e4,
                               3e-39, -2.5e-40, 1.001e-7])
def test_the_mean_of_many_roundings_is_the_value_and_each_is_a_neighbour(x):
    """Positive and negative, just below a power of two (the upper neighbour is in the next
    binade), a value near 1 ulp from its lower neighbour, normal and subnormal values."""
    n = 40_000
    got = _draw(x, n)
    x32 = float(torch.tensor(x, dtype=torch.float32))
    down, up = _neighbours(x32)
    assert down != x32 != up  # the case is not trivial
    assert set(got.unique().tolist()) <= {down, up}
    p = (x32 - down) / (up - down)
    stderr = abs(up - down) * math.sqrt(p * (1 - p) / n)
    assert abs(float(got.mean()) - x32) < 4 * stderr, (float(got.mean()), x32, stderr)
    assert 0 < (got == up).sum() < n  # both happen


def test_round_to_nearest_is_biased_where_stochastic_rounding_is_not():
    """The reason for the setting: a weight that AdamW moved by less than half a bf16 step is
    lost to round-to-nearest every time, while stochastic rounding keeps it on average."""
    x = 1.0 + 2 ** -10  # a quarter of bf16's spacing at 1.0
    assert float(torch.tensor(x).to(torch.bfloat16)) == 1.0
    assert abs(float(_draw(x, 40_000).mean()) - x) < 2 ** -12


def test_special_values_pass_through_and_nothing_rounds_past_the_largest_finite():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([nan, -nan, inf, -inf, BF16_MAX, -BF16_MAX, F32_MAX, -F32_MAX, BF16_MAX * (1 + 2 ** -9)])
    weird_nan = torch.tensor([0x7F800001, 0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)  # low-payload NaNs
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        out = stochastic_round_bf16(torch.cat([x, weird_nan]), g).float()
        assert torch.isnan(out[:2]).all() and torch.isnan(out[-3:]).all()
        assert out[2:4].tolist() == [inf, -inf]
        assert out[4:9].tolist() == [BF16_MAX, -BF16_MAX, BF16_MAX, -BF16_MAX, BF16_MAX]


def test_bf16_values_come_out_exactly():
    """Every bf16 value, its sign and zero included, subnormals and the extremes: unchanged."""
    g = torch.Generator().manual_seed(1)
    exact = torch.randn(10_000, generator=g).mul(torch.logspace(-38, 38, 10_000)).to(torch.bfloat16)
    tiny = torch.tensor([1, 2, 0x7F, 0x80, 0x8001 - 65536, 0x807F - 65536], dtype=torch.int16).view(torch.bfloat16)  # subnormals
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, BF16_MAX, -BF16_MAX], dtype=torch.bfloat16)
    want = torch.cat([exact, tiny, specials])
    got = stochastic_round_bf16(want.float(), g)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit for bit: -0.0 stays -0.0


def test_the_same_seed_rounds_alike_and_chunks_do_not_change_the_definition(monkeypatch):
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2))
    a = stochastic_round_bf16(x, torch.Generator().manual_seed(5))
    assert a.shape == x.shape and a.dtype == torch.bfloat16
    assert torch.equal(a, stochastic_round_bf16(x, torch.Generator().manual_seed(5)))
    assert not torch.equal(a, stochastic_round_bf16(x, torch.Generator().manual_seed(6)))
    monkeypatch.setattr(stochastic_rounding, "CHUNK", 7)  # chunk edges fall inside rows
    chunked = stochastic_round_bf16(x, torch.Generator().manual_seed(5)).float()
    down = (_bits(x) & -65536).view(torch.float32)
    assert ((chunked == down) | (chunked == (_bits(down) + 65536).view(torch.float32))).all()


def test_only_fp32_tensors_are_rounded_and_the_seed_names_seed_version_and_tensor():
    with pytest.raises(TypeError, match="fp32"):
        stochastic_round_bf16(torch.ones(3, dtype=torch.float16), torch.Generator())
    seeds = {tensor_seed(s, v, n) for s in (0, 1) for v in (0, 1) for n in ("a", "b")}
    assert len(seeds) == 8 and all(0 <= s < 2 ** 63 for s in seeds)
    r = SyncRounding(3)
    x = torch.randn(64)
    assert r.apply("w", x, changed=False, version=1) is x  # frozen: the engine rounds it to nearest
    assert r.apply("w", x.to(torch.bfloat16), changed=True, version=1).dtype == torch.bfloat16
    assert torch.equal(r.apply("w", x, True, 1), stochastic_round_bf16(x, torch.Generator().manual_seed(tensor_seed(3, 1, "w"))))
    assert SyncRounding.of("nearest", 0) is None


# ---------------------------------------------------------------------------- the weight sync
def _llama(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                  tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return _llama(tmp_path_factory.mktemp("sr") / "llama")


def test_a_bf16_engine_synced_stochastically_holds_the_functions_output_under_the_seed(tiny_llama):
    """The trainer's weights after a small step (fp32, a frozen norm), pushed as version 2 with
    stage seed 3: every trained tensor in the engine is `stochastic_round_bf16` of the trainer's
    with the generator of `tensor_seed(3, 2, name)`, the frozen one is its nearest bf16, the same
    push again (a resumed run) gives the same bits, and version 3 other ones."""
    from stages.common.hf_io import load_causal_lm
    from stages.rl.engines import create_engine
    from stages.rl.weight_sync import GatherIntoEngines

    engine = create_engine("torch", str(tiny_llama), device="cpu", dtype="bfloat16", max_batch=2, max_len=32)
    trainer = load_causal_lm(tiny_llama, torch.float32, trust_remote_code=False)
    frozen = "model.norm.weight"
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.add_(torch.randn(p.shape) * 1e-3)  # ~ a few bf16 steps at most, most below one
            p.requires_grad_(name != frozen)
    sync = GatherIntoEngines(trainer, engine, zero3=False, bucket_bytes=4 << 10, rounding=SyncRounding(3))
    # the bytes it reports are those sent, as the split placement counts them: bf16 rounded, fp32 frozen
    assert sync.bytes == sum(p.numel() * (4 if n == frozen else 2) for n, p in trainer.named_parameters())
    sync.push(2)
    held = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    for name, p in trainer.named_parameters():
        want = (p.detach().to(torch.bfloat16) if name == frozen
                else stochastic_round_bf16(p.detach(), torch.Generator().manual_seed(tensor_seed(3, 2, name))))
        assert torch.equal(held[name].view(torch.int16), want.view(torch.int16)), name
    assert not torch.equal(held["model.embed_tokens.weight"], trainer.model.embed_tokens.weight.to(torch.bfloat16))

    sync.push(2)
    assert all(torch.equal(held[n], p) for n, p in engine.model.named_parameters())
    sync.push(3)
    again = dict(engine.model.named_parameters())
    assert not torch.equal(held["model.layers.0.mlp.up_proj.weight"], again["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(held[frozen], again[frozen])


def test_a_bf16_lora_trainers_merge_is_rounded_from_fp32_where_nearest_loses_the_adapter(tiny_llama):
    """A bf16 trainer with LoRA adapters: an adapted layer's W + scale * B @ A is computed in fp32
    and rounded stochastically into the engine (under the documented seed), where round to
    nearest gives back W, the adapter's sub-bf16 change lost; the frozen bf16 rest is sent as is."""
    from stages.common.hf_io import load_causal_lm
    from stages.common.lora import apply_lora
    from stages.common.training_settings import LoraSettings
    from stages.rl.engines import create_engine
    from stages.rl.weight_sync import GatherIntoEngines

    trainer = load_causal_lm(tiny_llama, torch.bfloat16, trust_remote_code=False)
    apply_lora(trainer, LoraSettings(rank=2, alpha=2.0, target_modules=["*.q_proj"]))
    name = "model.layers.0.self_attn.q_proj.weight"
    layer = trainer.get_submodule("model.layers.0.self_attn.q_proj")
    delta = 2 ** -15  # B @ A (rank 2, scale 1): below half of bf16's spacing (2^-13) at every |W| >= 2^-6
    with torch.no_grad():
        layer.lora_A["default"].weight.fill_(2 ** -8)
        layer.lora_B["default"].weight.fill_(2 ** -8)
    w = layer.base_layer.weight.detach()
    big = w.float().abs() >= 2 ** -6
    assert w.dtype == torch.bfloat16 and int(big.sum()) > 200
    exact = w.float() + delta
    pushes = {}
    for rounding in (None, SyncRounding(3)):
        engine = create_engine("torch", str(tiny_llama), device="cpu", dtype="bf16", max_batch=2, max_len=32)
        sync = GatherIntoEngines(trainer, engine, zero3=False, bucket_bytes=4 << 10, changed_only=True,
                                 rounding=rounding)
        sync.push(2)
        pushes[rounding is None] = dict(engine.model.named_parameters())[name].detach().clone()
    assert torch.equal(pushes[True][big], w[big])  # nearest: the merge rounds back to W
    want = stochastic_round_bf16(exact, torch.Generator().manual_seed(tensor_seed(3, 2, name)))
    assert torch.equal(pushes[False].view(torch.int16), want.view(torch.int16))
    assert not torch.equal(pushes[False][big], w[big])
    # unbiased: over the layer's elements the mean change is the adapter's, not 0
    moved = (pushes[False].float() - w.float())[big]
    assert abs(float(moved.mean()) - delta) < 0.25 * delta


def test_an_engine_that_does_not_hold_bf16_weights_is_refused(tiny_llama):
    from stages.common.hf_io import load_causal_lm
    from stages.rl.engines import create_engine
    from stages.rl.weight_sync import GatherIntoEngines

    engine = create_engine("torch", str(tiny_llama), device="cpu", max_batch=2, max_len=32)  # auto on CPU: fp32
    trainer = load_causal_lm(tiny_llama, torch.float32, trust_remote_code=False)
    with pytest.raises(StageError, match=r"rollout.sync_rounding: stochastic.*torch engine holds torch.float32.*"
                                         r"rollout.dtype: bf16"):
        GatherIntoEngines(trainer, engine, zero3=False, bucket_bytes=4 << 10, rounding=SyncRounding(0))


def test_an_engine_that_keeps_tensors_in_other_dtypes_is_refused(tiny_llama):
    """An engine whose class says it does not take rounded weights (vLLM: fp32 router gates) is
    refused by the sync itself, bf16 or not (the recipe refuses it first: its table)."""
    from stages.common.hf_io import load_causal_lm
    from stages.rl.engines import create_engine
    from stages.rl.weight_sync import GatherIntoEngines

    engine = create_engine("torch", str(tiny_llama), device="cpu", dtype="bf16", max_batch=2, max_len=32)
    engine.takes_stochastic_rounding = False
    trainer = load_causal_lm(tiny_llama, torch.float32, trust_remote_code=False)
    with pytest.raises(StageError, match=r"rollout.sync_rounding: stochastic.*torch engine keeps some tensors in "
                                         r"other dtypes: set rollout.sync_rounding: nearest"):
        GatherIntoEngines(trainer, engine, zero3=False, bucket_bytes=4 << 10, rounding=SyncRounding(0))


# ---------------------------------------------------------------------------- the recipe
REASONING = {"kind": "reasoning_rl", "model": "m", "data": "d.jsonl", "steps": 1, "precision": "fp32"}


def _reasoning(**rollout):
    from stages.reasoning_rl.config import ReasoningRLConfig

    return ReasoningRLConfig.model_validate({**REASONING, "rollout": {"sync_rounding": "stochastic", **rollout}})


@pytest.mark.parametrize("rollout,match", [
    ({"dtype": "fp32"}, "rollout.dtype fp32 holds the trainer's fp32 weights exactly: nothing to round"),
    ({"dtype": "float32"}, "rollout.dtype float32 holds"),
    ({"dtype": "fp8"}, "rollout.dtype fp8 is not supported"),
    ({"dtype": "fp16"}, "rollout.dtype fp16 is not bf16"),
    ({"device": "cpu"}, "rollout.dtype auto is fp32 on rollout.device cpu: nothing to round"),
    ({"engine": "vllm", "dtype": "bf16"}, r"rollout.engine vllm does not take it \(engines that do: torch\)"),
    ({"engine": "sglang", "dtype": "bf16"}, r"rollout.engine sglang does not take it"),  # one not declared
])
def test_the_recipe_refuses_engines_it_cannot_round_into(rollout, match):
    with pytest.raises(ValidationError, match=rf"rollout.sync_rounding: stochastic.*{match}.*sync_rounding: nearest"):
        _reasoning(**rollout)


@pytest.mark.parametrize("precision", ["auto", "bf16"])
def test_the_recipe_refuses_a_trainer_whose_weights_are_bf16_already(precision):
    from stages.general_rl.config import GeneralRLConfig

    general = {"kind": "general_rl", "model": "m", "data": {"chat": {"path": "p"}}, "steps": 1, "reward_model": "rm",
               "reasoning_eval": None, "precision": precision, "rollout": {"sync_rounding": "stochastic"}}
    with pytest.raises(ValidationError, match=rf"stochastic rounds an fp32 trainer's weights, and precision is "
                                              rf"{precision}.*Set precision: fp32"):
        GeneralRLConfig.model_validate(general)


@pytest.mark.parametrize("precision", ["auto", "bf16"])
def test_the_recipe_takes_it_with_a_bf16_lora_trainer(precision):
    """A LoRA policy's merge is computed in fp32 whatever the precision: something to round."""
    from stages.general_rl.config import GeneralRLConfig

    general = {"kind": "general_rl", "model": "m", "data": {"chat": {"path": "p"}}, "steps": 1, "reward_model": "rm",
               "reasoning_eval": None, "precision": precision, "rollout": {"sync_rounding": "stochastic"},
               "lora": {"rank": 4}}
    assert GeneralRLConfig.model_validate(general).rollout.sync_rounding == "stochastic"


def test_the_recipe_takes_it_with_an_fp32_trainer_and_a_bf16_engine_and_nearest_keeps_old_hashes():
    from pipeline.plan import result_config

    for rollout in ({}, {"dtype": "bf16", "device": "cpu"}, {"dtype": "bfloat16"}, {"gpus": 1}):
        assert _reasoning(**rollout).rollout.sync_rounding == "stochastic"
    from stages.reasoning_rl.config import ReasoningRLConfig

    nearest = ReasoningRLConfig.model_validate(REASONING)
    assert "sync_rounding" not in result_config(nearest)["rollout"]  # configs from before it keep their hash
    assert result_config(_reasoning())["rollout"]["sync_rounding"] == "stochastic"


def test_stages_without_a_weight_sync_refuse_it():
    from stages.eval.config import EvalConfig

    with pytest.raises(ValidationError, match=r"rollout.sync_rounding: stochastic rounds the RL weight sync.*no weight sync"):
        EvalConfig.model_validate({"kind": "eval", "models": {"m": "/m"}, "sets": {"s": "x.jsonl"},
                                   "rollout": {"sync_rounding": "stochastic"}})

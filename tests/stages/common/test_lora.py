"""LoRA (stages/common/lora.py) on a tiny model in process: the settings and their hash, the
plan's errors, the merged weights (against peft's own merge), the adapter file (loaded back
by peft onto the base), the base forward with adapters off, and the weight sync's tensors."""
from __future__ import annotations

import json

import pydantic
import pytest
import torch

from stages.common.contract import StageError
from stages.common.lora import adapters_disabled, apply_lora, lora_state_dict, merged_tensors, peft_config, write_adapter
from stages.common.training_settings import LoraSettings
from stages.registry import STAGE_KINDS
from tests.stages.rl.tiny_model import build_model

KINDS = ("sft", "reward_model", "reasoning_rl", "general_rl")
REQUIRED = {"sft": {"data": "d.jsonl"}, "reward_model": {"data": "p.jsonl"},
            "reasoning_rl": {"data": "r.jsonl", "steps": 1}, "general_rl": {"steps": 1, "data": {"math": {"path": "r.jsonl"}}, "reward": {"rm_weight": 0},
                           "reasoning_eval": None}}


def _trained(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Random values in every trainable tensor (LoRA's B starts at zero: no effect to merge)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[5, 17, 42, 99, 7, 3]])


@pytest.mark.parametrize("kind", KINDS)
def test_every_training_kind_has_the_one_lora_block_and_an_unset_one_leaves_the_hash(kind):
    from pipeline.plan import result_config

    config = STAGE_KINDS[kind].config
    plain = config(model="m", **REQUIRED[kind])
    assert config.model_fields["lora"].annotation == LoraSettings | None
    assert "lora" not in result_config(plain)  # configs written before LoRA keep their stage hash
    with_lora = config(model="m", lora={"rank": 4}, **REQUIRED[kind])
    assert result_config(with_lora)["lora"]["rank"] == 4
    assert result_config(config(model="m", lora={"rank": 4, "publish": "adapter"}, **REQUIRED[kind])) != \
        result_config(with_lora)


@pytest.mark.parametrize("bad, key", [({"rank": 0}, "rank"), ({"alpha": 0}, "alpha"), ({"dropout": 1.0}, "dropout"),
                                      ({"target_modules": []}, "target_modules"), ({"publish": "both"}, "publish"),
                                      ({"rnak": 4}, "rnak")])
def test_bad_settings_name_their_key(bad, key):
    with pytest.raises(pydantic.ValidationError, match=key):
        STAGE_KINDS["sft"].config(model="m", data="d.jsonl", lora=bad)


def test_rl_refuses_lora_dropout():
    with pytest.raises(pydantic.ValidationError, match="lora.dropout"):
        STAGE_KINDS["reasoning_rl"].config(model="m", data="r.jsonl", steps=1, lora={"dropout": 0.1})


def test_the_plan_refuses_what_it_cannot_do():
    with pytest.raises(StageError, match=r"target_modules: '\*\.c_attn' matches no linear layer"):
        apply_lora(build_model("llama"), LoraSettings(target_modules=["*.q_proj", "*.c_attn"]))
    with pytest.raises(StageError, match="train_fully: 'head' matches no module"):
        apply_lora(build_model("llama"), LoraSettings(train_fully=["head"]))
    with pytest.raises(StageError, match="both a target module and inside a module trained fully"):
        apply_lora(build_model("llama"), LoraSettings(target_modules=["*.q_proj"], train_fully=["model.layers.0"]))
    with pytest.raises(StageError, match="tied to"):  # qwen2's tiny model ties lm_head to the embeddings
        apply_lora(build_model("qwen2"), LoraSettings(train_fully=["lm_head"]))
    with pytest.raises(StageError, match=r"target_modules: lm_head.weight is tied to model.embed_tokens.weight.*"
                                         "adapter's change would be lost"):
        apply_lora(build_model("qwen2"), LoraSettings(target_modules=["lm_head", "*.q_proj"]))
    apply_lora(build_model("llama"), LoraSettings(target_modules=["lm_head"]))  # untied: its own weight
    with pytest.raises(StageError, match="always trains fully"):
        apply_lora(build_model("llama"), LoraSettings(), always_train=("score",))


def test_a_layer_stored_transposed_gets_no_adapter():
    """GPT-2's Conv1D stores W as [in, out]: the merge (W + scale * B @ A) and the weight sync are
    for nn.Linear's [out, in], so a Conv1D layer is no target: named, not merged transposed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(StageError, match=r"target_modules: '\*\.c_attn' matches no linear layer of the model "
                                         r"\(some of its linear layers: lm_head\)"):
        apply_lora(gpt2, LoraSettings(target_modules=["*.c_attn"]))


def test_only_adapters_and_fully_trained_modules_train():
    model = build_model("llama")
    apply_lora(model, LoraSettings(rank=4, target_modules=["*.q_proj", "*.v_proj"], train_fully=["lm_head"]))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_" in n or ".modules_to_save." in n for n in trainable)
    assert sum(".lora_A." in n for n in trainable) == 4  # 2 layers x (q, v)


def test_adapters_take_the_base_layers_dtype_so_a_bf16_model_computes_in_bf16():
    """peft would upcast a bf16 model's adapters to fp32 and copy each adapted layer's input to
    fp32 for them; the adapters follow the base instead (as DeepSpeed's bf16 mode casts them)."""
    model = build_model().to(torch.bfloat16)
    apply_lora(model, LoraSettings(rank=4))
    adapters = {n: p.dtype for n, p in model.named_parameters() if ".lora_" in n}
    assert adapters and set(adapters.values()) == {torch.bfloat16}
    seen = []
    layer = model.model.layers[0].self_attn.q_proj.lora_A["default"]
    layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    _logits(model, IDS)
    assert seen == [torch.bfloat16]
    fp32 = build_model()
    apply_lora(fp32, LoraSettings(rank=4))
    assert {p.dtype for n, p in fp32.named_parameters() if ".lora_" in n} == {torch.float32}


def test_merged_weights_are_peft_merge_and_give_the_adapted_models_outputs():
    from peft import PeftModel

    model = build_model("llama")
    settings = LoraSettings(rank=4, alpha=12, target_modules=["*.q_proj", "*.down_proj"], train_fully=["lm_head"])
    plan = apply_lora(model, settings)
    _trained(model)
    adapted = _logits(model, IDS)
    merged = lora_state_dict(model, "merged", zero3=False, rank=0)
    base = build_model("llama")
    assert set(merged) == set(base.state_dict())
    base.load_state_dict(merged)
    torch.testing.assert_close(_logits(base, IDS), adapted, rtol=1e-5, atol=1e-5)
    # peft's own merge of the same adapters gives the same weights
    peft_merged = PeftModel(build_model("llama"), peft_config(settings, plan))
    peft_merged.load_state_dict({f"base_model.model.{k}": v for k, v in model.state_dict().items()})
    for k, v in peft_merged.merge_and_unload().state_dict().items():
        torch.testing.assert_close(merged[k], v, rtol=1e-6, atol=1e-6)


def test_the_adapter_file_loads_with_peft_onto_the_base(tmp_path):
    from peft import PeftModel

    model = build_model("llama")
    settings = LoraSettings(rank=2, target_modules=["*.k_proj", "*.up_proj"], train_fully=["lm_head"],
                            publish="adapter")
    plan = apply_lora(model, settings)
    _trained(model, seed=3)
    write_adapter(lora_state_dict(model, "adapter", zero3=False, rank=0), settings, plan, tmp_path,
                  "file:///store/base-123", None)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "file:///store/base-123"
    loaded = PeftModel.from_pretrained(build_model("llama"), str(tmp_path))
    torch.testing.assert_close(_logits(loaded, IDS), _logits(model, IDS), rtol=1e-5, atol=1e-5)


def test_adapters_off_is_the_base_model_and_they_come_back_on():
    model = build_model("llama")
    base_logits = _logits(model, IDS)
    apply_lora(model, LoraSettings(rank=4, train_fully=["lm_head"]))
    _trained(model)
    adapted = _logits(model, IDS)
    assert not torch.allclose(adapted, base_logits)
    with adapters_disabled(model):
        torch.testing.assert_close(_logits(model, IDS), base_logits)
    torch.testing.assert_close(_logits(model, IDS), adapted)
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


def test_the_weight_syncs_tensors_are_the_base_names_merged():
    model = build_model("llama")
    apply_lora(model, LoraSettings(rank=4, target_modules=["*.o_proj"]))
    _trained(model)
    merged = lora_state_dict(model, "merged", zero3=False, rank=0)
    changed = merged_tensors(model, changed_only=True)
    assert [t.name for t in changed] == ["model.layers.0.self_attn.o_proj.weight",
                                         "model.layers.1.self_attn.o_proj.weight"]
    for t in changed:
        torch.testing.assert_close(t.value(), merged[t.name])
    everything = merged_tensors(model)
    assert [t.name for t in everything] == [n for n, _ in build_model("llama").named_parameters()]


def _adapter_artifact(tmp_path):
    model = build_model("llama")
    settings = LoraSettings(rank=2, target_modules=["*.k_proj"], publish="adapter")
    plan = apply_lora(model, settings)
    out = tmp_path / "adapter"
    write_adapter(lora_state_dict(model, "adapter", zero3=False, rank=0), settings, plan, out, "file:///b", None)
    return out


def _distill_teacher(job):
    from stages.rl.verified_sampling import SamplingModel
    SamplingModel(job, None, "teacher", "${stages.sft.output}", key="teacher")


def _eval_model(job):
    from stages.rl.verified_sampling import SamplingModel
    SamplingModel(job, None, "policy", "${stages.sft.output}")


def _eval_lm_eval_set(job):
    from stages.eval.job import run_harness
    run_harness(job, None, "policy", "${stages.sft.output}", {}, [])


@pytest.mark.parametrize("load, key", [(_distill_teacher, "teacher"), (_eval_model, "models.policy"),
                                       (_eval_lm_eval_set, "models.policy")])
def test_an_adapter_only_artifact_is_named_where_a_model_is_loaded(tmp_path, load, key):
    """distill's teacher, eval's models and its lm-eval sets load a model dir: an adapter alone
    (`lora.publish: adapter`) is named as one, with the key, and how to publish what they load."""
    from types import SimpleNamespace

    adapter = _adapter_artifact(tmp_path)
    with pytest.raises(StageError, match=rf"^{key} = \$\{{stages.sft.output\}}: {adapter} holds a LoRA adapter "
                                         r"alone \(.*lora.publish: adapter\).*publish it merged"):
        load(SimpleNamespace(fetch=lambda ref: str(adapter)))
    with pytest.raises(StageError, match=rf"^{key} = .*: {tmp_path} is not a Hugging Face model dir \(no config.json\)"):
        load(SimpleNamespace(fetch=lambda ref: str(tmp_path)))

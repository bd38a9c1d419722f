"""The sft stage's fast path: the chunked loss equals the full-logits loss (values and
gradients, with and without gradient checkpointing), packed samples never see each other (a
perturbation of one sample leaves the other's loss unchanged; padding to a static width
changes nothing), and the new settings' errors name their field."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from stages.common.compile_layers import BACKEND_ENV
from stages.common.packed_attention import document_block_mask, document_causal_mask_mod, pad_packed_batch
from stages.sft.config import SFTConfig
from stages.sft.job import PackedLMLoss, load_packed_lm, packed_loss_sum

CPU = torch.device("cpu")
VOCAB = 211


def _lm(seed=0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():  # larger weights than the init: attention patterns that matter
        for p in lm.parameters():
            if p.ndim >= 2:
                p.mul_(4.0)
    return lm


def _packed_batch(len_a=13, len_b=19, seed=0, restart=True):
    """Two samples, A then B, in one row (positions restart at B unless `restart` is False)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (1, len_a + len_b), generator=g)
    tgt = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    tgt[0, len_a - 1] = -100  # nothing is predicted across the boundary
    pos = torch.cat([torch.arange(len_a), torch.arange(len_b) + (len_a if not restart else 0)])[None]
    return {"input_ids": ids, "targets": tgt, "position_ids": pos}


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = packed_loss_sum(model, batch, CPU)
    loss.backward()
    params = model.lm.parameters() if isinstance(model, PackedLMLoss) else model.parameters()
    return loss.detach(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_loss_equals_full_logits_loss(chunk, checkpointing, tmp_path):
    lm = _lm()
    lm.save_pretrained(tmp_path)
    batch = _packed_batch()
    want, want_grads = _loss_and_grads(lm.train(), batch)
    # packs of at most 64 tokens (the batch has 32): the head runs ceil(64 / chunk) times, padding
    # calls included, instead of the default 64k-token pack's 65,536 calls at chunk 1
    cfg = SFTConfig.model_validate({"model": "m", "data": "d", "loss_chunk_tokens": chunk, "max_seq_len": 64,
                                    "gradient_checkpointing": checkpointing})
    model = load_packed_lm(tmp_path, cfg, "sdpa").train()
    renamed = hasattr(type(model.lm), "is_activation_checkpointing")  # transformers >= 5.20
    assert (model.lm.is_activation_checkpointing if renamed else model.lm.is_gradient_checkpointing) == checkpointing
    got, got_grads = _loss_and_grads(model, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _loss_of_b(model, batch, len_a):
    b = dict(batch, targets=batch["targets"].clone())
    b["targets"][:, :len_a] = -100
    return packed_loss_sum(model, b, CPU)


@pytest.mark.parametrize("perturb", ["tokens", "length"])
def test_a_perturbation_of_sample_a_leaves_sample_b_unchanged(perturb):
    model = PackedLMLoss(_lm(), chunk_tokens=8).eval()
    len_a = 13
    batch = _packed_batch(len_a)
    if perturb == "tokens":  # other tokens in A
        other = dict(batch, input_ids=batch["input_ids"].clone())
        other["input_ids"][0, :len_a] = (other["input_ids"][0, :len_a] + 17) % VOCAB
        other_len_a = len_a
    else:  # a longer A (B shifts right)
        g = torch.Generator().manual_seed(5)
        extra = 9
        other_len_a = len_a + extra
        other = {"input_ids": torch.cat([torch.randint(2, VOCAB, (1, other_len_a), generator=g),
                                         batch["input_ids"][:, len_a:]], 1),
                 "targets": torch.cat([torch.full((1, other_len_a), -100), batch["targets"][:, len_a:]], 1),
                 "position_ids": torch.cat([torch.arange(other_len_a), batch["position_ids"][0, len_a:]])[None]}
    with torch.no_grad():
        base = _loss_of_b(model, batch, len_a)
        changed = _loss_of_b(model, other, other_len_a)
        # control: the same perturbation with positions that do not restart does reach B
        glued = _packed_batch(len_a, restart=False)
        glued_other = dict(other, position_ids=torch.arange(other["input_ids"].shape[1])[None])
        control = (_loss_of_b(model, glued, len_a), _loss_of_b(model, glued_other, other_len_a))
    torch.testing.assert_close(changed, base, atol=1e-5, rtol=1e-6)
    assert (control[0] - control[1]).abs() > 1e-3


def test_padding_to_a_static_width_changes_neither_loss_nor_grads():
    model = PackedLMLoss(_lm(), chunk_tokens=16).train()
    batch = _packed_batch()
    want, want_grads = _loss_and_grads(model, batch)
    got, got_grads = _loss_and_grads(model, pad_packed_batch(batch, 128, pad_id=0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field,value,problem", [
    ("loss_chunk_tokens", 0, "greater than or equal to 1"),
    ("attn_implementation", "flex", "flex_attention"),
    ("gradient_checkpointing", "sometimes", "valid boolean")])
def test_bad_speed_settings_are_named(field, value, problem):
    with pytest.raises(ValidationError) as err:
        SFTConfig.model_validate({"model": "m", "data": "d", field: value})
    assert err.value.errors()[0]["loc"][0] == field and problem in str(err.value)  # `auto` | bool: a union


def test_compiled_layers_give_the_same_loss_and_grads(monkeypatch, tmp_path):
    """compile_layers compiles every decoder layer in place (parameter names unchanged) and the
    packed loss and its gradients do not move. Traced with dynamo's aot_eager backend here
    (RING_COMPILE_BACKEND): the graph capture and autograd are what compilation changes in the
    stage; inductor's code generation is measured on the GPU (benchmarks/sft_throughput.py, stage_mixed_compiled)."""
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    _lm().save_pretrained(tmp_path / "m")
    cfg = {"model": "m", "data": "d", "max_seq_len": 64, "loss_chunk_tokens": 16, "attn_implementation": "sdpa"}
    eager = load_packed_lm(tmp_path / "m", SFTConfig.model_validate(cfg), "sdpa").train()
    compiled = load_packed_lm(tmp_path / "m", SFTConfig.model_validate({**cfg, "compile_layers": True}),
                              "sdpa").train()
    assert all(layer._compiled_call_impl is not None for layer in compiled.lm.get_decoder().layers)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    batch = _packed_batch()
    want, want_grads = _loss_and_grads(eager, batch)
    got, got_grads = _loss_and_grads(compiled, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_compile_layers_with_zero3_is_refused_by_name():
    with pytest.raises(ValidationError, match="compile_layers needs zero_stage 0, 1 or 2"):
        SFTConfig.model_validate({"model": "m", "data": "d", "compile_layers": True, "zero_stage": 3})


# -- issue 36 item 4's speed options: the same training, refused where they cannot run ---------------
def _padded_packs():
    """Two rows: samples of 5, 9 and 2 tokens (then a padding segment) and one of 16; positions
    restart per sample, as collate + pad_packed_batch make them."""
    a = torch.cat([torch.arange(5), torch.arange(9), torch.arange(2), torch.arange(4)])
    return torch.stack([a, torch.arange(20)])


def test_the_document_mask_is_transformers_own():
    """document_causal_mask_mod (the mask `async_micro_batches` builds on the GPU) allows exactly
    what transformers' causal + packed-sequence mask functions allow, element by element and
    block by block, and the model's outputs under it equal those under transformers' own mask."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
    )

    pos = _padded_packs()
    rows, width = pos.shape
    ours = create_mask(document_causal_mask_mod(pos), rows, 1, width, width, device="cpu")
    hf_mod = and_masks(causal_mask_function, packed_sequence_mask_function(find_packed_sequence_indices(pos)))
    assert torch.equal(ours, create_mask(hf_mod, rows, 1, width, width, device="cpu"))
    assert ours[0, 0, 6, 4].item() is False and ours[0, 0, 6, 5].item() is True  # sample 2 sees only itself
    blocks = document_block_mask(pos)  # on CPU without compiling; 128-token blocks
    want = create_block_mask(hf_mod, rows, None, width, width, device="cpu")
    assert torch.equal(blocks.to_dense(), want.to_dense())
    lm = _lm().eval()
    ids = torch.randint(2, VOCAB, (rows, width), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = lm.get_decoder()(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False)
        mine = lm.get_decoder()(input_ids=ids, position_ids=pos, attention_mask=ours, use_cache=False)
    torch.testing.assert_close(mine.last_hidden_state, theirs.last_hidden_state, atol=1e-6, rtol=1e-6)


def test_the_document_mask_is_used_only_with_flex_attention(tmp_path):
    _lm().save_pretrained(tmp_path / "m")
    cfg = SFTConfig.model_validate({"model": "m", "data": "d", "max_seq_len": 64, "async_micro_batches": True})
    assert load_packed_lm(tmp_path / "m", cfg, "sdpa").document_mask is False
    assert PackedLMLoss(_lm(), 8, document_mask=True).document_mask is True


@pytest.mark.parametrize("setting,value", [("zero_stage", 2), ("zero_stage", 3), ("precision", "bf16")])
def test_lean_optimizer_step_where_deepspeed_clips_is_refused_by_name(setting, value):
    with pytest.raises(ValidationError, match=f"lean_optimizer_step needs zero_stage 0 .*{setting} {value}"):
        SFTConfig.model_validate({"model": "m", "data": "d", "lean_optimizer_step": True, setting: value})
    SFTConfig.model_validate({"model": "m", "data": "d", "lean_optimizer_step": True, "zero_stage": 0,
                              "precision": "bf16-mixed"})


def test_the_speed_options_at_their_default_leave_the_stage_hash_alone():
    from pipeline.plan import result_config

    base = {"model": "m", "data": "d"}
    before = result_config(SFTConfig.model_validate(base))
    assert result_config(SFTConfig.model_validate(
        {**base, "async_micro_batches": False, "lean_optimizer_step": False})) == before
    assert "async_micro_batches" not in before and "lean_optimizer_step" not in before
    assert result_config(SFTConfig.model_validate({**base, "lean_optimizer_step": True}))["lean_optimizer_step"]


def test_flex_attention_under_the_document_block_mask_equals_dense_masked_attention():
    """The BlockMask's block sparsity (128-token blocks; samples that cross block edges) loses
    nothing: FlexAttention under it equals SDPA under the element-wise mask (CPU: FlexAttention's
    eager forward; its backward and compiled kernel run on the GPU only)."""
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    first = torch.cat([torch.arange(100), torch.arange(90), torch.arange(66)])
    pos = torch.stack([first, torch.arange(256)])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 16, generator=g) for _ in range(3))
    with torch.no_grad():
        got = flex_attention(q, k, v, block_mask=document_block_mask(pos))
    dense = create_mask(document_causal_mask_mod(pos), 2, 1, 256, 256, device="cpu")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not dense[0, 0, 150, 99] and dense[0, 0, 150, 100]  # the second sample starts at 100


@pytest.mark.slow  # two sft stage runs on the stage tests' shared tiny base and data
def test_the_speed_options_train_the_model_the_defaults_train(stage_env, data_artifact, base_artifact):
    """async_micro_batches and lean_optimizer_step (ZeRO-0, one rank, 4 micro batches a step) through
    the real stage publish the model the defaults publish, to float rounding, and their summaries'
    losses agree: the same training, only fewer host syncs."""
    from safetensors.torch import load_file

    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    config = {"model": "${stages.base.output}", "data": "${stages.data.output}/sft.jsonl", "max_seq_len": 256,
              "max_steps": 6, "micro_batch_size": 1, "grad_accum": 4, "lr": 1e-2, "warmup_steps": 1,
              "zero_stage": 0, "precision": "fp32", "checkpoint_every": 100}
    runs = [run_stage("sft", {**config, **options}, resources=Resources(cpu_ranks=1), stage="sft",
                      storage=stage_env["storage"], recipe=recipe, launcher="local",
                      upstream={"base": base_artifact.url, "data": data_artifact.url},
                      work_root=str(stage_env["work_root"]))
            for recipe, options in (("sftopts-defaults", {}),
                                    ("sftopts-fast", {"async_micro_batches": True, "lean_optimizer_step": True}))]
    defaults, fast = ({k: v for k, v in load_file(str(Path(local_path(r.url)) / "model.safetensors")).items()}
                      for r in runs)
    assert defaults.keys() == fast.keys()
    moved = 0
    for name, w in defaults.items():
        torch.testing.assert_close(fast[name], w, rtol=1e-4, atol=1e-5, msg=name)
        moved += not torch.equal(w, load_file(str(Path(local_path(base_artifact.url)) / "model.safetensors"))[name])
    assert moved > 0  # the runs trained
    for key in ("first_loss", "final_loss", "steps"):
        assert runs[1].summary[key] == pytest.approx(runs[0].summary[key], rel=1e-5), key


def test_compiled_layers_train_a_moe_whose_router_bias_gets_no_gradient(stage_env, data_artifact, moe_base_artifact,
                                                                        monkeypatch):
    """A ring_moe's expert_bias only selects experts: no loss gives it a gradient. Compiled layers
    still call its gradient hook, with no gradient, and DeepSpeed's ZeRO-2 hook crashed on it
    (round 18 on an H200: sft's `auto` compiles the layers on a GPU). `frozen_param_patterns`
    (default: the router bias) keeps it out of training: the compiled ZeRO-2 stage trains the rest
    and publishes the bias as it was."""
    from safetensors.torch import load_file

    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    monkeypatch.setenv(BACKEND_ENV, "aot_eager")  # compiled autograd as on a GPU, without inductor's C++ build
    run = run_stage("sft", {"model": "${stages.base.output}", "data": "${stages.data.output}/sft.jsonl",
                            "trust_remote_code": True, "max_seq_len": 128, "max_steps": 3, "micro_batch_size": 1,
                            "lr": 1e-2, "warmup_steps": 1, "zero_stage": 2, "precision": "fp32",
                            "compile_layers": True, "checkpoint_every": 100},
                    resources=Resources(cpu_ranks=1), stage="sft", storage=stage_env["storage"], recipe="sft-moe-compiled",
                    launcher="local",                    upstream={"base": moe_base_artifact.url, "data": data_artifact.url},
                    work_root=str(stage_env["work_root"]))
    base = load_file(str(Path(local_path(moe_base_artifact.url)) / "model.safetensors"))
    trained = load_file(str(Path(local_path(run.url)) / "model.safetensors"))
    biases = [n for n in base if n.endswith("expert_bias")]
    assert biases and all(torch.equal(trained[n], base[n]) for n in biases)
    assert sum(not torch.equal(trained[n], w) for n, w in base.items()) == len(base) - len(biases)

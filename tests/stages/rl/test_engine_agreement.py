"""The torch engine's pi_infer against the trainer's pi_train at the same weights, for dense
and Mixture-of-Experts models (stages/rl/engines/agreement.py, torch_engine/moe.py).

In fp32 on CPU the engine (static KV cache, our attention, our static-shape expert dispatch)
and the learner's forward (`PolicyHead` over the model's own modules) compute the same
function along two code paths: their per-token log-probs must agree to rounding. The models
are tiny and random (initializer_range 0.2, so routing and logits are far from uniform); the
MoE ones get a random expert bias, so the selection score differs from the weights.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.init_model.model import MODEL_KINDS, save_model
from stages.rl.engines import RolloutRequest, SamplingParams, create_engine
from stages.rl.engines.agreement import measure_agreement
from stages.rl.engines.torch_engine import moe
from stages.rl.engines.torch_engine.moe import MoEFeedForward, routed_experts

VOCAB, EOS, PAD = 256, 1, 0
pytestmark = pytest.mark.usefixtures("one_thread")
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
             eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None, initializer_range=0.2)
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
MODELS = {
    "qwen2": {},
    "ring_moe": {**EXPERTS, "shared_expert_intermediate_size": 48, "first_k_dense_replace": 1,
                 "routed_scaling_factor": 1.5},
    "qwen2_moe": {**EXPERTS, "shared_expert_intermediate_size": 48},
    "qwen3_moe": {**EXPERTS, "head_dim": 16},
}




def build(model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    if model_type in MODEL_KINDS:
        config_cls, model_cls = MODEL_KINDS[model_type].classes()
        config = config_cls(**SIZES, **MODELS[model_type])
        config.auto_map = dict(MODEL_KINDS[model_type].auto_map)
        model = model_cls(config)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SIZES, **MODELS[model_type]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("expert_bias"):
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def saved(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param)
    model = build(request.param)
    if request.param in MODEL_KINDS:
        save_model(model, request.param, out)
    else:
        model.save_pretrained(out)
    return request.param, out


def _requests(n: int, seed: int) -> list[RolloutRequest]:
    g = torch.Generator().manual_seed(seed)
    return [RolloutRequest(f"r{i}", torch.randint(2, VOCAB, (int(torch.randint(2, 24, (1,), generator=g)),),
                                                 generator=g).tolist(), 4 + 3 * i) for i in range(n)]


@pytest.mark.parametrize("static_shapes", [False, True], ids=["eager", "static"])
def test_engine_logprobs_match_the_training_forward(saved, static_shapes):
    from stages.common.hf_io import load_causal_lm

    model_type, path = saved
    trust = model_type in MODEL_KINDS
    # fewer slots than requests: refills and compaction run too
    engine = create_engine("torch", str(path), device="cpu", dtype="float32", max_batch=4, max_len=96,
                           eos_token_ids=[], static_shapes=static_shapes, trust_remote_code=trust,
                           record_routes=True)
    trainer = load_causal_lm(path, torch.float32, trust_remote_code=trust)
    got = measure_agreement(engine, trainer, _requests(7, seed=1), SamplingParams(temperature=0.9, seed=3),
                            pad_id=PAD, device="cpu")
    assert sum(map(len, got.engine_logprobs)) == sum(4 + 3 * i for i in range(7))
    for e, t in zip(got.engine_logprobs, got.trainer_logprobs):
        torch.testing.assert_close(torch.tensor(e), torch.tensor(t), atol=2e-5, rtol=0)
    assert got.stats["abs_log_k_max"] < 2e-5 and got.stats["masked_fraction"] == 0.0
    # MoE: the engine's recorded experts are the trainer's own, token by token (routing replay's premise)
    assert got.stats.get("expert_disagreement") == (None if model_type == "qwen2" else 0.0)


def test_moe_dispatch_paths_equal_the_models_own_block():
    """The padded path (whole and in token chunks) and the grouped_mm path give the block's
    own output, for routings that are balanced, all on one expert, and one token alone."""
    model = build("ring_moe")
    block = model.model.layers[1].mlp
    ffn = MoEFeedForward(block, "test block")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, SIZES["hidden_size"], generator=g)
    with torch.no_grad():
        want = block(x[None])[0]
        torch.testing.assert_close(ffn(x), want, atol=1e-5, rtol=0)
        _, w, idx = block.gate(x)
        shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        for grouped in (False, True):
            torch.testing.assert_close(routed_experts(ffn, x, idx, w, grouped=grouped) + shared, want,
                                       atol=1e-5, rtol=0)
        # every token on the same two experts (one expert's block full, the others empty)
        same = torch.tensor([[3, 5]]).expand(37, 2)
        ref = block.experts(x, same, w)
        for grouped in (False, True):
            torch.testing.assert_close(routed_experts(ffn, x, same, w, grouped=grouped), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(ffn(x[:1]), block(x[None, :1])[0], atol=1e-5, rtol=0)
    chunk_before = moe.PADDED_BLOCK_ELEMENTS
    try:  # a long prefill is cut into token chunks: 5 tokens per chunk here
        moe.PADDED_BLOCK_ELEMENTS = 5 * ffn.num_experts * max(2 * ffn.ff, ffn.hidden)
        with torch.no_grad():
            torch.testing.assert_close(ffn(x), want, atol=1e-5, rtol=0)
    finally:
        moe.PADDED_BLOCK_ELEMENTS = chunk_before


def test_engine_refuses_models_it_cannot_run(tmp_path, saved):
    """Custom code without trust_remote_code is a StageError naming the files; layers with
    norms the engine would skip (Gemma 2's feed-forward norms) are refused by structure."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.common.contract import StageError

    model_type, path = saved
    if model_type == "ring_moe":
        with pytest.raises(StageError, match=r"modeling_ring_moe\.py.*trust_remote_code: true"):
            create_engine("torch", str(path))
    if model_type != "qwen2":
        return
    gemma = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gemma2", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=32, layer_types=["full_attention"]))
    gemma.save_pretrained(tmp_path / "gemma2")
    with pytest.raises(ValueError, match=r"model_type 'gemma2'.*pre_feedforward_layernorm"):
        create_engine("torch", str(tmp_path / "gemma2"))


def test_a_lora_policy_agrees_with_the_engine_after_the_weight_sync(saved):
    """The engine loads the base; the trainer's copy gets adapters (and a fully trained head)
    with random values. Before the weight sync the two disagree; the sync sends only the
    changed tensors, merged under the base's names, and then they agree as a full model does."""
    from stages.common.hf_io import load_causal_lm
    from stages.common.lora import apply_lora
    from stages.common.training_settings import LoraSettings
    from stages.rl.weight_sync import GatherIntoEngines

    model_type, path = saved
    trust = model_type in MODEL_KINDS
    engine = create_engine("torch", str(path), device="cpu", dtype="float32", max_batch=4, max_len=96,
                           eos_token_ids=[], trust_remote_code=trust)
    trainer = load_causal_lm(path, torch.float32, trust_remote_code=trust)
    dense_mlp = any(n.endswith("down_proj") and isinstance(m, torch.nn.Linear) for n, m in trainer.named_modules())
    targets = ["*.q_proj", "*.v_proj", "*.o_proj"] + ["*.down_proj"] * dense_mlp  # qwen3_moe: fused experts
    apply_lora(trainer, LoraSettings(rank=4, target_modules=targets, train_fully=["lm_head"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in trainer.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    requests, sampling = _requests(5, seed=2), SamplingParams(temperature=0.9, seed=4)
    before = measure_agreement(engine, trainer, requests, sampling, pad_id=PAD, device="cpu")
    assert before.stats["abs_log_k_max"] > 1e-2  # the engine still runs the base
    sync = GatherIntoEngines(trainer, engine, zero3=False, bucket_bytes=16 << 10, changed_only=True)
    full = sum(p.numel() * p.element_size() for p in load_causal_lm(path, torch.float32,
                                                                     trust_remote_code=trust).parameters())
    assert 0 < sync.bytes < full  # only what changed travels
    sync.push(1)
    got = measure_agreement(engine, trainer, requests, sampling, pad_id=PAD, device="cpu")
    # the trainer computes x W^T + s (x A^T) B^T, the engine x (W + s B A)^T: the same function
    # rounded along two paths (fp32), a little further apart than a full model's 2e-5
    for e, t in zip(got.engine_logprobs, got.trainer_logprobs):
        torch.testing.assert_close(torch.tensor(e), torch.tensor(t), atol=1e-4, rtol=0)
    assert got.stats["abs_log_k_max"] < 1e-4 and got.stats["masked_fraction"] == 0.0


def _tied_llama(path: Path, seed: int = 0) -> Path:
    """A llama with tied embeddings and SmolLM2's rope theta (1e5), saved in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("llama", **SIZES, tie_word_embeddings=True, rope_theta=100000.0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_a_bf16_engine_rotates_positions_as_the_fp32_trainer_does(tmp_path):
    """The rotary frequencies are a buffer, not a weight: a bf16 engine keeps them fp32 as the
    trainer has them, so its cos/sin at every position are the trainer's rounded once to bf16.
    (Cast to bf16 with the weights, they were 0.3% off: ~1 rad at a distance of 700 tokens.)"""
    from stages.common.hf_io import load_causal_lm

    path = _tied_llama(tmp_path / "llama")
    engine = create_engine("torch", str(path), device="cpu", dtype="bfloat16", max_batch=2, max_len=64)
    trainer = load_causal_lm(path, torch.float32, trust_remote_code=False)
    pos = torch.arange(2048)[None]
    x = torch.zeros(1, 1, SIZES["hidden_size"])
    with torch.no_grad():
        want = trainer.model.rotary_emb(x, pos)
        got = engine.model.model.rotary_emb(x.to(torch.bfloat16), pos)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w.to(torch.bfloat16), atol=0, rtol=0)
    # the weights themselves are bf16, and the tied head is still the embedding
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_engine_synced_step_after_step_equals_one_built_from_the_weights(tmp_path, dtype):
    """Nothing of the old weights survives the weight sync (a packed q/k/v or gate/up copy, the
    tied head, an fp32 buffer): after several large AdamW steps, each pushed through the stage's
    sync, the engine decodes exactly what a fresh engine loaded from the trainer's saved weights
    decodes, token for token and log-prob for log-prob."""
    from stages.common.hf_io import load_causal_lm
    from stages.rl.weight_sync import GatherIntoEngines

    path = _tied_llama(tmp_path / "llama")
    options = dict(device="cpu", dtype=dtype, max_batch=4, max_len=96, eos_token_ids=[])
    synced = create_engine("torch", str(path), **options)
    trainer = load_causal_lm(path, torch.float32, trust_remote_code=False)
    sync = GatherIntoEngines(trainer, synced, zero3=False, bucket_bytes=16 << 10)
    opt = torch.optim.AdamW(trainer.parameters(), lr=3e-3)
    requests, sampling = _requests(5, seed=3), SamplingParams(temperature=0.9, seed=5)
    for version in range(1, 5):
        opt.zero_grad()
        ids = torch.tensor([requests[0].prompt_ids])
        trainer(ids, labels=ids).loss.backward()
        opt.step()
        sync.push(version)
    trainer.save_pretrained(tmp_path / "now")
    fresh = create_engine("torch", str(tmp_path / "now"), **options)
    a, b = synced.generate(requests, sampling), fresh.generate(requests, sampling)
    assert [u.token_ids for u in a] == [u.token_ids for u in b]
    assert [u.logprobs for u in a] == [u.logprobs for u in b]
    moved = load_causal_lm(path, torch.float32, trust_remote_code=False).model.embed_tokens.weight
    assert (moved - trainer.model.embed_tokens.weight).abs().max() > 1e-3  # the steps moved the weights

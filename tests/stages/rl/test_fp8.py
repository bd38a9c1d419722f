"""FP8 rollouts of the torch engine (torch_engine/fp8.py, issue 34) on CPU: the e4m3
quantise / dequantise round trip and its scales, the refusal where torch._scaled_mm cannot
run, and (through the dequantising reference path) that the weight sync re-quantises what it
pushes. The FP8 matmuls themselves need a GPU: benchmarks/fp8_rollouts.py."""
from __future__ import annotations

import pytest
import torch

from stages.rl.engines import RolloutRequest, SamplingParams, create_engine
from stages.rl.engines.agreement import measure_agreement
from stages.rl.engines.torch_engine.fp8 import E4M3, E4M3_MAX, Fp8Matmul, dequantize, quantize, weight_scale

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 256


def _weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g)
    w[3] *= 100.0   # one loud row
    w[5] *= 1e-3    # one quiet row
    w[7] = 0.0      # and an empty one
    return w


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_round_trip_error_is_within_e4m3_rounding(scaling):
    w = _weights()
    q, scale = quantize(w, scaling)
    assert q.dtype == E4M3 and scale.dtype == torch.float32
    back = dequantize(q, scale)
    # 3 mantissa bits: half an ulp is 2^-4 relative; below the normal range the step is 2^-9 * scale
    bound = w.abs() * 2 ** -4 + scale.expand_as(w) * 2 ** -9
    assert ((back - w).abs() <= bound + 1e-12).all()
    assert (back[7] == 0).all()


def test_scales_map_each_amax_to_the_largest_e4m3_value():
    w = _weights()
    assert weight_scale(w, "tensor") == pytest.approx(float(w.abs().max()) / E4M3_MAX)
    rows = weight_scale(w, "row")
    assert rows.shape == (64, 1)
    torch.testing.assert_close(rows[:7], w[:7].abs().amax(dim=1, keepdim=True) / E4M3_MAX)
    assert float(rows[7]) > 0  # an empty row keeps a usable (positive) scale
    q, _ = quantize(w, "row")
    assert float(q.float().abs().amax(dim=1)[:7].min()) == E4M3_MAX
    # per row the quiet row keeps its precision; one scale for all rounds it to nothing
    quiet = float(w[5].abs().max())
    assert (dequantize(*quantize(w, "tensor"))[5] - w[5]).abs().max() > 0.15 * quiet
    assert (dequantize(*quantize(w, "row"))[5] - w[5]).abs().max() <= 2 ** -4 * quiet
    with pytest.raises(ValueError, match="fp8_scaling"):
        weight_scale(w, "block")


def test_requantize_writes_in_place():
    w = _weights()
    mm = Fp8Matmul(lambda: w, lambda: None, "tensor", reference=True)
    q_before = mm.q
    w.mul_(3.0)
    mm.requantize()
    assert mm.q is q_before  # the address a CUDA graph captured stays valid
    torch.testing.assert_close(mm(torch.eye(48)), dequantize(*quantize(w, "tensor")).t())


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128, initializer_range=0.2,
        eos_token_id=1, pad_token_id=0))
    out = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(out)
    return out, model


def test_fp8_is_refused_where_scaled_mm_cannot_run(qwen2_dir):
    path, _ = qwen2_dir
    with pytest.raises(ValueError, match=r"rollout.dtype fp8 .*_scaled_mm.*device cpu is not a CUDA GPU"):
        create_engine("torch", str(path), device="cpu", dtype="fp8")


def _generate(engine):
    reqs = [RolloutRequest(f"r{i}", [5 + i, 17, 60 + i], 6) for i in range(3)]
    return engine.generate(reqs, SamplingParams(temperature=1.0, seed=11))


def test_the_weight_sync_requantizes_the_pushed_weights(qwen2_dir, tmp_path):
    path, model = qwen2_dir
    fp8 = create_engine("torch", str(path), device="cpu", dtype="fp8", fp8_reference=True, eos_token_ids=[])
    full = create_engine("torch", str(path), device="cpu", dtype="float32", eos_token_ids=[])
    # q/k/v and gate/up packed, o_proj and down_proj: 4 FP8 matmuls per layer
    assert len(fp8.fp8.matmuls) == 8 and fp8.fp8.skipped == []
    # FP8 weights move the log-probs a little against the fp32 trainer: the mismatch IcePop sees
    reqs = [RolloutRequest(f"r{i}", [5 + i, 17, 60 + i], 6) for i in range(3)]
    got = measure_agreement(fp8, model, reqs, SamplingParams(seed=11), pad_id=0, device="cpu")
    same = measure_agreement(full, model, reqs, SamplingParams(seed=11), pad_id=0, device="cpu")
    fp32_max, fp8_mean = same.stats["abs_log_k_max"], got.stats["abs_log_k_mean"]
    assert fp32_max < 1e-4 and max(100 * fp32_max, 1e-3) < fp8_mean < 0.5

    # the trainer's update arrives by name; the engine's FP8 copies must follow it
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "mlp" in n or "self_attn" in n:
                p.mul_(1.3)
    fp8.update_weights(model.named_parameters())
    model.save_pretrained(tmp_path / "updated")
    fresh = create_engine("torch", str(tmp_path / "updated"), device="cpu", dtype="fp8", fp8_reference=True,
                          eos_token_ids=[])
    for synced, built in zip(fp8.fp8.matmuls, fresh.fp8.matmuls):
        assert torch.equal(synced.q.float(), built.q.float()) and torch.equal(synced.scale, built.scale)
    assert [u.logprobs for u in _generate(fp8)] == [u.logprobs for u in _generate(fresh)]


def test_weights_released_by_sleep_come_back_quantized(qwen2_dir):
    """sleep(weights=True) frees the FP8 copies with the weights; the sync after wake() rebuilds them."""
    from stages.common.hf_io import load_causal_lm

    path, _ = qwen2_dir
    model = load_causal_lm(path, torch.float32, trust_remote_code=False)  # the saved weights (the fixture's model was changed above)
    engine = create_engine("torch", str(path), device="cpu", dtype="fp8", fp8_reference=True, eos_token_ids=[])
    before = [u.logprobs for u in _generate(engine)]
    engine.sleep(weights=True)
    assert all(mm.q.numel() == 0 for mm in engine.fp8.matmuls)
    engine.wake()
    engine.update_weights(model.named_parameters())
    assert [u.logprobs for u in _generate(engine)] == before

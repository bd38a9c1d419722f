"""compile_layers (stages/common/compile_layers.py), the one regional compilation of the SFT and
RL stages: the RL learner's micro batches, which change shape with every call, compile a few
times, not once per shape, and give the eager learner's numbers. Traced with dynamo's
aot_eager backend (RING_COMPILE_BACKEND): graph capture, guards and autograd are what
compilation changes; inductor's code is measured on the GPU (benchmarks/sft_throughput.py)."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from stages.common.compile_layers import BACKEND_ENV, compile_decoder_layers
from stages.common.contract import StageError
from stages.common.speed_defaults import settle_auto
from stages.reasoning_rl.config import ReasoningRLConfig
from stages.rl.learner import Learner, LearnerConfig, TorchBackend
from stages.rl.loss import LossConfig
from stages.sft.config import SFTConfig
from tests.stages.rl.test_learner import sample


def tiny_lm():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=True, attn_implementation="sdpa"))


def rollouts():
    """Micro batches of 160 padded tokens over these: rows x width 2x70, 4x36, 3x19"""
    g = torch.Generator().manual_seed(5)
    shapes = [(3, 67), (6, 60), (2, 34), (5, 31), (4, 30), (2, 28), (9, 10), (8, 1), (2, 3)]
    return [sample(torch.randint(2, 64, (p,), generator=g).tolist(), torch.randint(2, 64, (r,), generator=g).tolist(),
                   adv=(-1.0) ** i * (0.2 + 0.1 * i), infer=(-torch.rand(r, generator=g) * 3).tolist())
            for i, (p, r) in enumerate(shapes)]


def learner_of(model) -> Learner:
    return Learner(TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.5), grad_clip=None),
                   LearnerConfig(loss=LossConfig(correction="icepop"), pad_id=0, temperature=0.9,
                                 micro_batch_tokens=160, logit_chunk=32))


def test_the_learner_with_compiled_layers_compiles_a_few_times_and_matches_eager(monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = tiny_lm(), tiny_lm()
    compile_decoder_layers(compiled, "tiny", dynamic=True)  # as the RL policy's
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]

    learner, samples = learner_of(compiled), rollouts()
    got = [learner.train(samples, version=0)]
    # micro batches of 3 shapes through 2 layers, a no-grad and a grad pass: one graph per grad
    # mode, shared by the layers and the shapes
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2, dict(counters["stats"])
    got.append(learner.train(samples[1:], version=1))  # other micro batches again: no compile
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])

    learner = learner_of(eager)
    want = [learner.train(samples, version=0), learner.train(samples[1:], version=1)]
    for w, g in zip(want, got):
        for key in (k for k in w if not k.endswith("_seconds")):  # the loss, grad norm, mismatch stats
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)


def test_a_decoder_without_layers_is_named():
    class Decoder(torch.nn.Module):
        pass

    class LM(torch.nn.Module):
        def get_decoder(self):
            return Decoder()

    with pytest.raises(StageError, match=r"model m: compile_layers needs the decoder's layers as `.layers`.*Decoder"):
        compile_decoder_layers(LM(), "m")


def test_an_unknown_backend_is_named(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "no_such_backend")
    with pytest.raises(StageError, match=f"{BACKEND_ENV}='no_such_backend' is not a torch.compile backend"):
        compile_decoder_layers(tiny_lm(), "m")


@pytest.mark.parametrize("config,base", [
    (SFTConfig, {"model": "m", "data": "d"}),
    (ReasoningRLConfig, {"model": "m", "data": "d", "steps": 1})], ids=["sft", "reasoning_rl"])
def test_compile_layers_is_auto_by_default_and_refused_under_zero3(config, base):
    # `auto` is decided before launch (stages/common/speed_defaults.py); a job left with it runs eager
    assert config.model_validate(base).compile_layers == "auto"
    assert settle_auto(config.model_validate(base)).compile_layers is False
    assert config.model_validate({**base, "compile_layers": True, "zero_stage": "auto"}).compile_layers is True
    assert config.model_validate({**base, "compile_layers": True, "zero_stage": 2}).compile_layers
    with pytest.raises(ValidationError, match="compile_layers needs zero_stage 0, 1 or 2"):
        config.model_validate({**base, "compile_layers": True, "zero_stage": 3})

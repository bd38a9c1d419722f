"""The torch engine's `compile` option (torch_engine/compiled_step.py) on CPU: the decode step
through torch.compile decodes what the eager step decodes, and a compile that fails falls back
to the eager step with one warning.

The decode tests trace the step with `RING_COMPILE_BACKEND=aot_eager`: dynamo's whole-graph
capture and AOT autograd's functionalized graph (the KV cache's in-place writes) without
inductor's code generation: with its C++ build of the CPU graphs the file took 82 CPU-s on a cold
cache, without it 33 (the GPU runs inductor's Triton code). The failure test runs the real inductor, with
its C++ compiler missing.

The bucketed bookkeeping (static_shapes) runs without graphs, as on CPU it must; the CUDA
graph capture of the compiled kernels needs a GPU run (benchmarks/engine_decode.py --compile).
"""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from stages.common.compile_layers import BACKEND_ENV
from stages.rl.engines import RolloutRequest, SamplingParams, create_engine
from tests.stages.rl.tiny_model import build_model, save_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                 reason="inductor's CPU backend needs a C++ compiler (g++ / c++)")]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True)
def traced_without_codegen(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model(build_model(), tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    return save_model(build_model(seed=1), tmp_path_factory.mktemp("tiny_qwen2_other"))


def _requests():
    # mixed prompt lengths and budgets: an idle row, a finished row mid-call (the other two are
    # compacted into the next batch bucket and end together), one kv bucket: two shapes to
    # compile (each costs seconds of C++ compiling on a cold cache)
    return [RolloutRequest(f"r{i}", [2 + i, 5, 7, 11, 13][: 2 + i], 3 if i == 0 else 5) for i in range(3)]


def _engine(model_dir, max_batch=4, **options):
    return create_engine("torch", str(model_dir), max_batch=max_batch, max_len=32, eos_token_ids=[],
                         static_shapes=True, dtype="float32", **options)


@pytest.mark.slow
def test_compiled_decode_matches_eager_greedy(model_dir, other_model_dir):
    """Also for a second engine of other weights in the same process: torch.compile's code
    cache is shared between engines, their weights are not."""
    for path in (model_dir, other_model_dir):
        eager = _engine(path).generate(_requests(), GREEDY)
        engine = _engine(path, compile=True)
        compiled = engine.generate(_requests(), GREEDY)
        assert engine.compiled.enabled and len(engine.compiled.compiled) >= 1
        assert engine.compiled.compile_seconds > 0
        for a, b in zip(eager, compiled):
            assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason, a.uid
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    assert eager[0].token_ids != _engine(model_dir).generate(_requests(), GREEDY)[0].token_ids


@pytest.mark.slow
def test_failed_compile_warns_once_and_decodes_eagerly(model_dir, caplog, monkeypatch):
    """A real inductor failure (its C++ compiler is missing) mid-call: the call still returns
    the eager rollouts, and compiling stays off for the engine. (max_batch 2: a shape no
    other test compiled, so no cached compile hides the failure.)"""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv(BACKEND_ENV, "inductor")
    eager = _engine(model_dir, max_batch=2).generate(_requests(), GREEDY)
    engine = _engine(model_dir, max_batch=2, compile=True)
    with inductor_config.patch({"cpp.cxx": ("no-such-c++-compiler",), "force_disable_caches": True}), \
            caplog.at_level(logging.WARNING, logger="stages.rl.engines.torch_engine"):
        got = engine.generate(_requests(), GREEDY)
        again = engine.generate(_requests(), GREEDY)
    assert not engine.compiled.enabled
    warnings = [r for r in caplog.records if "compiled decode step failed" in r.getMessage()]
    assert len(warnings) == 1
    for a, b, c in zip(eager, got, again):
        assert b.token_ids == a.token_ids == c.token_ids, a.uid
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)


def test_compile_options_are_checked(model_dir):
    with pytest.raises(ValueError, match="compile_max_shapes must be >= 1"):
        _engine(model_dir, compile=True, compile_max_shapes=0)
    with pytest.raises(ValueError, match="compile_mode must be one of .*own CUDA graphs"):
        _engine(model_dir, compile=True, compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="compile=True needs static_shapes=True"):
        create_engine("torch", str(model_dir), compile=True, static_shapes=False)
    assert create_engine("torch", str(model_dir), compile=True).static_shapes  # the default follows


@pytest.mark.slow
def test_shapes_beyond_compile_max_shapes_decode_eagerly(model_dir, caplog):
    """compile_max_shapes=1: the greedy step is compiled, the sampled one (another shape
    signature) runs eagerly, with one warning, and both decode what the eager engine does."""
    sampled = SamplingParams(temperature=1.0, seed=7)
    eager = _engine(model_dir)
    engine = _engine(model_dir, compile=True, compile_max_shapes=1)
    with caplog.at_level(logging.WARNING, logger="stages.rl.engines.torch_engine"):
        for params in (GREEDY, sampled, sampled):
            want, got = eager.generate(_requests(), params), engine.generate(_requests(), params)
            for a, b in zip(want, got):
                assert b.token_ids == a.token_ids, (params, a.uid)
                torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    assert engine.compiled.enabled and len(engine.compiled.compiled) == 1
    assert sum("decode shapes compiled" in r.getMessage() for r in caplog.records) == 1

"""Routing replay (R3) on the tiny ring_moe policy (issue 34): the torch engine records each
position's experts, the C3PO++ scheduler carries them (over carry-over and a checkpoint), and
the learner measures the trainer's disagreement with them or routes with them.

The policy is random (initializer_range 0.2, a random expert bias: the selection score differs
from the weights); the trainer's copy gets its router weights perturbed, so that it routes some
tokens elsewhere than the engine did: the mismatch replay removes."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from stages.init_model.model import MODEL_KINDS, save_model
from stages.rl.engines import RolloutRequest, SamplingParams, create_engine
from stages.rl.engines.routes import decode_routes, encode_routes
from stages.rl.learner import Learner, LearnerConfig, TorchBackend
from stages.rl.loss import LossConfig
from stages.rl.prompt_sampler import PromptSampler
from stages.rl.rollout_records import SchedulerConfig
from stages.rl.routing import RouterReplay, moe_routers
from stages.rl.scheduler import make_scheduler
from tests.stages.rl.fakes import decode, parity_reward

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, PAD = 256, 0
E, K = 8, 2
ROWS = [{"id": f"r{i}", "domain": "math", "prompt": f"p{i}", "reference": i} for i in range(6)]
PROMPT_IDS = [[3 + i, 100 + i, 40 + 7 * i] for i in range(6)]


def build_moe(seed: int = 0):
    torch.manual_seed(seed)
    config_cls, model_cls = MODEL_KINDS["ring_moe"].classes()
    config = config_cls(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128,
                        eos_token_id=1, pad_token_id=PAD, bos_token_id=None, initializer_range=0.2,
                        num_experts=E, num_experts_per_tok=K, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, first_k_dense_replace=1)
    config.auto_map = dict(MODEL_KINDS["ring_moe"].auto_map)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("expert_bias"):
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("ring_moe")
    model = build_moe()
    save_model(model, "ring_moe", out)
    return model, out


@pytest.fixture(scope="module")
def samples(moe):
    """Two C3PO++ steps with the real engine; the scheduler checkpointed (JSON) between them."""
    _, path = moe
    engine = create_engine("torch", str(path), device="cpu", dtype="float32", max_batch=8, max_len=64,
                           eos_token_ids=[], static_shapes=True, trust_remote_code=True, record_routes=True)
    conf = SchedulerConfig(rollouts_per_prompt=4, max_new_tokens=9, pool_capacity=8, token_budget=6,
                           retention_limit=100, prompts_per_step=2)

    def scheduler():
        return make_scheduler("c3po", engine, conf, ROWS, PROMPT_IDS, PromptSampler({"math": list(range(6))}, None, 0),
                              SamplingParams(temperature=1.0, seed=5), decode, parity_reward,
                              max_new_tokens_fn=lambda row: 3 + 3 * (row % 3))  # ragged: some carried over

    first = scheduler()
    batches = [first.next_batch(0)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert state["pool"] and all(r["routes"] for r in state["pool"] if r["token_ids"]), "unfinished rollouts carry routes"
    resumed = scheduler()
    resumed.load_state_dict(state)
    batches += [resumed.next_batch(1), resumed.next_batch(2)]
    out = [s for b in batches for s in b.samples]
    assert any(s.carried for s in out), "the scenario must carry a rollout over a policy update"
    return out


def test_engines_record_routes_only_when_asked(moe):
    """Off by default (eval and distill decode with the same engine and need none)."""
    _, path = moe
    engine = create_engine("torch", str(path), device="cpu", dtype="float32", eos_token_ids=[], trust_remote_code=True)
    (update,) = engine.generate([RolloutRequest("a", [5, 6, 7], 3)], SamplingParams(seed=0))
    assert update.routes is None and len(update.token_ids) == 3


def own_routes(model, seq: list[int]) -> np.ndarray:
    """[positions, MoE layers, k] the model's own routers choose on `seq` (sorted ids)."""
    got = []
    hooks = [r.register_forward_hook(lambda m, a, out: got.append(out[2].detach())) for r in moe_routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    return np.sort(torch.stack(got, dim=1).numpy(), axis=-1)


def test_the_engine_records_every_fed_position_as_the_model_routes_it(moe, samples):
    model, _ = moe
    for s in samples:
        routes = decode_routes(s.routes)
        seq = s.prompt_ids + s.response_ids
        # every position fed through the model: all but the last sampled token
        assert routes.shape == (len(seq) - 1, 2, K), s.uid
        assert (routes >= 0).all() and (routes < E).all()
        # fp32, same weights: the engine's choice is the model's own, position by position
        np.testing.assert_array_equal(np.sort(routes, axis=-1), own_routes(model, seq)[:len(seq) - 1])


def _learner(model, replay: bool) -> tuple[Learner, RouterReplay]:
    routing = RouterReplay(model, replay=replay)
    backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0), grad_clip=None)
    return Learner(backend, LearnerConfig(loss=LossConfig(), pad_id=PAD), routing=routing), routing


def _perturbed(model):
    trainer = copy.deepcopy(model)
    with torch.no_grad():
        for r in moe_routers(trainer):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.15)
    return trainer


def test_without_replay_the_disagreement_is_reported(moe, samples):
    model, _ = moe
    same, _ = _learner(copy.deepcopy(model), replay=False)
    assert same.train(samples, 2)["expert_disagreement"] == 0.0
    other, _ = _learner(_perturbed(model), replay=False)
    metrics = other.train(samples, 2)
    assert 0.0 < metrics["expert_miss_fraction"] <= metrics["expert_disagreement"] < 1.0


def test_with_replay_the_trainer_routes_every_token_as_the_engine_did(moe, samples):
    model, _ = moe
    trainer = _perturbed(model)
    learner, routing = _learner(trainer, replay=True)
    seen = []  # the routers' output after the replay hook (hooks run in registration order)
    for r in routing.routers:
        r.register_forward_hook(lambda m, a, out: seen.append(out[2].detach().clone()))
    metrics = learner.train(samples, 2)
    assert metrics["expert_disagreement"] > 0  # the trainer's own choice still differs ...
    order = sorted(range(len(samples)), key=lambda i: (-(len(samples[i].prompt_ids) + len(samples[i].response_ids)), i))
    # ... but what it routes with is the engine's: one micro batch (all rows), 2 layers, 2 passes
    assert len(seen) == 4
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    for call, layer_out in enumerate(seen):
        used = layer_out.view(len(samples), width, K)
        for row, i in enumerate(order):
            routes = decode_routes(samples[i].routes)
            np.testing.assert_array_equal(used[row, :len(routes)].numpy(), routes[:, call % 2])


def test_replay_is_refused_where_it_cannot_work():
    from transformers import AutoConfig, AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match="no MoE block"):
        RouterReplay(dense, replay=True)
    qwen_moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2_moe", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16))
    with pytest.raises(ValueError, match="no replay rule.*Qwen2MoeTopKRouter"):
        RouterReplay(qwen_moe, replay=True)
    RouterReplay(qwen_moe, replay=False)  # measuring works for any router


def test_routes_survive_their_plain_data_form():
    rng = np.random.default_rng(0)
    for experts in (8, 300):  # uint8 and int16 storage
        a = rng.integers(0, experts, size=(7, 3, 2)).astype(np.int16)
        a[2] = -1
        back = decode_routes(json.loads(json.dumps(encode_routes(a))))
        np.testing.assert_array_equal(back, a)
    with pytest.raises(ValueError, match="positions, layers, k"):
        encode_routes(np.zeros((3, 2)))

"""The update step: chunked response log-probs, micro-batch planning, gradient accumulation."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from stages.rl.learner import Learner, LearnerConfig, PolicyHead, TorchBackend, collate, plan_micro_batches
from stages.rl.loss import LossConfig


def tiny_lm(seed=0, vocab=64, attention_dropout=0.0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                      attention_dropout=attention_dropout)
    return Qwen2ForCausalLM(cfg)


def sample(prompt, response, adv, infer=None, segments=None):
    s = SimpleNamespace(prompt_ids=prompt, response_ids=response, advantage=adv,
                        infer_logprobs=infer or [-1.0] * len(response), segments=segments or [[0, 0]])
    s.token_versions = lambda: [v for (a, v), (b, _) in zip(s.segments, s.segments[1:] + [[len(response), 0]])
                                for _ in range(b - a)]
    return s


def batch_samples():
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (p, r) in enumerate([(3, 7), (5, 2), (2, 9), (4, 4), (6, 1)]):
        prompt = torch.randint(2, 64, (p,), generator=g).tolist()
        resp = torch.randint(2, 64, (r,), generator=g).tolist()
        out.append(sample(prompt, resp, adv=[1.0, -0.5, 0.3, -1.2, 0.9][i]))
    return out


def naive_logprobs(model, s, temperature):
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    logits = model(input_ids=ids).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    P = len(s.prompt_ids)
    return torch.stack([lp[P - 1 + t, tok] for t, tok in enumerate(s.response_ids)])


@pytest.mark.parametrize("chunk", [2, 1024])
def test_response_logprobs_match_a_plain_forward(chunk):
    model = tiny_lm()
    samples = batch_samples()
    mb = collate(samples, version=0, pad_id=0, device=torch.device("cpu"))
    head = PolicyHead(model)
    lp, ent = head(mb.input_ids, mb.attention_mask, mb.resp_pos, mb.targets, 0.7, chunk, True)
    for b, s in enumerate(samples):
        ref = naive_logprobs(model, s, 0.7)
        torch.testing.assert_close(lp[b, :len(s.response_ids)], ref, rtol=1e-4, atol=1e-5)
    assert torch.all(ent[mb.mask] > 0)
    # gradients through the chunked (checkpointed) path equal the plain path's
    lp_g, _ = head(mb.input_ids, mb.attention_mask, mb.resp_pos, mb.targets, 0.7, chunk)
    (lp_g * mb.mask).sum().backward()
    g_chunk = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sum(naive_logprobs(model, s, 0.7).sum() for s in samples).backward()
    for a, p in zip(g_chunk, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-3, atol=1e-5)


def test_plan_micro_batches_covers_balances_and_pads():
    lengths = [100, 10, 40, 40, 5, 70, 30, 30, 20]
    plans = plan_micro_batches(lengths, world_size=2, max_tokens=80)
    flat = sorted(i for rank in plans for mb in rank for i in mb)
    assert flat == list(range(len(lengths)))
    assert len(plans[0]) == len(plans[1])  # same number of micro-batches on every rank
    for rank in plans:
        for mb in rank:
            if len(mb) > 1:
                assert len(mb) * max(lengths[i] for i in mb) <= 80
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plans]
    assert abs(loads[0] - loads[1]) <= 100


def _train_once(micro_batch_tokens, updates=1, correction="icepop", attention_dropout=0.0, clip_eps=0.2):
    model = tiny_lm(seed=3, attention_dropout=attention_dropout)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    learner = Learner(TorchBackend(model, opt, grad_clip=None),
                      LearnerConfig(loss=LossConfig(correction=correction, clip_eps_low=clip_eps, clip_eps_high=clip_eps),
                                    pad_id=0, temperature=1.0, micro_batch_tokens=micro_batch_tokens,
                                    updates_per_batch=updates))
    samples = batch_samples()
    with torch.no_grad():  # pi_infer = pi_train(theta_old) perturbed a little
        for s in samples:
            s.infer_logprobs = (naive_logprobs(model.eval(), s, 1.0) + 0.05).tolist()
    stats = learner.train(samples, version=0)
    return model, stats


def test_micro_batching_does_not_change_the_update():
    whole, s1 = _train_once(micro_batch_tokens=10_000)
    split, s2 = _train_once(micro_batch_tokens=1)  # one rollout per micro-batch
    for a, b in zip(whole.parameters(), split.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert s1["loss"] == pytest.approx(s2["loss"], rel=1e-5)
    # the update equals SGD on the direct loss (r = 1: J = 1/N sum_i 1/|y_i| sum_t k A_i)
    ref = tiny_lm(seed=3)
    samples = batch_samples()
    with torch.no_grad():
        for s in samples:
            s.infer_logprobs = (naive_logprobs(ref, s, 1.0) + 0.05).tolist()
    obj = 0.0
    for s in samples:
        lp = naive_logprobs(ref, s, 1.0)
        k = torch.exp(lp.detach() - torch.tensor(s.infer_logprobs))
        obj = obj + (k * torch.exp(lp - lp.detach()) * s.advantage).mean()
    (-obj / len(samples)).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    for a, b in zip(whole.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # k = exp(-0.05) everywhere: nothing masked, mismatch measured
    assert s1["masked_fraction"] == 0.0
    assert s1["abs_log_k_mean"] == pytest.approx(0.05, rel=1e-3)
    assert s1["mismatch_kl"] == pytest.approx(torch.exp(torch.tensor(-0.05)).item() - 1 + 0.05, rel=1e-2)


def test_a_policy_with_dropout_has_ratio_one_at_the_first_update():
    """theta_old and the update are one function (both passes in train mode, dropout off): with
    a clip range of 1e-6 no token is clipped, and the update is the dropout-free one."""
    dropped, stats = _train_once(micro_batch_tokens=10_000, attention_dropout=0.5, clip_eps=1e-6)
    assert stats["clip_fraction"] == 0.0
    plain, _ = _train_once(micro_batch_tokens=10_000, clip_eps=1e-6)
    for a, b in zip(dropped.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert dropped.config.attention_dropout == 0.5  # the model's own settings are kept (and saved)


def test_several_updates_per_batch():
    _, stats = _train_once(micro_batch_tokens=10_000, updates=2)
    assert stats["optimizer_steps"] == 2
    assert stats["grad_norm"] > 0


def test_kl_needs_reference_model():
    model = tiny_lm()
    with pytest.raises(ValueError, match="reference model"):
        Learner(TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), None),
                LearnerConfig(loss=LossConfig(kl_coef=0.1), pad_id=0))
    ref = copy.deepcopy(model)
    learner = Learner(TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), None),
                      LearnerConfig(loss=LossConfig(kl_coef=0.1), pad_id=0), ref_model=ref)
    stats = learner.train(batch_samples(), version=0)
    assert stats["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # theta == reference before the step


def test_the_learner_step_runs_without_cudnn_attention():
    """Forward and backward of a learner step run with SDPA's cuDNN kernel switched off (its
    per-shape plans: stages/common/packed_attention.py), and the switch is restored after."""
    model = tiny_lm()
    seen = []
    model.model.layers[0].self_attn.register_forward_hook(
        lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    model.model.layers[0].self_attn.register_full_backward_hook(
        lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    learner = Learner(TorchBackend(model, opt, grad_clip=None),
                      LearnerConfig(loss=LossConfig(correction="icepop"), pad_id=0, micro_batch_tokens=64))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    learner.train(batch_samples(), version=0)
    assert seen and not any(seen)  # theta_old pass, update forward and backward
    assert len(seen) >= 3
    assert torch.backends.cuda.cudnn_sdp_enabled() == before

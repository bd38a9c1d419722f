"""The learner passes no padding mask to a model whose attention is causal by position (its
micro batches are right-padded), and the numbers do not move: log-probs, entropies, the
loss and the gradients equal those of the masked forward, over micro batches whose rows
differ several-fold in length. A model whose attention is not causal keeps the mask."""
from __future__ import annotations

import copy

import pytest
import torch

from stages.rl.learner import CAUSAL_BY_POSITION, Learner, LearnerConfig, PolicyHead, TorchBackend, collate
from stages.rl.loss import LossConfig
from tests.stages.rl.test_learner import sample

VOCAB = 64


def qwen2(attn: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=True,
        attn_implementation=attn))


def ring_moe(attn: str):
    from stages.init_model.ring_moe.configuration_ring_moe import RingMoeConfig
    from stages.init_model.ring_moe.modeling_ring_moe import RingMoeForCausalLM

    torch.manual_seed(0)
    model = RingMoeForCausalLM(RingMoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=256, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=32, first_k_dense_replace=1,
        attn_implementation=attn))
    for name, p in model.named_parameters():  # a trained router's bias: routing not uniform
        if name.endswith("expert_bias"):
            p.data.normal_()
    return model


def gemma3_bidirectional(attn: str):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=256, use_bidirectional_attention=True,
        attn_implementation=attn))


def rollouts():
    """Rows of 4 to 70 tokens: a micro batch's shortest rows are mostly padding."""
    g = torch.Generator().manual_seed(3)
    shapes = [(3, 67), (5, 2), (2, 40), (8, 1), (4, 25), (6, 60), (2, 3), (3, 12)]
    return [sample(torch.randint(2, VOCAB, (p,), generator=g).tolist(),
                   torch.randint(2, VOCAB, (r,), generator=g).tolist(),
                   adv=(-1.0) ** i * (0.3 + 0.1 * i),
                   infer=(-torch.rand(r, generator=g) * 4).tolist())
            for i, (p, r) in enumerate(shapes)]


def test_collate_right_pads_every_row_from_position_zero():
    samples = rollouts()
    mb = collate(samples, version=0, pad_id=0, device=torch.device("cpu"))
    for b, s in enumerate(samples):
        n = len(s.prompt_ids) + len(s.response_ids)
        assert mb.attention_mask[b, :n].all() and not mb.attention_mask[b, n:].any()
        assert mb.input_ids[b, :n].tolist() == s.prompt_ids + s.response_ids
        # every response token is predicted from a real token of its own row
        assert int(mb.resp_pos[b, :len(s.response_ids)].max()) < n


def _logprobs_and_grads(head: PolicyHead, mb):
    head.zero_grad(set_to_none=True)
    lp, ent = head(mb.input_ids, mb.attention_mask, mb.resp_pos, mb.targets, 0.8, 16, True)
    (lp * mb.mask).sum().backward()
    # the router's expert bias has none (top-k indices carry no gradient)
    return lp.detach(), ent, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [qwen2, ring_moe], ids=["qwen2", "ring_moe"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_causal_models_get_no_mask_and_the_same_logprobs_and_grads(build, attn):
    model = build(attn).train()
    masked, causal = PolicyHead(copy.deepcopy(model), keep_padding_mask=True), PolicyHead(model)
    assert masked.uses_padding_mask and not causal.uses_padding_mask
    mb = collate(rollouts(), version=0, pad_id=0, device=torch.device("cpu"))
    want_lp, want_ent, want_grads = _logprobs_and_grads(masked, mb)
    got_lp, got_ent, got_grads = _logprobs_and_grads(causal, mb)
    m = mb.mask
    torch.testing.assert_close(got_lp[m], want_lp[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent[m], want_ent[m], atol=1e-5, rtol=1e-5)
    assert want_grads.keys() == got_grads.keys() and len(want_grads) > 10
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_learner_step_without_the_mask_is_the_masked_step():
    """Learner.train end to end (theta_old pass, loss, backward over several micro batches,
    one step): SGD with lr 1 makes each parameter's change its gradient."""
    samples = rollouts()

    def step(keep_padding_mask: bool):
        model = qwen2("sdpa")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        head = PolicyHead(model, keep_padding_mask=keep_padding_mask)
        learner = Learner(TorchBackend(head, torch.optim.SGD(model.parameters(), lr=1.0), grad_clip=None),
                          LearnerConfig(loss=LossConfig(correction="icepop"), pad_id=0, temperature=0.8,
                                        micro_batch_tokens=160, logit_chunk=16))
        metrics = learner.train(samples, version=0)
        return metrics, {n: p.detach() - before[n] for n, p in model.named_parameters()}

    want_metrics, want_delta = step(True)
    got_metrics, got_delta = step(False)
    for key in ("loss", "pg_loss", "grad_norm", "kept_fraction", "clip_fraction"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-7), key
    assert want_metrics["grad_norm"] > 0
    for name in want_delta:
        torch.testing.assert_close(got_delta[name], want_delta[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_model_whose_attention_is_not_causal_keeps_the_mask():
    """gemma3 with bidirectional attention (an embedding model's setting): without the mask a
    row's real tokens would attend to the pads after them. Its log-probs in a padded micro
    batch equal those of each row alone, which only the mask makes so."""
    model = gemma3_bidirectional("sdpa").train()
    assert model.config.model_type not in CAUSAL_BY_POSITION
    head = PolicyHead(model)
    assert head.uses_padding_mask
    samples = rollouts()[:3]
    mb = collate(samples, version=0, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        lp, _ = head(mb.input_ids, mb.attention_mask, mb.resp_pos, mb.targets, 1.0, 16)
        for b, s in enumerate(samples):
            alone = collate([s], version=0, pad_id=0, device=torch.device("cpu"))
            want, _ = head(alone.input_ids, alone.attention_mask, alone.resp_pos, alone.targets, 1.0, 16)
            torch.testing.assert_close(lp[b, :len(s.response_ids)], want[0], atol=1e-5, rtol=1e-5)
        # the control: the same micro batch with no mask is not the same
        unmasked, _ = head(mb.input_ids, None, mb.resp_pos, mb.targets, 1.0, 16)
        short = 1  # the second row, 7 real tokens in a row of 70
        n = len(samples[short].response_ids)
        assert (unmasked[short, :n] - lp[short, :n]).abs().max() > 1e-3

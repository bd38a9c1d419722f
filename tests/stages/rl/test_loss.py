"""IcePop / TIS / plain GRPO loss against a direct, loop-by-loop implementation of Eq. 1."""
from __future__ import annotations

import math

import pytest
import torch

from stages.rl.loss import LossConfig, MismatchStats, correction_weights, group_advantages, policy_loss


def direct_objective(logp, old, infer, adv, lengths, cfg: LossConfig, n_seqs):
    """Eq. 1 written out: 1/N sum_i 1/|y_i| sum_t w(k) min(r A, clip(r) A), in float64 python."""
    total = 0.0
    for i, L in enumerate(lengths):
        s = 0.0
        for t in range(L):
            k = math.exp(old[i][t] - infer[i][t])
            if cfg.correction == "icepop":
                w = k if cfg.alpha <= round(k, 6) <= cfg.beta else 0.0
            elif cfg.correction == "tis":
                w = min(k, cfg.tis_cap)
            else:
                w = 1.0
            r = math.exp(logp[i][t] - old[i][t])
            a = adv[i]
            s += w * min(r * a, min(max(r, 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high) * a)
        total += s / L
    return total / n_seqs


# k values at and around the interval ends, plus ordinary ones
K_VALUES = [0.49, 0.5, 5.0, 5.01, 1.0, 0.8, 1.3, 0.2, 12.0]
INSIDE = [False, True, True, False, True, True, True, False, False]


def crafted():
    """Two rollouts (lengths 6 and 3) laid out [2, 6]; k per token from K_VALUES."""
    torch.manual_seed(0)
    lengths = [6, 3]
    ks = [K_VALUES[:6], K_VALUES[6:9] + [1.0, 1.0, 1.0]]
    infer = torch.tensor([[-1.5, -0.7, -2.3, -1.9, -0.4, -3.0], [-1.1, -2.0, -0.9, -1.0, -1.0, -1.0]],
                         dtype=torch.float64)
    old = infer + torch.log(torch.tensor(ks, dtype=torch.float64))
    # store like a trainer would: float32 log-probs
    infer32, old32 = infer.float(), old.float()
    # theta moved a little away from theta_old (some ratios beyond the clip range)
    delta = torch.tensor([[0.05, -0.1, 0.3, 0.0, -0.3, 0.1], [0.02, 0.25, -0.02, 0.0, 0.0, 0.0]])
    logp = (old32 + delta).clone().requires_grad_(True)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.3, -0.7])
    return logp, old32, infer32, adv, mask, lengths


@pytest.mark.parametrize("correction", ["icepop", "tis", "none"])
def test_loss_and_gradient_match_eq1(correction):
    cfg = LossConfig(correction=correction, alpha=0.5, beta=5.0, clip_eps_low=0.2, clip_eps_high=0.28,
                     tis_cap=2.0)
    logp, old, infer, adv, mask, lengths = crafted()
    n_seqs = 5  # the batch these two rollouts belong to holds 5 rollouts
    out = policy_loss(logp, old, infer, adv, mask, cfg, num_sequences=n_seqs)
    ref = direct_objective(logp.detach().double().tolist(), old.double().tolist(), infer.double().tolist(),
                           adv.tolist(), lengths, cfg, n_seqs)
    assert out.loss.item() == pytest.approx(-ref, rel=1e-5, abs=1e-7)

    # gradient check: autograd of the direct formula, token by token
    out.loss.backward()
    g = logp.grad
    lp = logp.detach().double().clone().requires_grad_(True)
    obj = 0.0
    for i, L in enumerate(lengths):
        s = 0.0
        for t in range(L):
            k = math.exp(float(old[i, t].double() - infer[i, t].double()))
            w = {"icepop": k if (0.5 <= round(k, 6) <= 5.0) else 0.0, "tis": min(k, 2.0), "none": 1.0}[correction]
            r = torch.exp(lp[i, t] - old[i, t].double())
            a = float(adv[i])
            s = s + w * torch.minimum(r * a, r.clamp(0.8, 1.28) * a)
        obj = obj + s / L
    (-obj / n_seqs).backward()
    torch.testing.assert_close(g.double(), lp.grad, rtol=1e-5, atol=1e-8)
    assert torch.all(g[~mask] == 0)


def test_icepop_interval_is_closed_and_masked_tokens_get_zero_gradient():
    cfg = LossConfig(correction="icepop", alpha=0.5, beta=5.0)
    logp, old, infer, adv, mask, lengths = crafted()
    w, keep = correction_weights(old, infer, cfg)
    got = keep[0].tolist() + keep[1, :3].tolist()
    assert got == INSIDE
    # inside tokens are weighted by k itself
    for flat, (inside, k) in enumerate(zip(INSIDE, K_VALUES)):
        i, t = (0, flat) if flat < 6 else (1, flat - 6)
        assert float(w[i, t]) == (pytest.approx(k, rel=1e-5) if inside else 0.0)
    # no clipping anywhere (ratio 1): every inside token gets gradient -k*A/(|y| N), outside 0
    logp1 = old.clone().requires_grad_(True)
    policy_loss(logp1, old, infer, adv, mask, cfg).loss.backward()
    for flat, (inside, k) in enumerate(zip(INSIDE, K_VALUES)):
        i, t = (0, flat) if flat < 6 else (1, flat - 6)
        expected = -k * float(adv[i]) / lengths[i] / 2 if inside else 0.0
        assert float(logp1.grad[i, t]) == pytest.approx(expected, rel=1e-5, abs=0.0)


def test_tis_keeps_every_token_with_truncated_weight():
    cfg = LossConfig(correction="tis", tis_cap=2.0)
    logp, old, infer, adv, mask, lengths = crafted()
    w, keep = correction_weights(old, infer, cfg)
    assert keep.all()
    flat_w = w[0].tolist() + w[1, :3].tolist()
    assert flat_w == pytest.approx([min(k, 2.0) for k in K_VALUES], rel=1e-5)
    logp1 = old.clone().requires_grad_(True)
    policy_loss(logp1, old, infer, adv, mask, cfg).loss.backward()
    assert torch.all(logp1.grad[mask] != 0)


def test_none_is_plain_grpo():
    cfg = LossConfig(correction="none")
    logp, old, infer, adv, mask, lengths = crafted()
    w, _ = correction_weights(old, infer, cfg)
    assert torch.all(w == 1)
    logp1 = old.clone().requires_grad_(True)
    out = policy_loss(logp1, old, infer, adv, mask, cfg)
    # r = 1: J = mean_i A_i  (each rollout's tokens average to A_i)
    assert out.loss.item() == pytest.approx(-(1.3 - 0.7) / 2, rel=1e-6)


def test_clip_zeroes_gradient_beyond_the_trust_region():
    cfg = LossConfig(correction="none", clip_eps_low=0.2, clip_eps_high=0.2)
    old = torch.zeros(1, 2)
    infer = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    out = policy_loss(logp, old, infer, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), cfg)
    out.loss.backward()
    # A > 0: r = 1.5 is clipped (no gradient); r = 0.5 is below 1 - eps, min picks r*A (gradient)
    assert logp.grad[0, 0] == 0
    assert logp.grad[0, 1] == pytest.approx(-0.5 / 2)
    assert out.clipped_tokens == 1


def test_kl_term_needs_reference_and_is_zero_at_reference():
    cfg = LossConfig(correction="none", kl_coef=0.1)
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), torch.ones(1, 2, dtype=torch.bool), cfg)
    out = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), torch.ones(1, 2, dtype=torch.bool), cfg,
                      ref_logp=lp.detach())
    assert out.kl == pytest.approx(0.0)
    out = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), torch.ones(1, 2, dtype=torch.bool), cfg,
                      ref_logp=lp.detach() - 0.5)
    assert out.kl == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-5)


def test_loss_config_validation():
    with pytest.raises(ValueError, match="alpha < beta"):
        LossConfig(alpha=5.0, beta=0.5)
    with pytest.raises(ValueError, match="alpha < beta"):
        LossConfig(alpha=0.0, beta=5.0)
    with pytest.raises(ValueError, match="correction"):
        LossConfig(correction="ppo")  # type: ignore[arg-type]


def test_group_advantages_normal_and_degenerate():
    a = group_advantages([1.0, 0.0, 0.0, 1.0])
    std = math.sqrt(4 * 0.25 / 3)
    assert a == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 1 + [-0.5 / (std + 1e-6), 0.5 / (std + 1e-6)])
    assert sum(a) == pytest.approx(0.0, abs=1e-9)
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]  # zero variance
    assert group_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]  # equal, even with float noise in the mean
    assert group_advantages([0.7]) == [0.0]  # one member
    assert group_advantages([]) == []


def test_mismatch_stats():
    cfg = LossConfig()
    _, old, infer, _, mask, _ = crafted()
    ent = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    stale = torch.tensor([[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    s = MismatchStats()
    s.add(old, infer, mask, cfg, entropy=ent, stale=stale)
    out = s.finalize()
    assert out["masked_fraction"] == pytest.approx(4 / 9)
    logks = [math.log(k) for k in K_VALUES]
    assert out["abs_log_k_max"] == pytest.approx(max(abs(x) for x in logks), rel=1e-5)
    assert out["abs_log_k_mean"] == pytest.approx(sum(abs(x) for x in logks) / 9, rel=1e-5)
    assert out["mismatch_kl"] == pytest.approx(sum(k - 1 - math.log(k) for k in K_VALUES) / 9, rel=1e-5)
    # masked tokens: (0,0) k=.49, (0,3) k=5.01, (1,1) k=.2, (1,2) k=12 -> entropies 0, 3, 7, 8
    assert out["entropy_masked"] == pytest.approx((0 + 3 + 7 + 8) / 4)
    assert out["entropy_all"] == pytest.approx((0 + 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) / 9)
    assert out["stale_token_fraction"] == pytest.approx(2 / 9)
    assert out["masked_fraction_stale"] == pytest.approx(1 / 2)
    # sums merge across micro-batches / ranks
    s2 = MismatchStats()
    s2.add(old, infer, mask, cfg, entropy=ent, stale=stale)
    s.merge(s2)
    assert s.finalize()["masked_fraction"] == pytest.approx(4 / 9)
    assert s.sums["tokens"] == 18

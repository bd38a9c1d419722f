"""GRPO with IcePop (Ring-1T, arXiv 2510.18855, Eq. 1-3) and its two baselines.

Per response token t of rollout i (all log-probs of the sampled token y_{i,t}):

    k_{i,t} = pi_train(y_{i,t}; theta_old) / pi_infer(y_{i,t}; theta_old)   train-inference ratio
    r_{i,t} = pi_train(y_{i,t}; theta)     / pi_train(y_{i,t}; theta_old)   PPO ratio
    M(k)    = k  if alpha <= k <= beta  else 0                              (Eq. 2)

    J(theta) = 1/N sum_i 1/|y_i| sum_t M(k_{i,t}) * min(r A_i, clip(r, 1-eps_lo, 1+eps_hi) A_i)   (Eq. 1)

k does not depend on theta (both of its factors are theta_old), so the gradient is
M(k) * grad min(...) (Eq. 3): a token outside [alpha, beta] contributes exactly zero
gradient, a token inside is weighted by k. N is the number of rollouts in the optimisation
batch (1/G per group times the number of groups); |y_i| counts every response token of
rollout i, masked or not. The loss is -J (+ kl_coef * KL to a reference, k3 estimator,
averaged the same way; the recipe uses kl_coef 0).

Baselines (`correction`):
- "tis":  truncated importance sampling, weight min(k, tis_cap) on every token (none dropped);
- "none": plain GRPO, weight 1 (the mismatch is ignored).

Advantages are group-normalised: A_i = (R_i - mean_g R) / (std_g R + eps), std the sample
(Bessel-corrected) standard deviation. A group whose rewards are all equal, or with a
single member, has A = 0 for every member (it carries no preference signal).

The interval test runs in log space, log k = log pi_train - log pi_infer, in float64 with
a tolerance of 1e-6 nats at both ends: [alpha, beta] is closed, and the tolerance only
absorbs the rounding of log-probs stored in float32 (k = 0.5 stored in float32 must stay
inside, 0.49 or 5.01 are 2e-2 / 2e-3 nats away and stay outside).

This module imports torch only (no DeepSpeed): the benchmark runs it with a plain optimizer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

Correction = Literal["icepop", "tis", "none"]
LOG_K_TOL = 1e-6  # nats; see the module docstring


@dataclass(frozen=True)
class LossConfig:
    correction: Correction = "icepop"
    alpha: float = 0.5
    beta: float = 5.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    tis_cap: float = 2.0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.correction not in ("icepop", "tis", "none"):
            raise ValueError(f"correction must be icepop, tis or none, not {self.correction!r}")
        if not 0 < self.alpha < self.beta:
            raise ValueError(f"IcePop needs 0 < alpha < beta (got alpha={self.alpha}, beta={self.beta})")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            raise ValueError("clip eps must be >= 0")
        if self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 (got {self.tis_cap})")


# -- advantages ------------------------------------------------------------------------------
def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """(R - mean) / (std + eps) over one group; 0 for every member of a degenerate group
    (one member, or all rewards equal)."""
    n = len(rewards)
    if n == 0:
        return []
    if n == 1 or max(rewards) == min(rewards):
        return [0.0] * n
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]


# -- the mask / weights ----------------------------------------------------------------------
def inside_interval(log_k: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """alpha <= k <= beta, decided on log k in float64 (closed interval, see LOG_K_TOL)."""
    lk = log_k.detach().double()
    return (lk >= math.log(alpha) - LOG_K_TOL) & (lk <= math.log(beta) + LOG_K_TOL)


def correction_weights(old_logp: torch.Tensor, infer_logp: torch.Tensor,
                       cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weight on the PPO term (no gradient) and the mask of tokens kept.

    icepop: (M(k), alpha <= k <= beta); tis: (min(k, cap), all); none: (1, all)."""
    log_k = (old_logp.detach().double() - infer_logp.detach().double())
    if cfg.correction == "icepop":
        keep = inside_interval(log_k, cfg.alpha, cfg.beta)
        w = torch.where(keep, log_k.exp(), torch.zeros_like(log_k))
    elif cfg.correction == "tis":
        keep = torch.ones_like(log_k, dtype=torch.bool)
        w = log_k.exp().clamp(max=cfg.tis_cap)
    else:
        keep = torch.ones_like(log_k, dtype=torch.bool)
        w = torch.ones_like(log_k)
    return w.to(old_logp.dtype), keep


# -- the loss --------------------------------------------------------------------------------
@dataclass
class LossOutput:
    loss: torch.Tensor            # scalar, to minimise (its share of the batch objective)
    pg_loss: float                # -J part, same normalisation
    kl: float                     # KL part before kl_coef, same normalisation
    clipped_tokens: int           # tokens whose PPO term took the clipped branch
    kept_tokens: int              # tokens with a non-zero correction weight
    tokens: int


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, infer_logp: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig, *,
                num_sequences: int | None = None, ref_logp: torch.Tensor | None = None) -> LossOutput:
    """The micro-batch's share of -J(theta) (Eq. 1) for rollouts laid out as [B, T].

    logp: log pi_train(theta) of the response tokens (with grad); old_logp: the same under
    theta_old (computed once before the update); infer_logp: pi_infer recorded by the rollout
    engine at sampling time; advantages: [B] (one per rollout) or [B, T]; mask: [B, T], 1 on
    response tokens. num_sequences: N of Eq. 1, the number of rollouts in the whole
    optimisation batch (summing the micro-batches' losses gives the batch loss); default B.
    """
    if logp.shape != old_logp.shape or logp.shape != infer_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)}, old {tuple(old_logp.shape)}, "
                         f"infer {tuple(infer_logp.shape)}, mask {tuple(mask.shape)}")
    maskf = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    n = num_sequences if num_sequences is not None else logp.shape[0]
    lengths = maskf.sum(dim=1).clamp(min=1.0)  # |y_i|

    weight, keep = correction_weights(old_logp, infer_logp, cfg)
    # log r clamped to +-20 so that no inf reaches a masked token's (zero) gradient as 0 * inf
    ratio = torch.exp((logp - old_logp.detach()).clamp(-20.0, 20.0))
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * adv
    surr = torch.minimum(surr1, surr2)
    per_token = weight.detach() * surr * maskf
    objective = (per_token.sum(dim=1) / lengths).sum() / n
    loss = -objective
    kl_value = 0.0
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference model's log-probs (ref_logp)")
        d = ref_logp.detach() - logp
        kl_tok = (torch.exp(d) - d - 1.0) * maskf  # k3 estimator of KL(pi_theta || pi_ref)
        kl = (kl_tok.sum(dim=1) / lengths).sum() / n
        loss = loss + cfg.kl_coef * kl
        kl_value = float(kl.detach())
    with torch.no_grad():
        m = mask.bool()
        clipped = ((surr2 < surr1) & m).sum()
        kept = ((weight != 0) & m).sum()
    return LossOutput(loss=loss, pg_loss=float(-objective.detach()), kl=kl_value,
                      clipped_tokens=int(clipped), kept_tokens=int(kept), tokens=int(m.sum()))


# -- diagnostics of the train-inference mismatch ------------------------------------------------
STAT_KEYS = ("tokens", "masked", "abs_log_k_sum", "mismatch_kl_sum", "entropy_sum", "entropy_masked_sum",
             "stale_tokens", "stale_masked", "abs_log_k_max")
# |log k| quantiles come from a histogram of log10 |log k| with fixed bins, so micro-batches and
# ranks add up (a sum per bin) and no token's value is kept: bin 0 holds |log k| < 1e-9 (0
# included: fp32 engines often agree exactly), then HIST_PER_DECADE bins per decade up to
# 1e2, the last bin everything above. A quantile is read as its bin's geometric middle: within
# 10^(0.5/HIST_PER_DECADE) (6%) of the exact value.
HIST_LOW_DECADE, HIST_HIGH_DECADE, HIST_PER_DECADE = -9, 2, 20
HIST_BINS = (HIST_HIGH_DECADE - HIST_LOW_DECADE) * HIST_PER_DECADE + 2
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "p999": 0.999}


def abs_log_k_histogram(abs_log_k: torch.Tensor) -> torch.Tensor:
    """Counts per bin (float64, [HIST_BINS]) of a 1-D tensor of |log k| values."""
    x = abs_log_k.detach().double().flatten()
    pos = torch.floor((torch.log10(x.clamp(min=1e-300)) - HIST_LOW_DECADE) * HIST_PER_DECADE) + 1
    idx = torch.where(x < 10.0 ** HIST_LOW_DECADE, torch.zeros_like(pos), pos.clamp(1, HIST_BINS - 1))
    return torch.zeros(HIST_BINS, dtype=torch.float64, device=x.device).index_add_(
        0, idx.long(), torch.ones_like(x))


def histogram_quantile(hist: torch.Tensor | list[float], q: float) -> float:
    """The q-quantile of the values counted in `hist` (bin middle; 0 in the bottom bin)."""
    counts = [float(c) for c in hist]
    total = sum(counts)
    if total <= 0:
        return float("nan")
    need, run = q * total, 0.0
    for i, c in enumerate(counts):
        run += c
        if run >= need and c > 0:
            if i == 0:
                return 0.0
            return 10.0 ** (HIST_LOW_DECADE + (min(i, HIST_BINS - 2) - 0.5) / HIST_PER_DECADE)
    return 10.0 ** HIST_HIGH_DECADE


@dataclass
class MismatchStats:
    """Sums over tokens, so micro-batches and ranks add up; `finalize` gives the means.

    masked = tokens outside [alpha, beta] (what IcePop drops; reported for every correction,
    only "icepop" actually drops them). mismatch KL = KL(pi_infer || pi_train(theta_old)),
    estimated on the sampled tokens with k3 = k - 1 - log k (unbiased, >= 0). Stale tokens
    are the ones sampled by an older policy than theta_old (C3PO++ carry-over)."""

    sums: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in STAT_KEYS})
    hist: list[float] = field(default_factory=lambda: [0.0] * HIST_BINS)  # of |log k|, see HIST_*

    def add(self, old_logp: torch.Tensor, infer_logp: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
            entropy: torch.Tensor | None = None, stale: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            m = mask.bool()
            log_k = old_logp.double() - infer_logp.double()
            outside = ~inside_interval(log_k, cfg.alpha, cfg.beta) & m
            s = self.sums
            s["tokens"] += float(m.sum())
            s["masked"] += float(outside.sum())
            if m.any():
                lk = log_k[m]
                s["abs_log_k_sum"] += float(lk.abs().sum())
                s["abs_log_k_max"] = max(s["abs_log_k_max"], float(lk.abs().max()))
                s["mismatch_kl_sum"] += float((lk.exp() - 1.0 - lk).sum())
                self.hist = (torch.tensor(self.hist, dtype=torch.float64)
                             + abs_log_k_histogram(lk.abs()).cpu()).tolist()
            if entropy is not None:
                s["entropy_sum"] += float(entropy.double()[m].sum())
                s["entropy_masked_sum"] += float(entropy.double()[outside].sum())
            if stale is not None:
                st = stale.bool() & m
                s["stale_tokens"] += float(st.sum())
                s["stale_masked"] += float((st & outside).sum())

    def merge(self, other: "MismatchStats") -> None:
        for k, v in other.sums.items():
            self.sums[k] = max(self.sums[k], v) if k == "abs_log_k_max" else self.sums[k] + v
        self.hist = [a + b for a, b in zip(self.hist, other.hist)]

    def finalize(self) -> dict[str, float]:
        s = self.sums
        t = max(s["tokens"], 1.0)
        out = {
            "masked_fraction": s["masked"] / t,
            "mismatch_kl": s["mismatch_kl_sum"] / t,
            "abs_log_k_mean": s["abs_log_k_sum"] / t,
            "abs_log_k_max": s["abs_log_k_max"],
            "entropy_all": s["entropy_sum"] / t,
            "stale_token_fraction": s["stale_tokens"] / t,
        }
        if s["tokens"] > 0:
            # a bin's middle can lie past the largest value: the max bounds every quantile
            out.update({f"abs_log_k_{name}": min(histogram_quantile(self.hist, q), s["abs_log_k_max"])
                        for name, q in QUANTILES.items()})
        if s["masked"] > 0:
            out["entropy_masked"] = s["entropy_masked_sum"] / s["masked"]
        if s["stale_tokens"] > 0:
            out["masked_fraction_stale"] = s["stale_masked"] / s["stale_tokens"]
        fresh = s["tokens"] - s["stale_tokens"]
        if fresh > 0:
            out["masked_fraction_fresh"] = (s["masked"] - s["stale_masked"]) / fresh
        return out

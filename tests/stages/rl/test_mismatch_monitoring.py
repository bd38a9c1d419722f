"""The train-inference mismatch metrics of every RL step (issue 34): |log k| quantiles that add
up over micro batches and ranks, their MLflow sections, the jump warnings, and the setting
that replays MoE routes (off by default, without changing existing stage hashes)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from stages.rl.loss import HIST_PER_DECADE, LossConfig, MismatchStats, abs_log_k_histogram, histogram_quantile
from stages.rl.metrics import mlflow_name
from stages.rl.mismatch_monitor import mismatch_warnings


def _stats(log_k: torch.Tensor) -> MismatchStats:
    s = MismatchStats()
    infer = torch.zeros_like(log_k)
    s.add(log_k, infer, torch.ones_like(log_k, dtype=torch.bool), LossConfig())
    return s


def test_quantiles_of_log_k_are_within_a_bin_of_the_exact_ones():
    g = torch.Generator().manual_seed(0)
    # a realistic bf16 mismatch: most tokens ~1e-3 nats, a heavy tail, some exact agreements
    log_k = torch.randn(4000, generator=g, dtype=torch.float64) * 3e-3
    log_k[:200] = torch.randn(200, generator=g, dtype=torch.float64) * 2.0
    log_k[200:600] = 0.0
    halves = [_stats(log_k[:2500, None]), _stats(log_k[2500:, None])]
    halves[0].merge(halves[1])  # micro batches / ranks add up
    got = halves[0].finalize()
    exact = np.quantile(log_k.abs().numpy(), [0.5, 0.9, 0.99, 0.999])
    tolerance = 10 ** (1 / HIST_PER_DECADE)  # one bin
    for name, want in zip(("p50", "p90", "p99", "p999"), exact):
        assert want / tolerance <= got[f"abs_log_k_{name}"] <= want * tolerance, name
    assert got["abs_log_k_max"] == pytest.approx(float(log_k.abs().max()))


def test_histogram_edges():
    h = abs_log_k_histogram(torch.tensor([0.0, 1e-12, 1e-3, 1e5]))
    assert float(h.sum()) == 4 and float(h[0]) == 2 and float(h[-1]) == 1
    assert histogram_quantile(h, 0.5) == 0.0  # half the tokens agree exactly
    assert math.isnan(histogram_quantile([0.0] * len(h), 0.5))
    assert 1e-3 / 1.13 < histogram_quantile(abs_log_k_histogram(torch.tensor([1e-3])), 0.5) < 1e-3 * 1.13


def test_mismatch_metrics_have_their_mlflow_sections():
    assert mlflow_name("abs_log_k_p99") == "icepop/abs_log_k_p99"
    assert mlflow_name("mismatch_kl") == "icepop/mismatch_kl"
    assert mlflow_name("masked_fraction") == "icepop/masked_fraction"
    assert mlflow_name("expert_disagreement") == "routing/expert_disagreement"
    assert mlflow_name("routing/expert_disagreement") == "routing/expert_disagreement"


def _history(key: str, values):
    return [{key: v} for v in values]


@pytest.mark.parametrize("key,base,jump", [("mismatch_kl", 3e-4, 5e-3), ("masked_fraction", 2e-3, 0.05),
                                           ("abs_log_k_p99", 0.08, 0.9), ("expert_disagreement", 0.05, 0.4)])
def test_a_jump_warns_and_noise_does_not(key, base, jump):
    rng = np.random.default_rng(0)
    past = _history(key, base * (1 + 0.1 * rng.standard_normal(10)))
    (w,) = mismatch_warnings(past, {key: jump})
    assert w.startswith(f"{key} jumped to") and "mismatch" in w
    assert mismatch_warnings(past, {key: base * 1.2}) == []       # noise
    assert mismatch_warnings(past, {key: base * 0.01}) == []      # a fall needs no operator
    assert mismatch_warnings(past[:3], {key: jump}) == []         # too little history to judge


def test_tiny_values_below_the_floor_never_warn():
    """fp32 engines agree to rounding: x1000 of nothing is still nothing."""
    past = _history("mismatch_kl", [1e-12, 2e-12, 1e-12, 1e-12, 2e-12])
    assert mismatch_warnings(past, {"mismatch_kl": 5e-9}) == []


def _reasoning_cfg(**extra):
    from stages.reasoning_rl.config import ReasoningRLConfig

    return ReasoningRLConfig(kind="reasoning_rl", model="m", data="d.jsonl", steps=1, **extra)


def test_routing_replay_setting_keeps_old_hashes_and_needs_a_recording_engine():
    from pipeline.plan import result_config

    assert "routing_replay" not in result_config(_reasoning_cfg())
    assert "routing_replay" not in result_config(_reasoning_cfg(routing_replay=False))
    assert result_config(_reasoning_cfg(routing_replay=True))["routing_replay"] is True
    with pytest.raises(ValidationError, match="routing_replay: true needs an engine that records"):
        _reasoning_cfg(routing_replay=True, rollout={"engine": "vllm", "sleep": "none"})

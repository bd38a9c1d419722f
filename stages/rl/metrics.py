"""What an RL step and a whole RL stage report: per-step metrics of the trained batch, the
sample rollouts logged as text, the stage summary built from the metric history, and the
section each step metric has in MLflow (`mlflow_name`).

The step metrics keep one flat name each in the stage log, metrics.jsonl and the code that
reads them (benchmarks, tests); only MLflow sees them grouped (`reward/`, `icepop/` (the
train-inference mismatch: masked fraction, mismatch KL, |log k| mean / max / quantiles),
`routing/` (MoE: the engine's expert choices against the trainer's), `loss/`, `rollout/`,
`perf/`), because MLflow draws one section per prefix and a flat list of ~60 RL curves hides
the ones an operator looks for (IcePop's mask ratio, the reward)."""
from __future__ import annotations

import math
from typing import Any


def sample_text(tokenizer, samples, n: int, step: int) -> str:
    parts = []
    for s in samples[:n]:
        versions = sorted({v for _, v in s.segments})
        parts.append(f"### {s.uid} (row {s.row_index}, domain {s.domain}) reward {s.reward:.3f} "
                     f"adv {s.advantage:+.3f} finish {s.finish_reason} policy versions {versions}\n"
                     f"reason: {s.reward_reason}\n--- prompt ---\n"
                     f"{tokenizer.decode(s.prompt_ids, skip_special_tokens=False)}\n--- response ---\n"
                     f"{s.response_text}\n")
    return f"step {step}\n\n" + "\n".join(parts)


# flat name -> MLflow name, where the group alone is not enough
_RENAMED = {"reward_mean": "reward/mean", "loss": "loss/total", "pg_loss": "loss/pg",
            "entropy_all": "loss/entropy", "entropy_masked": "loss/entropy_masked"}
_GROUP_OF = {
    **{n: "reward" for n in ("zero_advantage_fraction",)},
    **{n: "icepop" for n in ("masked_fraction", "masked_fraction_fresh", "masked_fraction_stale", "mismatch_kl",
                             "abs_log_k_mean", "abs_log_k_max", "kept_fraction", "stale_token_fraction",
                             "abs_log_k_p50", "abs_log_k_p90", "abs_log_k_p99", "abs_log_k_p999")},
    **{n: "routing" for n in ("expert_disagreement", "expert_miss_fraction")},
    **{n: "loss" for n in ("kl_ref", "clip_fraction", "grad_norm", "optimizer_steps")},
}
# flat prefixes of per-domain / per-part metrics -> their MLflow prefix
_PREFIXES = {"reward_mean/": "reward/mean/", "reward_part/": "reward/part/",
             "reward_part_rate/": "reward/part_rate/", "reward_mean_source/": "reward/mean_source/"}
GROUPED_ALREADY = ("reward/", "icepop/", "loss/", "rollout/", "perf/", "monitor/", "reasoning_eval/", "routing/")


def mlflow_name(name: str) -> str:
    """The MLflow name of an RL step metric: its group, then its name. Timings and rates are
    `perf/`; everything not named above is about the rollouts (`rollout/`)."""
    if name.startswith(GROUPED_ALREADY):
        return name
    if name in _RENAMED:
        return _RENAMED[name]
    for flat, grouped in _PREFIXES.items():
        if name.startswith(flat):
            return grouped + name[len(flat):]
    if name in _GROUP_OF:
        return f"{_GROUP_OF[name]}/{name}"
    if "seconds" in name or "per_second" in name or name.startswith("engine_idle"):
        return f"perf/{name}"
    return f"rollout/{name}"


def batch_metrics(samples) -> dict[str, float]:
    out: dict[str, float] = {}
    by_dom: dict[str, list[float]] = {}
    for s in samples:
        by_dom.setdefault(s.domain, []).append(s.reward)
    rewards = [s.reward for s in samples]
    out["reward_mean"] = sum(rewards) / len(rewards)
    for d, r in sorted(by_dom.items()):
        out[f"reward_mean/{d}"] = sum(r) / len(r)
    lens = [len(s.response_ids) for s in samples]
    out["response_len_mean"] = sum(lens) / len(lens)
    out["response_len_max"] = float(max(lens))
    out["finished_by_length_fraction"] = sum(s.finish_reason == "length" for s in samples) / len(samples)
    out["zero_advantage_fraction"] = sum(s.advantage == 0 for s in samples) / len(samples)
    out["carried_over_trained"] = float(sum(s.carried for s in samples))
    return out


def summarize(history: list[dict[str, float]], sched_totals: dict[str, int], extra: dict[str, Any]) -> dict:
    def mean(key):
        vals = [h[key] for h in history if key in h and math.isfinite(h[key])]
        return sum(vals) / len(vals) if vals else None

    return {
        **extra,
        "steps": len(history),
        "reward_first": history[0]["reward_mean"] if history else None,
        "reward_last": history[-1]["reward_mean"] if history else None,
        "masked_fraction_mean": mean("masked_fraction"),
        "mismatch_kl_mean": mean("mismatch_kl"),
        "abs_log_k_p99_mean": mean("abs_log_k_p99"),
        "expert_disagreement_mean": mean("expert_disagreement"),
        "weight_sync_seconds_mean": mean("weight_sync_seconds"),
        "rollout_seconds_mean": mean("rollout_seconds"),
        "train_seconds_mean": mean("train_seconds"),
        "step_seconds_mean": mean("step_seconds"),
        "generated_tokens_per_second_mean": mean("generated_tokens_per_second"),
        "engine_idle_fraction_mean": mean("engine_idle_fraction"),
        "carried_over_finished": int(sched_totals.get("carried_over_finished", 0)),
        "carried_over_trained": int(sum(h.get("carried_over_trained", 0) for h in history)),
        "purged": int(sched_totals.get("purged", 0)),
        "groups_dropped": int(sched_totals.get("groups_dropped", 0)),
        "groups_trained": int(sched_totals.get("groups_trained", 0)),
        "rollouts_trained": int(sum(h.get("train_rollouts", 0) for h in history)),
        "tokens_trained": int(sum(h.get("train_tokens", 0) for h in history)),
        "generated_tokens": int(sched_totals.get("generated_tokens", 0)),
    }

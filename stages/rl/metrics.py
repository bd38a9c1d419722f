"""What an RL step and a whole RL stage report: per-step metrics of the trained batch, the
sample rollouts logged as text, and the stage summary built from the metric history."""
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

"""RL step metrics reach MLflow in the five sections an operator reads (`reward/`, `icepop/`,
`loss/`, `rollout/`, `perf/`), while the stage log keeps their flat names."""
import pytest

from stages.rl.metrics import mlflow_name

SECTIONS = ("reward/", "icepop/", "loss/", "rollout/", "perf/")


@pytest.mark.parametrize("flat, grouped", [
    ("reward_mean", "reward/mean"), ("reward_mean/math", "reward/mean/math"),
    ("reward_part/format", "reward/part/format"), ("reward_mean_source/chat", "reward/mean_source/chat"),
    ("zero_advantage_fraction", "reward/zero_advantage_fraction"),
    ("masked_fraction", "icepop/masked_fraction"), ("masked_fraction_stale", "icepop/masked_fraction_stale"),
    ("mismatch_kl", "icepop/mismatch_kl"), ("abs_log_k_max", "icepop/abs_log_k_max"),
    ("loss", "loss/total"), ("pg_loss", "loss/pg"), ("entropy_all", "loss/entropy"), ("grad_norm", "loss/grad_norm"),
    ("response_len_mean", "rollout/response_len_mean"), ("pool_size", "rollout/pool_size"),
    ("carried_over_trained", "rollout/carried_over_trained"), ("policy_version", "rollout/policy_version"),
    ("step_seconds", "perf/step_seconds"), ("weight_sync_gbytes_per_second", "perf/weight_sync_gbytes_per_second"),
    ("generated_tokens_per_second", "perf/generated_tokens_per_second"),
    ("engine_idle_fraction", "perf/engine_idle_fraction"),
    # already in a section of their own: unchanged
    ("monitor/math/fallback_share", "monitor/math/fallback_share"), ("reasoning_eval/delta", "reasoning_eval/delta"),
])
def test_each_metric_has_its_section(flat, grouped):
    assert mlflow_name(flat) == grouped


def test_every_name_of_a_real_step_lands_in_a_section():
    """The names one reasoning_rl step logged on the GPU (phase 1 of gpu_learning, 2026-11-26)."""
    logged = ("rollout_seconds generate_seconds generate_calls generated_tokens slot_tokens slot_capacity "
              "rollouts_finished carried_over_finished purged carried_over groups_dropped budget_tokens pool_size "
              "waiting_finished open_groups engines generate_seconds_mean generate_seconds_max slot_utilization "
              "verify_seconds groups_trained train_rollouts train_tokens total_purged total_generated_tokens "
              "masked_fraction mismatch_kl abs_log_k_mean abs_log_k_max entropy_all stale_token_fraction "
              "entropy_masked masked_fraction_fresh loss pg_loss kl_ref clip_fraction kept_fraction grad_norm "
              "optimizer_steps old_logprob_seconds update_seconds reward_mean reward_mean/math response_len_mean "
              "response_len_max finished_by_length_fraction zero_advantage_fraction carried_over_trained "
              "rollout_phase_seconds train_seconds engine_sleep_seconds weight_sync_seconds "
              "weight_sync_gbytes_per_second engine_sync_seconds step_seconds generated_tokens_per_second "
              "engine_idle_fraction policy_version").split()
    names = [mlflow_name(n) for n in logged]
    assert all(n.startswith(SECTIONS) for n in names)
    assert len(set(names)) == len(logged)  # no two metrics share an MLflow name

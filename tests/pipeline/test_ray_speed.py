"""`auto` speed settings of `launcher: ray` stages decided from the Ray cluster's GPUs (issue 36
item 1 under issue 33's launcher): the probe's facts reach `plan` (the stage's own address, the
cluster's ranks, where the facts came from); a cluster that cannot be reached gives `unknown`
at once with the reason, and the old defaults. The probe on a real cluster (a logical GPU, no
CUDA) is in tests/stages/test_ray_cluster.py, on that file's cluster."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline import speed as pipeline_speed
from pipeline.cli import app
from stages.common.speed_defaults import HardwareFacts, ModelFacts, resolve_speed
from stages.sft.config import SFTConfig
from tests.stages.common.test_speed_defaults import QWEN_15B
from tests.stages.common.test_speed_defaults import RECIPE as SPEED_RECIPE

ON_RAY = HardwareFacts("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 79.1, gpus=8, cpus=96,
                       note="Ray cluster 10.0.0.1:6379: NVIDIA H100 80GB HBM3 x 16 GPUs on 2 node(s) "
                            "(a one-GPU task probed one)")
RECIPE = SPEED_RECIPE.replace("  resources: {{nodes: 1, gpus_per_node: 1}}\n",
                              "  launcher: ray\n  resources: {{nodes: 2, gpus_per_node: 8}}\n")


@pytest.fixture
def recipe(tmp_path):
    """A writer of the two-node Ray recipe (its sft stage's extra lines)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_15B))
    (tmp_path / "sft.jsonl").write_text('{"messages": []}\n')

    def write(extra: str = "") -> Path:
        path = tmp_path / "r.yaml"
        path.write_text(RECIPE.format(root=tmp_path, model=model, data=tmp_path / "sft.jsonl", extra=extra))
        return path
    return write


@pytest.fixture
def probed(monkeypatch) -> list[str]:
    """The addresses the Ray probe was asked about; it answers with ON_RAY."""
    asked: list[str] = []
    monkeypatch.setattr(pipeline_speed, "ray_gpus", lambda address: asked.append(address) or ON_RAY)
    monkeypatch.setattr(pipeline_speed, "local_gpus", lambda: pytest.fail("a Ray stage probed this machine"))
    return asked


def test_a_ray_stage_is_decided_on_its_clusters_gpu_and_plan_says_whose(recipe, probed):
    res = CliRunner().invoke(app, ["plan", str(recipe("    ray: {address: '10.0.0.1:6379'}\n"))])
    assert res.exit_code == 0, res.output
    assert probed == ["10.0.0.1:6379"]  # the stage's own cluster, not the defaults'
    config = SFTConfig.model_validate({"model": "m", "data": "d", "max_seq_len": 4096, "grad_accum": 8,
                                       "lr": 1e-5}).model_dump(mode="json")
    decided = resolve_speed("sft", config, ON_RAY, ModelFacts.from_config(QWEN_15B), 16)
    assert "precision auto -> bf16-mixed" in decided.summary()  # a GPU decision, not the job's
    assert f"speed:    {decided.summary()}\n" in res.output, res.output
    assert "on NVIDIA H100 80GB HBM3 (79 GiB, sm90), 16 training rank(s)" in res.output
    assert "Ray cluster 10.0.0.1:6379: NVIDIA H100 80GB HBM3 x 16 GPUs on 2 node(s)" in res.output


def test_a_ray_stage_with_every_setting_written_contacts_no_cluster(recipe, probed):
    written = "".join(f"    {k}: {v}\n" for k, v in {"zero_stage": 3, "precision": "bf16", "compile_layers": "false",
                                                       "attn_implementation": "sdpa", "micro_batch_size": 1,
                                                       "gradient_checkpointing": "true", "loss_chunk_tokens": 8192,
                                                       "async_micro_batches": "false",
                                                       "lean_optimizer_step": "false"}.items())
    res = CliRunner().invoke(app, ["plan", str(recipe(written))])
    assert res.exit_code == 0, res.output
    assert probed == [] and "speed:" not in res.output


def test_an_unreachable_cluster_is_unknown_at_once_with_why_and_keeps_the_old_defaults(recipe, unreachable_port,
                                                                                      monkeypatch):
    calls: list[list[str]] = []
    probe = pipeline_speed._probe
    monkeypatch.setattr(pipeline_speed, "_probe", lambda args, what: calls.append(args) or probe(args, what))
    address = f"127.0.0.1:{unreachable_port}"
    pipeline_speed.ray_gpus.cache_clear()
    started = time.monotonic()
    res = CliRunner().invoke(app, ["plan", str(recipe(f"    ray: {{address: '{address}'}}\n"))])
    assert time.monotonic() - started < 30, "planning waited on a cluster that is not there"
    assert res.exit_code == 0, res.output
    assert (f"GPU unknown: ray.address '{address}': cannot connect to the Ray cluster there: nothing answers at "
            f"{address}") in res.output, res.output
    assert "zero_stage auto -> 2" in res.output and "precision auto (the job decides on its device)" in res.output
    assert pipeline_speed.ray_gpus(address).note.startswith(f"ray.address '{address}': cannot connect") and len(calls) == 1  # cached


def test_addresses_that_cannot_name_a_cluster_are_unknown_with_the_reason():
    pipeline_speed.ray_gpus.cache_clear()
    facts = pipeline_speed.ray_gpus("head-without-port")
    assert facts.device == "unknown" and "expected auto, host:port or ray://host:port" in facts.note


def test_auto_with_a_dead_ray_address_is_unknown_at_once_not_after_rays_minutes(monkeypatch, unreachable_port):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{unreachable_port}")
    pipeline_speed.ray_gpus.cache_clear()
    try:
        started = time.monotonic()
        facts = pipeline_speed.ray_gpus("auto")
        assert time.monotonic() - started < 30  # ray.init itself waits minutes for an absent GCS
    finally:
        pipeline_speed.ray_gpus.cache_clear()  # `auto` means another cluster once $RAY_ADDRESS is restored
    assert facts.device == "unknown"
    assert facts.note.startswith(f"ray.address auto is $RAY_ADDRESS '127.0.0.1:{unreachable_port}': cannot connect")


def test_a_probe_that_does_not_answer_in_time_is_killed_and_said(monkeypatch):
    monkeypatch.setattr(pipeline_speed, "PROBE_TIMEOUT_S", 0.01)
    pipeline_speed.ray_gpus.cache_clear()
    try:
        facts = pipeline_speed.ray_gpus("127.0.0.1:1")
    finally:
        pipeline_speed.ray_gpus.cache_clear()
    assert facts.device == "unknown"
    assert facts.note == "the Ray cluster's GPU probe (127.0.0.1:1) did not answer within 0.01s (killed)"

"""`auto` speed settings (issue 36): the rules with fake hardware facts (H100 / H200 / CPU /
unknown), explicit settings win, memory-driven gradient checkpointing, the stage hash of `auto`,
`plan`'s output, and a CPU sft run through the pipeline whose manifest records what was decided
and whose model is bit-identical to a run with the old defaults written out."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline import speed as pipeline_speed
from pipeline.cli import app
from pipeline.loader import load_recipe
from pipeline.plan import make_plan, result_config
from stages.common.contract import Resources
from stages.common.packed_attention import choose_attention
from stages.common.precision import resolve_precision
from stages.common.speed_defaults import RULES, HardwareFacts, ModelFacts, Situation, resolve_speed, settle_auto
from stages.reasoning_rl.config import ReasoningRLConfig
from stages.reward_model.config import RewardModelConfig
from stages.sft.config import SFTConfig

QWEN_15B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True)
QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
QWEN_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)
H100 = HardwareFacts("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 79.1, gpus=1, cpus=16)
H200 = HardwareFacts("cuda", "NVIDIA H200", (9, 0), 139.8, gpus=1, cpus=16)
CPU = HardwareFacts("cpu", cpus=2)
UNKNOWN = HardwareFacts("unknown", note="launcher ray")
LEGACY = {"zero_stage": 2, "micro_batch_size": 1, "compile_layers": False, "gradient_checkpointing": False}
# sft's settings that became `auto` with round 20's step, at what they were before
SFT_LATER = {"loss_chunk_tokens": 8192, "async_micro_batches": False, "lean_optimizer_step": False}


def _sft(**kw) -> dict:
    return SFTConfig.model_validate({"model": "m", "data": "d", **kw}).model_dump(mode="json")


def _decided(profile, config, hw, model=None, world=1) -> dict:
    r = resolve_speed(profile, config, hw, model and ModelFacts.from_config(model), world)
    return r.updates


def test_parameter_count_from_config_json():
    assert ModelFacts.from_config(QWEN_15B).params == pytest.approx(1.54e9, rel=0.01)
    assert ModelFacts.from_config(QWEN_05B).params == pytest.approx(0.494e9, rel=0.01)
    assert ModelFacts.from_config(QWEN_7B).params == pytest.approx(7.6e9, rel=0.01)


def test_h100_15b_at_4096_gets_the_measured_fast_path():
    # RESULTS.md rounds 8-10: ZeRO-0, bf16-mixed, compiled layers, FlexAttention, 2 packs a micro batch
    # (4 do not fit 80 GiB: round 10c); round 20's async micro batches and lean optimizer step
    got = _decided("sft", _sft(max_seq_len=4096, grad_accum=8), H100, QWEN_15B)
    assert got == {"zero_stage": 0, "precision": "bf16-mixed", "compile_layers": True,
                   "attn_implementation": "flex_attention", "micro_batch_size": 2, "grad_accum": 4,
                   "gradient_checkpointing": False, "loss_chunk_tokens": 8192, "async_micro_batches": True,
                   "lean_optimizer_step": True}


def test_h200_15b_at_4096_gets_round_22s_measured_step():
    """What benchmarks/sft_throughput.py's stage_defaults ran in round 22 (its resolved_speed): 8 packs
    per micro batch, one head chunk; 4 packs (round 20's step) where a step's 4 packs are not 8."""
    got = _decided("sft", _sft(max_seq_len=4096, grad_accum=8), H200, QWEN_15B)
    assert got == {"zero_stage": 0, "precision": "bf16-mixed", "compile_layers": True,
                   "attn_implementation": "flex_attention", "micro_batch_size": 8, "grad_accum": 1,
                   "gradient_checkpointing": False, "loss_chunk_tokens": 32768, "async_micro_batches": True,
                   "lean_optimizer_step": True}
    got = _decided("sft", _sft(max_seq_len=4096, grad_accum=4), H200, QWEN_15B)
    assert (got["micro_batch_size"], got["grad_accum"], got["loss_chunk_tokens"]) == (4, 1, 16384)


def test_four_and_eight_packs_only_where_the_estimate_fits_them():
    """1.5B@4096: the estimate at 4 packs (round 20 measured 70.3 GiB on an H200) is over an 80 GiB
    H100's budget (round 10c ran out of memory there) and under an H200's; at 8 packs (round 22
    measured 108.9 GiB) it is under an H200's 118.8, at or above what was measured."""
    cfg = {**_sft(max_seq_len=4096, grad_accum=8), "zero_stage": 0, "precision": "bf16-mixed",
           "compile_layers": True}
    for hw, fits in ((H100, False), (H200, True)):
        s = Situation("sft", cfg, hw, ModelFacts.from_config(QWEN_15B), 1)
        assert 70.3 <= s.peak_gib(0, "bf16-mixed", micro_batch=4) < 75
        assert s.fits(0, "bf16-mixed", micro_batch=4) is fits
    s = Situation("sft", cfg, H200, ModelFacts.from_config(QWEN_15B), 1)
    assert 108.9 <= s.peak_gib(0, "bf16-mixed", micro_batch=8) and s.fits(0, "bf16-mixed", micro_batch=8)
    # the measured peaks of rounds 8 and 10b (one pack and two): the estimate is not under them
    assert s.peak_gib(0, "bf16-mixed", micro_batch=1) >= 35.9 and s.peak_gib(0, "bf16-mixed", micro_batch=2) >= 48.1
    # packs longer than measured, or a step of packs that 4 do not divide: 2 packs, the chunk as before
    for over in ({"max_seq_len": 8192, "grad_accum": 8}, {"max_seq_len": 2048, "grad_accum": 6}):
        got = _decided("sft", _sft(**over), H200, QWEN_15B)
        assert got["micro_batch_size"] == (1 if over["max_seq_len"] == 8192 else 2), over
        assert got["loss_chunk_tokens"] == 8192
    # an explicit 4 with checkpointing: the chunk stays 8192 (the estimate holds no head chunk then)
    got = _decided("sft", _sft(micro_batch_size=4, gradient_checkpointing=True), H200, QWEN_15B)
    assert got["loss_chunk_tokens"] == 8192


def test_the_lean_step_resolves_off_where_deepspeed_clips():
    for explicit, want_precision in (({"zero_stage": 2}, "bf16"), ({"precision": "bf16"}, None),
                                     ({"zero_stage": 0, "precision": "fp32"}, None)):
        got = _decided("sft", _sft(max_seq_len=4096, grad_accum=8, **explicit), H200, QWEN_15B)
        lean = explicit.get("precision") == "fp32"  # ZeRO-0 without DeepSpeed's bf16 wrapper: it applies
        assert got["lean_optimizer_step"] is lean and got["async_micro_batches"] is True, explicit
        assert want_precision is None or got["precision"] == want_precision
    assert SFTConfig(model="m", data="d", zero_stage=3).lean_optimizer_step == "auto"  # auto is never refused


def test_h200_05b_sft_and_rl_learner():
    sft = _decided("sft", _sft(max_seq_len=4096, grad_accum=4), H200, QWEN_05B)
    assert sft["zero_stage"] == 0 and sft["precision"] == "bf16-mixed" and sft["micro_batch_size"] == 4
    rl = ReasoningRLConfig.model_validate({"model": "m", "data": "d", "steps": 1, "max_len": 2048,
                                           "prompt_max_len": 256}).model_dump(mode="json")
    # DeepSpeed's bf16 optimizer: ZeRO-1 was its fastest stage (round 7); compiled layers (rounds 9-10)
    assert _decided("rl", rl, H200, QWEN_05B) == {"zero_stage": 1, "precision": "bf16", "compile_layers": True,
                                                  "gradient_checkpointing": False}


def test_cpu_ranks_resolve_to_what_the_stage_ran_before():
    cfg = _sft(packing=True)
    got = _decided("sft", cfg, CPU)
    assert got == {**LEGACY, **SFT_LATER, "precision": resolve_precision("auto", on_gpu=False),
                   "attn_implementation": choose_attention("auto", on_gpu=False, packed=True)}
    rm = RewardModelConfig.model_validate({"model": "m", "data": "d"}).model_dump(mode="json")
    assert _decided("reward_model", rm, CPU) == {"zero_stage": 2, "micro_batch_size": 1, "precision": "fp32",
                                                 "attn_implementation": "sdpa"}


def test_gpus_the_pipeline_cannot_see_keep_the_old_values_and_leave_precision_to_the_job(monkeypatch):
    assert _decided("sft", _sft(), UNKNOWN) == {**LEGACY, **SFT_LATER, "precision": "auto",
                                                "attn_implementation": "auto"}
    gpus = Resources(gpus_per_node=8)
    monkeypatch.setattr(pipeline_speed, "ray_gpus", lambda address: UNKNOWN)  # its cluster's probe: test_ray_speed
    assert pipeline_speed.hardware_for(gpus, "ray").device == "unknown"
    assert pipeline_speed.hardware_for(Resources(nodes=2, gpus_per_node=8, hostfile="h"), "deepspeed").device \
        == "unknown"
    assert pipeline_speed.hardware_for(Resources(cpu_ranks=3), "ray").device == "cpu"


def test_explicit_settings_win():
    explicit = {"zero_stage": 2, "precision": "bf16", "compile_layers": False, "micro_batch_size": 1,
                "attn_implementation": "sdpa", "gradient_checkpointing": True, **SFT_LATER}
    assert _decided("sft", _sft(max_seq_len=4096, grad_accum=8, **explicit), H100, QWEN_15B) == {}
    # round 20's step, each part written off on the card that would get it
    for off in ({"async_micro_batches": False}, {"lean_optimizer_step": False}, {"micro_batch_size": 2}):
        got = _decided("sft", _sft(max_seq_len=4096, grad_accum=8, **off), H200, QWEN_15B)
        assert not set(off) & set(got) and got["loss_chunk_tokens"] == (8192 if "micro_batch_size" in off else 32768)
    # an explicit ZeRO stage steers the rest: DeepSpeed's bf16 mode above ZeRO-0 (round 8)
    got = _decided("sft", _sft(max_seq_len=4096, grad_accum=8, zero_stage=2), H100, QWEN_15B)
    assert got["precision"] == "bf16" and "zero_stage" not in got
    # explicit compiled layers: ZeRO-3 is never picked, even where nothing fits
    got = _decided("sft", _sft(max_seq_len=65536, compile_layers=True), H100, QWEN_7B, world=8)
    assert got["zero_stage"] != 3 and "compile_layers" not in got
    # an explicit micro batch keeps grad_accum as written
    assert "grad_accum" not in _decided("sft", _sft(micro_batch_size=4, grad_accum=8), H100, QWEN_15B)


def test_gradient_checkpointing_only_when_memory_needs_it():
    long = _sft(max_seq_len=16384, grad_accum=8)
    on_h100 = _decided("sft", long, H100, QWEN_15B)
    assert on_h100["gradient_checkpointing"] is True and on_h100["micro_batch_size"] == 1
    assert _decided("sft", long, H200, QWEN_15B)["gradient_checkpointing"] is False
    assert on_h100["loss_chunk_tokens"] == 8192
    # a 7B model over 8 H100s: state partitioned (ZeRO >= 1) rather than one GPU's copy of everything
    assert _decided("sft", _sft(max_seq_len=4096), H100, QWEN_7B, world=8)["zero_stage"] >= 1
    r = resolve_speed("sft", _sft(max_seq_len=65536), H100, ModelFacts.from_config(QWEN_7B), 1)
    assert r.updates["gradient_checkpointing"] is True and any("expect out of memory" in n for n in r.notes)


@pytest.mark.parametrize("over", [{}, {"max_len": 512, "prompt_max_len": 128}, {"micro_batch_tokens": 4096}])
def test_the_rl_micro_batch_estimate_is_the_learners(over):
    cfg = ReasoningRLConfig.model_validate({"model": "m", "data": "d", "steps": 1, **over})
    assert Situation("rl", cfg.model_dump(mode="json"), H100, None, 1).micro_tokens() == cfg.micro_tokens


def test_every_rule_says_why():
    for rule in RULES:
        assert rule.because, rule.name
        assert any(w in rule.because for w in ("tok/s", "out of memory", "before", "not measured", "ZeRO-3")), \
            rule.name


def test_round_20s_settings_at_auto_or_written_as_before_keep_the_hash():
    """loss_chunk_tokens was hashed at 8192, async_micro_batches and lean_optimizer_step were kept out
    of the hash at false (`added_later`): at `auto` and written as before, the hashed config is the
    same; `true` is hashed."""
    auto, before = SFTConfig(model="m", data="d"), SFTConfig(model="m", data="d", **SFT_LATER)
    assert result_config(auto) == result_config(before)
    assert result_config(auto)["loss_chunk_tokens"] == 8192
    assert "async_micro_batches" not in result_config(auto) and "lean_optimizer_step" not in result_config(auto)
    assert result_config(SFTConfig(model="m", data="d", async_micro_batches=True))["async_micro_batches"] is True
    assert settle_auto(auto).model_dump() == SFTConfig(model="m", data="d", **LEGACY, **SFT_LATER).model_dump()


def test_auto_hashes_as_the_old_default_and_jobs_without_the_pipeline_get_it():
    auto, legacy = SFTConfig(model="m", data="d"), SFTConfig(model="m", data="d", **LEGACY)
    assert result_config(auto) == result_config(legacy)
    # a job started without the pipeline: every `auto` as before it existed, round 20's settings too
    assert settle_auto(auto).model_dump() == SFTConfig(model="m", data="d", **LEGACY, **SFT_LATER).model_dump()
    rl = ReasoningRLConfig.model_validate({"model": "m", "data": "d", "steps": 1})
    assert settle_auto(rl).zero_stage == 2 and settle_auto(rl).compile_layers is False


RECIPE = """\
name: speedy
storage: {{url: "file://{root}/store"}}
defaults:
  resources: {{nodes: 1, gpus_per_node: 1}}
stages:
  sft:
    kind: sft
    model: {model}
    data: {data}
    max_seq_len: 4096
    grad_accum: 8
    lr: 1.0e-5
{extra}"""


def test_plan_prints_the_decided_values_and_keeps_the_hash(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_15B))  # all the pipeline reads of it
    (tmp_path / "sft.jsonl").write_text('{"messages": []}\n')
    monkeypatch.setattr(pipeline_speed, "local_gpus", lambda: H100)

    def recipe(extra: str = "") -> Path:
        p = tmp_path / "r.yaml"
        p.write_text(RECIPE.format(root=tmp_path, model=model, data=tmp_path / "sft.jsonl", extra=extra))
        return p

    res = CliRunner().invoke(app, ["plan", str(recipe())])
    assert res.exit_code == 0, res.output
    assert ("speed:    zero_stage auto -> 0, precision auto -> bf16-mixed, compile_layers auto -> true, "
            "attn_implementation auto -> flex_attention, micro_batch_size auto -> 2, gradient_checkpointing "
            "auto -> false, loss_chunk_tokens auto -> 8192, async_micro_batches auto -> true, "
            "lean_optimizer_step auto -> true, grad_accum -> 4") in res.output, res.output
    assert "on NVIDIA H100 80GB HBM3 (79 GiB, sm90), 1 training rank(s); rules: fastest-zero-that-fits" in res.output
    assert "estimated peak" in res.output
    auto_hash = make_plan(load_recipe(recipe()))["sft"].hash
    written = "".join(f"    {k}: {json.dumps(v)}\n" for k, v in LEGACY.items())
    assert make_plan(load_recipe(recipe(written)))["sft"].hash == auto_hash


SFT_RUN = {"model": "${stages.base.output}", "data": "${stages.data.output}/sft.jsonl", "max_seq_len": 256,
           "max_steps": 3, "grad_accum": 2, "lr": 1e-3, "warmup_steps": 1, "checkpoint_every": 100}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_sft_with_auto_is_bit_identical_to_the_old_defaults_and_recorded(stage_env, data_artifact,
                                                                            base_artifact):
    from data_curation.urls import local_path
    from pipeline.execute import run_stage

    def run(recipe: str, config: dict):
        return run_stage("sft", config, stage="sft", storage=stage_env["storage"], recipe=recipe,
                         launcher="local", resources=Resources(cpu_ranks=1),
                         upstream={"base": base_artifact.url, "data": data_artifact.url},
                         work_root=Path(stage_env["work_root"]))

    auto = run("speedauto", SFT_RUN)
    legacy = run("speedlegacy", {**SFT_RUN, **LEGACY})
    assert auto.hash == legacy.hash  # `auto` hashes as the old defaults
    manifests = [json.loads((Path(local_path(r.url)) / "manifest.json").read_text()) for r in (auto, legacy)]
    speed = manifests[0]["resolved_speed"]
    assert {k: v["value"] for k, v in speed["settings"].items()} == {
        "zero_stage": 2, "precision": "fp32", "compile_layers": False, "attn_implementation": "sdpa",
        "micro_batch_size": 1, "gradient_checkpointing": False, **SFT_LATER}
    assert speed["hardware"]["device"] == "cpu" and speed["world_size"] == 1
    assert manifests[0]["config"]["zero_stage"] == "auto"  # the manifest keeps the config as written
    weights = [{f["path"]: f["sha256"] for f in m["files"] if f["path"].endswith(".safetensors")}
               for m in manifests]
    assert weights[0] and weights[0] == weights[1]

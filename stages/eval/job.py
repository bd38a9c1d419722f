"""The `eval` stage: `python -m stages.eval.job --job job.json` (one process).

For each model of `models` (an upstream stage's output, or any HF model dir / URI: this is
also how a user scores their own checkpoints), in turn: its tokenizer renders every set's
prompts with the chat template (prompts over `prompt_max_len` tokens are skipped and
counted); the rollout engine (`stages.rl.engines.create_engine`, the one the RL stages
sample with: bf16 on GPU by default) generates the responses of each decoding; the
verifier of each row's domain scores them (`stages.rl.verified_sampling`, what distill samples
with too).

A set is RL rows, a benchmark file read through its field mapping (GSM8K, MATH-500, ...:
benchmarks.py), or an lm-evaluation-harness task (harness.py: the task's own prompts,
generation and metrics, lm-eval's `hf` backend on the model directory; its metrics go to the
summary's `lm_eval`, model -> set -> `<metric>,<filter>` -> value, and a record per set).

Outputs (job.output_dir): `stage_summary.json` (-> the manifest) with one record per model,
set, decoding and domain (accuracy, pass_at_k, rows, responses, mean response length, share
ended by EOS; domain "all" = the whole set) and `accuracy`, model -> set -> decoding ->
accuracy; `responses.jsonl`, every response with its score and the verifier's reason. The
same numbers go to MLflow as `<model>/<set>/<decoding>/<domain>/<metric>`.

Imports: this module is the `__main__` of its verifier workers (verifiers/api.py: each worker
imports it as it starts), so what loads torch (the engine, the device) is imported by the functions that
use it, not at the top.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from stages.common.contract import StageError, StageJob
from stages.common.entry import run_job
from stages.common.hf_io import require_model_dir
from stages.common.rows import DataError
from stages.common.stage_log import StageLogger, info
from stages.eval.benchmarks import benchmark_rows
from stages.eval.config import BenchmarkSet, Decoding, EvalConfig, EvalSet, LmEvalSet
from stages.eval.harness import require_lm_eval, run_task
from stages.eval.scoring import ALL_DOMAINS, Scored, summarize
from stages.reasoning_rl.config import RLData
from stages.reasoning_rl.data import load_rows, require_verifiers
from stages.rl.prompts import render_prompts
from stages.rl.verified_sampling import SamplingModel


def load_set(job: StageJob, name: str, spec: EvalSet) -> list[dict[str, Any]]:
    """The set's rows (RL format, validated with the file and line of each problem): RL rows
    as they are, or a benchmark file through its field mapping (benchmarks.py)."""
    if isinstance(spec, BenchmarkSet):
        rows = benchmark_rows(job.fetch, name, spec)
    else:
        try:
            rows = load_rows(job.fetch, [RLData(path=p) for p in spec.paths])
        except DataError as e:
            raise DataError(f"eval set {name!r}: {e}") from None
        rows = rows[:spec.limit] if spec.limit is not None else rows
    require_verifiers(rows, f"eval set {name!r}")
    return rows


def evaluate(model: SamplingModel, cfg: EvalConfig, rows: list[dict], prompt_ids: list[list[int]],
             dec: Decoding, responses: TextIO, tag: dict[str, str]) -> dict[str, dict[str, float]]:
    """Generate `dec.samples` responses per row, score them, write them to `responses`;
    returns the summary per domain."""
    from stages.rl.engines import SamplingParams  # torch: not at the top (module docstring)

    sampling = SamplingParams(temperature=dec.temperature, top_p=dec.top_p, top_k=dec.top_k, seed=cfg.seed)
    scored = []
    for r in model.generate_and_score(cfg, rows, prompt_ids, sampling, samples=dec.samples):
        row, text = rows[r.row], r.text
        task = row.get("task")
        scored.append(Scored(r.row, row["domain"], float(r.reward.score), text.n_tokens, text.ended_by_eos,
                             task if isinstance(task, str) and task else None))
        responses.write(json.dumps({**tag, "id": row["id"], "domain": row["domain"], "response": str(text),
                                    "score": r.reward.score, "reason": r.reward.reason, "tokens": text.n_tokens,
                                    "ended_by_eos": text.ended_by_eos}, ensure_ascii=False) + "\n")
    return summarize(scored, dec.pass_at)


def score_model(job: StageJob, cfg: EvalConfig, name: str, ref: str, sets: dict[str, list[dict]],
                responses: TextIO, records: list[dict[str, Any]], accuracy: dict[str, Any]) -> None:
    """Every decoding of every verifier-scored set on one model."""
    log = StageLogger.for_job(job)
    model = SamplingModel(job, cfg, name, ref)
    for set_name, rows in sets.items():
        kept, prompt_ids, _ = render_prompts(rows, model.tokenizer, cfg.prompt_max_len)
        if not kept:
            raise StageError(f"eval set {set_name!r}: every prompt is longer than prompt_max_len="
                             f"{cfg.prompt_max_len} tokens for model {name!r}")
        for dec_name, dec in cfg.decodings.items():
            t0 = time.perf_counter()
            tag = {"model": name, "set": set_name, "decoding": dec_name}
            per_domain = evaluate(model, cfg, kept, prompt_ids, dec, responses, tag)
            seconds = time.perf_counter() - t0
            for domain, m in per_domain.items():
                records.append({**tag, "domain": domain, **m, "prompts_skipped": len(rows) - len(kept),
                                "seconds": seconds})
                log.metrics(0, {f"{name}/{set_name}/{dec_name}/{domain}/{k}": v for k, v in m.items()})
            acc = per_domain[ALL_DOMAINS]["accuracy"]
            accuracy.setdefault(name, {}).setdefault(set_name, {})[dec_name] = acc
            extra = " ".join(f"{k} {v:.3f}" for k, v in per_domain[ALL_DOMAINS].items() if k.startswith("pass_at_"))
            info(f"eval: {name} on {set_name} ({dec_name}): accuracy {acc:.4f} over "
                 f"{len(kept)} rows x {dec.samples} {extra} ({len(rows) - len(kept)} skipped as too long, "
                 f"{seconds:.1f}s)")
    model.close()


def run_harness(job: StageJob, cfg: EvalConfig, name: str, ref: str, tasks: dict[str, LmEvalSet],
                records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Every lm-eval task on one model: set -> `<metric>,<filter>` -> value."""
    import torch

    from stages.common.distributed import resolve_device  # torch: not at the top (module docstring)

    model_dir = require_model_dir(job.fetch(ref), f"models.{name} = {ref}:")
    log = StageLogger.for_job(job)
    device = resolve_device(cfg.rollout.device, "rollout.device",
                            torch.device("cuda:0" if torch.cuda.is_available() else "cpu"))
    dtype = cfg.rollout.dtype if cfg.rollout.dtype != "auto" else ("bfloat16" if device.startswith("cuda")
                                                                   else "float32")
    out: dict[str, dict[str, float]] = {}
    for set_name, spec in tasks.items():
        t0 = time.perf_counter()
        metrics = run_task(spec, set_name, model_dir, job.fetch, device=device, dtype=dtype, seed=cfg.seed,
                           trust_remote_code=cfg.trust_remote_code)
        seconds = time.perf_counter() - t0
        out[set_name] = metrics
        records.append({"model": name, "set": set_name, "decoding": "lm_eval", "domain": ALL_DOMAINS, **metrics,
                        "seconds": seconds})
        # MLflow names take no ',': lm-eval's "<metric>,<filter>" becomes "<metric>/<filter>"
        log.metrics(0, {f"{name}/{set_name}/lm_eval/{k.replace(',', '/')}": v for k, v in metrics.items()})
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if "stderr" not in k)
        info(f"eval: {name} on {set_name} (lm-eval): {shown} ({seconds:.1f}s)")
    return out


def main(job: StageJob, cfg: EvalConfig) -> dict[str, Any]:
    log = StageLogger.for_job(job)
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sets = {name: load_set(job, name, s) for name, s in cfg.sets.items() if isinstance(s, EvalSet)}
    tasks = {name: s for name, s in cfg.sets.items() if isinstance(s, LmEvalSet)}
    if tasks:
        require_lm_eval(f"eval sets {sorted(tasks)} (lm-eval tasks)")  # before any model is loaded
    records: list[dict[str, Any]] = []
    accuracy: dict[str, dict[str, dict[str, float]]] = {}
    lm_eval: dict[str, dict[str, dict[str, float]]] = {}
    with open(out / "responses.jsonl", "w", encoding="utf-8") as responses:
        for model_name, ref in cfg.models.items():
            if sets:
                score_model(job, cfg, model_name, ref, sets, responses, records, accuracy)
            if tasks:
                lm_eval[model_name] = run_harness(job, cfg, model_name, ref, tasks, records)
    summary = {"accuracy": accuracy, "results": records, **({"lm_eval": lm_eval} if tasks else {})}
    (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
    log.artifact(out / "stage_summary.json")
    return summary


if __name__ == "__main__":
    sys.exit(run_job(main, EvalConfig))

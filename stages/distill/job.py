"""The `distill` stage: `python -m stages.distill.job --job job.json` (one process, one engine).

Rejection sampling from a teacher, the way Long-CoT cold-start data is built:
1. the prompt rows (RL format: domain, prompt, reference; any verifier domain) are rendered
   with the teacher's chat template (`system_prompt` first when set; prompts over
   `prompt_max_len` tokens are skipped and counted per family);
2. the prompts go in batches of `batch_prompts`: the rollout engine (`stages.rl.engines`, the
   one the RL stages and `eval` sample with: torch, or vLLM with `rollout.engine: vllm`)
   samples `samples_per_prompt` responses of each, seeded per batch (seed, batch index), so a
   batch's responses do not depend on what ran before it;
3. the verifier of each row's domain scores them (`stages.rl.verified_sampling`, what `eval`
   scores with too), and
   `selection.verdicts` keeps the accepted, finished, in-bounds, distinct ones, at most
   `max_per_prompt` per prompt;
4. after every `checkpoint_every` batches the records of the samples since the last checkpoint
   go into a part of their own (record_parts.py: each written once) and a checkpoint lists the
   parts (`Checkpointer`, the training stages' one: the stage's artifact dir, so a rerun
   resumes after the last finished batch, whichever attempt wrote it).

Outputs (job.output_dir): `sft.jsonl`, the kept chats (`messages`: system?, user, assistant:
the response as the teacher wrote it, its reasoning included), with their prompt's id,
domain, family, score and length; `samples.jsonl`, every sample with its score, the
verifier's reason and its verdict; `stage_summary.json` (-> the manifest): the counts per
family, per domain and overall (selection.report). Fewer kept chats than `min_rows` is a
StageError naming the teacher and the acceptance rates: an empty SFT set must not flow on.

Imports: this module is the `__main__` of its verifier workers (verifiers/api.py: each worker
imports it as it starts), so what loads torch (the engine, the checkpoint, the ranks) is imported by the functions that
use it, not at the top.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.common.contract import StageError, StageJob
from stages.common.entry import run_job
from stages.common.rows import DataError
from stages.common.stage_log import StageLogger, info
from stages.distill.config import DistillConfig
from stages.distill.record_parts import RecordParts
from stages.distill.selection import describe_rates, report, verdicts
from stages.reasoning_rl.data import load_rows, require_verifiers
from stages.rl.prompts import render_prompts
from stages.rl.verified_sampling import SamplingModel


@dataclass
class Progress:
    """What a resume needs: the batches done and the record of every sample they drew. The
    checkpoint holds the list of record parts (record_parts.py: each record is written once,
    in the part of the first checkpoint after its batch), not the records: `records` is filled
    from the parts on resume. A checkpoint written before the parts holds the records
    themselves; a resume from one takes them, and its next checkpoint writes them in a part. A
    Stateful of its own rather than a `StatefulDataclass`: that mixin's module imports torch,
    and every verifier worker imports this module at its start (verifiers/api.py)."""

    batches_done: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    parts: list[dict[str, Any]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {"batches_done": self.batches_done, "parts": self.parts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches_done, self.parts = state["batches_done"], state.get("parts", [])
        self.records = state.get("records", [])

    def save_part(self, parts: RecordParts) -> None:
        """The records not in a part yet, as the part of the batches since the last one."""
        start, written = (self.parts[-1]["end"], sum(p["records"] for p in self.parts)) if self.parts else (0, 0)
        self.parts.append(parts.write(start, self.batches_done, self.records[written:]))


def load_prompts(job: StageJob, cfg: DistillConfig) -> list[dict[str, Any]]:
    """The validated rows (file and line of each problem), the teacher's messages of each."""
    try:
        rows = load_rows(job.fetch, cfg.data_list)
    except DataError as e:
        raise DataError(f"distill data: {e}") from None
    rows = rows[:cfg.limit] if cfg.limit is not None else rows
    require_verifiers(rows, "distill data")
    if cfg.system_prompt is not None:
        for r in rows:
            r["messages"] = [{"role": "system", "content": cfg.system_prompt}, *r["messages"]]
    return rows


def family_of(row: dict[str, Any], cfg: DistillConfig) -> str:
    value = row.get(cfg.family_field)
    return value if isinstance(value, str) and value else row["domain"]


def sample_batch(teacher: SamplingModel, cfg: DistillConfig, rows: list[dict], prompt_ids: list[list[int]],
                 batch: list[int], batch_no: int) -> list[dict[str, Any]]:
    """Sample, score and judge the responses of the prompts `batch` (indices into rows):
    one record per sample, in prompt then sample order."""
    from stages.rl.engines import SamplingParams  # torch: not at the top (module docstring)

    k = cfg.samples_per_prompt
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              seed=cfg.seed * 1_000_003 + batch_no)
    records = [{"prompt": r.row, "id": str(rows[r.row]["id"]), "domain": rows[r.row]["domain"],
                "family": family_of(rows[r.row], cfg), "sample": r.sample, "response": str(r.text),
                "tokens": r.text.n_tokens, "ended_by_eos": r.text.ended_by_eos, "score": float(r.reward.score),
                "reason": r.reward.reason}
               for r in teacher.generate_and_score(cfg, rows, prompt_ids, sampling, samples=k, which=batch)]
    for start in range(0, len(records), k):
        group = records[start:start + k]
        for rec, verdict in zip(group, verdicts(group, cfg)):
            rec["verdict"] = verdict
    return records


def chat_of(rec: dict[str, Any], row: dict[str, Any], cfg: DistillConfig) -> dict[str, Any]:
    """A kept sample as the SFT chat `sft` reads (stages/sft/data.py, format `messages`)."""
    messages = [m for m in row["messages"] if cfg.keep_system_prompt or m["role"] != "system"]
    return {"id": f"{rec['id']}#{rec['sample']}", "domain": rec["domain"], "family": rec["family"],
            "prompt_id": rec["id"], "score": rec["score"], "response_tokens": rec["tokens"],
            "messages": [*messages, {"role": "assistant", "content": rec["response"]}]}


def prompts_digest(rows: list[dict], prompt_ids: list[list[int]]) -> str:
    """What a checkpoint's batches were drawn from: the prompts and their token ids."""
    h = hashlib.sha256()
    for row, ids in zip(rows, prompt_ids):
        h.update(json.dumps([str(row["id"]), row["domain"], ids]).encode())
    return h.hexdigest()[:16]


def running_metrics(so_far: list[dict[str, Any]], batch: list[dict[str, Any]]) -> dict[str, float]:
    """A batch's metrics: the acceptance rate and kept chats so far (the finish line's
    headline is the whole run's), and the batch's mean response length."""
    return {"acceptance_rate": sum(r["verdict"] != "rejected" for r in so_far) / len(so_far),
            "kept": float(sum(r["verdict"] == "kept" for r in so_far)),
            "response_len_mean": sum(r["tokens"] for r in batch) / len(batch)}


def run_batches(job: StageJob, cfg: DistillConfig, teacher, rows: list[dict], prompt_ids: list[list[int]],
                log: StageLogger) -> tuple[Progress, int | None]:
    """Every batch not done yet (resumed from the latest checkpoint), checkpointed as it goes;
    returns the progress and the batch it resumed after (None: a fresh start)."""
    import torch

    from stages.common.checkpoint import Checkpointer  # torch: not at the top (module docstring)
    from stages.common.distributed import Ranks  # torch (module docstring)
    from stages.common.groups import SOLO  # torch (module docstring)

    batches = [list(range(b, min(b + cfg.batch_prompts, len(rows)))) for b in range(0, len(rows), cfg.batch_prompts)]
    progress = Progress()
    ranks = Ranks(0, 1, 0, torch.device("cpu"), torch.cuda.is_available(), SOLO)
    ckpt = Checkpointer(job, None, ranks, {"progress": progress},
                        fingerprint={"prompts": len(rows), "prompts digest": prompts_digest(rows, prompt_ids)})
    parts = RecordParts(job)
    resumed = ckpt.resume()
    if resumed is not None:
        progress.records = parts.read(progress.parts) + progress.records
        info(f"distill: resumed after batch {progress.batches_done} of {len(batches)} "
             f"({len(progress.records)} samples drawn)")
    log.progress(progress.batches_done, total=len(batches), unit="batch")
    for b in range(progress.batches_done, len(batches)):
        records = sample_batch(teacher, cfg, rows, prompt_ids, batches[b], b)
        progress.records.extend(records)
        progress.batches_done = b + 1
        log.metrics(b + 1, running_metrics(progress.records, records))
        if (b + 1) % cfg.checkpoint_every == 0 or b + 1 == len(batches):
            progress.save_part(parts)
            ckpt.save(b + 1)
    return progress, resumed


def write_outputs(out: Path, cfg: DistillConfig, rows: list[dict], progress: Progress) -> int:
    """sft.jsonl and samples.jsonl; returns the number of kept chats."""
    kept = 0
    with open(out / "sft.jsonl", "w", encoding="utf-8") as sft, \
            open(out / "samples.jsonl", "w", encoding="utf-8") as samples:
        for rec in progress.records:
            samples.write(json.dumps(rec, ensure_ascii=False) + "\n")
            if rec["verdict"] == "kept":
                sft.write(json.dumps(chat_of(rec, rows[rec["prompt"]], cfg), ensure_ascii=False) + "\n")
                kept += 1
    return kept


def main(job: StageJob, cfg: DistillConfig) -> dict[str, Any]:
    log = StageLogger.for_job(job)
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = load_prompts(job, cfg)
    teacher = SamplingModel(job, cfg, "teacher", cfg.teacher, key="teacher")
    kept_rows, prompt_ids, index = render_prompts(rows, teacher.tokenizer, cfg.prompt_max_len)
    kept_set = set(index)
    skipped = [{"domain": r["domain"], "family": family_of(r, cfg)} for i, r in enumerate(rows) if i not in kept_set]
    if not kept_rows:
        raise StageError(f"distill data: every prompt is longer than prompt_max_len={cfg.prompt_max_len} tokens "
                         f"for teacher {cfg.teacher}")
    info(f"distill: {len(kept_rows)} prompts x {cfg.samples_per_prompt} samples from teacher {cfg.teacher} "
         f"({len(skipped)} prompts skipped as longer than {cfg.prompt_max_len} tokens)")
    progress, resumed = run_batches(job, cfg, teacher, kept_rows, prompt_ids, log)
    teacher.close()
    n_kept = write_outputs(out, cfg, kept_rows, progress)
    rep = report(progress.records, skipped)
    summary = {"teacher": cfg.teacher, "rows": n_kept, "batches": progress.batches_done,
               "resumed_from_batch": resumed, **rep}
    (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
    log.artifact(out / "stage_summary.json")
    o = rep["overall"]
    info(f"distill: {o['accepted']}/{o['samples']} samples accepted ({o['acceptance_rate']:.1%}), {n_kept} chats "
         f"kept for {o['prompts_with_kept']}/{o['prompts']} prompts; {describe_rates(rep)}")
    if n_kept < cfg.min_rows:
        raise StageError(f"distill: teacher {cfg.teacher} gave {n_kept} chats, fewer than min_rows={cfg.min_rows}: "
                         f"{o['accepted']}/{o['samples']} samples accepted ({o['acceptance_rate']:.1%}); per family: "
                         f"{describe_rates(rep)}. Check the teacher's answer format against the verifiers "
                         f"({out / 'samples.jsonl'} holds every response and the verifier's reason), or "
                         "sample more (samples_per_prompt, temperature)")
    return summary


if __name__ == "__main__":
    sys.exit(run_job(main, DistillConfig))

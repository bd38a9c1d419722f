"""distill's checkpoints in process (run_batches with a stand-in teacher, a real Checkpointer on a
file store): each sample record is written once, in the part of the first checkpoint after its
batch (the checkpoint itself lists the parts: its size does not grow with the run); a run
stopped mid-way resumes to the records of an uninterrupted run, drawing only the batches not
checkpointed; a checkpoint written before the parts (the records in its state) resumes too; a
part that differs from what the checkpoint recorded is refused."""
from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
import torch

from stages.common.checkpoint import STATE_FILE, Checkpointer, CheckpointError
from stages.common.checkpoint_store import CheckpointStore
from stages.common.contract import StageJob
from stages.common.distributed import Ranks
from stages.common.groups import SOLO
from stages.common.stage_log import StageLogger
from stages.distill.config import DistillConfig
from stages.distill.job import prompts_digest, run_batches
from stages.distill.record_parts import RecordParts
from stages.rl.decoding import Decoded
from stages.rl.verified_sampling import ScoredResponse

ROWS = [{"id": f"p{i}", "domain": "math", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(9)]
PROMPT_IDS = [[i, i + 1] for i in range(len(ROWS))]
CFG = DistillConfig(teacher="t", data="d.jsonl", samples_per_prompt=2, batch_prompts=2, checkpoint_every=1,
                    max_new_tokens=8, min_tokens=1, max_tokens=8)
BATCHES = 5  # 9 prompts, 2 a batch


class Teacher:
    """Responses that depend on the row, the sample and the batch's seed; `stop_at`: the batch
    it fails on (a killed run)."""

    def __init__(self, stop_at: int | None = None):
        self.stop_at, self.asked = stop_at, []

    def generate_and_score(self, cfg, rows, prompt_ids, sampling, *, samples, which):
        batch = which[0] // cfg.batch_prompts
        if batch == self.stop_at:
            raise KeyboardInterrupt("killed")
        self.asked.append(batch)
        return [ScoredResponse(i, j, Decoded(f"answer {i}.{j} seed {sampling.seed}", 3, True),
                               SimpleNamespace(score=float((i + j) % 2), reason="stand-in"))
                for i in which for j in range(samples)]


def _job(tmp_path, name: str) -> StageJob:
    return StageJob(recipe="r", stage="distill", kind="distill", hash="h", config={},
                    stage_url=f"file://{tmp_path}/{name}", output_dir=str(tmp_path / name / "out"),
                    work_dir=str(tmp_path / name / "work"))


def _run(job: StageJob, teacher: Teacher):
    return run_batches(job, CFG, teacher, ROWS, PROMPT_IDS, StageLogger(None, None, 0))


def _state(job: StageJob) -> dict:
    store = CheckpointStore(job.stage_url, {})
    path = f"{store.path}/step-{store.latest():08d}/{STATE_FILE}"
    return json.loads(gzip.decompress(store.fs.cat_file(path)))["state"]["progress"]


def test_each_record_is_written_once_and_a_stopped_run_resumes_to_the_same_records(tmp_path):
    whole_job = _job(tmp_path, "whole")
    whole, resumed = _run(whole_job, Teacher())
    assert resumed is None and whole.batches_done == BATCHES and len(whole.records) == len(ROWS) * 2
    state = _state(whole_job)
    assert "records" not in state  # the checkpoint lists the parts; it does not hold the records
    assert [(p["start"], p["end"]) for p in state["parts"]] == [(b, b + 1) for b in range(BATCHES)]
    assert sum(p["records"] for p in state["parts"]) == len(whole.records)  # each record once
    assert RecordParts(whole_job).read(state["parts"]) == whole.records

    job = _job(tmp_path, "stopped")
    with pytest.raises(KeyboardInterrupt):
        _run(job, Teacher(stop_at=3))
    rest = Teacher()
    progress, resumed = _run(job, rest)
    assert resumed == 3 and rest.asked == [3, 4]
    assert progress.records == whole.records


def test_a_checkpoint_that_holds_the_records_resumes(tmp_path):
    """A checkpoint written before the parts: `records` in its state."""
    whole, _ = _run(_job(tmp_path, "whole"), Teacher())
    job = _job(tmp_path, "legacy")
    first_two = [r for r in whole.records if r["prompt"] < 2 * CFG.batch_prompts]
    legacy = SimpleNamespace(state_dict=lambda: {"batches_done": 2, "records": first_two})
    ranks = Ranks(0, 1, 0, torch.device("cpu"), False, SOLO)
    Checkpointer(job, None, ranks, {"progress": legacy},
                 fingerprint={"prompts": len(ROWS), "prompts digest": prompts_digest(ROWS, PROMPT_IDS)}).save(2)
    rest = Teacher()
    progress, resumed = _run(job, rest)
    assert resumed == 2 and rest.asked == [2, 3, 4] and progress.records == whole.records
    assert sum(p["records"] for p in _state(job)["parts"]) == len(whole.records)


def test_a_changed_part_is_refused(tmp_path):
    job = _job(tmp_path, "changed")
    with pytest.raises(KeyboardInterrupt):
        _run(job, Teacher(stop_at=2))
    parts = RecordParts(job)
    parts.fs.pipe_file(f"{parts.path}/{parts.name(1, 2)}", gzip.compress(b'{"other": 1}\n'))
    with pytest.raises(CheckpointError, match=r"record part batches-00000001-00000002.jsonl.gz is not the one"):
        _run(job, Teacher())

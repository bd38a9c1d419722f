"""distill's sample records in the store, one part per checkpoint: the part of a checkpoint
holds the records of the batches since the one before (`{stage_url}/checkpoints/records/
batches-SSSSSSSS-EEEEEEEE.jsonl.gz`), so each record is written once, not again at every later
checkpoint. The checkpoint's state lists its parts (batch range, record count, sha256); a resume
reads exactly those, in order, and refuses a part that is missing or differs from what the
checkpoint recorded. A part left by a killed run beyond its last checkpoint is rewritten by the
run that resumes (its batches are drawn again, seeded per batch)."""
from __future__ import annotations

import gzip
import hashlib
import json
from typing import Any

from data_curation.urls import filesystem, join
from stages.common.artifact_inputs import CHECKPOINTS
from stages.common.contract import StageJob
from stages.common.store_writes import WritePolicy

RECORDS = "records"


class RecordParts:
    """The record parts of one distill stage's checkpoints."""

    def __init__(self, job: StageJob):
        self.url = join(job.stage_url, CHECKPOINTS, RECORDS)
        self.fs, self.path = filesystem(self.url, job.storage_options)
        self.writes = WritePolicy(job.store_timeout_s, job.store_attempts)

    @staticmethod
    def name(start: int, end: int) -> str:
        return f"batches-{start:08d}-{end:08d}.jsonl.gz"

    def write(self, start: int, end: int, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The records of batches [start, end) as one part; returns its entry for the checkpoint."""
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        data = gzip.compress(text, mtime=0)
        name = self.name(start, end)
        self.fs.makedirs(self.path, exist_ok=True)
        self.writes.run(f"write distill records {name} to", self.url,
                        lambda: self.fs.pipe_file(join(self.path, name), data))
        return {"start": start, "end": end, "records": len(records), "sha256": hashlib.sha256(text).hexdigest()}

    def read(self, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every record of the checkpoint's `parts`, in order."""
        from stages.common.checkpoint import CheckpointError  # torch: the job module's workers must not load it

        out: list[dict[str, Any]] = []
        for part in parts:
            name = self.name(part["start"], part["end"])
            try:
                text = gzip.decompress(self.fs.cat_file(join(self.path, name)))
            except (OSError, EOFError) as e:
                raise CheckpointError(f"distill checkpoint of {self.url}: record part {name} cannot be read "
                                      f"({type(e).__name__}: {e}); delete the stage's checkpoints/ to start over") from e
            if hashlib.sha256(text).hexdigest() != part["sha256"]:
                raise CheckpointError(f"distill checkpoint of {self.url}: record part {name} is not the one the "
                                      "checkpoint wrote (sha256 differs); delete the stage's checkpoints/ to start over")
            out.extend(json.loads(line) for line in text.decode().splitlines())
        return out

"""Mid-stage checkpoints in the artifact store, under `{stage_url}/checkpoints/step-NNNNNNNN/`,
each with its own `_COMPLETE` marker (not part of the artifact's manifest)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_curation.urls import filesystem, join
from stages.common.artifact_inputs import CHECKPOINTS
from stages.common.store_writes import WritePolicy


@dataclass
class CheckpointStore:
    """Mid-stage checkpoints under `{stage_url}/checkpoints/step-NNNNNNNN/`."""

    stage_url: str
    storage_options: dict[str, Any]
    keep: int = 2
    writes: WritePolicy = WritePolicy()  # each file's write: a deadline, retries

    def __post_init__(self) -> None:
        self.fs, self.path = filesystem(join(self.stage_url, CHECKPOINTS), self.storage_options)

    def _step_path(self, step: int) -> str:
        return join(self.path, f"step-{step:08d}")

    def steps(self) -> list[int]:
        if not self.fs.exists(self.path):
            return []
        out = []
        for p in self.fs.ls(self.path, detail=False):
            name = p.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("step-") and self.fs.exists(join(p, "_COMPLETE")):
                out.append(int(name[5:]))
        return sorted(out)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, local_dir: Path, step: int) -> str:
        """Upload a finished local checkpoint (one node), mark it complete, prune old ones."""
        self.clear(step)
        self.upload(local_dir, step)
        self.mark_complete(step)
        return self._step_path(step)

    # Multi-node: rank 0 `clear`s, every node's local rank 0 `upload`s its own ranks'
    # files into the same step, then (after a barrier) rank 0 `mark_complete`s it.
    def clear(self, step: int) -> None:
        """Remove a stale, never completed upload of this step."""
        if self.fs.exists(self._step_path(step)):
            self.fs.rm(self._step_path(step), recursive=True)

    def upload(self, local_dir: Path, step: int) -> str:
        dest = self._step_path(step)
        for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
            rel = path.relative_to(local_dir).as_posix()
            self.fs.makedirs(join(dest, os.path.dirname(rel)) if "/" in rel else dest, exist_ok=True)
            self.writes.run(f"upload checkpoint step {step}'s {rel} to", self.stage_url,
                            lambda path=path, rel=rel: self.fs.put_file(str(path), join(dest, rel)))
        return dest

    def mark_complete(self, step: int) -> None:
        self.writes.run(f"mark checkpoint step {step} complete at", self.stage_url,
                        lambda: self.fs.pipe_file(join(self._step_path(step), "_COMPLETE"), str(step).encode()))
        for old in self.steps()[:-self.keep]:
            self.fs.rm(self._step_path(old), recursive=True)

    def restore(self, step: int, local_dir: Path) -> Path:
        if local_dir.exists():
            shutil.rmtree(local_dir)
        local_dir.mkdir(parents=True)
        src = self._step_path(step)
        for p in self.fs.find(src):
            rel = p[len(src):].strip("/")
            if rel == "_COMPLETE":
                continue
            (local_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            self.writes.run(f"download checkpoint step {step}'s {rel} from", self.stage_url,
                            lambda p=p, rel=rel: self.fs.get_file(p, str(local_dir / rel)))
        return local_dir

"""Mid-stage DeepSpeed checkpoints through the stage's CheckpointStore, with every rank's RNG."""
from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.artifacts import CheckpointStore
from pipeline.stage_api import StageJob


class CheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be loaded."""


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """DeepSpeed checkpoints written to a node-local dir, then into the stage's
    CheckpointStore: every node's local rank 0 uploads its ranks' files, rank 0 marks
    the step complete (and prunes old steps) once every node is done."""

    def __init__(self, job: StageJob, engine, rank: int, local_rank: int):
        self.store = CheckpointStore(job.stage_url, job.storage_options)
        self.engine, self.rank, self.local_rank = engine, rank, local_rank
        self.local_root = Path(job.work_dir) / "checkpoints"

    @staticmethod
    def tag(step: int) -> str:
        return f"step-{step:08d}"

    def save(self, step: int, client_state: dict[str, Any]) -> None:
        tag = self.tag(step)
        self.engine.save_checkpoint(str(self.local_root), tag=tag, client_state=client_state,
                                    save_latest=False)
        torch.save(rng_state(), self.local_root / tag / f"rng_rank{self.rank:05d}.pt")
        if self.rank == 0:
            self.store.clear(step)
        dist.barrier()
        if self.local_rank == 0:
            self.store.upload(self.local_root / tag, step)
        dist.barrier()
        if self.rank == 0:
            self.store.mark_complete(step)
        if self.local_rank == 0:
            shutil.rmtree(self.local_root / tag, ignore_errors=True)

    def latest(self) -> int | None:
        box = [self.store.latest() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def load(self, step: int) -> dict[str, Any]:
        tag = self.tag(step)
        root = self.local_root.parent / "resume"
        if self.local_rank == 0:
            self.store.restore(step, root / tag)
        dist.barrier()
        path, client_state = self.engine.load_checkpoint(str(root), tag=tag)
        if path is None or client_state is None:
            raise CheckpointError(f"checkpoint {tag} of {self.store.stage_url} could not be loaded")
        rng_file = root / tag / f"rng_rank{self.rank:05d}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))
        return client_state

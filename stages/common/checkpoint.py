"""Mid-stage checkpoints of the training stages, through the stage's CheckpointStore.

One checkpoint (`checkpoints/step-NNNNNNNN/` of the stage's artifact dir) holds
- the DeepSpeed state of every training rank (module, optimizer, lr schedule), written by
  DeepSpeed (a rank that does not train, e.g. an RL rank that only generates, has none);
- every rank's RNG state (python, numpy, torch, CUDA): `rng_rank00000.pt`, ...;
- `state.json.gz`, written by rank 0: the step, the run's fingerprint and the `state_dict()`
  of every Stateful the stage registered (its progress counters, metric history, ...), the
  torchtitan way: whatever must survive a restart is a Stateful handed to the
  Checkpointer, not a field copied by hand;
- `rank_state_00000.json.gz`, ...: the per-rank Statefuls (`rank_state`), one file per rank
  that holds any (each RL engine rank's scheduler shard: its pools, open groups, sampler
  position), loaded back by the same rank.

The fingerprint is the world size plus what the stage adds (SFT: the pack count, ...). A
restart with a different fingerprint is refused before anything is loaded (DeepSpeed's ZeRO
shards cannot be read by another world size; a different data set would silently resume at
a wrong position).

Every node's local rank 0 uploads its ranks' files; rank 0 marks the step complete (and
prunes older steps) once every node is done. On restart each node's local rank 0 restores
the latest complete step and every rank loads its part. The ranks synchronise over
`Ranks.everyone` (all ranks of the launch, whatever role worlds they train in).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from stages.common.checkpoint_store import CheckpointStore
from stages.common.contract import StageError, StageJob
from stages.common.distributed import Ranks
from stages.common.lora import has_lora
from stages.common.store_writes import WritePolicy

STATE_FILE = "state.json.gz"


def rank_state_file(rank: int) -> str:
    return f"rank_state_{rank:05d}.json.gz"


class CheckpointError(StageError):
    """A checkpoint that cannot be resumed from (corrupt, or written by another setup)."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StatefulDataclass:
    """Mixin: a dataclass whose fields are JSON-able is a Stateful (a stage's progress counters)."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, state[f.name])


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


def read_state(step_dir: Path, name: str = STATE_FILE) -> dict[str, Any]:
    """`state.json.gz` of a restored checkpoint directory: {"step", "fingerprint", "state"}
    (or, with `name` = rank_state_file(r), rank r's Statefuls: {name: state_dict})."""
    with gzip.open(Path(step_dir) / name, "rt", encoding="utf-8") as f:
        return json.load(f)


def _write_json_gz(path: Path, obj: Any) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(obj, f)


class Checkpointer:
    """Saves and resumes a stage: DeepSpeed `engine` (None on a rank that does not train),
    RNG, the Statefuls in `state` (name -> object; None on a rank that does not hold that
    object: rank 0's state is the one saved, and every rank loads it) and the per-rank
    Statefuls in `rank_state` (each rank saves and loads its own)."""

    def __init__(self, job: StageJob, engine, ranks: Ranks, state: dict[str, Stateful | None],
                 fingerprint: dict[str, Any] | None = None, rank_state: dict[str, Stateful | None] | None = None):
        self.store = CheckpointStore(job.stage_url, job.storage_options,
                                     writes=WritePolicy(job.store_timeout_s, job.store_attempts))
        self.engine, self.ranks, self.state = engine, ranks, state
        self.rank_state = {k: s for k, s in (rank_state or {}).items() if s is not None}
        self.fingerprint = {"world size": ranks.world, **(fingerprint or {})}
        self.local_root = Path(job.work_dir) / "checkpoints"
        # a LoRA model's frozen weights are the input model's (loaded again on resume): its
        # checkpoints hold the adapters, fully trained modules and their optimizer state only
        self.trained_only = engine is not None and has_lora(engine.module)

    @staticmethod
    def tag(step: int) -> str:
        return f"step-{step:08d}"

    def save(self, step: int) -> None:
        r = self.ranks
        tag = self.tag(step)
        local = self.local_root / tag
        group = r.everyone
        if r.local_rank == 0:  # leftovers of a killed run must not mix into this checkpoint
            shutil.rmtree(local, ignore_errors=True)
        group.barrier()
        if self.engine is not None:
            self.engine.save_checkpoint(str(self.local_root), tag=tag, save_latest=False,
                                        exclude_frozen_parameters=self.trained_only)
        local.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), local / f"rng_rank{r.rank:05d}.pt")
        if self.rank_state:
            _write_json_gz(local / rank_state_file(r.rank), {k: s.state_dict() for k, s in self.rank_state.items()})
        if r.rank == 0:
            _write_json_gz(local / STATE_FILE, {"step": step, "fingerprint": self.fingerprint,
                                                "state": {k: s.state_dict() for k, s in self.state.items()
                                                          if s is not None}})
            self.store.clear(step)  # a stale, never completed upload of this step
        group.barrier()
        if r.local_rank == 0:  # each node uploads its own ranks' files (one node: all of them)
            self.store.upload(local, step)
        group.barrier()
        if r.rank == 0:
            self.store.mark_complete(step)
        if r.local_rank == 0:  # the store has it now; local copies would pile up
            shutil.rmtree(local, ignore_errors=True)

    def resume(self) -> int | None:
        """Load the latest complete checkpoint into the engine, the RNG and every Stateful;
        returns its step, or None when the stage has none (a fresh start)."""
        r = self.ranks
        step = r.everyone.broadcast_object(self.store.latest() if r.rank == 0 else None, 0)
        if step is None:
            return None
        tag = self.tag(step)
        root = self.local_root.parent / "resume"
        if r.local_rank == 0:
            shutil.rmtree(root / tag, ignore_errors=True)
            self.store.restore(step, root / tag)
        r.everyone.barrier()
        saved = self._read(root / tag, STATE_FILE)
        if saved["fingerprint"] != self.fingerprint:
            raise CheckpointError(
                f"checkpoint {tag} of {self.store.stage_url} was written by a run with "
                f"{_describe(saved['fingerprint'])}; this run has {_describe(self.fingerprint)}. "
                "Resume with the same resources and data, or delete its checkpoints/")
        mine = self._read(root / tag, rank_state_file(r.rank)) if self.rank_state else {}
        if self.engine is not None:
            path, _ = self.engine.load_checkpoint(str(root), tag=tag, load_module_strict=not self.trained_only)
            if path is None:
                raise CheckpointError(f"checkpoint {tag} of {self.store.stage_url} has no loadable DeepSpeed state")
        for name, obj in self.state.items():
            if obj is not None:
                obj.load_state_dict(saved["state"][name])
        for name, obj in self.rank_state.items():
            obj.load_state_dict(mine[name])
        set_rng_state(torch.load(root / tag / f"rng_rank{r.rank:05d}.pt", weights_only=False))
        return step

    def _read(self, step_dir: Path, name: str) -> dict[str, Any]:
        try:
            return read_state(step_dir, name)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {step_dir.name} of {self.store.stage_url}: {name} "
                                  f"cannot be read ({type(e).__name__}: {e})") from e


def _describe(fingerprint: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in fingerprint.items())

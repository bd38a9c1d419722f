"""The artifact store (fsspec), the pipeline's side: publishing, listing, notes, pruning.
Its layout and how it is read: stages/common/artifact_inputs.py. `{storage}/{recipe}/{stage}-{hash12}/`.

A stage directory holds the stage's published files, `manifest.json` (written after
every file) and `_SUCCESS` (written last). A directory without `_SUCCESS` does not exist
for any reader. Mid-stage checkpoints live under `checkpoints/step-NNNNNNNN/`, each with
its own `_COMPLETE` marker, and are not part of the manifest.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_curation.urls import filesystem, join, normalise_url
from stages.common import secrets
from stages.common.artifact_inputs import CHECKPOINTS, MANIFEST, SUCCESS, read_manifest, sha256_file, storage_errors
from stages.common.checkpoint_store import CheckpointStore
from stages.common.store_writes import WritePolicy


@dataclass
class ArtifactStore:
    """The store root for one recipe: `{storage}/{recipe}`.

    Every operation names itself and its URL when the store fails (StorageError)."""

    root: str
    storage_options: dict[str, Any]
    writes: WritePolicy = WritePolicy()  # each file's write: a deadline, retries (stages.common.store_writes)

    def __post_init__(self) -> None:
        self.root = normalise_url(self.root)
        with storage_errors("open the store at", self.root):  # an unknown protocol, a backend not installed
            self.fs, self.root_path = filesystem(self.root, self.storage_options)

    def stage_url(self, stage: str, stage_hash: str) -> str:
        return join(self.root, f"{stage}-{stage_hash[:12]}")

    def _path(self, url: str) -> str:
        return filesystem(url, self.storage_options)[1]

    def stage_dirs(self) -> dict[str, list[str]]:
        """stage name -> URLs of its `{stage}-{hash12}` directories (any state)."""
        with storage_errors("list the store", self.root):
            self.fs.invalidate_cache()
            if not self.fs.exists(self.root_path):
                return {}
            entries = self.fs.ls(self.root_path, detail=True)
        out: dict[str, list[str]] = {}
        for e in entries:
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            stage, _, h = name.rpartition("-")
            if e.get("type") == "directory" and stage and len(h) == 12:
                out.setdefault(stage, []).append(join(self.root, name))
        return out

    # small side files next to an artifact (`_FAILED`, `_RUNNING`)
    def write_note(self, stage_url: str, name: str, data: dict[str, Any]) -> None:
        with storage_errors(f"write {name} at", stage_url):
            self.fs.makedirs(self._path(stage_url), exist_ok=True)  # a job may fail before writing anything
            with self.fs.open(join(self._path(stage_url), name), "w") as f:
                json.dump(secrets.public(data), f, default=str)  # never a credential (stages.common.secrets)

    def read_note(self, stage_url: str, name: str) -> dict[str, Any] | None:
        p = join(self._path(stage_url), name)
        with storage_errors(f"read {name} at", stage_url):
            try:
                with self.fs.open(p, "r") as f:
                    return json.load(f)
            except FileNotFoundError:
                return None

    def remove(self, stage_url: str, name: str) -> None:
        p = join(self._path(stage_url), name)
        with storage_errors(f"remove {name} at", stage_url):
            if self.fs.exists(p):
                self.fs.rm(p, recursive=True)

    def remove_all(self, stage_url: str) -> None:
        with storage_errors("remove", stage_url):
            if self.fs.exists(self._path(stage_url)):
                self.fs.rm(self._path(stage_url), recursive=True)

    def is_done(self, stage_url: str) -> bool:
        with storage_errors("check for _SUCCESS at", stage_url):
            return self.fs.exists(join(self._path(stage_url), SUCCESS))

    def read_manifest(self, stage_url: str) -> dict[str, Any]:
        return read_manifest(stage_url, self.storage_options)

    def unpublish(self, stage_url: str) -> None:
        """Withdraw a published artifact (before a forced rerun): `_SUCCESS` goes first."""
        with storage_errors("unpublish", stage_url):
            for name in (SUCCESS, MANIFEST):
                p = join(self._path(stage_url), name)
                if self.fs.exists(p):
                    self.fs.rm(p)

    def publish(self, local_dir: Path, stage_url: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Upload every file of `local_dir`, then manifest.json, then `_SUCCESS`.

        Readers only trust directories with `_SUCCESS`, so a crash mid-publish leaves an
        artifact that nobody reads and the next run publishes again.
        """
        dest = self._path(stage_url)
        self.unpublish(stage_url)
        files = []
        with storage_errors("publish to", stage_url):
            for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
                rel = path.relative_to(local_dir).as_posix()
                if rel in (MANIFEST, SUCCESS) or rel.startswith(CHECKPOINTS + "/"):
                    continue
                files.append({"path": rel, "size": path.stat().st_size, "sha256": sha256_file(path)})
                self.fs.makedirs(join(dest, os.path.dirname(rel)) if "/" in rel else dest, exist_ok=True)
                self.writes.run(f"publish {rel} to", stage_url,
                                lambda path=path, rel=rel: self.fs.put_file(str(path), join(dest, rel)))
            manifest = secrets.public({**manifest, "files": files, "published_at": time.time()})
            text = json.dumps(manifest, indent=2, sort_keys=True, default=str)
            self.writes.run(f"write {MANIFEST} to", stage_url,
                            lambda: self.fs.pipe_file(join(dest, MANIFEST), text.encode()))
            self.writes.run(f"write {SUCCESS} to", stage_url, lambda: self.fs.pipe_file(join(dest, SUCCESS), b""))
        return manifest

    def prune_checkpoints(self, stage_url: str, keep: int, dry_run: bool = False) -> list[str]:
        """Keep the newest `keep` complete checkpoints of an artifact (0: none, the final model
        only); remove older and never-completed ones. Returns the URLs removed (or, with
        `dry_run`, that would be)."""
        ckpt = CheckpointStore(stage_url, self.storage_options, writes=self.writes)
        with storage_errors("prune checkpoints of", stage_url):
            if not ckpt.fs.exists(ckpt.path):
                return []
            complete = ckpt.steps()
            kept = set(complete[-keep:]) if keep else set()
            doomed = [p for p in ckpt.fs.ls(ckpt.path, detail=False)
                      if _step_of(p) not in kept]
            if not dry_run:
                for p in doomed:
                    ckpt.fs.rm(p, recursive=True)
                if not kept and ckpt.fs.exists(ckpt.path):  # local stores keep empty directories
                    ckpt.fs.rm(ckpt.path, recursive=True)
        return [join(stage_url, CHECKPOINTS, p.rstrip("/").rsplit("/", 1)[-1]) for p in doomed]


def _step_of(path: str) -> int | None:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None

"""The artifact store (fsspec): `{storage}/{recipe}/{stage}-{hash12}/`.

A stage directory holds the stage's published files, `manifest.json` (written after
every file) and `_SUCCESS` (written last). A directory without `_SUCCESS` does not exist
for any reader. Mid-stage checkpoints live under `checkpoints/step-NNNNNNNN/`, each with
its own `_COMPLETE` marker, and are not part of the manifest.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from filelock import FileLock

# the store's URLs are read the way curation reads its inputs' (one normalisation, one fsspec lookup)
from data_curation.io import filesystem, is_local, join, normalise_url
from pipeline import secrets

MANIFEST = "manifest.json"
SUCCESS = "_SUCCESS"
CHECKPOINTS = "checkpoints"
_CHUNK = 1 << 20


class ArtifactError(RuntimeError):
    """An artifact is missing, unfinished or fails its integrity check."""


class StorageError(ArtifactError):
    """The store failed an operation (outage, permissions, credentials, corrupt file): the
    message names the operation and the URL."""


@contextlib.contextmanager
def storage_errors(operation: str, url: str) -> Iterator[None]:
    """Turn whatever the filesystem raises (OSError, botocore, aiohttp, JSON...) into one
    StorageError naming `operation` and `url`; our own ArtifactErrors pass through."""
    try:
        yield
    except ArtifactError:
        raise
    except json.JSONDecodeError as e:
        raise StorageError(f"cannot {operation} {url}: the file is corrupt (not JSON: {e})") from e
    except Exception as e:  # noqa: BLE001 - every backend has its own error types
        raise StorageError(f"cannot {operation} {url}: {type(e).__name__}: {e}") from e


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn() in a thread of its own; TimeoutError when it has not returned after `seconds` (a
    store call blocked on a dead connection cannot be interrupted: it is left behind)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="bounded store call")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@dataclass(frozen=True)
class WritePolicy:
    """How long one store write (a file) may take, and how often it is tried (with backoff:
    1 s, 2 s, 4 s ... between tries). A network file system or object store that stops
    answering fails the write with its cause instead of hanging the stage for hours."""

    timeout_s: float = 1800.0
    attempts: int = 3
    backoff_s: float = 1.0

    def run(self, operation: str, url: str, fn: Callable[[], Any]) -> Any:
        last: BaseException | None = None
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return within(self.timeout_s, fn)
            except (FileNotFoundError, PermissionError, IsADirectoryError):
                raise  # not a passing outage: another try would fail the same way
            except Exception as e:  # noqa: BLE001 - every backend has its own errors
                last = e
        what = str(last) if isinstance(last, TimeoutError) else f"{type(last).__name__}: {last}"
        # the message carries the cause: a chained traceback would be reported first (pipeline.job_output)
        raise StorageError(f"cannot {operation} {url}: {what} (tried {self.attempts} times)") from None


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def local_path(url: str) -> Path:
    return Path(url[len("file://"):] if url.startswith("file://") else url)


@dataclass
class ArtifactStore:
    """The store root for one recipe: `{storage}/{recipe}`.

    Every operation names itself and its URL when the store fails (StorageError)."""

    root: str
    storage_options: dict[str, Any]
    writes: WritePolicy = WritePolicy()

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
                json.dump(secrets.public(data), f, default=str)

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
            self.writes.run(f"write {MANIFEST} to", stage_url, lambda: self.fs.pipe_file(join(dest, MANIFEST),
                                                                                      text.encode()))
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


def read_manifest(stage_url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    fs, path = filesystem(stage_url, storage_options)
    with storage_errors("read the manifest of", stage_url):
        if not fs.exists(join(path, SUCCESS)):
            raise ArtifactError(f"artifact {stage_url} is not published (no {SUCCESS}): "
                                "its stage has not finished")
        try:
            with fs.open(join(path, MANIFEST), "r") as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise ArtifactError(f"artifact {stage_url} has {SUCCESS} but no {MANIFEST}: rerun its "
                                "stage with --force") from None
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{join(stage_url, MANIFEST)} is corrupt (not JSON: {e}): rerun its "
                                "stage with --force") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise ArtifactError(f"{join(stage_url, MANIFEST)} is corrupt (no `files` list): rerun its "
                            "stage with --force")
    return manifest


def verify_artifact(stage_url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Re-hash every file of a published artifact against its manifest."""
    manifest = read_manifest(stage_url, storage_options)
    fs, path = filesystem(stage_url, storage_options)
    for entry in manifest["files"]:
        with fs.open(join(path, entry["path"]), "rb") as f:
            h = hashlib.sha256()
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
        if h.hexdigest() != entry["sha256"]:
            raise ArtifactError(
                f"integrity check failed for {join(stage_url, entry['path'])}: sha256 "
                f"{h.hexdigest()[:16]}... does not match the manifest's {entry['sha256'][:16]}...")
    return manifest


def _download_verified(fs, src: str, dest: Path, entry: dict[str, Any], url_for_error: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    with fs.open(src, "rb") as fin, open(tmp, "wb") as fout:
        for chunk in iter(lambda: fin.read(_CHUNK), b""):
            h.update(chunk)
            fout.write(chunk)
    if h.hexdigest() != entry["sha256"]:
        tmp.unlink(missing_ok=True)
        raise ArtifactError(
            f"integrity check failed for {url_for_error}: sha256 {h.hexdigest()[:16]}... "
            f"does not match the manifest's {entry['sha256'][:16]}... (corrupted or "
            "modified after publishing; rerun the producing stage with --force)")
    os.replace(tmp, dest)


def fetch_input(url: str, dest_root: Path, storage_options: dict[str, Any] | None,
                artifact_urls: Iterable[str] = ()) -> Path:
    """Local path of `url`. Inside a known artifact: download what the manifest lists
    under that sub-path, verifying sha256. Elsewhere: local paths are used in place,
    remote URLs are downloaded as they are."""
    url = normalise_url(url)
    for art in sorted((normalise_url(a) for a in artifact_urls), key=len, reverse=True):
        if url == art or url.startswith(art + "/"):
            return _fetch_from_artifact(art, url[len(art):].strip("/"), dest_root, storage_options)
    if is_local(url):
        p = local_path(url)
        if not p.exists():
            raise ArtifactError(f"input {url} does not exist")
        return p
    fs, path = filesystem(url, storage_options)
    if not fs.exists(path):
        raise ArtifactError(f"input {url} does not exist")
    dest = dest_root / "external" / hashlib.sha1(url.encode()).hexdigest()[:16] / Path(path).name
    dest_root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if not dest.exists():
            fs.get(path, str(dest), recursive=fs.isdir(path))
    return dest


def _fetch_from_artifact(art: str, sub: str, dest_root: Path,
                         storage_options: dict[str, Any] | None) -> Path:
    manifest = read_manifest(art, storage_options)
    fs, art_path = filesystem(art, storage_options)
    name = f"{manifest.get('stage', 'artifact')}-{manifest.get('hash', '')[:12]}"
    base = dest_root / name
    entries = [e for e in manifest["files"]
               if not sub or e["path"] == sub or e["path"].startswith(sub + "/")]
    if not entries:
        raise ArtifactError(f"{join(art, sub)} is not in the artifact's manifest")
    base.mkdir(parents=True, exist_ok=True)
    with FileLock(str(base) + ".lock"):  # ranks on one node download once
        for e in entries:
            dest = base / e["path"]
            if dest.exists() and dest.stat().st_size == e["size"] and \
                    (base / ".verified" / e["path"]).exists():
                continue
            _download_verified(fs, join(art_path, e["path"]), dest, e, join(art, e["path"]))
            marker = base / ".verified" / e["path"]
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    return base / sub if sub else base


@dataclass
class CheckpointStore:
    """Mid-stage checkpoints under `{stage_url}/checkpoints/step-NNNNNNNN/`."""

    stage_url: str
    storage_options: dict[str, Any]
    keep: int = 2
    writes: WritePolicy = WritePolicy()

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

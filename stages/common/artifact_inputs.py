"""Reading the artifact store (fsspec): a published artifact is a directory
`{storage}/{recipe}/{stage}-{hash12}/` of the stage's files, `manifest.json` (every file's
size and sha256, written after them) and `_SUCCESS` (written last); a directory without
`_SUCCESS` does not exist for any reader. A stage job reads its inputs through
`fetch_input` (an artifact's files verified against its manifest); the pipeline writes
artifacts (pipeline/artifacts.py) with the same layout and errors.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from filelock import FileLock

from data_curation.urls import filesystem, is_local, join, local_path, normalise_url

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


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


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
        p = Path(local_path(url))
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

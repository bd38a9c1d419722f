"""A Hugging Face hub cache populated by the tests themselves (nothing is downloaded): the
layout huggingface_hub reads offline, `{cache}/{type}s--{org}--{name}/refs/{revision}` naming
a commit and `snapshots/{commit}/` holding the repo's files."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def cache_repo(cache: Path, repo_type: str, repo_id: str, files: Path, revision: str = "main") -> str:
    """Copy the directory `files` into `cache` as `repo_id` at `revision`; returns the commit."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}:{sorted(p.name for p in files.rglob('*'))}".encode()).hexdigest()
    shutil.copytree(files, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit

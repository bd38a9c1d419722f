"""A stranger's clone: the repository as `git clone` gives it, in an empty directory with
nothing beside it (no ../shared), carrying this checkout's uncommitted changes so that the
suite tests the code in front of it. Commands run there use the clone's own code (the
working directory comes first on a `python -m` path), and see no benchmarks directory."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from data_curation.benchmarks import BENCHMARKS_DIR_ENV
from tests.conftest import REPO


def clone_repository(parent: Path) -> Path:
    """`parent`/ring-pipeline: a clone of this checkout's HEAD plus its changed and new files."""
    dest = parent / "ring-pipeline"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(dest)], check=True, timeout=120)
    changed = subprocess.run(["git", "ls-files", "-z", "--modified", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split("\0")
    deleted = subprocess.run(["git", "ls-files", "-z", "--deleted"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split("\0")
    for rel in filter(None, changed):
        src, out = REPO / rel, dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.unlink(missing_ok=True)
            out.symlink_to(os.readlink(src))
        elif src.is_file():
            shutil.copy2(src, out)
    for rel in filter(None, deleted):
        (dest / rel).unlink(missing_ok=True)
    return dest


def stranger_env(home: Path) -> dict[str, str]:
    """This process's environment as a new user has it: no benchmarks directory, and a Hugging
    Face cache of their own (empty, offline: nothing shipped may need the hub)."""
    env = {k: v for k, v in os.environ.items() if k != BENCHMARKS_DIR_ENV}
    env.update(HF_HUB_CACHE=str(home / "hf-cache"), HF_HUB_OFFLINE="1")
    return env


def paths_outside(value, allowed: list[Path]) -> list[str]:
    """The absolute local paths (plain or file://) among the strings of `value` that lie outside
    every `allowed` root."""
    found: list[str] = []
    if isinstance(value, dict):
        for v in value.values():
            found += paths_outside(v, allowed)
    elif isinstance(value, (list, tuple)):
        for v in value:
            found += paths_outside(v, allowed)
    elif isinstance(value, str):
        path = value[len("file://"):] if value.startswith("file://") else value
        if path.startswith("/") and not any(Path(path).resolve().is_relative_to(a.resolve()) for a in allowed):
            found.append(value)
    return found

"""A file built once per run of the suite, in the run's shared directory, for every pytest-xdist
worker: the migrated Prefect database (tests/prefect_db.py) and MLflow tracking database
(tests/mlflow_db.py) that the suite's servers and stores start from as copies."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Callable

# names the run's shared directory: made by the run's main process (tests/conftest.py), inherited
# by its workers, removed at the run's end
RUN_SHARED = "RING_TEST_RUN_SHARED"


def run_shared() -> Path:
    return Path(os.environ[RUN_SHARED])


def built_once(shared: Path, name: str, filename: str, build: Callable[[Path], None]) -> Path:
    """`shared/name/filename`, made now by `build(directory)` (which writes `filename` there) if no
    process of the run has made it yet; under a lock, so the first caller builds and the others
    wait for it. An SQLite file is checkpointed into the one file that is copied."""
    done = shared / name / filename
    with open(shared / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if done.exists():
            return done
        building = shared / f"{name}.building"
        shutil.rmtree(building, ignore_errors=True)  # a build that failed half-way
        building.mkdir()
        build(building)
        with contextlib.closing(sqlite3.connect(building / filename)) as con:
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        building.rename(done.parent)  # complete or absent: a reader never sees half a database
        return done

"""One MLflow tracking database per run of the suite, copied where a test's pipeline would make a
new one.

MLflow makes a new SQLite tracking database by running its ~50 Alembic migrations: ~2 CPU-s on
this machine, paid by whichever process opens the store first (the `ring-pipeline run`
orchestrator, or a stage test's rank 0) for each test's own database. The first test of the run
that asks makes this template once, with MLflow's own store (the same migrations), under a lock
in the run's shared directory; `tracking_uri` gives a test's directory a copy, which MLflow then
opens as the existing, current database it is. The tiny recipe's end-to-end test still has its
orchestrator make a new database (tests/e2e/test_tiny_recipe.py), as a user's first run does.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sqlite3
from pathlib import Path

DB_NAME = "mlflow.db"


def template(shared: Path) -> Path:
    """The run's migrated database (made now if no process of the run has made it yet)."""
    done = shared / "mlflow-template" / DB_NAME
    with open(shared / "mlflow-template.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if done.exists():
            return done
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        building = shared / "mlflow-template.building"
        shutil.rmtree(building, ignore_errors=True)  # a build that failed half-way
        building.mkdir()
        db = building / DB_NAME
        store = SqlAlchemyStore(f"sqlite:///{db}", str(building / "mlruns"))
        store.engine.dispose()
        with contextlib.closing(sqlite3.connect(db)) as con:  # all of it in the one file that is copied
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        building.rename(done.parent)  # complete or absent: a reader never sees half a database
        return done


def tracking_uri(directory: Path, name: str = DB_NAME) -> str:
    """The `sqlite:///` tracking URI of `directory/name`, a copy of the run's template unless a
    database is there already."""
    db = directory / name
    if not db.exists():
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template(Path(os.environ["RING_TEST_RUN_SHARED"])), db)
    return f"sqlite:///{db}"

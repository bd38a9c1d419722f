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

import shutil
from pathlib import Path

from tests.suite_templates import built_once, run_shared

DB_NAME = "mlflow.db"


def template(shared: Path) -> Path:
    """The run's migrated database (made now if no process of the run has made it yet)."""
    return built_once(shared, "mlflow-template", DB_NAME, _migrate)


def _migrate(directory: Path) -> None:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    SqlAlchemyStore(f"sqlite:///{directory / DB_NAME}", str(directory / "mlruns")).engine.dispose()


def tracking_uri(directory: Path, name: str = DB_NAME) -> str:
    """The `sqlite:///` tracking URI of `directory/name`, a copy of the run's template unless a
    database is there already."""
    db = directory / name
    if not db.exists():
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template(run_shared()), db)
    return f"sqlite:///{db}"

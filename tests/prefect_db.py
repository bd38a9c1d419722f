"""One migrated Prefect database per run of the suite, copied for each Prefect server it starts.

A Prefect server on a brand-new database spends ~7 of its ~10 CPU-seconds of start-up running
Prefect's ~100 Alembic migrations; on a database already at the latest revision its own
migrate-on-start finds nothing to do. The first process of the run that needs a database
(any pytest-xdist worker) migrates this template once, with Prefect's own function the
server runs at start (`create_db`), in a child process under a lock in the run's shared
directory; every server the suite starts then gets a copy: the shared one
(tests/prefect_api.py), each worker's PREFECT_HOME before a `ring-pipeline run` starts its
embedded server there (tests/conftest.py's `embedded_prefect_home`), a test's own home
(`prefect_template`). The
servers themselves are started as before (migrate-on-start on, their usual settings).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.suite_templates import built_once

DB_NAME = "prefect.db"  # where Prefect keeps its database in PREFECT_HOME by default
_MIGRATE = ("import asyncio\n"
            "from prefect.server.database import provide_database_interface\n"
            "asyncio.run(provide_database_interface().create_db())\n")


def template(shared: Path) -> Path:
    """The run's migrated database (made now if no process of the run has made it yet)."""
    return built_once(shared, "prefect-template", DB_NAME, _migrate)


def _migrate(directory: Path) -> None:
    db = directory / DB_NAME
    env = {**os.environ, "PREFECT_HOME": str(directory),
           "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{db}"}
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run([sys.executable, "-c", _MIGRATE], env=env, capture_output=True, text=True)
    if out.returncode != 0 or not db.exists():
        raise RuntimeError(f"migrating the suite's template Prefect database failed:\n{out.stderr[-3000:]}")


def seed(home: Path, migrated: Path) -> None:
    """Give PREFECT_HOME `home` a copy of `migrated` (`template`), unless it has a database."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / DB_NAME).exists():
        shutil.copyfile(migrated, home / DB_NAME)

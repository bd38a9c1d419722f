"""One Prefect API server for a whole run of the suite, every pytest-xdist worker included.

Each Prefect server start on a new database costs ~10 CPU-seconds (imports, migrations: the
database is a copy of the run's migrated one, tests/prefect_db.py); a
server per worker (prefect_test_harness) plus an embedded one per `ring-pipeline run` whose
claim is not about Prefect was ~5-8 of them per suite run. The first worker that asks starts
this one (the product's own server command, `pipeline.prefect_server`, on a database in the
run's shared directory) and records its URL; the others read the record. The server outlives
the worker that started it (its own session, no parent guard): the run's main process stops
it at the end (`stop`, from tests/conftest.py's pytest_unconfigure).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from pipeline.prefect_server import server_command, server_env, wait_until_serving
from stages.common.ports import reserved_port
from tests import prefect_db

_RECORD = "prefect-api.json"


def shared_api(shared: Path) -> str:
    """The API URL of the run's server, started now if no worker has started it yet."""
    with open(shared / "prefect-api.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        record = shared / _RECORD
        if record.exists():
            return json.loads(record.read_text())["api"]
        home = shared / "prefect-home"
        prefect_db.seed(home, prefect_db.template(shared))  # migrated once for the run's servers
        env = server_env(PREFECT_HOME=str(home),
                         PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db")
        log_path = shared / "prefect-api.log"
        with reserved_port() as port, open(log_path, "ab") as log:  # held until the server listens
            proc = subprocess.Popen(server_command(port), env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                api = wait_until_serving(proc, port, log_path)
            except BaseException:
                _stop_group(proc.pid)
                raise
        record.write_text(json.dumps({"api": api, "pid": proc.pid}))
        return api


def stop(shared: Path) -> None:
    """Stop the run's server, if a worker started one."""
    record = shared / _RECORD
    if record.exists():
        _stop_group(json.loads(record.read_text())["pid"])


def _stop_group(pid: int) -> None:
    import psutil

    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    for _ in range(100):  # up to 10 s for a clean exit (its database closed), then SIGKILL
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it where it is our child (a run without workers)
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)

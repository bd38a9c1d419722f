"""The embedded Prefect API server of `ring-pipeline run` when no PREFECT_API_URL is set.

Prefect's own ephemeral mode starts the same server (its uvicorn app factory with the
ephemeral settings) as a plain child process: in our process group, so a Ctrl-C to the
group killed it before the flow could record the stop (minutes of connection errors), and
left alone by kill -9 or SIGTERM, so it outlived the run. Started here instead: in its own
session (group signals do not reach it; the run stops it last) under `pipeline.job_guard`
(it dies with the run, kill -9 included).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from stages.common.ports import reserved_port

_STOP_GRACE_S = 10.0


class PrefectServerError(RuntimeError):
    """The embedded server did not come up."""


@contextlib.contextmanager
def embedded_prefect_api(log_path: Path) -> Iterator[str]:
    """Start the server, yield its API URL, stop it (SIGTERM, then SIGKILL) on the way out."""
    with reserved_port() as port:  # held while the server runs: no other process takes it first
        yield from _serve(port, log_path)


def _serve(port: int, log_path: Path) -> Iterator[str]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.job_guard", str(os.getpid()), "--",
                                 *server_command(port)],
                                env=server_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        api = wait_until_serving(proc, port, log_path)
        yield api
    finally:
        _stop(proc)
        if log_path.exists() and log_path.stat().st_size == 0:  # nothing to read: no clutter
            log_path.unlink()


def server_command(port: int) -> list[str]:
    """Prefect's API server (its uvicorn app factory) on 127.0.0.1:`port`, without the UI."""
    return [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]


def server_env(**overrides: str) -> dict[str, str]:
    """The environment of `server_command`: this process's Prefect settings in ephemeral-server
    mode (Prefect's own ephemeral server's), no PREFECT_API_URL (the server is the API), then
    `overrides` (e.g. another database)."""
    from prefect.settings import get_current_settings

    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    env.pop("PREFECT_API_URL", None)
    return {**env, **overrides}


def wait_until_serving(proc: subprocess.Popen, port: int, log_path: Path) -> str:
    """The API URL of the server `proc` once it answers its health check; PrefectServerError if it
    exits first or does not answer within the startup timeout (at least 120 s)."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    api = f"http://127.0.0.1:{port}/api"
    # a loaded machine needs longer than Prefect's default
    timeout_s = max(120, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    deadline = time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            raise PrefectServerError(f"the embedded Prefect server exited with code {proc.returncode}; "
                                     f"its log: {log_path}")
        with contextlib.suppress(OSError):  # refused until it listens
            with urllib.request.urlopen(f"{api}/health", timeout=2) as answer:
                if answer.status == 200:
                    return api
        if time.time() > deadline:
            raise PrefectServerError(f"the embedded Prefect server did not answer within "
                                     f"{timeout_s:.0f} s; its log: {log_path}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue

"""Stopping a run on Ctrl-C or SIGTERM.

The signal lands in the main thread, while stage jobs are waited on in Prefect's worker
threads. So the handler only records the request; each thread that waits on a job polls
`stop_requested()` and stops its job's process group itself (SIGINT, SIGTERM, SIGKILL: see
`pipeline.launch.stop_group`; a second signal skips the grace periods), and a stage that has
not started its job does not start it. `ring-pipeline run` keeps its main thread free (the
flow runs in a worker thread), so the handler runs at once.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StageInterrupted(Exception):
    """A stage was stopped (or not started) because the run was told to stop."""


class _StopRequest:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reason: str | None = None
        self.signum: int | None = None
        self.count = 0

    def reset(self) -> None:
        with self.lock:
            self.reason, self.signum, self.count = None, None, 0


_REQUEST = _StopRequest()


def request_stop(reason: str, signum: int | None = None) -> None:
    with _REQUEST.lock:
        _REQUEST.count += 1
        if _REQUEST.reason is None:
            _REQUEST.reason, _REQUEST.signum = reason, signum


def stop_requested() -> str | None:
    """Why the run must stop, or None."""
    return _REQUEST.reason


def hurry() -> bool:
    """A second signal: kill now, no grace periods."""
    return _REQUEST.count >= 2


def raise_if_stopping(what: str) -> None:
    reason = stop_requested()
    if reason:
        raise StageInterrupted(f"{what}: not started, the run was interrupted ({reason})")


def exit_code() -> int:
    """The shell's convention for death by a signal: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + (_REQUEST.signum or signal.SIGINT)


@contextlib.contextmanager
def signals_stop_the_run() -> Iterator[None]:
    """Install SIGINT/SIGTERM handlers (main thread only) that request a stop; the request
    lasts until the block ends."""
    _REQUEST.reset()

    def handler(signum: int, _frame) -> None:
        request_stop(signal.Signals(signum).name, signum)

    previous = {s: signal.signal(s, handler) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _REQUEST.reset()

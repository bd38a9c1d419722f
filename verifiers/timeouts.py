"""In-process wall-clock timeout for one verification.

In the main thread of a Unix process this uses ``signal.setitimer(ITIMER_REAL)``, which
interrupts pure-Python work (sympy, parsing) with ``VerifierTimeout``. Outside the main
thread signals are unavailable: the call then runs without an in-process limit and only
``verify_batch``'s process pool (which kills a worker past its deadline) bounds it. That
is why RL loops should call ``verify_batch``, not ``verify`` from threads.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class VerifierTimeout(Exception):
    pass


_deadline = threading.local()


def remaining_s(default: float = 10.0) -> float:
    """Seconds left in the current verification's budget (``default`` when none is set)."""
    d = getattr(_deadline, "t", None)
    return default if d is None else max(0.0, d - time.monotonic())


def _can_use_signals() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    prev_deadline = getattr(_deadline, "t", None)
    if not seconds or seconds <= 0:
        yield
        return
    _deadline.t = time.monotonic() + seconds
    if not _can_use_signals():
        try:
            yield
        finally:
            _deadline.t = prev_deadline
        return

    def _handler(signum, frame):  # noqa: ARG001
        raise VerifierTimeout(f"timed out after {seconds:g}s")

    started = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, _handler)
    old_timer = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_timer[0] > 0:  # an outer timer was running: re-arm what is left of it
            left = old_timer[0] - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, left))
        _deadline.t = prev_deadline

"""``verify`` (one row, in-process) and ``verify_batch`` (process pool).

``verify_batch`` keeps a module-level pool of worker processes alive between calls (an RL
loop calls it every step; starting processes each time would cost more than verifying).
Workers are forked from a forkserver that has already imported ``verifiers``. A worker
gets its first row only once it says it is ready: its start-up (multiprocessing imports the
parent's ``__main__`` module in it, e.g. a stage entry and all it imports) is not charged to
a row's time, and a worker that cannot start within ``WORKER_START_TIMEOUT_S`` is an error
(on an H100, workers importing vLLM through the stage's main module outlived every row's
timeout, so every row scored 0 "verifier timeout" and the stage crawled). Each row
gets ``timeout_s``: the worker enforces it in-process (SIGALRM), and the parent kills a
worker that is still busy ``timeout_s + grace`` after dispatch (C-level hangs, crashes),
records score 0 with the reason and starts a fresh worker. Order is preserved.
Verifiers registered from modules outside ``verifiers`` are imported in the workers by
module name (the pool restarts when that set changes); ones defined in ``__main__`` are not.
``num_workers=0`` verifies in the calling process (no isolation from crashes). The
forkserver's socket lives in a dir short enough for a socket path whatever TMPDIR is
(mp_tempdir.py).
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from .extract import NoAnswer, final_text
from .grading import grade
from .mp_tempdir import SocketDirError, short_socket_dir
from .registry import VERIFIERS, WORKER_PRELOAD, get_verifier
from .sandbox import SandboxUnavailable
from .schema import Reward, TaskRow
from .timeouts import VerifierTimeout, time_limit

DEFAULT_TIMEOUT_S = 10.0
KILL_GRACE_S = 2.0
WORKER_START_TIMEOUT_S = 300.0
READY = "ready"


class VerifierPoolError(RuntimeError):
    """The pool cannot verify at all (a worker that does not start): an environment problem
    that must stop training, not score 0."""


def verify(row: TaskRow | dict[str, Any], response: str, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> Reward:
    """Verify one response in this process, under the row's grading (``grading.py``: reference
    unless the row says strict). Never raises for bad answers, malformed rows or
    verifier bugs: those give score 0 with the reason. Raises SandboxUnavailable when code
    cannot be run safely here (an environment problem that must stop training, not score 0)."""
    t0 = time.perf_counter()
    try:
        row = TaskRow.coerce(row)
    except Exception as e:  # pydantic.ValidationError
        errors = getattr(e, "errors", lambda: [])()
        why = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'row'}: {err['msg']}" for err in errors) or str(e)
        return Reward(score=0.0, reason=f"invalid task row: {why}".splitlines()[0], source="invalid_row",
                      elapsed_s=time.perf_counter() - t0)
    try:
        fn = get_verifier(row.domain)
    except KeyError as e:
        return Reward(score=0.0, reason=str(e.args[0]), source="unknown_domain", elapsed_s=time.perf_counter() - t0)
    try:
        require_think = bool((row.extraction or {}).get("require_think", False))
        text = final_text(response, require_think=require_think)
        with time_limit(timeout_s):
            reward = grade(row, text, fn(row, text))
    except NoAnswer as e:
        reward = Reward.zero(str(e), source="no_answer")
    except VerifierTimeout as e:
        reward = Reward.zero(f"verifier timeout: {e}", source="timeout")
    except SandboxUnavailable:
        raise
    except Exception as e:
        reward = Reward.zero(f"verifier error: {type(e).__name__}: {e}", source="verifier_error",
                             traceback=traceback.format_exc(limit=5))
    reward.elapsed_s = time.perf_counter() - t0
    if row.id is not None:
        reward.details.setdefault("id", row.id)
    reward.details.setdefault("domain", row.domain)
    return reward


# ---- worker pool -----------------------------------------------------------------------
def _worker_main(conn: Connection, sys_path: list[str], modules: list[str]) -> None:
    import importlib
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    sys.path[:] = list(dict.fromkeys(sys.path + sys_path))
    for name in modules:  # verifiers registered in the parent by other modules
        try:
            importlib.import_module(name)
        except Exception:
            pass  # their rows then score 0 with "no verifier registered"
    conn.send(READY)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, row, response, timeout_s = msg
        try:
            conn.send((idx, verify(row, response, timeout_s=timeout_s).model_dump()))
        except SandboxUnavailable as e:
            conn.send((idx, SandboxUnavailable(str(e))))


def _verifier_modules() -> tuple[str, ...]:
    mods = {getattr(fn, "__module__", None) for fn in VERIFIERS.values()}
    return tuple(sorted(m for m in mods if m and m != "__main__" and not m.startswith("verifiers.")))


class _Worker:
    def __init__(self, ctx, modules: tuple[str, ...]) -> None:
        import sys

        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, list(sys.path), list(modules)), daemon=True)
        self.proc.start()
        child.close()
        self.task: int | None = None
        self.deadline = 0.0
        self.ready = False

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the worker has started (its READY message); VerifierPoolError if it
        exits or stays silent for `timeout_s`."""
        if self.ready:
            return
        t0 = time.monotonic()
        try:
            if not self.conn.poll(timeout_s):
                raise VerifierPoolError(f"a verifier worker did not start within {timeout_s:g}s (pid "
                                        f"{self.proc.pid}); its start-up imports the calling program's "
                                        f"main module")
            msg = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise VerifierPoolError(f"a verifier worker exited while starting (exit code "
                                    f"{self.proc.exitcode}) after {time.monotonic() - t0:.1f}s") from None
        if msg != READY:
            raise VerifierPoolError(f"a verifier worker sent {msg!r} before saying it was ready")
        self.ready = True

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(timeout=5)
        finally:
            self.conn.close()


class VerifierPool:
    """A fixed number of worker processes, reused across ``run`` calls."""

    def __init__(self, num_workers: int, modules: tuple[str, ...] = ()) -> None:
        self.num_workers = num_workers
        self.modules = modules
        try:
            short_socket_dir()  # the forkserver's socket must fit a socket path, whatever TMPDIR is
        except SocketDirError as e:
            raise VerifierPoolError(str(e)) from None
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["verifiers", *WORKER_PRELOAD])
        self._workers = [_Worker(self._ctx, modules) for _ in range(num_workers)]
        self._lock = threading.Lock()

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx, self.modules)

    def run(self, rows: list[Any], responses: list[str], timeout_s: float) -> list[Reward]:
        with self._lock:
            return self._run(rows, responses, timeout_s)

    def _run(self, rows, responses, timeout_s):
        results: list[Reward | None] = [None] * len(rows)
        sent_at: dict[int, float] = {}
        todo = deque(range(len(rows)))
        for i, w in enumerate(self._workers):
            if not w.proc.is_alive():
                self._replace(i)
        while todo or any(w.task is not None for w in self._workers):
            for w in self._workers:
                if w.task is None and todo:
                    w.wait_ready(WORKER_START_TIMEOUT_S)  # start-up is not the row's time
                    idx = todo.popleft()
                    row = rows[idx].model_dump() if isinstance(rows[idx], TaskRow) else rows[idx]
                    try:
                        w.conn.send((idx, row, responses[idx], timeout_s))
                    except Exception as e:  # unpicklable row, broken pipe
                        results[idx] = Reward.zero(f"could not send row to worker: {type(e).__name__}: {e}",
                                                   source="verifier_error")
                        continue
                    w.task, sent_at[idx] = idx, time.monotonic()
                    w.deadline = sent_at[idx] + timeout_s + KILL_GRACE_S
            busy = [w for w in self._workers if w.task is not None]
            if not busy:
                continue
            now = time.monotonic()
            wait_s = max(0.0, min(w.deadline for w in busy) - now)
            ready = wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], timeout=wait_s)
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.task is None:
                    continue
                idx = w.task
                if w.conn in ready:
                    try:
                        got_idx, payload = w.conn.recv()
                        if isinstance(payload, SandboxUnavailable):  # the batch cannot go on
                            for k in range(len(self._workers)):
                                self._replace(k)  # fresh workers: none holds a stale task
                            raise payload
                        results[got_idx] = Reward.model_validate(payload)
                        w.task = None
                        continue
                    except (EOFError, OSError):
                        pass  # died while answering: handled below
                if w.conn in ready or w.proc.sentinel in ready or not w.proc.is_alive():
                    w.proc.join(timeout=1)
                    results[idx] = Reward.zero(f"verifier process crashed (exit code {w.proc.exitcode})",
                                               source="crashed")
                    results[idx].elapsed_s = now - sent_at[idx]
                    self._replace(i)
                elif now >= w.deadline:
                    results[idx] = Reward.zero(f"verifier timeout: killed after {timeout_s:g}s", source="timeout")
                    results[idx].elapsed_s = now - sent_at[idx]
                    self._replace(i)
        return [r for r in results]  # type: ignore[misc]

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except Exception:
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            if w.proc.is_alive():
                w.kill()
        self._workers = []


_POOL: VerifierPool | None = None
_POOL_LOCK = threading.Lock()


def get_pool(num_workers: int) -> VerifierPool:
    global _POOL
    with _POOL_LOCK:
        modules = _verifier_modules()
        if _POOL is None or _POOL.num_workers != num_workers or _POOL.modules != modules:
            if _POOL is not None:
                _POOL.close()
            _POOL = VerifierPool(num_workers, modules)
        return _POOL


def shutdown_pool() -> None:
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None


atexit.register(shutdown_pool)


def verify_batch(
    rows: list[TaskRow | dict[str, Any]],
    responses: list[str],
    num_workers: int = 2,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Reward]:
    """Verify many responses in a reused process pool; order preserved; never raises for
    a crashing or hanging verifier (score 0 with the reason instead). Raises
    VerifierPoolError when a worker cannot start, SandboxUnavailable when code cannot be run
    safely here."""
    if len(rows) != len(responses):
        raise ValueError(f"verify_batch: {len(rows)} rows but {len(responses)} responses")
    if not rows:
        return []
    if num_workers <= 0:
        return [verify(r, s, timeout_s=timeout_s) for r, s in zip(rows, responses)]
    return get_pool(num_workers).run(list(rows), list(responses), timeout_s)

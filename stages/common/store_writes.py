"""Store writes that cannot hang a stage: each one (a file of an artifact or a checkpoint) runs
with a deadline and is retried with backoff (`WritePolicy`: `storage.write_timeout_s`,
`storage.write_attempts`). A network file system or object store that stops answering fails the
write with its cause and URL instead of holding the stage for hours."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from stages.common.artifact_inputs import StorageError


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn() in a thread of its own; TimeoutError when it has not returned after `seconds` (a
    store call blocked on a dead connection cannot be interrupted: it is left behind)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="bounded store call")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@dataclass(frozen=True)
class WritePolicy:
    """How long one store write may take and how often it is tried (1 s, 2 s, 4 s ... between
    tries)."""

    timeout_s: float = 1800.0
    attempts: int = 3
    backoff_s: float = 1.0

    def run(self, operation: str, url: str, fn: Callable[[], Any]) -> Any:
        last: BaseException | None = None
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return within(self.timeout_s, fn)
            except (FileNotFoundError, PermissionError, IsADirectoryError):
                raise  # not a passing outage: another try would fail the same way
            except Exception as e:  # noqa: BLE001 - every backend has its own errors
                last = e
        what = str(last) if isinstance(last, TimeoutError) else f"{type(last).__name__}: {last}"
        # the message carries the cause: a chained traceback would be reported first (pipeline.job_output)
        raise StorageError(f"cannot {operation} {url}: {what} (tried {self.attempts} times)") from None

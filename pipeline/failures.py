"""How a failed stage is described: built once where it fails (pipeline.execute), then the
same text on the console, in its `_FAILED` note (`ring-pipeline status`), in the Prefect UI
and in the run's closing list.

What failed comes first: the user error's message, or for a crash the exception and the
few log lines before it; then where to look: the stage log and the stage's MLflow run.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.interrupt import StageInterrupted
from stages.common import secrets
from stages.common.artifact_inputs import ArtifactError
from stages.common.contract import StageFailed

# what happened, by exception type (most specific first); anything else is a bug of ours
_CATEGORIES: tuple[tuple[type[BaseException], str], ...] = (
    (StageInterrupted, "interrupted"),
    (KeyboardInterrupt, "interrupted"),
    (ArtifactError, "store error"),
)
_NOT_RETRIED = {"user error", "interrupted", "busy"}
_BUG_LINES = 10


@dataclass
class StageFailure:
    stage: str
    category: str  # user error | crash | interrupted | store error | busy | bug
    reason: str  # may span lines (a user error listing bad rows)
    excerpt: list[str] = field(default_factory=list)  # log lines around a crash
    error_type: str = ""
    exit_code: int | None = None
    log: str | None = None
    run_id: str | None = None
    run_link: str | None = None  # the MLflow run: its UI URL, or how to open it
    attempt: str | None = None
    time: float = field(default_factory=time.time)

    @classmethod
    def of(cls, stage: str, error: BaseException, *, log: str | None = None, run_id: str | None = None,
           run_link: str | None = None, attempt: str | None = None) -> "StageFailure":
        excerpt: list[str] = []
        exit_code = None
        if isinstance(error, StageFailed):
            category = "user error" if error.user_error else "crash"
            reason, excerpt, exit_code = error.reason, error.excerpt, error.exit_code
            log = log or (str(error.log_path) if error.log_path else None)
        else:  # an exception type may say what it means (execute.StageRunning: "busy")
            category = getattr(error, "failure_category", None) or \
                next((c for t, c in _CATEGORIES if isinstance(error, t)), "bug")
            reason = str(error) or type(error).__name__
            if category == "bug":  # ours: the exception and where it was raised
                reason = f"{type(error).__name__}: {error}"
                excerpt = "".join(traceback.format_tb(error.__traceback__)).rstrip().splitlines()[-_BUG_LINES:]
        # shown on the console, in the store's `_FAILED` note, in Prefect and MLflow: never a credential
        return cls(stage, category, secrets.redact(reason.strip()), secrets.public(list(excerpt)),
                   type(error).__name__, exit_code, log, run_id, secrets.redact(run_link) if run_link else None,
                   attempt)

    @property
    def retryable(self) -> bool:
        """Worth another attempt: a crash, a store outage, a bug; not what the user must fix."""
        return self.category not in _NOT_RETRIED

    @property
    def interrupted(self) -> bool:
        return self.category == "interrupted"

    @property
    def verdict(self) -> str:
        """What the console calls it: a stop is not a failure."""
        return "STOPPED" if self.interrupted else "FAILED"

    def summary(self) -> str:
        """One line: `user error: data.jsonl:3: not JSON`."""
        first = next((ln.strip() for ln in self.reason.splitlines() if ln.strip()), "?")
        more = len([ln for ln in self.reason.splitlines() if ln.strip()]) - 1
        return f"{self.category}: {first}" + (f" (+{more} lines)" if more > 0 else "")

    def report(self) -> str:
        """The whole story, a few lines: what failed, then where to look."""
        exit_note = f" (exit code {self.exit_code})" if self.exit_code is not None and self.category == "user error" else ""
        lines = [f"{self.category}{exit_note}: {self.reason}"]
        lines += [f"  | {ln}" for ln in self.excerpt]
        if self.log:
            lines.append(f"log: {self.log}")
        if self.run_link or self.run_id:
            lines.append(f"MLflow run: {self.run_link or self.run_id}")
        return "\n".join(lines)

    # -- the `_FAILED` note ------------------------------------------------------------------
    def as_note(self) -> dict[str, Any]:
        note = asdict(self)
        # the keys the note always had: `error` (the reason), `type`, `interrupted`
        note.update(error=self.reason[-4000:], type=self.error_type, interrupted=self.interrupted)
        return note

    @classmethod
    def from_note(cls, stage: str, note: dict[str, Any]) -> "StageFailure":
        fields = cls.__dataclass_fields__
        known = {k: v for k, v in note.items() if k in fields}
        known.setdefault("reason", str(note.get("error", "")))
        known.setdefault("error_type", str(note.get("type", "")))
        known.setdefault("category", "interrupted" if note.get("interrupted") else "crash")
        return cls(**{**known, "stage": stage})

"""Data types shared by every verifier: the task row and the reward."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Reward(BaseModel):
    """Outcome of one verification. JSON-serialisable via ``.model_dump()``."""

    score: float = Field(0.0, ge=0.0, le=1.0)
    extracted: str | None = None
    reason: str = ""
    elapsed_s: float = 0.0
    details: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def zero(cls, reason: str, extracted: str | None = None, **details: Any) -> "Reward":
        return cls(score=0.0, extracted=extracted, reason=reason, details=details)

    @classmethod
    def one(cls, reason: str = "correct", extracted: str | None = None, **details: Any) -> "Reward":
        return cls(score=1.0, extracted=extracted, reason=reason, details=details)


class TaskRow(BaseModel):
    """A task: ``domain`` picks the verifier, ``reference`` is domain specific.

    Unknown keys are kept (``extra="allow"``) so rows from other stages pass through.
    """

    model_config = ConfigDict(extra="allow")

    domain: str
    prompt: str = ""
    reference: dict[str, Any] | str | list[Any] | int | float | None = None
    id: str | int | None = None
    extraction: dict[str, Any] | None = None

    @classmethod
    def coerce(cls, row: "TaskRow | dict[str, Any]") -> "TaskRow":
        return row if isinstance(row, TaskRow) else cls.model_validate(row)

"""Data types shared by every verifier: the task row and the reward."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Which path produced a reward (``Reward.source``). Stable names: RL monitors group by them.
SOURCES = {
    "boxed": "the last \\boxed{} of the final answer",
    "answer_tag": "the last <answer> </answer> of the final answer (reasoning_gym, logic games)",
    "answer_is": 'a marker: "the answer is", "final answer:", "answer:" (its line, or the block below it)',
    "bare": "the final answer is one short line of mathematics",
    "hashes": 'GSM8K\'s answer line "#### N" (opt-in math strategy)',
    "last_number": "FALLBACK: the last number anywhere in the final answer",
    "full": "FALLBACK: the whole final answer (opt-in math strategy)",
    "fenced_code": "the last fenced code block",
    "unfenced_code": "FALLBACK: the whole final answer taken as the program (no code fence)",
    "whole_text": "logic games, reasoning_gym: the final answer taken whole (no tag, box or marker)",
    "response": "instruction following: the whole response",
    "no_answer": "nothing could be extracted (unclosed <think>, no marker, stuffing)",
    "invalid_row": "the task row is malformed",
    "unknown_domain": "no verifier is registered for the row's domain",
    "verifier_error": "the verifier raised",
    "timeout": "the verification ran out of time",
    "crashed": "the verifier process died",
}
FALLBACK_SOURCES = frozenset(k for k, v in SOURCES.items() if v.startswith("FALLBACK"))


class Reward(BaseModel):
    """Outcome of one verification. JSON-serialisable via ``.model_dump()``."""

    score: float = Field(0.0, ge=0.0, le=1.0)
    extracted: str | None = None
    reason: str = ""
    source: str = ""  # a SOURCES key (plugins may add their own names)
    elapsed_s: float = 0.0
    details: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def zero(cls, reason: str, extracted: str | None = None, source: str = "", **details: Any) -> "Reward":
        return cls(score=0.0, extracted=extracted, reason=reason, source=source, details=details)

    @classmethod
    def one(cls, reason: str = "correct", extracted: str | None = None, source: str = "", **details: Any) -> "Reward":
        return cls(score=1.0, extracted=extracted, reason=reason, source=source, details=details)


class TaskRow(BaseModel):
    """A task: ``domain`` picks the verifier, ``reference`` is domain specific, ``grading``
    (``reference`` when unset; a dict reference may name it instead) is ``grading.py``'s.

    Unknown keys are kept (``extra="allow"``) so rows from other stages pass through.
    """

    model_config = ConfigDict(extra="allow")

    domain: str
    prompt: str = ""
    reference: dict[str, Any] | str | list[Any] | int | float | None = None
    id: str | int | None = None
    extraction: dict[str, Any] | None = None
    grading: Literal["reference", "strict"] | None = None

    @model_validator(mode="after")
    def _one_grading(self) -> "TaskRow":
        named = self.reference.get("grading") if isinstance(self.reference, dict) else None
        if self.grading is not None and named is not None and named != self.grading:
            raise ValueError(f"grading {self.grading!r} and reference.grading {named!r} disagree")
        if self.grading is not None and named is None and isinstance(self.reference, dict):
            self.reference = {**self.reference, "grading": self.grading}  # IFEval's verifier reads its reference's
        return self

    @classmethod
    def coerce(cls, row: "TaskRow | dict[str, Any]") -> "TaskRow":
        return row if isinstance(row, TaskRow) else cls.model_validate(row)

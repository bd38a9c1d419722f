"""reasoning-gym tasks (module not named reasoning_gym: it would shadow the package when its
directory is on sys.path) scored by each family's own ``score_answer``.

Reference (written by the ``reasoning_gym`` generator of ``synthetic_data``):
``{"family": name, "answer": the entry's answer (a string, or None for families that
check validity instead), "metadata": the entry's metadata, "config": the family's config
(what it was generated with; some scorers read it, e.g. ARC's board format),
"partial_credit": bool}``. The scorer is the family's dataset built with that config
(cached), called as ``score_answer(answer=extracted, entry={"question", "answer",
"metadata"})``. With ``partial_credit`` false (the default) a response scores 1 only when
the family gives it full marks and 0 otherwise (the family's own score stays in
``details["family_score"]``): several families give partial credit (knights_knaves 0.3+,
ARC 0.05 for any readable grid, the default scorer len(gold)/len(answer) when the gold is a
substring), which would make "accuracy" more than the share of solved tasks.

The answer format the rows ask for is ``ANSWER_FORMAT``: reasoning in ``<think> </think>``,
then the final answer inside ``<answer> </answer>`` (multi-line answers such as grids fit
in a tag better than in ``\\boxed{}``). ``extract`` reads, from the text after the last
``</think>`` (``verifiers.api.verify`` does that split): the last closed ``<answer>`` tag
("answer_tag"), else the last ``\\boxed{}`` ("boxed"), else the last "Answer:" / "final
answer is" marker ("answer_is": the rest of its line, or the block below it, as
``extract.block_after`` reads a grid or table), else the whole final text when it is short
("whole_text").
Every scan is linear in the text: hostile responses (megabytes, thousands of nested
braces) get an answer or a reason, never a timeout. Answers that a family's scorer would
execute (eval / sympy.parse_expr) are screened first (`rgym_safety.py`).
"""
from __future__ import annotations

import importlib
import json
import math
import signal
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from .extract import NoAnswer, last_answer_is_block
from .registry import WORKER_PRELOAD, register_verifier
from .rgym_safety import unsafe_answer
from .schema import Reward, TaskRow

DOMAIN = "reasoning_gym"
ANSWER_FORMAT = ("Think step by step inside <think> </think>. Then write only your final answer "
                 "inside <answer> </answer>, exactly like this:\n"
                 "<think>\nyour reasoning\n</think>\n<answer>your final answer</answer>")
MAX_ANSWER_CHARS = 20_000     # an extracted answer longer than this is not scored (no family needs it)
MAX_WHOLE_TEXT_CHARS = 2_000  # an unmarked final text is taken whole only up to this length
ROUNDING = 1e-9  # a family score this far outside [0, 1] is float rounding, clamped
# families whose metadata is not plain JSON: their scorer compares against tuples that
# JSON turns into lists (ARC grids: `parse_board(answer) == metadata["output"]`)
TUPLE_GRID_FIELDS = {"arc_agi": ("output",), "rearc": ("output",)}
# meta-families that mix other families (the generator's own weights do that)
EXCLUDED_FAMILIES = {"composite"}

WORKER_PRELOAD.append("reasoning_gym")  # the pool's workers start with it imported

_OPEN, _CLOSE = "<answer>", "</answer>"
_BOX = "\\boxed{"


def last_answer_tag(text: str) -> str | None:
    """Content of the last closed <answer>...</answer> (case-insensitive), else None."""
    low = text.lower()
    end = low.rfind(_CLOSE)
    if end == -1:
        return None
    start = low.rfind(_OPEN, 0, end)
    return None if start == -1 else text[start + len(_OPEN): end]


def last_boxed(text: str) -> str | None:
    """Content of the last closed outermost \\boxed{...}, in one pass over the text: a stack
    of the open boxes' brace depths, so unclosed or deeply nested boxes cost O(len)."""
    last: tuple[int, int] | None = None  # (content start, end) of the box that closed last
    open_boxes: list[tuple[int, int]] = []  # (content start, brace depth just inside it)
    depth, i, n = 0, 0, len(text)
    while i < n:
        if text.startswith(_BOX, i):
            depth += 1
            open_boxes.append((i + len(_BOX), depth))
            i += len(_BOX)
            continue
        c = text[i]
        if c == "\\" and i + 1 < n and text[i + 1] in "{}":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            if open_boxes and open_boxes[-1][1] == depth:
                # the box closing last is the last one, or the one enclosing it
                last = (open_boxes.pop()[0], i)
            depth = max(depth - 1, 0)
        i += 1
    return None if last is None else text[last[0]: last[1]]


def extract(text: str) -> tuple[str, str]:
    """(answer, source) from the final text; NoAnswer with the reason when there is none."""
    for source, find in (("answer_tag", last_answer_tag), ("boxed", last_boxed)):
        found = find(text)
        if found is not None:
            if not found.strip():
                raise NoAnswer(f"the {source.replace('_', ' ')} is empty")
            return found.strip(), source
    block = last_answer_is_block(text[-MAX_ANSWER_CHARS:])
    if block and block.strip("*").strip():  # "**Answer:** 5" leaves the bold's closing stars
        return block.strip("*").strip(), "answer_is"
    whole = text.strip()
    if not whole:
        raise NoAnswer("empty final answer")
    if len(whole) > MAX_WHOLE_TEXT_CHARS:
        raise NoAnswer(f"no <answer> tag, box or 'Answer:' line, and the final text is {len(whole)} chars "
                       f"(taken whole only up to {MAX_WHOLE_TEXT_CHARS})")
    return whole, "whole_text"


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def restore_metadata(family: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """The metadata as the family's scorer expects it after a JSON round trip."""
    fields = TUPLE_GRID_FIELDS.get(family, ())
    return {k: (_tuples(v) if k in fields else v) for k, v in metadata.items()} if fields else metadata


def _import_reasoning_gym():
    """reasoning_gym, imported on first use (it loads every family: 1.5-3 s) with the
    verifier's SIGALRM timer held off meanwhile: a timeout that fired inside the import would
    leave the package half-imported for every later row. A timer that expires during the
    import fires right after it (that row times out; the next ones find the package whole)."""
    hold = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM}) if hold else None
    try:
        return importlib.import_module("reasoning_gym")
    finally:
        if hold:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


@lru_cache(maxsize=64)
def _scorer(family: str, config_json: str) -> Callable[..., float]:
    reasoning_gym = _import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if family not in DATASETS or family in EXCLUDED_FAMILIES:
        raise KeyError(f"unknown reasoning-gym family {family!r}")
    return reasoning_gym.create_dataset(family, **{**json.loads(config_json), "size": 1, "seed": 0}).score_answer


def family_score(reference: dict[str, Any], answer: str) -> float:
    """The family's own score of `answer` for the task in `reference` (raises on a bad reference)."""
    family = reference["family"]
    score = _scorer(family, json.dumps(reference.get("config") or {}, sort_keys=True))
    entry = {"question": reference.get("question", ""), "answer": reference.get("answer"),
             "metadata": restore_metadata(family, reference.get("metadata") or {})}
    return float(score(answer=answer, entry=entry))


def _check_reference(ref: Any) -> str | None:
    if not isinstance(ref, dict):
        return f"reference must be an object with family/answer/metadata, got {type(ref).__name__}"
    if not isinstance(ref.get("family"), str):
        return "reference.family must name a reasoning-gym family"
    if not isinstance(ref.get("metadata", {}), dict) or not isinstance(ref.get("config", {}) or {}, dict):
        return "reference.metadata and reference.config must be objects"
    return None


_WRAPPERS = ("**", "__", "`", "$")


def readings(answer: str) -> list[str]:
    """The answer, then (when different) the answer without what a sentence puts around it:
    markdown emphasis, `$...$`, a final period ("So, the answer is 8." -> "8"). Both are
    scored and the better counts: a family whose gold itself ends in "." still matches."""
    bare = answer.strip()
    for _ in range(3):
        for w in _WRAPPERS:
            if len(bare) > 2 * len(w) and bare.startswith(w) and bare.endswith(w):
                bare = bare[len(w): -len(w)].strip()
        bare = bare.removesuffix(".").strip() if not bare.endswith("..") else bare
    return [answer] if bare == answer or not bare else [answer, bare]


def score_readings(ref: dict[str, Any], family: str, answer: str) -> tuple[float, str, str | None]:
    """(the family's best score over the answer's readings, that reading, why none could be
    scored or None)."""
    best, best_reading, refused = -1.0, answer, None
    for reading in readings(answer):
        refused = unsafe_answer(family, reading)
        if refused:
            return 0.0, reading, refused
        raw = family_score(ref, reading)
        if math.isnan(raw) or not -ROUNDING <= raw <= 1.0 + ROUNDING:  # a scorer bug, not a reward
            raise ValueError(f"{family}.score_answer returned {raw!r}")
        raw = min(max(raw, 0.0), 1.0)  # spell_backward sums 1/n per letter: 1.0000000000000002
        if raw > best:
            best, best_reading = raw, reading
    return best, best_reading, None


@register_verifier(DOMAIN)
def verify_reasoning_gym(row: TaskRow, text: str) -> Reward:
    problem = _check_reference(row.reference)
    if problem:
        return Reward.zero(problem, source="invalid_row")
    ref: dict[str, Any] = row.reference  # type: ignore[assignment]
    answer, source = extract(text)
    if len(answer) > MAX_ANSWER_CHARS:
        return Reward.zero(f"answer of {len(answer)} chars (limit {MAX_ANSWER_CHARS})", source=source)
    family = ref["family"]
    try:
        raw, answer, refused = score_readings(ref, family, answer)
    except KeyError as e:
        return Reward.zero(str(e.args[0]), source="invalid_row")
    except ValueError as e:
        return Reward.zero(str(e), extracted=answer[:200], source="verifier_error")
    if refused:
        return Reward.zero(refused, extracted=answer[:200], source=source)
    details = {"family": family, "family_score": raw}
    if raw >= 1.0:
        return Reward.one(f"{family}: full marks", extracted=answer, source=source, **details)
    if ref.get("partial_credit") and raw > 0.0:
        return Reward(score=raw, extracted=answer, source=source, details=details,
                      reason=f"{family}: partial credit {raw:.3g}")
    return Reward.zero(f"{family}: score_answer gave {raw:.3g}" + ("" if raw == 0 else " (partial credit off)"),
                       extracted=answer, source=source, **details)

"""Benchmark files as they are (GSM8K, MATH-500, Minerva, AMC, AIME...) as eval rows.

A `BenchmarkSet` (config.py) names the question and answer fields of the file, how the gold
answer is read from the answer field (`answer_extractor`), the verifier domain, and the
prompt template the question is put in. Each file row becomes an RL-format row (`domain`,
`prompt`, `reference: {"answer": gold}`, `id`, `messages`), scored by the domain's verifier
like every other eval row. A row whose field is missing or whose gold answer cannot be read
is a DataError naming the file, the line and the field: a benchmark silently shrunk by bad
rows would report a wrong accuracy.

Answer extractors (the registry `ANSWER_EXTRACTORS`, name -> fn(text) -> gold or None):
- `field`: the field's value as it is (a number or a string: aime/amc/math500's `answer`);
- `gsm8k`: the N after the last "#### " of a worked GSM8K solution, thousands separators
  removed ("#### 1,000" -> "1000");
- `boxed`: the last \\boxed{...} of a worked solution (Minerva's and MATH's `solution`).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.common.rows import DataError, input_rows
from verifiers.extract import find_boxed

# how a GSM8K response's answer is read: GSM8K's own "#### N" line first, then the usual
# markers and fallbacks (the verifiers' extraction options, set per row)
GSM8K_EXTRACTION = {"strategies": ["hashes", "boxed", "answer_is", "bare", "last_number"]}

_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def gsm8k_gold(text: Any) -> str | None:
    """The final answer of a GSM8K worked solution ("... #### 18" -> "18")."""
    if not isinstance(text, str) or "####" not in text:
        return None
    m = _GSM8K_ANSWER.search(text[text.rfind("####"):])
    gold = m.group(1).replace(",", "").strip() if m else ""
    return gold or None


def boxed_gold(text: Any) -> str | None:
    boxed = find_boxed(text) if isinstance(text, str) else []
    return boxed[-1] if boxed and boxed[-1] else None


def field_gold(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return value
    return value if isinstance(value, str) and value.strip() else None


ANSWER_EXTRACTORS: dict[str, Callable[[Any], Any]] = {"field": field_gold, "gsm8k": gsm8k_gold, "boxed": boxed_gold}


def benchmark_rows(fetch: Callable[[str], Path], name: str, spec) -> list[dict[str, Any]]:
    """The rows of benchmark set `name` (a config.BenchmarkSet) in the RL format, in file order."""
    extract = ANSWER_EXTRACTORS[spec.answer_extractor]
    what = f"eval set {name!r}"
    if spec.hub is not None and (problem := spec.unavailable(name)):
        raise DataError(problem)  # neither in the hub cache nor under RING_BENCHMARKS_DIR
    rows: list[dict[str, Any]] = []
    for path in spec.inputs(name):
        for row in input_rows(fetch, path, what):
            data = row.data
            if not isinstance(data, dict):
                raise DataError(f"{what} {row.where}: a row must be a JSON object, got {type(data).__name__}")
            question = data.get(spec.question_field)
            if not isinstance(question, str) or not question.strip():
                raise DataError(f"{what} {row.where}: field {spec.question_field!r} (question_field) must be a "
                                f"non-empty string; the row's fields: {sorted(data)}")
            if spec.answer_field not in data:
                raise DataError(f"{what} {row.where}: field {spec.answer_field!r} (answer_field) is missing; "
                                f"the row's fields: {sorted(data)}")
            gold = extract(data[spec.answer_field])
            if gold is None:
                raise DataError(f"{what} {row.where}: no gold answer in field {spec.answer_field!r} with "
                                f"answer_extractor {spec.answer_extractor!r} (value: {str(data[spec.answer_field])[-80:]!r})")
            rid = data.get(spec.id_field) if spec.id_field else None
            prompt = spec.prompt_template.replace("{question}", question)
            rows.append({"id": row.where if rid is None else rid, "domain": spec.domain, "prompt": prompt,
                         "reference": {"answer": gold}, "messages": [{"role": "user", "content": prompt}],
                         **({"extraction": spec.extraction} if spec.extraction is not None else {})})
            if spec.limit is not None and len(rows) == spec.limit:
                return rows
    if not rows:
        raise DataError(f"{what} {spec.hub or spec.paths} holds no rows")
    return rows

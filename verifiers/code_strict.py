"""Strict grading of code answers (``grading.py``).

The outputs themselves are compared strictly under both gradings (``code_exec.py``: every
line and token, integers exactly, a return value with its type), so a program that prints
or returns several candidates fails its test. What a reference verdict still rewards is a
response that offers several programs for the task: only the last fenced one is run.
Strict grading gives 0 to a rewarded response with more than one different candidate
program: a Python (or unlabelled) fenced block that defines a function the tests call, or,
for stdin tests, reads the input. A helper snippet or an example call is not a candidate.
"""
from __future__ import annotations

import re
from typing import Any

from .code_exec import FENCE_RE, PYTHON_FENCES
from .grading import Hedge, register_hedge_check
from .schema import Reward, TaskRow

_READS_INPUT_RE = re.compile(r"\binput\s*\(|\bsys\s*\.\s*stdin\b|\bopen\s*\(\s*0\b|\bfileinput\b")


def _is_candidate(program: str, ref: dict[str, Any]) -> bool:
    tests = ref.get("tests") if isinstance(ref.get("tests"), list) else []
    names = {str(t.get("fn") or ref.get("fn_name")) for t in tests if isinstance(t, dict)
             and ("fn" in t or ("args" in t and ref.get("fn_name")))}
    if any(re.search(rf"^[ \t]*def[ \t]+{re.escape(n)}[ \t]*\(", program, re.MULTILINE) for n in names if n != "None"):
        return True
    reads_stdin = any(isinstance(t, dict) and "fn" not in t and "args" not in t for t in tests)
    return reads_stdin and bool(_READS_INPUT_RE.search(program))


@register_hedge_check("code")
def code_hedge(row: TaskRow, text: str, reward: Reward) -> Hedge | None:
    """Why a rewarded code response is a hedge (module doc), or None."""
    ref = row.reference if isinstance(row.reference, dict) else {}
    programs = {"\n".join(ln.rstrip() for ln in body.strip().splitlines())
                for lang, body in FENCE_RE.findall(text) if lang.lower() in PYTHON_FENCES}
    candidates = [p for p in programs if _is_candidate(p, ref)]
    if len(candidates) > 1:
        return Hedge("several_answers", f"{len(candidates)} different programs for the task (only the last is run)")
    return None

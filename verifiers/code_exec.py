"""Code: run the candidate program against test cases inside the sandbox (``sandbox.py``).

Reference (``row.reference``)::

    {"tests": [{"input": "1 2\\n", "output": "3\\n"}, ...]}                  # stdin/stdout
    {"tests": [{"fn": "add", "args": [1, 2], "kwargs": {}, "expected": 3}]}  # function calls
    optional: "fn_name" (default function for call tests), "scoring": "fraction" (default)
    or "all_or_nothing", "timeout_s" (wall seconds per test, default 4), "cpu_s" (2),
    "memory_mb" (512: the whole program's memory, its children and threads included; a program
    the kernel had to stop at that limit fails the test), "float_tol" (1e-6, for numeric outputs)

The program is the last fenced code block of the final answer (```python ... ```), or the
whole final answer when it has no fence (source "unfenced_code", a fallback). Integer
outputs compare exactly; ``float_tol`` applies only where the expected value is a
non-integer number. The reason names the first failing test and where its output differs.
Expected outputs never enter the sandbox: a
program cannot print them by reading test files. Each stdin test is a separate run; all
call tests of a row share one run of a small harness that imports the candidate as a
module, calls it with the arguments and writes the return values to a file.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from .registry import register_verifier
from .sandbox import SandboxConfig, run_python, sandbox_info
from .schema import Reward, TaskRow
from .timeouts import remaining_s

FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_FENCES = ("python", "py", "python3", "")

HARNESS = r'''
import json, sys, io, contextlib
calls = json.load(open("calls.json"))
out = open("results.jsonl", "w")
sink = io.StringIO()
try:
    with contextlib.redirect_stdout(sink):
        import solution
except BaseException as e:
    out.write(json.dumps({"import_error": "%s: %s" % (type(e).__name__, e)}) + "\n")
    out.flush()
    raise SystemExit(0)
def _plain(x):
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (set, frozenset)):
        return sorted((_plain(v) for v in x), key=repr)
    return x
for i, c in enumerate(calls):
    try:
        fn = getattr(solution, c["fn"])
        with contextlib.redirect_stdout(sink):
            r = fn(*c.get("args", []), **c.get("kwargs", {}))
        line = json.dumps({"i": i, "ok": True, "value": _plain(r)})
    except BaseException as e:
        line = json.dumps({"i": i, "ok": False, "error": "%s: %s" % (type(e).__name__, str(e)[:200])})
    out.write(line + "\n")
    out.flush()
'''


def extract_code(text: str) -> tuple[str | None, str]:
    """(program, source): the last fenced block ("fenced_code"; a python one preferred),
    else the whole final answer ("unfenced_code", a fallback)."""
    blocks = FENCE_RE.findall(text)
    if blocks:
        py = [b for lang, b in blocks if lang.lower() in PYTHON_FENCES]
        return (py or [b for _, b in blocks])[-1], "fenced_code"
    return (text, "unfenced_code") if text.strip() else (None, "no_answer")


def _norm_lines(s: str) -> list[str]:
    lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


_INT_RE = re.compile(r"[-+]?\d+")


def _token_differs(expected: str, got: str, float_tol: float) -> bool:
    """Integer tokens compare exactly (as written); only a non-integer expected number gets
    the float tolerance; anything else compares as text."""
    if expected == got:
        return False
    if _INT_RE.fullmatch(expected):
        return True
    try:
        fe, fg = float(expected), float(got)
    except ValueError:
        return True
    return not math.isclose(fe, fg, rel_tol=float_tol, abs_tol=float_tol)


def output_difference(expected: str, got: str, float_tol: float = 1e-6) -> str | None:
    """None when ``got`` matches ``expected`` (line by line, whitespace-separated tokens),
    else where and how it first differs."""
    e, g = _norm_lines(expected), _norm_lines(got)
    if e == g:
        return None
    if len(e) != len(g):
        return f"{len(g)} output lines, expected {len(e)}"
    for n, (le, lg) in enumerate(zip(e, g), 1):
        te, tg = le.split(), lg.split()
        if len(te) != len(tg):
            return f"line {n}: {len(tg)} tokens, expected {len(te)}"
        for k, (a, b) in enumerate(zip(te, tg), 1):
            if _token_differs(a, b, float_tol):
                return f"line {n}, token {k}: expected {a[:40]!r}, got {b[:40]!r}"
    return None


def values_match(expected: Any, got: Any, float_tol: float = 1e-6) -> bool:
    """Integers (and bools) exactly, with their type; floats within the tolerance."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(expected) is type(got) and expected == got
    if isinstance(expected, int):
        return isinstance(got, int) and expected == got
    if isinstance(expected, float) and isinstance(got, (int, float)):
        return math.isclose(expected, got, rel_tol=float_tol, abs_tol=float_tol)
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(expected) == len(got) and all(values_match(a, b, float_tol) for a, b in zip(expected, got))
    if isinstance(expected, dict) and isinstance(got, dict):
        return expected.keys() == got.keys() and all(values_match(expected[k], got[k], float_tol) for k in expected)
    return expected == got


def _memory_note(r, cfg: SandboxConfig) -> str:
    return f"memory limit exceeded ({cfg.memory_mb} MiB for the whole program, {r.memory_mode} mode)"


def run_tests(program: str, ref: dict[str, Any]) -> dict[str, Any]:
    tests = ref.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError("code reference needs a non-empty 'tests' list")
    per_test = float(ref.get("timeout_s", 4.0))
    float_tol = float(ref.get("float_tol", 1e-6))
    base = SandboxConfig(cpu_s=int(ref.get("cpu_s", 2)), wall_s=per_test, memory_mb=int(ref.get("memory_mb", 512)))
    passed: list[bool] = [False] * len(tests)
    notes: list[str] = [""] * len(tests)
    call_idx = [i for i, t in enumerate(tests) if "fn" in t or ("args" in t and ref.get("fn_name"))]
    io_idx = [i for i in range(len(tests)) if i not in set(call_idx)]
    startup = []
    for i in io_idx:
        t = tests[i]
        budget = remaining_s(default=per_test * len(tests) + 5) - 0.5
        if budget <= 0.2:
            notes[i] = "not run: verification budget spent"
            continue
        cfg = SandboxConfig(**{**base.__dict__, "wall_s": min(per_test, budget)})
        r = run_python({"main.py": program}, "main.py", stdin=str(t.get("input", "")), config=cfg)
        startup.append(r.elapsed_s)
        if r.timed_out:
            notes[i] = "timeout"
        elif r.output_capped:
            notes[i] = "output limit exceeded"
        elif r.memory_exceeded:  # part of the program was killed at its limit: no output counts
            notes[i] = _memory_note(r, cfg)
        elif r.returncode != 0:
            notes[i] = f"exit code {r.returncode}: " + r.stderr.decode(errors="replace")[-300:]
        else:
            diff = output_difference(str(t.get("output", "")), r.stdout.decode(errors="replace"), float_tol)
            passed[i] = diff is None
            notes[i] = "ok" if passed[i] else f"wrong output: {diff}"
    if call_idx:
        calls = [{"fn": tests[i].get("fn", ref.get("fn_name")), "args": tests[i].get("args", []),
                  "kwargs": tests[i].get("kwargs", {})} for i in call_idx]
        budget = remaining_s(default=per_test * len(tests) + 5) - 0.5
        cfg = SandboxConfig(**{**base.__dict__, "wall_s": max(0.2, min(per_test * len(calls), budget))})
        r = run_python({"solution.py": program, "main.py": HARNESS, "calls.json": json.dumps(calls)}, "main.py",
                       config=cfg, collect=("results.jsonl",))
        results: dict[int, dict] = {}
        if r.memory_exceeded:
            for i in call_idx:
                notes[i] = _memory_note(r, cfg)
        for line in ([] if r.memory_exceeded else r.files.get("results.jsonl", b"").decode(errors="replace").splitlines()):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if "import_error" in obj:
                for i in call_idx:
                    notes[i] = "import failed: " + obj["import_error"]
                break
            if isinstance(obj.get("i"), int):
                results[obj["i"]] = obj
        for k, i in enumerate(call_idx):
            obj = results.get(k)
            if obj is None:
                notes[i] = notes[i] or ("timeout" if r.timed_out else f"no result (exit code {r.returncode})")
            elif not obj.get("ok"):
                notes[i] = "raised " + str(obj.get("error"))
            else:
                passed[i] = values_match(tests[i].get("expected"), obj.get("value"), float_tol)
                notes[i] = "ok" if passed[i] else f"wrong value: got {str(obj.get('value'))[:80]}"
    return {"passed": passed, "notes": notes, "sandbox_s": startup}


@register_verifier("code")
def verify_code(row: TaskRow, text: str) -> Reward:
    ref = row.reference if isinstance(row.reference, dict) else {}
    program, source = extract_code(text)
    if program is None:
        return Reward.zero("no program in the final answer", source=source)
    res = run_tests(program, ref)
    n_pass, n = sum(res["passed"]), len(res["passed"])
    scoring = ref.get("scoring", "fraction")
    score = n_pass / n if scoring == "fraction" else float(n_pass == n)
    reason = f"{n_pass}/{n} tests passed"
    first_fail = next((note for ok, note in zip(res["passed"], res["notes"]) if not ok), None)
    if first_fail:
        reason += f"; first failure: {first_fail[:200]}"
    return Reward(score=score, extracted=program[:2000], reason=reason, source=source,
                  details={"tests": [{"passed": p, "note": note[:300]} for p, note in zip(res["passed"], res["notes"])],
                           "scoring": scoring, "sandbox": {k: v for k, v in sandbox_info().items() if k != "memory_why"}})

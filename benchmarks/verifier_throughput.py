"""Verifier throughput: verifications per second per domain, the code sandbox's start-up
latency (p50/p99), and the math verifier's accuracy on generated near misses and
equivalent forms (``verifiers.math_cases``), per category.

    python benchmarks/verifier_throughput.py --n 200 --workers 2 --sandbox-runs 100 --math-cases 20

Each domain gets ``--n`` (row, response) pairs, half correct and half wrong, verified
through ``verify_batch`` on a warm pool (the pool is started and warmed before timing).
Code rows have 2 stdin tests each, so one code verification = 2 sandbox runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verifiers import verify_batch  # noqa: E402
from verifiers.logic import arc, countdown, knights_knaves, maze, sudoku  # noqa: E402
from verifiers.logic.maze import shortest_path  # noqa: E402
from verifiers.math_cases import generate_cases, score_cases  # noqa: E402
from verifiers.math_gen import generate_arithmetic  # noqa: E402
from verifiers.sandbox import SandboxConfig, isolation_mode, run_python  # noqa: E402

T = "<think>...</think> "


def workload(domain: str, n: int):
    rows, resp = [], []
    if domain == "math":
        for i, r in enumerate(generate_arithmetic(n, seed=0)):
            a = int(r["reference"]["answer"])
            rows.append(r)
            resp.append(T + (rf"The answer is $\boxed{{{a}}}$." if i % 2 == 0 else rf"\boxed{{\frac{{{2 * a + 1}}}{{2}}}}"))
    elif domain == "math_latex":
        for i in range(n):
            rows.append({"domain": "math", "reference": {"answer": r"\frac{\sqrt{3}}{2}"}})
            resp.append(T + (r"\boxed{\sqrt{3}/2}" if i % 2 == 0 else r"\boxed{\frac{\sqrt{2}}{2}}"))
    elif domain == "countdown":
        for i, r in enumerate(countdown.generate(n, seed=0)):
            rows.append(r)
            resp.append(T + (r["reference"]["example"] if i % 2 == 0 else "1+2"))
    elif domain == "sudoku":
        for r in sudoku.generate(n, seed=0, size=9):
            rows.append(r)
            resp.append(T + "\n".join(" ".join(str(v or 1) for v in row) for row in r["reference"]["puzzle"]))
    elif domain == "maze":
        for i, r in enumerate(maze.generate(n, seed=0, rows=8, cols=8)):
            rows.append(r)
            p = shortest_path(r["reference"]["grid"])
            resp.append(T + (p if i % 2 == 0 else p[:-1]))
    elif domain == "knights_knaves":
        for i, r in enumerate(knights_knaves.generate(n, seed=0, people=4, depth=2)):
            rows.append(r)
            sol = r["reference"]["solution"]
            resp.append(T + ", ".join(f"{k} is a {v if i % 2 == 0 else 'knight'}" for k, v in sol.items()))
    elif domain == "arc":
        for i, r in enumerate(arc.generate(n, seed=0, size=5)):
            rows.append(r)
            resp.append(T + str(r["reference"]["output"] if i % 2 == 0 else r["reference"]["test_input"]))
    elif domain == "ifeval":
        for i in range(n):
            rows.append({"domain": "ifeval", "reference": {"instructions": [
                {"type": "word_count", "relation": "at least", "n": 20}, {"type": "no_commas"},
                {"type": "keywords_include", "keywords": ["river"]}, {"type": "language", "lang": "en"}]}})
            resp.append(T + "The river runs to the sea and the boat is on the river " * (3 if i % 2 == 0 else 1))
    elif domain == "code":
        tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12\n"}]
        for i in range(n):
            rows.append({"domain": "code", "reference": {"tests": tests}})
            body = "a, b = map(int, input().split())\nprint(a + b)" if i % 2 == 0 else "print(0)"
            resp.append(T + f"```python\n{body}\n```")
    else:
        raise ValueError(domain)
    return rows, resp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--code-n", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sandbox-runs", type=int, default=100)
    ap.add_argument("--math-cases", type=int, default=20, help="draws per category of verifiers.math_cases")
    args = ap.parse_args()
    domains = ["math", "math_latex", "countdown", "sudoku", "maze", "knights_knaves", "arc", "ifeval", "code"]
    warm_rows, warm_resp = workload("math_latex", 4)
    verify_batch(warm_rows, warm_resp, num_workers=args.workers)  # start + warm the pool
    results = {}
    for d in domains:
        n = args.code_n if d == "code" else args.n
        rows, resp = workload(d, n)
        t0 = time.perf_counter()
        out = verify_batch(rows, resp, num_workers=args.workers, timeout_s=30)
        dt = time.perf_counter() - t0
        mean = sum(r.score for r in out) / len(out)
        results[d] = {"n": n, "seconds": round(dt, 3), "per_s": round(n / dt, 1), "mean_score": round(mean, 3)}
        print(f"{d:15s} n={n:4d}  {n / dt:8.1f} verifications/s  mean score {mean:.2f}", flush=True)
    lat = []
    for _ in range(args.sandbox_runs):
        t0 = time.perf_counter()
        r = run_python({"main.py": "pass"}, "main.py", config=SandboxConfig(wall_s=10))
        lat.append(time.perf_counter() - t0)
        assert r.returncode == 0, r.stderr
    lat.sort()
    p50, p99 = statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    print(f"sandbox start-up ({isolation_mode()} mode, {len(lat)} runs of an empty program): "
          f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms")
    results["sandbox_startup"] = {"mode": isolation_mode(), "runs": len(lat), "p50_ms": round(p50 * 1000, 1),
                                  "p99_ms": round(p99 * 1000, 1)}
    table = score_cases(generate_cases(n_per_category=args.math_cases, seed=0))
    print("math near misses / equivalent forms (generated, verifiers.math_cases):")
    print("| category | equivalent forms accepted | near misses rejected |\n|---|---|---|")
    for cat in sorted({k.split("/")[0] for k in table}, key=lambda c: (c == "all", c)):
        eq, nm = table[f"{cat}/equivalent"], table[f"{cat}/near_miss"]
        print(f"| {cat} | {eq['ok']}/{eq['n']} ({eq['rate']:.1%}) | {nm['ok']}/{nm['n']} ({nm['rate']:.1%}) |")
    results["math_cases"] = {k: {"n": v["n"], "rate": round(v["rate"], 4)} for k, v in table.items()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()

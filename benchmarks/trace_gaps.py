"""Where a profiled GPU waited: the idle gaps of a torch.profiler chrome trace.

    python benchmarks/trace_gaps.py OUT/profile_trace.json [--top 15] [--min-gap-us 200]

A stage's `profile` window (stages/common/step_profile.py) writes a chrome trace; its operator
table says what the kernels cost, not when the GPU had none to run. This reads the trace's GPU
kernels and memory copies, merges their intervals, and prints the window's wall span, the time
the GPU was busy (the union of the intervals), and the longest gaps between them, each with the
kernel before and after it and the host operations that began during it (the host's work the GPU
waited for: a device sync that came before the gap, Python between steps, a copy that waited).
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cpu_op", "cuda_runtime", "user_annotation", "python_function", "cuda_driver"}


def load_events(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def busy_intervals(gpu: list[dict]) -> list[tuple[float, float, str, str]]:
    """The GPU's busy intervals, merged: (start, end, first kernel, last kernel)."""
    merged: list[list] = []
    for e in sorted(gpu, key=lambda e: e["ts"]):
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1][1], merged[-1][3] = end, e["name"]
        else:
            merged.append([start, end, e["name"], e["name"]])
    return [tuple(m) for m in merged]


def summarize(path: Path, top: int, min_gap_us: float) -> str:
    events = load_events(path)
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    host = sorted((e for e in events if e.get("cat") in HOST_CATS), key=lambda e: e["ts"])
    if not gpu:
        return f"{path.name}: no GPU events in the trace"
    busy = busy_intervals(gpu)
    t0, t1 = busy[0][0], busy[-1][1]
    busy_us = sum(end - start for start, end, *_ in busy)
    gaps = [(busy[i + 1][0] - busy[i][1], busy[i][1], busy[i][3], busy[i + 1][2]) for i in range(len(busy) - 1)]
    lines = [f"{path.name}: GPU span {(t1 - t0) / 1e3:.1f} ms, busy {busy_us / 1e3:.1f} ms "
             f"({busy_us / (t1 - t0):.1%}), idle {(t1 - t0 - busy_us) / 1e3:.1f} ms in {len(gaps)} gaps",
             f"gaps >= {min_gap_us:.0f} us: {sum(g for g, *_ in gaps if g >= min_gap_us) / 1e3:.1f} ms in "
             f"{sum(1 for g, *_ in gaps if g >= min_gap_us)}; by size:"]
    for gap, start, before, after in sorted(gaps, reverse=True)[:top]:
        began = collections.Counter(e["name"] for e in host if start <= e["ts"] < start + gap)
        # the host call still running when the GPU ran dry (a sync, a blocking copy)
        waiting = [e["name"] for e in host if e["ts"] < start < e["ts"] + e["dur"] and e.get("cat") == "cuda_runtime"]
        lines.append(f"  {gap / 1e3:7.2f} ms at +{(start - t0) / 1e3:8.1f} ms | after {before[:60]} | before "
                     f"{after[:60]}")
        if waiting:
            lines.append(f"      host in: {', '.join(sorted(set(waiting)))[:200]}")
        if began:
            lines.append("      host began: " + ", ".join(f"{n[:50]} x{c}" for n, c in began.most_common(12)))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--min-gap-us", type=float, default=200.0)
    a = p.parse_args()
    for t in a.traces:
        print(summarize(t, a.top, a.min_gap_us))


if __name__ == "__main__":
    main()

"""benchmarks/trace_gaps.py: the GPU's busy time is the union of its kernels (overlaps counted
once), and the gaps between them are found, sized and told with the host work begun in them."""
from __future__ import annotations

import json

from benchmarks.trace_gaps import summarize


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_gaps_between_merged_kernels_with_the_host_work_in_them(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        _x("gemm", "kernel", 0, 1000), _x("norm", "kernel", 500, 1000),  # overlap: busy 0..1500
        _x("cudaStreamSynchronize", "cuda_runtime", 1200, 400),  # still waiting when the GPU ran dry
        _x("collate", "user_annotation", 1600, 100), _x("aten::item", "cpu_op", 1700, 50),
        _x("copy", "gpu_memcpy", 4500, 500),  # gap 1500..4500: 3 ms
        _x("loss", "kernel", 5200, 800),  # gap 5000..5200: 0.2 ms
        {"ph": "i", "name": "marker", "ts": 10},  # not a duration event: ignored
    ]}))
    out = summarize(trace, top=5, min_gap_us=250)
    lines = out.splitlines()
    assert lines[0] == "t.json: GPU span 6.0 ms, busy 2.8 ms (46.7%), idle 3.2 ms in 2 gaps"
    assert lines[1].startswith("gaps >= 250 us: 3.0 ms in 1;")
    assert "3.00 ms at +     1.5 ms | after norm | before copy" in lines[2]
    assert "host in: cudaStreamSynchronize" in lines[3]
    assert "collate x1" in lines[4] and "aten::item x1" in lines[4]
    assert "0.20 ms at +     5.0 ms | after copy | before loss" in lines[5]


def test_a_trace_without_gpu_work_says_so(tmp_path):
    trace = tmp_path / "cpu.json"
    trace.write_text(json.dumps([_x("aten::mm", "cpu_op", 0, 10)]))
    assert summarize(trace, top=5, min_gap_us=200) == "cpu.json: no GPU events in the trace"

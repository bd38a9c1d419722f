"""benchmarks/_record.py: the result file holds every measurement as soon as it is put, and a
resumed file adds to what an earlier run left instead of replacing it."""
from __future__ import annotations

import json

from benchmarks._record import ResultFile


def test_each_put_is_on_disk_at_once_under_its_nested_keys(tmp_path):
    results = ResultFile(tmp_path / "r.json", {"device": "cpu", "cases": {}})
    results.put("cases", "a", "plain", result={"tokens_per_s": 1.0})
    assert json.loads(results.path.read_text()) == {"device": "cpu", "cases": {"a": {"plain": {"tokens_per_s": 1.0}}}}
    results.put("cases", "a", "stage", result={"error": "OOM"})
    assert json.loads(results.path.read_text())["cases"]["a"] == {"plain": {"tokens_per_s": 1.0},
                                                                  "stage": {"error": "OOM"}}


def test_a_resumed_file_keeps_the_parts_an_earlier_run_wrote(tmp_path):
    path = tmp_path / "r.json"
    assert ResultFile.resume(path).data == {} and not path.exists()
    ResultFile.resume(path).put("decode", result={"rc": 0})
    ResultFile.resume(path).put("rl", result={"rc": 1})
    ResultFile.resume(path).put("decode", result={"rc": 2})
    assert json.loads(path.read_text()) == {"decode": {"rc": 2}, "rl": {"rc": 1}}

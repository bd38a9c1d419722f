import pytest

from data_curation._base import CurationError
from data_curation.cli import curate_standalone

from .conftest import bench_rows, chat, read_jsonl, write_jsonl

FILLER = "Step by step: we combine the given numbers carefully and check the result."


def corpus(bench_dir, tmp_path):
    g = bench_rows(bench_dir, "gsm8k")[42]["question"]
    a = bench_rows(bench_dir, "aime24")[3]["problem"]
    rows = [chat(i, f"Compute ${i} \\times {i + 3}$ and explain.", f"It is {i * (i + 3)}. {FILLER}")
            for i in range(30)]
    rows += [chat(30, f"From my worksheet: {g}", FILLER), chat(31, f"Competition: {a}", FILLER),
             rows[4]]
    return write_jsonl(tmp_path / "data.jsonl", rows)


def bench_yaml(tmp_path, bench_dir, names, fname):
    fields = {"gsm8k": "question", "aime24": "problem"}
    path = tmp_path / fname
    path.write_text("".join(f"- {{path: {bench_dir / n}.jsonl, fields: [{fields[n]}], name: {n}}}\n"
                            for n in names))
    return str(path)


def test_standalone_curate_with_config_and_only(tmp_path, bench_dir):
    data = corpus(bench_dir, tmp_path)
    cfg = tmp_path / "curate.yaml"
    cfg.write_text("steps:\n  - step: quality\n  - step: exact_dedup\n  - step: near_dedup\n"
                   "  - step: decontaminate\n    benchmarks: []\n  - step: domain_tag\n"
                   "num_proc: 1\nbatch_size: 16\n")
    out = str(tmp_path / "out")
    with pytest.raises(CurationError, match="benchmark list is empty"):
        curate_standalone([str(data)], out, str(cfg), progress=False)
    rep = curate_standalone([str(data)], out, str(cfg), benchmarks_path=bench_yaml(tmp_path, bench_dir, ["gsm8k"], "b1.yaml"),
                            progress=False)
    assert rep["counts"]["removed_by_step"]["decontaminate"] == 1
    rep2 = curate_standalone([str(data)], out, str(cfg), only=["decontaminate"],
                             benchmarks_path=bench_yaml(tmp_path, bench_dir, ["gsm8k", "aime24"], "b2.yaml"),
                             progress=False)
    assert [s["reused"] for s in rep2["steps"]] == [True] * 4 + [False, False]
    assert rep2["counts"]["removed_by_step"]["decontaminate"] == 2
    flagged = {r["detail"]["hits"][0]["benchmark"] for r in read_jsonl(tmp_path / "out" / "removed.jsonl")
               if r["step"] == "decontaminate"}
    assert flagged == {"gsm8k", "aime24"}
    (tmp_path / "bad.yaml").write_text("steps:\n  - step: dedupe\n")
    with pytest.raises(CurationError, match="bad.yaml"):
        curate_standalone([str(data)], out, str(tmp_path / "bad.yaml"), progress=False)
    # no config: the default steps (decontamination only with --benchmarks)
    rep3 = curate_standalone([str(data)], str(tmp_path / "out3"), progress=False)
    assert [s["step"] for s in rep3["steps"]] == ["read", "quality", "exact_dedup", "near_dedup",
                                                   "harmful", "domain_tag"]

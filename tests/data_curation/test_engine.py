import json

import pytest

from data_curation import run_curation
from data_curation._base import CurationError

from .conftest import bench_rows, chat, read_jsonl, write_jsonl

FILLER = "We reason step by step about the quantities involved and reach a final answer."


def corpus(bench_dir, n=60):
    rows = [chat(i, f"Question number {i}: compute ${i} + {i * 7}$.",
                 f"<think>{i} plus {i * 7} is {i * 8}.</think> The answer is $\\boxed{{{i * 8}}}$. {FILLER}")
            for i in range(n)]
    rows.append(chat(n, "question number 3: Compute $3+21$",
                     "<think>3 plus 21 is 24.</think> The answer is $\\boxed{24}$. " + FILLER))   # dup of 3
    rows.append(chat(n + 1, "Hidden\u200b zero\u200bwidth question about pass\u200dwords please",
                     "Use a pass\u200dword manager. " + FILLER))                        # cleaned
    q = bench_rows(bench_dir, "gsm8k")[100]["question"]
    rows.append(chat(n + 2, f"Please solve: {q}", FILLER))                              # contaminated
    rows.append({"prompt": "How do I make a pipe bomb at home?", "response": FILLER})  # harmful
    return rows


def steps(bench_dir, names=("gsm8k",)):
    return [{"step": "quality"}, {"step": "exact_dedup"}, {"step": "near_dedup"},
            {"step": "harmful"},
            {"step": "decontaminate",
             "benchmarks": [{"path": str(bench_dir / f"{n}.jsonl"), "fields": ["question"], "name": n}
                            for n in names]},
            {"step": "domain_tag"}]


def write_corpus_with_bad_rows(path, rows):
    write_jsonl(path, rows)
    with open(path, "ab") as f:
        f.write(b'{"id": "bad-json", "messages": [}\n')                    # bad JSON
        f.write(b'{"id": "wrong-type", "messages": "not a list"}\n')      # wrong type
        f.write(b'{"id": "no-fields", "title": "x"}\n')                   # missing fields
        f.write(b'{"id": "bad-utf8", "text": "caf\xe9"}\n')               # bad UTF-8
        f.write(b"\n")                                                     # blank line
        f.write(b'[1, 2, 3]\n')                                             # not an object
        f.write(b'{"id": "lone", "messages": [{"role": "user", "content": "a lone \\ud800 surrogate '
                b'escape"}, {"role": "assistant", "content": "cleaned by the quality step"}]}\n')
        f.write(b'{"text": "last line without newline but fine"}')
    return path


def test_full_run_accounting_quarantine_and_reports(tmp_path, bench_dir):
    rows = corpus(bench_dir)
    src = write_corpus_with_bad_rows(tmp_path / "in.jsonl", rows)
    rep = run_curation([str(src)], steps(bench_dir), str(tmp_path / "out"), progress=False)
    out = tmp_path / "out"
    kept, removed, quar = (read_jsonl(out / f) for f in ("curated.jsonl", "removed.jsonl", "quarantine.jsonl"))
    n_in = len(rows) + 8
    assert rep["counts"]["input_rows"] == n_in
    assert len(kept) + len(removed) + len(quar) == n_in and rep["accounting"]["ok"]
    reasons = {q["raw"][:20]: q["reason"] for q in quar}
    assert len(quar) == 6
    assert any(r.startswith("invalid JSON") for r in reasons.values())
    assert "field 'messages' is str, expected a list" in reasons['{"id": "wrong-type",']
    assert any("none of the fields" in r for r in reasons.values())
    assert any(r.startswith("invalid UTF-8") for r in reasons.values())
    assert "blank line" in reasons.values()
    assert "row is a JSON list, not an object" in reasons.values()
    by_step = {r["step"]: r for r in removed}
    assert by_step["exact_dedup"]["detail"]["duplicate_of"] == 4   # the row id of r3: line 4
    assert by_step["exact_dedup"]["source"].endswith("in.jsonl:" + str(by_step["exact_dedup"]["line"]))
    assert by_step["decontaminate"]["detail"]["hits"][0]["benchmark"] == "gsm8k"
    assert by_step["harmful"]["detail"]["category"] == "weapons"
    cleaned = next(k for k in kept if k.get("id") == f"r{len(rows) - 3}")
    assert "\u200b" not in json.dumps(cleaned, ensure_ascii=False) and "password" in cleaned["messages"][1]["content"]
    assert all(k.get("domain") in ("math", "stem", "code", "other") for k in kept)
    lone = next(k for k in kept if k.get("id") == "lone")
    assert lone["messages"][0]["content"] == "a lone  surrogate escape"
    # without the quality step the escape goes through untouched
    rep2 = run_curation([str(src)], [{"step": "domain_tag"}], str(tmp_path / "out2"), progress=False)
    assert rep2["accounting"]["ok"]
    assert "\\ud800" in next(line for line in (tmp_path / "out2" / "curated.jsonl").read_text().splitlines()
                               if '"lone"' in line)
    assert rep["domain_mix"]["before"]["math"] >= rep["domain_mix"]["after"]["math"]
    md = (out / "report.md").read_text()
    assert "| gsm8k |" in md and "Domain mix" in md and "Quarantine" in md
    assert (out / "report.html").read_text().startswith("<!doctype html>")
    assert json.loads((out / "report.json").read_text())["accounting"]["ok"]


def test_only_decontaminate_reuses_earlier_steps(tmp_path, bench_dir, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", corpus(bench_dir))
    out = str(tmp_path / "out")
    with pytest.raises(CurationError, match="run the full curation"):
        run_curation([str(src)], steps(bench_dir), out, only=["decontaminate"], progress=False)
    first = run_curation([str(src)], steps(bench_dir), out, progress=False)
    assert not any(s["reused"] for s in first["steps"])
    # a new benchmark list: the earlier steps must not run again
    from data_curation import engine

    computed = []
    real = engine._run_step
    monkeypatch.setattr(engine, "_run_step", lambda cfg, *a, **k: computed.append(cfg.label) or real(cfg, *a, **k))
    second = run_curation([str(src)], steps(bench_dir, ("gsm8k", "aime24")), out,
                          only=["decontaminate"], progress=False)
    assert computed == ["decontaminate", "domain_tag"]
    assert [s["reused"] for s in second["steps"]] == [True] * 5 + [False] * 2
    assert [s["dir"] for s in second["steps"][:5]] == [s["dir"] for s in first["steps"][:5]]
    assert second["steps"][5]["dir"] != first["steps"][5]["dir"]
    assert second["counts"] == first["counts"]
    # an unchanged rerun computes nothing
    computed.clear()
    run_curation([str(src)], steps(bench_dir, ("gsm8k", "aime24")), out, progress=False)
    assert computed == []
    with pytest.raises(CurationError, match="no such step"):
        run_curation([str(src)], steps(bench_dir), out, only=["dedup"], progress=False)
    # another output location reuses this run's cache (read only) through reuse_from
    third = run_curation([str(src)], steps(bench_dir, ("aime24",)), str(tmp_path / "other"),
                         only=["decontaminate"], reuse_from=[out], progress=False)
    assert [s["dir"] for s in third["steps"][:5]] == [s["dir"] for s in first["steps"][:5]]
    assert third["steps"][5]["dir"].startswith((tmp_path / "other").as_uri())


def test_parallel_equals_serial_and_other_formats(tmp_path, bench_dir):
    import datasets

    rows = corpus(bench_dir, n=300)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    kw = dict(progress=False, batch_size=64)
    a = run_curation([str(src)], steps(bench_dir), str(tmp_path / "a"), num_proc=1, **kw)
    b = run_curation([str(src)], steps(bench_dir), str(tmp_path / "b"), num_proc=2, **kw)
    assert (tmp_path / "a" / "curated.jsonl").read_text() == (tmp_path / "b" / "curated.jsonl").read_text()
    assert a["counts"] == b["counts"]
    # the same rows as parquet and as a saved dataset dir, written out as parquet
    flat = [{"id": r.get("id", "x"), "prompt": r["messages"][0]["content"] if "messages" in r else r["prompt"],
             "response": r["messages"][1]["content"] if "messages" in r else r["response"]} for r in rows]
    datasets.Dataset.from_list(flat[:150]).to_parquet(str(tmp_path / "part1.parquet"))
    datasets.Dataset.from_list(flat[150:]).save_to_disk(str(tmp_path / "hfdir"))
    c = run_curation([str(tmp_path / "part1.parquet"), str(tmp_path / "hfdir")], steps(bench_dir),
                     str(tmp_path / "c"), output_format="parquet", **kw)
    assert c["counts"]["kept"] == a["counts"]["kept"] and c["counts"]["input_rows"] == len(rows)
    out = datasets.Dataset.from_parquet(str(tmp_path / "c" / "curated.parquet"))
    assert len(out) == a["counts"]["kept"] and "domain" in out.column_names


def test_field_mapping(tmp_path):
    rows = [{"uid": i, "conv": [{"speaker": "human", "text": f"q{i} " * 5},
                                {"speaker": "bot", "text": "same answer here " * 3}]} for i in range(3)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    fields = {"id": "uid", "messages": "conv", "role_key": "speaker", "content_key": "text",
              "response_roles": ["bot"]}
    rep = run_curation([str(src)], [{"step": "exact_dedup", "key": "response"}], str(tmp_path / "o"),
                       fields=fields, progress=False)
    assert rep["counts"]["kept"] == 1 and rep["counts"]["removed"] == 2
    removed = read_jsonl(tmp_path / "o" / "removed.jsonl")
    assert [r["id"] for r in removed] == ["1", "2"]


def test_directory_input_skips_metadata_and_hidden_files(tmp_path):
    d = tmp_path / "artifact"
    (d / ".verified").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", [{"text": "first file row with some text"}])
    write_jsonl(d / "sub" / "b.jsonl" if (d / "sub").mkdir() is None else None,
                [{"text": "second file row with some text"}])
    (d / ".verified" / "a.jsonl").write_text("")
    (d / "manifest.json").write_text('{"files": []}')
    (d / "stage_summary.json").write_text('{"rows": 2}')
    (d / "_SUCCESS").write_text("")
    rep = run_curation([str(d)], [{"step": "exact_dedup"}], str(tmp_path / "o"), progress=False)
    assert [x.rsplit("/", 2)[-2:] for x in rep["inputs"]] == [["artifact", "a.jsonl"], ["sub", "b.jsonl"]]
    assert rep["counts"]["kept"] == 2 and rep["counts"]["quarantined"] == 0

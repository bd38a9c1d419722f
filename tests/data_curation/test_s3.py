import json

from data_curation import run_curation

from .conftest import bench_rows, chat


def test_s3_round_trip_and_step_cache(s3_bucket, bench_dir):
    import s3fs

    url, so = s3_bucket
    fs = s3fs.S3FileSystem(**so)
    q = bench_rows(bench_dir, "gsm8k")[7]["question"]
    rows = [chat(i, f"Item {i}: tell me about topic number {i}.", f"Topic {i} is interesting. " * 4)
            for i in range(40)]
    rows += [rows[5], chat(99, f"Homework: {q}", "Let me think about it carefully.")]
    with fs.open(f"{url}/in/data.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    fs.put_file(str(bench_dir / "gsm8k.jsonl"), f"{url}/bench/gsm8k.jsonl")
    with fs.open(f"{url}/bench/list.yaml", "w") as f:
        f.write("- {path: gsm8k.jsonl, fields: [question], name: gsm8k}\n")
    steps = [{"step": "exact_dedup"}, {"step": "decontaminate", "benchmarks": f"{url}/bench/list.yaml"}]
    rep = run_curation([f"{url}/in/data.jsonl"], steps, f"{url}/clean/", storage_options=so,
                       num_proc=2, progress=False)
    assert rep["counts"] == {"input_rows": 43, "kept": 40, "removed": 2, "quarantined": 1,
                             "removed_by_step": {"exact_dedup": 1, "decontaminate": 1}}
    with fs.open(f"{url}/clean/curated.jsonl") as f:
        kept = [json.loads(x) for x in f.read().decode().splitlines()]
    assert len(kept) == 40 and kept[0]["id"] == "r0"
    assert fs.exists(f"{url}/clean/report.md") and fs.exists(f"{url}/clean/quarantine.jsonl")
    assert any(p.endswith("_DONE") for p in fs.find(f"{url}/clean/steps"))
    again = run_curation([f"{url}/in/data.jsonl"], steps, f"{url}/clean/", storage_options=so,
                         only=["decontaminate"], progress=False)
    assert all(s["reused"] for s in again["steps"])

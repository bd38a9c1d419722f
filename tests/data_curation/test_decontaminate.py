import json

import pytest

from data_curation._base import CurationError
from data_curation.decontaminate import DecontaminateConfig, load_benchmark_list

from .conftest import bench_rows, chat, table

FILLER = ("Sure, let me think about this carefully. We set up the quantities, write the "
          "relations between them, and solve step by step until the answer is clear.")


def bench_list(bench_dir, names=("gsm8k", "aime24", "aime25", "amc23")):
    fields = {"gsm8k": ["question"], "aime24": ["problem"], "aime25": ["problem"],
              "amc23": ["question"], "math500": ["problem"], "minerva_math": ["problem"]}
    return [{"path": str(bench_dir / f"{n}.jsonl"), "fields": fields[n], "name": n} for n in names]


def run(rows, ctx, benchmarks, **kw):
    step = DecontaminateConfig(benchmarks=benchmarks, **kw).build(ctx)
    return step.process(table(rows)), step


def test_pasted_gsm8k_and_reformatted_aime_are_caught(ctx, bench_dir):
    q = bench_rows(bench_dir, "gsm8k")[17]["question"]
    aime = bench_rows(bench_dir, "aime24")[0]["problem"]
    reformatted = ("  " + aime.replace("\\frac{", "\\dfrac {").replace("$", " $ ")
                   .replace(". ", ".\n\n").upper())
    rows = [
        chat(0, f"My teacher gave us this one. {q} Can you help me?", FILLER),
        chat(1, "Solve the following competition problem.", f"Problem restated: {reformatted}\n{FILLER}"),
        chat(2, "Hello", FILLER),
    ]
    d, step = run(rows, ctx, bench_list(bench_dir))
    assert d.keep.tolist() == [False, False, True]
    assert d.details[0]["benchmark"] == "gsm8k" and d.details[0]["method"] == "containment"
    assert d.details[0]["train_field"] == "prompt" and d.details[0]["benchmark_row"] == 17
    assert d.details[1]["benchmark"] == "aime24" and d.details[1]["train_field"] == "response"
    assert d.details[1]["method"] == "containment"
    assert "aya goes for a 9 kilometer long walk" in d.details[1]["span"]
    rep = step.summarize(d.stats)["benchmarks"]
    assert rep["gsm8k"]["rows_flagged"] == 1 and rep["aime24"]["rows_flagged"] == 1
    assert rep["aime24"]["examples"][0]["benchmark_file"].endswith("aime24.jsonl")


def test_exact_and_partial_overlap(ctx, bench_dir):
    q = max((r["question"] for r in bench_rows(bench_dir, "gsm8k")[:50]), key=len)
    words = q.split()
    assert len(words) > 50
    half = " ".join(words[: int(len(words) * 0.75)]) + " and then something else entirely happens."
    rows = [chat(0, q.lower(), FILLER),                   # the whole prompt is the question
            chat(1, half, FILLER)]                         # 3/4 of it, then different
    d, _ = run(rows, ctx, bench_list(bench_dir, ["gsm8k"]))
    assert d.details[0]["method"] == "exact"
    assert d.details[1]["method"] == "ngram" and 0.5 <= d.details[1]["overlap"] < 1
    d, _ = run(rows[1:], ctx, bench_list(bench_dir, ["gsm8k"]), ngram_threshold=0.95)
    assert d.keep.all()


def test_unrelated_math_is_not_flagged(ctx, bench_dir):
    hand = [
        "Every evening Bo runs a 7-kilometre loop and then rests at a bench. If he runs at $r$ km "
        "per hour it takes him 50 minutes; how long does it take at $r+3$ km per hour?",
        "Find the number of ordered pairs $(a,b)$ of positive integers with $a+b=100$ and "
        "$\\gcd(a,b)=1$. Express your answer as an integer.",
        "Janet has 12 pencils. She gives 5 to her brother and buys 8 more. How many pencils "
        "does she have now?",
    ]
    others = [r["problem"] for r in bench_rows(bench_dir, "math500")[:150]]
    rows = [chat(i, t, FILLER) for i, t in enumerate(hand + others)]
    d, _ = run(rows, ctx, bench_list(bench_dir))
    assert d.keep.all(), [x for x in d.details if x]


def test_benchmark_list_file_relative_paths_and_field_errors(ctx, bench_dir, tmp_path):
    import shutil

    shutil.copy(bench_dir / "amc23.jsonl", tmp_path / "amc.jsonl")
    (tmp_path / "list.yaml").write_text("- {path: amc.jsonl, fields: [problem], name: amc}\n")
    specs = load_benchmark_list(str(tmp_path / "list.yaml"))
    assert specs[0].path == str(tmp_path / "amc.jsonl")
    problem = bench_rows(bench_dir, "amc23")[5]["problem"]
    d, _ = run([chat(0, "x " + problem, FILLER)], ctx, str(tmp_path / "list.yaml"))
    assert d.details[0]["benchmark"] == "amc"
    with pytest.raises(CurationError, match="not found in any row.*fields present"):
        run([chat(0, "x", FILLER)], ctx, [{"path": str(tmp_path / "amc.jsonl"), "fields": ["prompt"]}])
    with pytest.raises(CurationError, match="does not exist"):
        run([chat(0, "x", FILLER)], ctx, str(tmp_path / "missing.yaml"))


def test_parquet_and_hf_dataset_dir_benchmarks(ctx, bench_dir, tmp_path):
    import datasets

    rows = bench_rows(bench_dir, "aime25")
    datasets.Dataset.from_list([{"Question": r["problem"]} for r in rows]).save_to_disk(str(tmp_path / "hf"))
    datasets.Dataset.from_list([{"body": r["problem"]} for r in rows]).to_parquet(str(tmp_path / "b.parquet"))
    specs = [{"path": str(tmp_path / "hf"), "fields": ["Question"], "name": "hfdir"},
             {"path": str(tmp_path / "b.parquet"), "fields": ["body"], "name": "pq"}]
    d, step = run([chat(0, rows[2]["problem"], FILLER), chat(1, "no", FILLER)], ctx, specs)
    assert d.keep.tolist() == [False, True]
    per = step.summarize(d.stats)["benchmarks"]
    assert per["hfdir"]["rows"] == len(rows) and per["pq"]["rows"] == len(rows)


def test_identity_changes_with_benchmark_content(ctx, bench_dir, tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps({"q": "one two three four five six seven eight nine"}) + "\n")
    cfg = DecontaminateConfig(benchmarks=[{"path": str(p), "fields": ["q"]}])
    a = cfg.identity(ctx)
    p.write_text(json.dumps({"q": "a different benchmark problem text entirely here"}) + "\n")
    assert cfg.identity(ctx) != a

import json

import pytest

from data_curation._base import CurationError
from data_curation.benchmarks import load_benchmark_list
from data_curation.decontaminate import DecontaminateConfig
from data_curation.normalize import Normalizer

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


def top(d, i):
    """The strongest hit of row i."""
    return d.details[i]["hits"][0]


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
    assert top(d, 0)["benchmark"] == "gsm8k" and top(d, 0)["method"] == "containment"
    # benchmark rows are 1-based lines, and carry the benchmark's own id when it has one
    assert top(d, 0)["train_field"] == "prompt" and top(d, 0)["benchmark_row"] == 18
    assert top(d, 0)["benchmark_id"] == str(bench_rows(bench_dir, "gsm8k")[17]["idx"])
    assert top(d, 1)["benchmark"] == "aime24" and top(d, 1)["train_field"] == "response"
    assert top(d, 1)["method"] == "containment" and top(d, 1)["benchmark_id"] == "60"
    assert "aya goes for a 9 kilometer long walk" in top(d, 1)["span"]
    rep = step.summarize(d.stats)["benchmarks"]
    assert rep["gsm8k"]["rows_flagged"] == 1 and rep["aime24"]["rows_flagged"] == 1
    assert rep["aime24"]["examples"][0]["benchmark_file"].endswith("aime24.jsonl")


def test_exact_and_ngram_overlap(ctx, bench_dir):
    q = max((r["question"] for r in bench_rows(bench_dir, "gsm8k")[:50]), key=len)
    words = q.split()
    assert len(words) > 50
    half = " ".join(words[: int(len(words) * 0.75)]) + " and then something else entirely happens."
    rows = [chat(0, q.lower(), FILLER),                   # the whole prompt is the question
            chat(1, half, FILLER)]                         # 3/4 of it, then different
    d, _ = run(rows, ctx, bench_list(bench_dir, ["gsm8k"]))
    assert top(d, 0)["method"] == "exact"
    assert top(d, 1)["method"] == "ngram" and 0.5 <= top(d, 1)["overlap"] < 1
    d, _ = run(rows[1:], ctx, bench_list(bench_dir, ["gsm8k"]), ngram_threshold=0.95, partial=False)
    assert d.keep.all()


def test_every_hit_and_every_item_found_are_reported(ctx, bench_dir):
    aime, m500 = bench_rows(bench_dir, "aime24"), bench_rows(bench_dir, "math500")
    rows = [chat(0, f"Two problems. First: {aime[4]['problem']} Second: {m500[9]['problem']}", FILLER),
            chat(1, "Again: " + aime[4]["problem"], FILLER), chat(2, "Nothing to see here.", FILLER)]
    d, step = run(rows, ctx, bench_list(bench_dir, ["aime24", "math500"]))
    assert d.keep.tolist() == [False, False, True]
    assert {h["benchmark"] for h in d.details[0]["hits"]} == {"aime24", "math500"}
    assert d.details[0]["hits_total"] == 2
    found = step.summarize(d.stats)["contaminated_items"]
    assert [(x["benchmark"], x["benchmark_row"], x["benchmark_id"], x["training_rows"]) for x in found] == [
        ("aime24", 5, str(aime[4]["id"]), 2), ("math500", 10, m500[9]["unique_id"], 1)]


def items_of(bench_dir, names, min_words, n, seed=0):
    """n benchmark problems of at least min_words words, spread over the files."""
    import random

    rng = random.Random(seed)
    field = {"gsm8k": "question", "aime24": "problem", "aime25": "problem", "amc23": "question",
             "math500": "problem", "minerva_math": "problem"}
    pool = [(b, i, r[field[b]]) for b in names for i, r in enumerate(bench_rows(bench_dir, b))
            if len(r[field[b]].split()) >= min_words]
    return rng.sample(pool, n)


HOMOGLYPHS = str.maketrans({"a": "\u0430", "e": "\u0435", "o": "\u043e", "p": "\u0440", "c": "\u0441",
                            "i": "\u0456", "x": "\u0445", "y": "\u0443", "T": "\u03a4", "A": "\u0391"})


@pytest.mark.parametrize("disguise", ["homoglyphs", "apostrophes", "unicode", "format"])
def test_disguised_copies_are_caught(ctx, bench_dir, disguise):
    import re

    names = ["gsm8k", "math500", "aime24"]
    change = {
        "homoglyphs": lambda t: t.translate(HOMOGLYPHS),
        "apostrophes": lambda t: t.replace("'", "").replace("\u2019", "").replace("s ", "'s "),
        "unicode": lambda t: t.replace(" ", "\u00a0").replace("the", "th\u200be").replace("'", "\u2019"),
        "format": lambda t: re.sub(r"(?<=[a-z]),", "", t).upper().replace(" ", "  \n "),
    }[disguise]
    picked = items_of(bench_dir, names, 12, 12)
    rows = [chat(k, f"Please solve: {change(q)}", FILLER) for k, (_, _, q) in enumerate(picked)]
    d, _ = run(rows, ctx, bench_list(bench_dir, names))
    assert not d.keep.any()
    assert [(top(d, k)["benchmark"], top(d, k)["benchmark_row"]) for k in range(len(rows))] == \
        [(b, i + 1) for b, i, _ in picked]


def test_one_key_sentence_of_a_longer_problem_is_a_partial_copy(ctx, bench_dir):
    import re

    names = ["aime24", "aime25", "math500", "gsm8k"]
    rows, want = [], []
    for b, i, q in items_of(bench_dir, names, 40, 40, seed=1):
        sents = re.split(r"(?<=[.?!])\s+(?=[A-Z$])", q)
        key = max(sents, key=lambda x: len(x.split()))
        if len(sents) < 2 or len(key.split()) < 12 or len(key.split()) > 0.8 * len(q.split()):
            continue
        rows.append(chat(len(rows), f"Think about this setup. {key} What follows from it?", FILLER))
        want.append((b, i + 1))
    assert len(rows) >= 15
    d, _ = run(rows, ctx, bench_list(bench_dir, names))
    caught = [(top(d, k)["benchmark"], top(d, k)["benchmark_row"]) if d.details[k] else None
              for k in range(len(rows))]
    assert sum(c == w for c, w in zip(caught, want)) >= 0.9 * len(rows), list(zip(caught, want))
    assert {top(d, k)["method"] for k in range(len(rows)) if d.details[k]} <= {"partial", "ngram"}


def test_boilerplate_shared_by_benchmark_items_is_no_evidence(ctx, bench_dir):
    """N-grams that several benchmark items share ("where m and n are relatively prime
    positive integers") stitched into new problems flag nothing."""
    cfg = DecontaminateConfig(benchmarks=bench_list(bench_dir, ["aime24", "aime25", "amc23", "math500"]))
    norm, n = Normalizer(), cfg.ngram
    field = {"aime24": "problem", "aime25": "problem", "amc23": "question", "math500": "problem"}
    items_with: dict[str, set] = {}
    for b in field:
        for i, r in enumerate(bench_rows(bench_dir, b)):
            toks = norm.tokens(r[field[b]])
            for p in range(len(toks) - n + 1):
                items_with.setdefault(" ".join(toks[p:p + n]), set()).add((b, i))
    shared = [g for g, items in items_with.items() if len(items) >= 2 and not any(c.isdigit() for c in g)]
    assert len(shared) > 20
    phrases = sorted(shared)
    rows = [chat(j, f"A new puzzle about {j} marbles: {phrases[j % len(phrases)]} and also "
                    f"{phrases[(7 * j + 3) % len(phrases)]}, so what is the total?", FILLER)
            for j in range(60)]
    d, _ = run(rows, ctx, cfg.benchmarks)
    assert d.keep.all(), [top(d, k) for k in range(len(rows)) if d.details[k]][:3]


def test_new_numbers_are_a_new_problem_reported_apart(ctx, bench_dir):
    import re

    names = ["gsm8k", "math500"]
    picked = [(b, i, q) for b, i, q in items_of(bench_dir, names, 20, 30, seed=2)
              if len(re.findall(r"\d+", q)) >= 2][:12]

    def renumber(q):
        return re.sub(r"\d+", lambda m: str(int(m.group()) + 7), q, count=2)

    rows = [chat(k, f"Try this one: {renumber(q)}", FILLER) for k, (_, _, q) in enumerate(picked)]
    rows.append(chat(len(rows), f"Try this one: {picked[0][2]}", "The answer is 41, since 12 + 29 = 41."))
    d, step = run(rows, ctx, bench_list(bench_dir, names))
    assert d.keep.tolist() == [True] * len(picked) + [False]   # kept: new problems; the copy goes
    summary = step.summarize(d.stats)
    assert {(x["benchmark"], x["benchmark_row"]) for x in summary["new_numbers_items"]} == \
        {(b, i + 1) for b, i, _ in picked}
    assert [(x["benchmark"], x["benchmark_row"]) for x in summary["contaminated_items"]] == \
        [(picked[0][0], picked[0][1] + 1)]
    d, _ = run(rows, ctx, bench_list(bench_dir, names), new_numbers="remove")
    assert not d.keep.any()
    assert {d.reasons[k] for k in range(len(picked))} == {"same_template_new_numbers"}
    assert all(h["numbers_changed"] for k in range(len(picked)) for h in d.details[k]["hits"])


def test_short_problems_pasted_into_a_template(ctx, bench_dir):
    m500 = bench_rows(bench_dir, "math500")
    short = [r["problem"] for r in m500 if 4 <= len(Normalizer().tokens(r["problem"])) < 8]
    assert len(short) >= 8
    rows = [chat(k, f"Quick one for my homework: {q} Thanks in advance!", FILLER) for k, q in enumerate(short)]
    d, _ = run(rows, ctx, bench_list(bench_dir, ["math500"]))
    assert not d.keep.any() and {top(d, k)["method"] for k in range(len(rows))} == {"containment"}


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
    assert top(d, 0)["benchmark"] == "amc"
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

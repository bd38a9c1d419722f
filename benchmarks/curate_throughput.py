"""Curation throughput and accuracy: exact + near dedup + decontamination (data_curation)
side by side with datatrove's MinHash dedup pipeline, on one generated corpus.

    python benchmarks/curate_throughput.py --docs 200000 --num-proc 2 \
        --datatrove-python /path/to/venv/bin/python     # a Python with datatrove + spacy

The corpus: `--docs` rows `{"id", "prompt", "response"}` of 120 synthetic words (letters
only: datatrove's normalisation maps digits to 0), split into 4 jsonl shards, with planted
- exact duplicates (half verbatim, half with case/whitespace changes),
- near duplicates: copies with 1, 3 or 6 of 120 words replaced (Jaccard reported),
- far copies: 40 of 120 words replaced (must be kept: not duplicates),
- contamination: a benchmark question/problem from $RING_BENCHMARKS_DIR's public sets pasted into a
  longer prompt, verbatim / re-cased and re-spaced / with LaTeX spacing changes,
- decoys: templated math word problems that are in no benchmark (must be kept).
Every copy has its own source (sources are distinct), rows are shuffled, and the first
row of a duplicate pair in file order is the one that should stay.

Both pipelines read the same shards and write their kept rows. data_curation runs
exact_dedup, near_dedup (defaults) and decontaminate against the six benchmark files;
`--baseline REV` also runs the data_curation of git revision REV (exported with `git
archive` to a temp dir) on the same corpus, alternating with the working tree's code
`--repeat` times, each in a fresh subprocess, so before/after come from one run;
datatrove runs MinhashDedupSignature/Buckets/Cluster/Filter with its defaults (word
5-grams, 14 buckets x 8 hashes) on `--num-proc` workers. datatrove is a benchmark-only
dependency (`pip install datatrove spacy`); it runs in a subprocess of the given Python.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from data_curation.benchmarks import BENCHMARKS_DIR_ENV, benchmarks_dir

REPO = Path(__file__).resolve().parents[1]
# the public benchmark test sets (gsm8k.jsonl, ...): the project holds no copy
BENCH_DIR = benchmarks_dir() or sys.exit(f"{BENCHMARKS_DIR_ENV} must name a directory of the public benchmark "
                                         "sets (aime24.jsonl, gsm8k.jsonl, math500.jsonl, ...)")
BENCH_FIELDS = {"aime24": "problem", "aime25": "problem", "amc23": "problem", "gsm8k": "question",
                "math500": "problem", "minerva_math": "problem"}
SHARDS = 4
WORDS = 120
PROMPT_WORDS = 20


# -- corpus ------------------------------------------------------------------------------
def make_vocab(rng: np.random.Generator, n: int = 30000) -> np.ndarray:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lens = rng.integers(3, 10, n)
    words = {"".join(rng.choice(letters, k)) for k in lens}
    return np.array(sorted(words))


def load_benchmark_texts() -> list[tuple[str, int, str]]:
    out = []
    for name, field in BENCH_FIELDS.items():
        with open(BENCH_DIR / f"{name}.jsonl", encoding="utf-8") as f:
            for i, line in enumerate(f):
                out.append((name, i, json.loads(line)[field]))
    return out


def reformat(text: str, mode: int, rng: np.random.Generator) -> str:
    if mode == 0:
        return text
    if mode == 1:   # case and whitespace
        t = text.upper() if rng.random() < 0.5 else text.lower()
        return re.sub(r" ", lambda m: "  " if rng.random() < 0.3 else ("\n" if rng.random() < 0.05 else " "), t)
    # LaTeX spacing / command variants
    t = text.replace("\\frac{", "\\dfrac {").replace("$", " $ ").replace("^{", "^ {")
    return t.replace("\\left(", "(").replace("\\right)", ")").replace(",", " ,")


def jaccard(a: list[str], b: list[str], n: int) -> float:
    sa = {tuple(a[i:i + n]) for i in range(len(a) - n + 1)}
    sb = {tuple(b[i:i + n]) for i in range(len(b) - n + 1)}
    return len(sa & sb) / len(sa | sb)


def generate(n_docs: int, out_dir: Path, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    vocab = make_vocab(rng)
    zipf = 1.0 / np.arange(1, len(vocab) + 1) ** 0.8
    zipf /= zipf.sum()
    plan = {"exact": 0.04, "near1": 0.03, "near3": 0.05, "near6": 0.03, "far40": 0.01}
    n_contam, n_decoy = min(1000, n_docs // 100), min(1000, n_docs // 100)
    n_copies = {k: int(n_docs * v) for k, v in plan.items()}
    n_base = n_docs - sum(n_copies.values()) - n_contam - n_decoy
    base = rng.choice(len(vocab), size=(n_base, WORDS), p=zipf)
    docs: list[list[str]] = [list(vocab[row]) for row in base]
    kinds = ["base"] * n_base
    source = [-1] * n_base
    sources = rng.permutation(n_base)   # every copy gets its own source
    s_iter = iter(sources.tolist())
    pool = iter(rng.choice(len(vocab), size=n_docs * 4, p=zipf).tolist())   # replacement words
    jac: dict[str, list[tuple[float, float]]] = {}
    for kind, count in n_copies.items():
        for _ in range(count):
            s = next(s_iter)
            words = list(docs[s])
            if kind == "exact":
                if rng.random() < 0.5:
                    words = [w.upper() if rng.random() < 0.1 else w for w in words]
                    words[0] = words[0].capitalize()
            else:
                k = int(re.sub(r"\D", "", kind))
                for p in rng.choice(WORDS, k, replace=False):
                    words[p] = vocab[next(pool)]
                if len(jac.get(kind, [])) < 300:
                    jac.setdefault(kind, []).append((jaccard(docs[s], words, 3), jaccard(docs[s], words, 5)))
            docs.append(words)
            kinds.append(kind)
            source.append(int(s))
    bench = load_benchmark_texts()
    contam_info = []
    for i in range(n_contam):   # contaminated rows are fresh (not sources of copies)
        name, row, text = bench[int(rng.integers(len(bench)))]
        mode = i % 3
        words = list(vocab[rng.choice(len(vocab), size=WORDS - PROMPT_WORDS, p=zipf)])
        prompt = f"Here is a problem from my homework set. {reformat(text, mode, rng)} Please explain each step."
        docs.append((prompt, words))
        kinds.append("contam")
        source.append(-1)
        contam_info.append((name, row, mode))
    for _ in range(n_decoy):
        a, b, c = rng.integers(2, 90, 3)
        item = vocab[rng.integers(len(vocab))]
        prompt = (f"A shop sells {a} boxes of {item} on Monday and {b} boxes on Tuesday. Each box "
                  f"holds {c} items. If the owner gives away {a % 7} boxes, how many items are left "
                  f"in total at the end of the week? Show the arithmetic.")
        words = list(vocab[rng.choice(len(vocab), size=WORDS - PROMPT_WORDS, p=zipf)])
        docs.append((prompt, words))
        kinds.append("decoy")
        source.append(-1)
    order = rng.permutation(len(docs))
    pos = np.empty(len(docs), dtype=np.int64)
    pos[order] = np.arange(len(docs))
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [open(out_dir / f"corpus-{k:02d}.jsonl", "w", encoding="utf-8") for k in range(SHARDS)]
    per = (len(docs) + SHARDS - 1) // SHARDS
    for j, d_idx in enumerate(order.tolist()):
        d = docs[d_idx]
        if isinstance(d, tuple):
            prompt, resp = d[0], " ".join(d[1])
        else:
            sep = "  " if kinds[d_idx] == "exact" and d_idx % 2 else " "
            prompt, resp = sep.join(d[:PROMPT_WORDS]), sep.join(d[PROMPT_WORDS:])
        files[j // per].write(json.dumps({"id": f"d{d_idx:07d}", "prompt": prompt,
                                          "response": resp}) + "\n")
    for f in files:
        f.close()
    return {"kinds": np.array(kinds), "source": np.array(source), "pos": pos,
            "jaccard": {k: {"j3_mean": float(np.mean([a for a, _ in v])),
                            "j5_mean": float(np.mean([b for _, b in v])),
                            "j3_min": float(np.min([a for a, _ in v])),
                            "j5_min": float(np.min([b for _, b in v]))} for k, v in jac.items()},
            "contam": contam_info, "n_docs": len(docs)}


# -- scoring -----------------------------------------------------------------------------
def score_dedup(removed: np.ndarray, truth: dict) -> dict:
    """removed: bool per doc index. A copy pair is caught when exactly one member is removed."""
    kinds, source = truth["kinds"], truth["source"]
    out = {}
    expected = np.zeros(len(kinds), dtype=bool)
    caught_total = 0
    for kind in ("exact", "near1", "near3", "near6"):
        idx = np.nonzero(kinds == kind)[0]
        pair_removed = removed[idx].astype(int) + removed[source[idx]].astype(int)
        caught = int((pair_removed >= 1).sum())
        out[f"recall_{kind}"] = round(caught / max(1, len(idx)), 4)
        caught_total += caught
        expected[idx] = True
        expected[source[idx]] = True
    # removals beyond one per planted pair, and removals of rows that have no duplicate
    pair_idx = np.nonzero(np.isin(kinds, ["exact", "near1", "near3", "near6"]))[0]
    extra_in_pairs = int(np.maximum(0, removed[pair_idx].astype(int) + removed[source[pair_idx]].astype(int) - 1).sum())
    false_removed = int(removed[~expected].sum()) + extra_in_pairs
    far = np.nonzero(kinds == "far40")[0]
    out["far40_removed"] = int(removed[far].sum() + removed[source[far]].sum())
    out["false_removals"] = false_removed
    out["removed"] = int(removed.sum())
    out["precision"] = round(caught_total / max(1, int(removed.sum())), 4)
    return out


def ids_to_mask(ids, n: int) -> np.ndarray:
    m = np.zeros(n, dtype=bool)
    m[[int(i[1:]) for i in ids]] = True
    return m


# -- data_curation ----------------------------------------------------------------------
def ours_worker(code_dir: str, corpus: str, out: str, num_proc: int, batch_size: int) -> None:
    """Runs in a subprocess whose sys.path starts with `code_dir` (a checkout of some revision)."""
    sys.path.insert(0, code_dir)
    import pyarrow.parquet as pq

    from data_curation import run_curation

    bench = [{"path": str(BENCH_DIR / f"{n}.jsonl"), "fields": [f], "name": n}
             for n, f in BENCH_FIELDS.items()]
    steps = [{"step": "exact_dedup"}, {"step": "near_dedup"},
             {"step": "decontaminate", "benchmarks": bench}]
    out_dir = Path(out)
    shutil.rmtree(out_dir, ignore_errors=True)
    t0 = time.time()
    report = run_curation([str(Path(corpus) / "corpus-*.jsonl")], steps, str(out_dir), num_proc=num_proc,
                          batch_size=batch_size, progress=False, work_dir=out_dir / "_work",
                          log=lambda m: None)
    wall = time.time() - t0
    removed = {}
    for st in report["steps"][1:]:
        ids = []
        d = Path(st["dir"].removeprefix("file://"), "removed")
        for p in sorted(d.glob("*.parquet")) if d.exists() else []:
            ids += pq.read_table(p, columns=["_id"]).column("_id").to_pylist()
        removed[st["step"]] = ids
    print(json.dumps({"wall_s": wall, "removed": removed,
                      "step_seconds": {st["step"]: st.get("seconds") for st in report["steps"]}}))


def run_ours(code_dir: Path, corpus: Path, out: Path, num_proc: int, batch_size: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--ours-worker", str(code_dir), str(corpus), str(out),
                           str(num_proc), str(batch_size)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"data_curation run ({code_dir}) failed:\n" + proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def export_revision(rev: str, dest: Path) -> Path:
    """The data_curation package of git revision `rev`, exported under `dest`."""
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    blob = subprocess.run(["git", "-C", str(REPO), "archive", rev, "data_curation"], capture_output=True,
                          check=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(blob)) as tar:
        tar.extractall(dest)
    return dest


def score_ours(ours: dict, truth: dict, n: int) -> dict:
    dedup_removed = ids_to_mask(ours["removed"].get("exact_dedup", []) + ours["removed"].get("near_dedup", []), n)
    contam_removed = ids_to_mask(ours["removed"].get("decontaminate", []), n)
    is_contam = truth["kinds"] == "contam"
    return {"wall_s": round(ours["wall_s"], 2), "docs_per_s": round(n / ours["wall_s"], 1),
            "step_seconds": ours["step_seconds"], "dedup": score_dedup(dedup_removed, truth),
            "decontamination": {
                "recall": round(float(contam_removed[is_contam].mean()), 4),
                "recall_by_format": {m: round(float(np.mean([contam_removed[i] for i, (_, _, mm) in
                                                             zip(np.nonzero(is_contam)[0], truth["contam"]) if mm == k])), 4)
                                     for k, m in enumerate(["verbatim", "case+space", "latex"])},
                "false_flags": int(contam_removed[~is_contam].sum()),
                "decoys_flagged": int(contam_removed[truth["kinds"] == "decoy"].sum())}}


# -- datatrove (runs in the datatrove Python) --------------------------------------------
def datatrove_worker(corpus: str, out: str, workers: int) -> None:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers.jsonl import JsonlWriter

    def adapter(self, data: dict, path: str, id_in_file) -> dict:
        return {"text": data["prompt"] + "\n" + data["response"], "id": data["id"], "metadata": {}}

    cfg = MinhashConfig()
    base = Path(out)
    tasks = SHARDS
    t0 = time.time()
    reader = lambda: JsonlReader(corpus, glob_pattern="corpus-*.jsonl", adapter=adapter)  # noqa: E731
    LocalPipelineExecutor(pipeline=[reader(), MinhashDedupSignature(str(base / "sigs"), config=cfg)],
                          tasks=tasks, workers=workers, logging_dir=str(base / "logs/s1")).run()
    LocalPipelineExecutor(pipeline=[MinhashDedupBuckets(str(base / "sigs"), str(base / "buckets"), config=cfg)],
                          tasks=cfg.num_buckets, workers=workers, logging_dir=str(base / "logs/s2")).run()
    LocalPipelineExecutor(pipeline=[MinhashDedupCluster(str(base / "buckets"), str(base / "remove"), config=cfg)],
                          tasks=1, workers=1, logging_dir=str(base / "logs/s3")).run()
    LocalPipelineExecutor(pipeline=[reader(), MinhashDedupFilter(str(base / "remove")),
                                    JsonlWriter(str(base / "kept"))],
                          tasks=tasks, workers=workers, logging_dir=str(base / "logs/s4")).run()
    print(json.dumps({"wall_s": time.time() - t0}))


def run_datatrove(python: str, corpus: Path, out: Path, workers: int) -> dict:
    if out.exists():
        shutil.rmtree(out)
    t0 = time.time()
    proc = subprocess.run([python, __file__, "--datatrove-worker", str(corpus), str(out), str(workers)],
                          capture_output=True, text=True)
    total = time.time() - t0
    if proc.returncode:
        raise RuntimeError("datatrove run failed:\n" + proc.stderr[-4000:])
    wall = json.loads(proc.stdout.strip().splitlines()[-1])["wall_s"]
    import gzip

    kept = []
    for p in sorted((out / "kept").glob("*")):
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt", encoding="utf-8") as f:
            kept += [json.loads(line)["id"] for line in f]
    return {"wall_s": wall, "process_s": total, "kept_ids": kept}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--datatrove-worker":
        datatrove_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--ours-worker":
        ours_worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=10_000)
    ap.add_argument("--work", default="/tmp/curate_bench")
    ap.add_argument("--datatrove-python", default=os.environ.get("DATATROVE_PYTHON", sys.executable))
    ap.add_argument("--skip-datatrove", action="store_true")
    ap.add_argument("--baseline", default=None, metavar="REV", help="also run data_curation of this git revision")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each data_curation version, alternating")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    t0 = time.time()
    truth = generate(args.docs, work / "corpus", args.seed)
    n = truth["n_docs"]
    print(f"generated {n} docs in {time.time() - t0:.1f}s; Jaccard of planted near copies "
          f"(word 3-/5-gram): {json.dumps(truth['jaccard'])}", flush=True)
    versions = {"ours": REPO}
    if args.baseline:
        versions = {f"baseline {args.baseline}": export_revision(args.baseline, work / "baseline-code"), **versions}
    res = {"docs": n, "num_proc": args.num_proc, "jaccard_planted": truth["jaccard"]}
    runs: dict[str, list[dict]] = {name: [] for name in versions}
    for _ in range(args.repeat):
        for name, code in versions.items():
            runs[name].append(score_ours(run_ours(code, work / "corpus", work / "ours", args.num_proc,
                                                  args.batch_size), truth, n))
            print(json.dumps({name: runs[name][-1]}, indent=1), flush=True)
    for name, rs in runs.items():
        best = max(rs, key=lambda r: r["docs_per_s"])
        res[name] = {**best, "docs_per_s_all_runs": [r["docs_per_s"] for r in rs]}
    if not args.skip_datatrove:
        dt = run_datatrove(args.datatrove_python, work / "corpus", work / "datatrove", args.num_proc)
        kept = ids_to_mask(dt["kept_ids"], n)
        res["datatrove"] = {"wall_s": round(dt["wall_s"], 2), "docs_per_s": round(n / dt["wall_s"], 1),
                            "process_s": round(dt["process_s"], 2), "dedup": score_dedup(~kept, truth)}
        res["speedup"] = round(res["ours"]["docs_per_s"] / res["datatrove"]["docs_per_s"], 2)
    (work / "results.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Decontamination recall and precision per contamination form, data_curation side by side
with lm-eval-harness's 13-gram Janitor and open-r1's 8-gram check, on one generated
adversarial corpus.

    pip install --no-deps --target /tmp/lmeval-pkg lm-eval==0.4.9   # benchmark only
    python benchmarks/curate_decontam.py --lmeval-path /tmp/lmeval-pkg --num-proc 2

The corpus (chat rows, built from $RING_BENCHMARKS_DIR's public sets at run time; nothing is copied into
the repository): every benchmark's items are split 75/25 by a seeded shuffle; the 75% are
the decontamination references (written as filtered copies under --work), the 25% are
held-out real problems that must be kept. Positive rows, `--per-form` of each, from
indexed items (the prompt/question field):
- verbatim: the item is the prompt;
- embedded: the item inside one of several instruction templates;
- answer_included: the item with its answer appended, and its worked solution (where the
  file has one) as the response;
- format: whitespace, case and punctuation changes, dropped apostrophes;
- latex: LaTeX re-spacing and command variants (\\dfrac, \\left(, \\, $ spacing);
- unicode: full-width letters, NBSP, curly quotes, zero-width characters, soft hyphens;
- markdown: headings, bold, one sentence per bullet, code fence;
- partial: the longest sentence (>= 8 words, < 80% of the item) of a multi-sentence item
  in a new context;
- homoglyph: 30% of the letters that have one replaced by a Cyrillic/Greek look-alike;
- new_numbers: 1-3 numbers of the item changed (a new problem: reported on its own, not a
  contamination and not counted in precision).
Negatives: held-out items (in the same templates), held-out items with their own
solutions, templated word problems ending in competition boilerplate ("relatively prime
positive integers", "Express your answer as a common fraction", ...), and chat rows of
random words.

Scores: recall per form (flagged / rows of that form), precision = true flags / all flags
over every row except new_numbers rows, and for data_curation how many new_numbers rows
it reported as "same template, new numbers". lm-eval's Janitor is imported from the
given install (its `janitor.py` file only: the package's __init__ imports torch and
transformers); a row is flagged when any of its 13-grams (Janitor's own normalisation and
n-grams, as in `Janitor.clean_python`) is a registered benchmark 13-gram. open-r1's check
(scripts/decontaminate.py: lowercase, whitespace split, any shared 8-gram) is
re-implemented here in a few lines.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io as stdio
import json
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from data_curation.benchmarks import BENCHMARKS_DIR_ENV, benchmarks_dir

REPO = Path(__file__).resolve().parents[1]
# the public benchmark test sets (gsm8k.jsonl, ...): the project holds no copy
BENCH_DIR = benchmarks_dir() or sys.exit(f"{BENCHMARKS_DIR_ENV} must name a directory of the public benchmark "
                                         "sets (aime24.jsonl, gsm8k.jsonl, math500.jsonl, ...)")
# text field, answer field, solution field of each benchmark file
BENCH = {"aime24": ("problem", "answer", "solution"), "aime25": ("problem", "answer", None),
         "amc23": ("problem", "answer", None), "gsm8k": ("question", None, "answer"),
         "math500": ("problem", "answer", "solution"), "minerva_math": ("problem", None, "solution")}
FORMS = ["verbatim", "embedded", "answer_included", "format", "latex", "unicode", "markdown",
         "partial", "homoglyph", "new_numbers"]
TEMPLATES = [
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $ANSWER.\n\n{q}\n\nRemember to put your answer on its own line.",
    "Here is a problem from my homework set. {q} Please explain each step.",
    "Problem:\n{q}\n\nGive a rigorous solution and box the final answer.",
    "I found this in an old contest and cannot crack it: {q} Any hints?",
    "Question: {q}\nLet's think step by step.",
]
CONTEXTS = [("Consider the following situation carefully.", "What can you conclude? Explain your reasoning."),
            ("Here is part of a puzzle a friend sent me.", "How would you approach it?"),
            ("We are studying this setup in class today.", "Describe the first step of a solution.")]
HOMOGLYPHS = {"a": "а", "c": "с", "e": "е", "i": "і", "j": "ј", "o": "о", "p": "р", "s": "ѕ",
              "x": "х", "y": "у", "A": "А", "B": "В", "C": "С", "E": "Е", "H": "Н", "I": "І",
              "K": "К", "M": "М", "N": "Ν", "O": "О", "P": "Р", "T": "Т", "X": "Х", "Y": "Υ"}
FULLWIDTH = {c: chr(ord(c) + 0xFEE0) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"}
BOILERPLATE = [
    "The probability can be written as $\\frac{{m}}{{n}}$, where $m$ and $n$ are relatively prime "
    "positive integers. Find $m+n$.",
    "Express your answer as a common fraction.",
    "Find the remainder when the answer is divided by $1000$.",
    "Express your answer in simplest radical form.",
    "What is the sum of all possible values?",
]
SENT = re.compile(r"(?<=[.?!])\s+(?=[A-Z$\\(])")
NUM = re.compile(r"(?<![\w.])\d+(?![\w.])")


# -- corpus ------------------------------------------------------------------------------
def load_items() -> list[dict]:
    out = []
    for name, (text_f, ans_f, sol_f) in BENCH.items():
        with open(BENCH_DIR / f"{name}.jsonl", encoding="utf-8") as f:
            for i, line in enumerate(f):
                r = json.loads(line)
                out.append({"bench": name, "line": i, "raw": line, "text": r[text_f],
                            "answer": r.get(ans_f) if ans_f else None,
                            "solution": r.get(sol_f) if sol_f else None})
    return out


def split_items(items: list[dict], rng: np.random.Generator, work: Path) -> tuple[list[dict], list[dict], list]:
    """(indexed, held-out, benchmark list) with the indexed items written as filtered
    benchmark files under work/bench. Held-out items that share a run of 12 words with an
    indexed item (the same problem in two benchmarks, minerva_math subproblems sharing a
    preamble) overlap the references and are left out of the negatives."""
    indexed, held = [], []
    for name in BENCH:
        mine = [it for it in items if it["bench"] == name]
        order = rng.permutation(len(mine))
        cut = int(round(len(mine) * 0.75))
        indexed += [mine[k] for k in order[:cut]]
        held += [mine[k] for k in order[cut:]]
    def runs(text: str, n: int = 12) -> set[tuple]:
        w = re.findall(r"\w+", text.lower())
        return {tuple(w[k:k + n]) for k in range(max(1, len(w) - n + 1))}

    seen = set().union(*(runs(it["text"]) for it in indexed))
    held = [it for it in held if not runs(it["text"]) & seen]
    (work / "bench").mkdir(parents=True, exist_ok=True)
    specs = []
    for name, (text_f, _, _) in BENCH.items():
        with open(work / "bench" / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(it["raw"] for it in sorted(indexed, key=lambda x: x["line"]) if it["bench"] == name)
        specs.append({"path": str(work / "bench" / f"{name}.jsonl"), "fields": [text_f], "name": name})
    return indexed, held, specs


def fmt_change(q: str, rng) -> str:
    """Case, whitespace and punctuation: apostrophes dropped, commas and periods after words
    dropped or detached (never between digits: "(5,4)" -> "(54)" would be new mathematics)."""
    words = q.split(" ")
    out = []
    for w in words:
        r = rng.random()
        w = w.upper() if r < 0.1 else w.lower() if r < 0.3 else w.capitalize() if r < 0.35 else w
        if rng.random() < 0.3:
            w = re.sub(r"(?<=[A-Za-z])[,.]$", rng.choice(["", " ,", " ."]), w.replace("'", "").replace("\u2019", ""))
        out.append(w)
    return "".join(w + rng.choice([" ", "  ", " ", "\n", " \t "]) for w in out).strip() + rng.choice(["", "!!", " ?"])


def latex_change(q: str, rng) -> str:
    t = q.replace("\\frac{", "\\dfrac {").replace("$", " $ ").replace("^{", "^ {").replace("(", "\\left(")
    t = t.replace(")", "\\right)").replace("=", " \\,=\\, ").replace("\\cdot", "\\cdot ")
    return t.replace("+", " + ").replace("\\le ", "\\leq ")


def unicode_change(q: str, rng) -> str:
    out = []
    for w in q.split(" "):
        r = rng.random()
        if r < 0.15:
            w = "".join(FULLWIDTH.get(c, c) for c in w)
        elif r < 0.3 and len(w) > 3:
            k = len(w) // 2
            w = w[:k] + rng.choice(["\u200b", "\u00ad", "\u2060", "\u200d"]) + w[k:]
        out.append(w.replace("'", "\u2019").replace('"', "\u201c"))
    return "".join(w + ("\u00a0" if rng.random() < 0.3 else " ") for w in out).strip()


def markdown_change(q: str, rng) -> str:
    sents = [s for s in SENT.split(q.strip()) if s]
    style = rng.integers(3)
    if style == 0:
        return "### Problem\n\n" + "\n".join(f"- {s}" for s in sents) + "\n\n**Answer:** ?"
    if style == 1:
        return f"**Problem.** *{q}*\n\n> Show all work."
    return f"```\n{q}\n```\nSolve the problem in the block above."


def homoglyph_change(q: str, rng) -> str:
    # only outside $...$ math, where a look-alike would change the mathematics
    parts = re.split(r"(\$[^$]*\$)", q)
    return "".join(p if p.startswith("$") else
                   "".join(HOMOGLYPHS[c] if c in HOMOGLYPHS and rng.random() < 0.3 else c for c in p)
                   for p in parts)


def key_sentence(q: str) -> str | None:
    sents = [s for s in SENT.split(q.strip()) if s]
    if len(sents) < 2:
        return None
    best = max(sents, key=lambda s: len(re.findall(r"\w+", s)))
    n, total = len(re.findall(r"\w+", best)), len(re.findall(r"\w+", q))
    return best if n >= 8 and n < 0.8 * total else None


def change_numbers(q: str, rng) -> str | None:
    nums = list(NUM.finditer(q))
    if not nums:
        return None
    chosen = {m.start() for m in rng.choice(nums, size=min(len(nums), int(rng.integers(1, 4))), replace=False)}
    out, last = [], 0
    for m in nums:
        out.append(q[last:m.start()])
        v = int(m.group())
        out.append(str(v + int(rng.integers(1, 9))) if m.start() in chosen else m.group())
        last = m.end()
    return "".join(out) + q[last:]


def positive(form: str, it: dict, rng) -> tuple[str, str] | None:
    q = it["text"]
    filler = "Let me work through this carefully, one step at a time, and check the result."
    if form == "verbatim":
        return q, filler
    if form == "embedded":
        return TEMPLATES[rng.integers(len(TEMPLATES))].format(q=q), filler
    if form == "answer_included":
        ans = it["answer"] if it["answer"] is not None else "(see the solution)"
        return f"{q}\nAnswer: {ans}", it["solution"] or f"The answer is {ans}."
    if form == "format":
        return fmt_change(q, rng), filler
    if form == "latex":
        return latex_change(q, rng), filler
    if form == "unicode":
        return unicode_change(q, rng), filler
    if form == "markdown":
        return markdown_change(q, rng), filler
    if form == "partial":
        s = key_sentence(q)
        if s is None:
            return None
        intro, ask = CONTEXTS[rng.integers(len(CONTEXTS))]
        return f"{intro} {s} {ask}", filler
    if form == "homoglyph":
        return homoglyph_change(q, rng), filler
    if form == "new_numbers":
        changed = change_numbers(q, rng)
        return (changed, filler) if changed and changed != q else None
    raise ValueError(form)


def negatives(held: list[dict], n_decoy: int, n_chat: int, rng) -> list[tuple[str, str, str]]:
    out = []
    for it in held:
        out.append(("held_out", TEMPLATES[rng.integers(len(TEMPLATES))].format(q=it["text"]),
                    "Let me think about it."))
        if it["solution"]:
            out.append(("held_out_solution", it["text"], it["solution"]))
    names = ["Alice", "Bo", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]
    things = ["marbles", "apples", "tickets", "stamps", "coins", "books", "shells", "cards"]
    for _ in range(n_decoy):
        a, b, c = (int(x) for x in rng.integers(2, 90, 3))
        who, what = names[rng.integers(len(names))], things[rng.integers(len(things))]
        q = (f"{who} has {a} {what} and buys {b} more each week for {c} weeks, then gives away a "
             f"third of them. {BOILERPLATE[rng.integers(len(BOILERPLATE))]}")
        out.append(("decoy", q, "We count the items week by week and simplify."))
    vocab = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), int(k))) for k in rng.integers(3, 9, 3000)]
    for _ in range(n_chat):
        words = rng.choice(vocab, 60)
        out.append(("chat", " ".join(words[:15]), " ".join(words[15:])))
    return out


def generate(work: Path, per_form: int, seed: int) -> tuple[Path, dict, list]:
    rng = np.random.default_rng(seed)
    indexed, held, specs = split_items(load_items(), rng, work)
    rows, truth = [], {}
    for form in FORMS:
        made = 0
        for k in rng.permutation(len(indexed)):
            if made == per_form:
                break
            pr = positive(form, indexed[k], rng)
            if pr is None:
                continue
            rid = f"{form}-{made}"
            rows.append({"id": rid, "messages": [{"role": "user", "content": pr[0]},
                                                 {"role": "assistant", "content": pr[1]}]})
            truth[rid] = {"form": form, "bench": indexed[k]["bench"]}
            made += 1
    for k, (kind, p, r) in enumerate(negatives(held, n_decoy=2000, n_chat=5000, rng=rng)):
        rid = f"{kind}-{k}"
        rows.append({"id": rid, "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]})
        truth[rid] = {"form": kind, "bench": None}
    order = rng.permutation(len(rows))
    path = work / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for k in order:
            f.write(json.dumps(rows[k], ensure_ascii=False) + "\n")
    return path, truth, specs


# -- methods -----------------------------------------------------------------------------
def run_ours(corpus: Path, specs: list, work: Path, num_proc: int, overrides: dict) -> dict:
    sys.path.insert(0, str(REPO))
    from data_curation import run_curation

    out = work / "ours"
    shutil.rmtree(out, ignore_errors=True)
    step = {"step": "decontaminate", "benchmarks": specs, "new_numbers": "remove", **overrides}
    t0 = time.time()
    report = run_curation([str(corpus)], [step], str(out), num_proc=num_proc, progress=False,
                          work_dir=work / "ours-work", log=lambda m: None)
    wall = time.time() - t0
    flagged, changed = set(), set()
    with open(out / "removed.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            (flagged if r["reason"] == "contamination" else changed).add(r["id"])
    return {"flagged": flagged, "new_numbers": changed, "wall_s": wall,
            "step_s": report["steps"][1]["seconds"], "rows": report["counts"]["input_rows"]}


def chat_text(row: dict) -> str:
    return "\n".join(m["content"] for m in row["messages"])


def run_lmeval(corpus: Path, specs: list, lmeval_path: str) -> dict:
    """lm-eval-harness's Janitor (13-grams), loaded from its own file in the install."""
    janitor_file = Path(lmeval_path) / "lm_eval" / "decontamination" / "janitor.py"
    spec = importlib.util.spec_from_file_location("lmeval_janitor", janitor_file)
    mod = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(stdio.StringIO()), contextlib.redirect_stderr(stdio.StringIO()):
        spec.loader.exec_module(mod)   # prints that its C++ helper is missing: python mode
    jan = mod.Janitor()
    for s in specs:
        with open(s["path"], encoding="utf-8") as f:
            for line in f:
                jan.register_contaminant_python(json.loads(line)[s["fields"][0]])
    t0 = time.time()
    flagged = set()
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            text = chat_text(row)
            # Janitor.clean_python's test for a contaminated n-gram
            if any(jan.normalize_string(ng) in jan.dirt_ngrams
                   for ng, _ in mod.word_ngrams_indices(text, jan.ngram_n)):
                flagged.add(row["id"])
    return {"flagged": flagged, "wall_s": time.time() - t0}


def run_openr1(corpus: Path, specs: list, n: int = 8) -> dict:
    """open-r1's scripts/decontaminate.py, re-implemented: lowercase, split on whitespace,
    any shared word 8-gram."""
    def grams(text: str) -> set[str]:
        words = text.lower().split()
        return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}

    lookup: set[str] = set()
    for s in specs:
        with open(s["path"], encoding="utf-8") as f:
            for line in f:
                lookup |= grams(json.loads(line)[s["fields"][0]])
    t0 = time.time()
    flagged = set()
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if grams(row["messages"][0]["content"]) & lookup:   # it checks the problem column
                flagged.add(row["id"])
    return {"flagged": flagged, "wall_s": time.time() - t0}


def score(flagged: set[str], truth: dict) -> dict:
    by_form: dict[str, list[int]] = {}
    for rid, t in truth.items():
        by_form.setdefault(t["form"], []).append(int(rid in flagged))
    positives = [f for f in FORMS if f != "new_numbers"]
    tp = sum(1 for rid in flagged if truth[rid]["form"] in positives)
    fp = sum(1 for rid in flagged if truth[rid]["bench"] is None)
    all_pos = sum(len(by_form[f]) for f in positives)
    return {"recall": {f: round(float(np.mean(by_form[f])), 4) for f in FORMS if f in by_form},
            "recall_all": round(tp / max(1, all_pos), 4),
            "precision": round(tp / max(1, tp + fp), 4), "false_flags": fp,
            "false_flags_by_kind": {k: int(sum(v)) for k, v in by_form.items()
                                    if k not in FORMS and sum(v)},
            "new_numbers_flagged": int(sum(by_form.get("new_numbers", [])))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/curate_decontam")
    ap.add_argument("--per-form", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--lmeval-path", default=None, help="a `pip install --target` dir holding lm-eval")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a decontaminate setting (e.g. partial_min_ngrams=3)")
    ap.add_argument("--show-false-flags", type=int, default=0)
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus, truth, specs = generate(work, args.per_form, args.seed)
    counts = {}
    for t in truth.values():
        counts[t["form"]] = counts.get(t["form"], 0) + 1
    print(f"corpus: {len(truth)} rows {json.dumps(counts)}", flush=True)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    ours = run_ours(corpus, specs, work, args.num_proc, overrides)
    res = {"rows": len(truth), "forms": counts, "settings": overrides,
           "data_curation": {**score(ours["flagged"], truth),
                             "new_numbers_reported": sum(1 for r in ours["new_numbers"]
                                                         if truth[r]["form"] == "new_numbers"),
                             "new_numbers_reported_other": sum(1 for r in ours["new_numbers"]
                                                               if truth[r]["form"] != "new_numbers"),
                             "wall_s": round(ours["wall_s"], 2), "step_s": ours["step_s"],
                             "docs_per_s": round(ours["rows"] / ours["step_s"], 1)}}
    if args.show_false_flags:
        bad = [rid for rid in ours["flagged"] if truth[rid]["bench"] is None][: args.show_false_flags]
        missed = [rid for rid, t in truth.items() if t["form"] in ("partial", "homoglyph", "embedded", "format")
                  and rid not in ours["flagged"]][: args.show_false_flags]
        rows = {json.loads(x)["id"]: json.loads(x) for x in open(corpus, encoding="utf-8")}
        det = {json.loads(x)["id"]: json.loads(x) for x in open(work / "ours" / "removed.jsonl", encoding="utf-8")}
        for rid in bad:
            print("FALSE", rid, json.dumps(det[rid]["detail"]["hits"][0])[:400])
        for rid in missed:
            print("MISSED", rid, rows[rid]["messages"][0]["content"][:300].replace("\n", " "))
    res["openr1_8gram"] = {**score(run_openr1(corpus, specs)["flagged"], truth)}
    if args.lmeval_path:
        lm = run_lmeval(corpus, specs, args.lmeval_path)
        res["lmeval_janitor_13gram"] = {**score(lm["flagged"], truth), "wall_s": round(lm["wall_s"], 2)}
    (work / "results.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

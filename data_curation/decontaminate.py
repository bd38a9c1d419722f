"""Decontamination against benchmark sets, on prompt and response separately.

Every (benchmark row, text field) is an item (benchmarks.py), normalised like the training
text (normalize.py: Unicode, confusables, apostrophes, case, LaTeX). A training field is
contaminated by an item when
- exact: its normalised text equals the item's;
- containment: the item's whole token sequence occurs inside it (a GSM8K question pasted
  into a longer prompt), for items of at least `min_containment_tokens` tokens;
- ngram: at least `ngram_threshold` of the item's distinct word n-grams occur in it (a
  lightly edited copy);
- partial: at least `partial_min_ngrams` of the item's *distinctive* n-grams occur in it
  (one key sentence of a longer problem); an n-gram found in more than
  `partial_max_items` benchmark items is boilerplate ("where m and n are relatively
  prime positive integers") and is no evidence of a partial copy.
Matching is number-aware: candidates are found with every number-bearing token masked,
then checked again with the numbers. A match that holds only with the numbers masked is a
"same template, new numbers" hit (`numbers_changed: true`): a new problem, reported on its
own and kept (`new_numbers: keep`) or removed (`new_numbers: remove`), never counted as
contamination. Templates are only matched for items of at least 8 words: a short item
with new numbers ("Compute 3 + 4") is just another problem.

N-gram hashes of all items go into one sorted array; a batch of training text is hashed
in bulk and looked up with one `searchsorted` behind a bitmap prefilter, so only texts
with hits reach Python-level attribution. Every hit of a row is kept (strongest first),
naming benchmark, file, 1-based row, the benchmark's own id, field, method, overlap and
the matched span; the step's report lists every benchmark item found (the contamination
manifest).
"""
from __future__ import annotations

import hashlib
from typing import Any, Literal

import numpy as np
from pydantic import Field

from data_curation._base import bump
from data_curation.benchmark_index import FILTER_SIZE, TEMPLATE_MIN_WORDS, BenchmarkIndex, masked_text
from data_curation.benchmarks import BenchmarkList, BenchmarkSpec, resolve_benchmarks
from data_curation.discovery import discover
from data_curation.hashing import TokenBatch, masked_word_hashes, ngram_hashes
from data_curation.normalize import NormalizeConfig, Normalizer
from data_curation.step_api import Decision, RunContext, StepConfig, StepRunner
from data_curation.urls import is_local, local_path

# hits recorded per training row (the count of all of them is kept)
MAX_HITS_PER_ROW = 20
METHOD_RANK = {"exact": 4, "containment": 3, "ngram": 2, "partial": 1}


class DecontaminateConfig(StepConfig):
    step: Literal["decontaminate"] = "decontaminate"
    benchmarks: BenchmarkList
    check: list[Literal["prompt", "response"]] = Field(["prompt", "response"], min_length=1)
    exact: bool = True
    containment: bool = True
    min_containment_tokens: int = Field(4, ge=1, description="shorter items are only matched "
                                                             "exactly")
    ngram: int = Field(8, ge=2, le=32)
    ngram_threshold: float = Field(0.5, gt=0, le=1, description="fraction of an item's distinct "
                                   "n-grams found in a training field that flags it")
    partial: bool = True
    partial_min_ngrams: int = Field(4, ge=1, description="distinctive n-grams of one item that "
                                    "flag a training field as a partial copy")
    partial_max_items: int = Field(1, ge=1, description="an n-gram in more benchmark items than "
                                   "this is boilerplate, not evidence of a partial copy")
    new_numbers: Literal["keep", "remove"] = Field(
        "keep", description="rows matching an item only with their numbers changed: reported, "
                            "and kept or removed")
    normalize: NormalizeConfig = NormalizeConfig()
    max_examples: int = Field(5, ge=0, description="example pairs per benchmark in the report")

    def identity(self, ctx: RunContext) -> Any:
        specs = resolve_benchmarks(self.benchmarks, ctx.storage_options)
        return {**self.model_dump(mode="json", exclude={"name", "benchmarks", "max_examples"}),
                "benchmarks": [{**s.model_dump(mode="json"), "content": _content_identity(s, ctx)}
                               for s in specs]}

    def modules(self) -> tuple[str, ...]:
        return (type(self).__module__, "data_curation.benchmarks", "data_curation.benchmark_index")

    def build(self, ctx: RunContext) -> "Decontaminate":
        specs = resolve_benchmarks(self.benchmarks, ctx.storage_options)
        return Decontaminate(self, BenchmarkIndex.build(specs, self, ctx.storage_options))


def _content_identity(spec: BenchmarkSpec, ctx: RunContext) -> list[Any]:
    """sha256 of local benchmark files; size/etag/mtime of remote ones and dataset dirs."""
    out: list[Any] = []
    for s in discover([spec.data_input()], ctx.storage_options):
        if is_local(s.url) and s.fmt != "hf":
            h = hashlib.sha256()
            with open(local_path(s.url), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out.append({"url": s.url, "sha256": h.hexdigest()})
        else:
            out.append({"url": s.url, "split": s.split, "identity": s.identity})
    return out


class Decontaminate(StepRunner):
    mode = "rows"

    def __init__(self, cfg: DecontaminateConfig, index: BenchmarkIndex):
        self.cfg = cfg
        self.index = index
        self.norm = Normalizer(cfg.normalize)

    def _hit(self, item: int, method: str, part: str, overlap: float, span: str,
             numbers_changed: bool) -> dict[str, Any]:
        it = self.index.items[item]
        return {"benchmark": it.benchmark, "benchmark_file": it.file, "benchmark_row": it.row,
                "benchmark_id": it.native_id, "benchmark_field": it.field, "method": method,
                "numbers_changed": numbers_changed, "train_field": part,
                "overlap": round(float(overlap), 4), "span": span[:300]}

    def check_texts(self, texts: list[str], parts: list[str]) -> list[list[dict]]:
        """Every contamination hit of each text (at most one per item, the strongest),
        strongest first; [] if clean."""
        import xxhash

        cfg, ix, n = self.cfg, self.index, self.cfg.ngram
        toks = [self.norm.tokens(t) for t in texts]
        norms = [" ".join(t) for t in toks]
        found: list[dict[int, dict]] = [{} for _ in texts]

        def offer(i: int, item: int, hit: dict) -> None:
            cur = found[i].get(item)
            if cur is None or _strength(hit) > _strength(cur):
                found[i][item] = hit

        digest = lambda s: xxhash.xxh3_128_digest(s.encode("utf-8", "surrogatepass"))  # noqa: E731
        masked_cache: dict[int, str] = {}

        def masked(i: int) -> str:
            if i not in masked_cache:
                masked_cache[i] = masked_text(toks[i])
            return masked_cache[i]

        raw_flat, masked_flat, lengths = masked_word_hashes(toks, norms)
        batch = TokenBatch(masked_flat, lengths)
        if cfg.exact:
            wholes = batch.whole().tolist() if ix.exact_masked else None
            for i, s in enumerate(norms):
                if not s:
                    continue
                for item in ix.exact.get(digest(s), ()):
                    offer(i, item, self._hit(item, "exact", parts[i], 1.0, s, False))
                if not found[i] and wholes is not None:
                    for item in ix.exact_masked.get(wholes[i], ()):
                        if ix.items[item].masked == masked(i):
                            offer(i, item, self._hit(item, "exact", parts[i], 1.0, s, True))
        if len(ix.ng_hash):
            h, doc, pos = batch.ngrams(n)
            # bitmap prefilter, then an exact lookup of the few candidates
            cand = np.nonzero(ix.filter[(h & np.uint64(FILTER_SIZE - 1)).astype(np.int64)])[0]
            k = np.zeros(len(h), dtype=np.int64)
            k[cand] = np.minimum(np.searchsorted(ix.ng_hash, h[cand]), len(ix.ng_hash) - 1)
            hit = np.zeros(len(h), dtype=bool)
            hit[cand] = ix.ng_hash[k[cand]] == h[cand]
            bounds = np.searchsorted(doc, np.arange(len(texts) + 1))
            for i in np.unique(doc[hit]).tolist():
                lo, hi = bounds[i], bounds[i + 1]
                hk = np.unique(k[lo:hi][hit[lo:hi]])
                items = np.concatenate([ix.ng_items[ix.ng_ptr[j]:ix.ng_ptr[j + 1]] for j in hk])
                items = np.unique(items)
                raw_row = None
                doc_h, doc_pos = h[lo:hi], pos[lo:hi]
                for item in items.tolist():
                    if not self._candidate(item, doc_h):
                        continue
                    if raw_row is None:   # raw n-gram hashes by position, aligned with doc_h
                        start = int(batch.starts[i])
                        raw_row = ngram_hashes(raw_flat[start:start + lengths[i]], lengths[i:i + 1], n)[0]
                    verdict = self._classify(item, doc_h, raw_row, norms[i], masked(i))
                    if verdict is None:
                        continue
                    method, overlap, changed = verdict
                    m = np.isin(doc_h, ix.masked_pos[item])
                    a, b = int(doc_pos[m].min()), int(doc_pos[m].max()) + n
                    offer(i, item, self._hit(item, method, parts[i], overlap, " ".join(toks[i][a:b]),
                                             changed))
        for L, table in ix.short.items():
            h, doc, pos = batch.ngrams(L)
            for j in np.nonzero(np.isin(h, ix.short_keys[L]))[0].tolist():
                i = int(doc[j])
                for item in table[int(h[j])]:
                    if f" {ix.items[item].norm} " in f" {norms[i]} ":
                        p = int(pos[j])
                        offer(i, item, self._hit(item, "containment", parts[i], 1.0,
                                                 " ".join(toks[i][p:p + L]), False))
        return [sorted(f.values(), key=_strength, reverse=True) for f in found]

    def _candidate(self, item: int, doc_h: np.ndarray) -> bool:
        """Whether the masked n-grams of a text could support any method for the item."""
        cfg, ix = self.cfg, self.index
        present = np.isin(ix.masked_pos[item], doc_h)
        if len(np.unique(ix.masked_pos[item][present])) >= cfg.ngram_threshold * ix.n_masked[item]:
            return True
        return cfg.partial and (
            len(np.unique(ix.masked_pos[item][present & ix.distinctive[item]])) >= cfg.partial_min_ngrams
            or len(np.unique(ix.raw_pos[item][present & ix.distinctive_raw[item]])) >= cfg.partial_min_ngrams)

    def _classify(self, item: int, doc_h: np.ndarray, raw_row: np.ndarray, norm: str, masked: str
                  ) -> tuple[str, float, bool] | None:
        """(method, overlap, numbers changed) of a candidate item for one text, or None.

        A copy: the raw n-grams support a method, and the text's n-grams that match the
        item's template all match its numbers too (or the whole item is there). Same
        template, new numbers: the masked n-grams support a method and some matched n-gram
        of the text carries other numbers than the item."""
        ix = self.index
        it = ix.items[item]
        copy, frac_raw = self._method(ix.raw_pos[item], np.isin(ix.raw_pos[item], raw_row), ix.n_raw[item],
                                      ix.distinctive_raw[item], it.norm, norm)
        template_rows = np.isin(doc_h, ix.masked_pos[item])
        numbers_differ = not np.isin(raw_row[template_rows], ix.raw_pos[item]).all()
        if copy is not None and (frac_raw >= 1.0 or not numbers_differ):
            return copy, frac_raw, False
        if numbers_differ and it.n_words >= TEMPLATE_MIN_WORDS:
            template, frac = self._method(ix.masked_pos[item], np.isin(ix.masked_pos[item], doc_h),
                                          ix.n_masked[item], ix.distinctive[item], it.masked, masked)
            if template is not None:
                return template, frac, True
        return (copy, frac_raw, False) if copy is not None else None

    def _method(self, hashes: np.ndarray, present: np.ndarray, total: int, distinctive: np.ndarray,
                item_text: str, text: str) -> tuple[str | None, float]:
        """The strongest method that an item's n-grams (`hashes` by position, `present` in
        the text) support, and the share of its distinct n-grams present."""
        cfg = self.cfg
        frac = len(np.unique(hashes[present])) / max(1, total)
        if cfg.containment and frac >= 1.0 and f" {item_text} " in f" {text} ":
            return "containment", frac
        if frac >= cfg.ngram_threshold:
            return "ngram", frac
        if cfg.partial and len(np.unique(hashes[present & distinctive])) >= cfg.partial_min_ngrams:
            return "partial", frac
        return None, frac

    def process(self, table) -> Decision:
        n = table.num_rows
        cols = {"prompt": table.column("_prompt").to_pylist(),
                "response": table.column("_response").to_pylist()}
        texts, owners, parts = [], [], []
        for part in self.cfg.check:
            for i, t in enumerate(cols[part]):
                if t:
                    texts.append(t)
                    owners.append(i)
                    parts.append(part)
        per_row: dict[int, list[dict]] = {}
        for i, hits in zip(owners, self.check_texts(texts, parts)):
            if hits:
                per_row.setdefault(i, []).extend(hits)
        keep = np.ones(n, dtype=bool)
        reasons: list[str | None] = [None] * n
        details: list[dict | None] = [None] * n
        rows = table.column("_row").to_pylist()
        stats: dict[str, Any] = {"benchmarks": {}, "items": {}, "new_numbers_items": {}}
        for i, hits in sorted(per_row.items()):
            hits.sort(key=_strength, reverse=True)
            copies = [h for h in hits if not h["numbers_changed"]]
            if not copies and self.cfg.new_numbers == "keep" and hits:
                self._count(stats, rows[i], hits, removed=False)
                continue
            keep[i] = False
            reasons[i] = "contamination" if copies else "same_template_new_numbers"
            details[i] = {"hits": hits[:MAX_HITS_PER_ROW], "hits_total": len(hits)}
            self._count(stats, rows[i], hits, removed=True)
        return Decision(keep, reasons, details, stats=stats)

    def _count(self, stats: dict[str, Any], row: int, hits: list[dict], removed: bool) -> None:
        copies = [h for h in hits if not h["numbers_changed"]]
        top = hits[0]
        b = stats["benchmarks"].setdefault(top["benchmark"], {
            "rows_flagged": 0, "rows_new_numbers": 0, "by_method": {}, "by_train_field": {},
            "examples": [], "new_numbers_examples": []})
        if copies:
            b["rows_flagged"] += 1
            bump(b["by_method"], top["method"])
            bump(b["by_train_field"], top["train_field"])
            if len(b["examples"]) < self.cfg.max_examples:
                b["examples"].append({"row": row, **top})
        else:
            b["rows_new_numbers"] += 1
            if len(b["new_numbers_examples"]) < self.cfg.max_examples:
                b["new_numbers_examples"].append({"row": row, "removed": removed, **top})
        per_item: dict[tuple[str, str], dict] = {}   # (kind, benchmark row) -> strongest hit
        for h in hits:   # strongest first
            kind = "new_numbers_items" if h["numbers_changed"] else "items"
            per_item.setdefault((kind, f"{h['benchmark']}\x1f{h['benchmark_file']}\x1f{h['benchmark_row']}"), h)
        for (kind, key), h in per_item.items():
            entry = stats[kind].setdefault(key, {"rows": 0, "methods": {}})
            entry["rows"] += 1
            bump(entry["methods"], h["method"])

    def summarize(self, stats: dict[str, Any]) -> dict[str, Any]:
        per = {}
        found = self._items(stats.get("items", {}))
        changed = self._items(stats.get("new_numbers_items", {}))
        for name, info in self.index.per_benchmark.items():
            s = stats.get("benchmarks", {}).get(name, {})
            per[name] = {**info, "rows_flagged": s.get("rows_flagged", 0),
                         "items_found": sum(1 for x in found if x["benchmark"] == name),
                         "by_method": s.get("by_method", {}),
                         "by_train_field": s.get("by_train_field", {}),
                         "rows_new_numbers": s.get("rows_new_numbers", 0),
                         "items_new_numbers": sum(1 for x in changed if x["benchmark"] == name),
                         "examples": s.get("examples", [])[: self.cfg.max_examples],
                         "new_numbers_examples": s.get("new_numbers_examples", [])[: self.cfg.max_examples]}
        c = self.cfg
        return {"benchmarks": per, "items_indexed": len(self.index.items),
                "contaminated_items": found, "new_numbers_items": changed,
                "methods": {"exact": c.exact, "containment": c.containment and
                            {"min_tokens": c.min_containment_tokens},
                            "ngram": {"n": c.ngram, "threshold": c.ngram_threshold},
                            "partial": c.partial and {"min_ngrams": c.partial_min_ngrams,
                                                      "max_items": c.partial_max_items},
                            "new_numbers": c.new_numbers,
                            "normalize": c.normalize.model_dump(mode="json")}}

    def _items(self, counts: dict[str, dict]) -> list[dict[str, Any]]:
        out = []
        for key, v in counts.items():
            it = self.index.rows[key]
            out.append({"benchmark": it.benchmark, "benchmark_file": it.file, "benchmark_row": it.row,
                        "benchmark_id": it.native_id, "training_rows": v["rows"],
                        "methods": dict(sorted(v["methods"].items()))})
        return sorted(out, key=lambda x: (x["benchmark"], x["benchmark_file"], x["benchmark_row"]))


def _strength(hit: dict) -> tuple:
    return (not hit["numbers_changed"], METHOD_RANK[hit["method"]], hit["overlap"])

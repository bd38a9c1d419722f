"""Decontamination against benchmark sets, on prompt and response separately.

A benchmark list names files / fsspec URLs / Hugging Face dataset directories and, for
each, the fields that hold benchmark text (real files differ: `problem`, `question`,
...). Every (benchmark row, field) is an item, normalised like the training text
(normalize.py). A training field is contaminated by an item when
- exact: its normalised text equals the item's;
- containment: the item's whole token sequence occurs inside it (a GSM8K question pasted
  into a longer prompt), for items of at least `min_containment_tokens` tokens;
- ngram: at least `ngram_threshold` of the item's distinct word n-grams (13 by default)
  occur in it (a lightly edited copy).
N-gram hashes of all items go into one sorted array; a batch of training text is hashed
in bulk and looked up with one `searchsorted`, so only rows with hits reach Python-level
attribution (which item, which method, the matched span).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from data_curation._base import CurationError, Strict, bump
from data_curation.normalize import NormalizeConfig, Normalizer
from data_curation.step_api import Decision, RunContext, StepConfig, StepRunner


class BenchmarkSpec(Strict):
    path: str = Field(description="file, fsspec URL, or Hugging Face dataset directory")
    fields: list[str] = Field(min_length=1, description="fields holding benchmark text")
    name: str | None = Field(None, description="label in reports (default: file stem)")
    split: str | None = Field(None, description="split of a DatasetDict directory")

    @property
    def label(self) -> str:
        return self.name or Path(self.path.rstrip("/")).name.split(".")[0]


def load_benchmark_list(url: str, storage_options: dict | None = None) -> list[BenchmarkSpec]:
    """A YAML/JSON list of `{path, fields, name}` (or `{benchmarks: [...]}`); relative paths
    are relative to the list file."""
    import yaml

    from data_curation.io import fs_path, is_local, local_path, norm_url

    full = norm_url(url)
    fs, p = fs_path(full, storage_options)
    if not fs.exists(p):
        raise CurationError(f"benchmark list {url} does not exist")
    with fs.open(p, "r", encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise CurationError(f"benchmark list {url}: not valid YAML: {e}") from e
    if isinstance(data, dict) and "benchmarks" in data:
        data = data["benchmarks"]
    if not isinstance(data, list) or not data:
        raise CurationError(f"benchmark list {url}: expected a non-empty list of "
                            "{path, fields, name} entries")
    base = full.rsplit("/", 1)[0]
    out = []
    for i, entry in enumerate(data):
        try:
            spec = BenchmarkSpec.model_validate(entry)
        except Exception as e:  # pydantic ValidationError: name the entry
            raise CurationError(f"benchmark list {url}, entry {i + 1}: {e}") from e
        if "://" not in spec.path and not spec.path.startswith("/"):
            rel = f"{base}/{spec.path}"
            spec = spec.model_copy(update={"path": str(Path(local_path(rel)).resolve())
                                           if is_local(rel) else rel})
        out.append(spec)
    return out


def resolve_benchmarks(benchmarks: list[BenchmarkSpec] | str, storage_options: dict | None
                       ) -> list[BenchmarkSpec]:
    if isinstance(benchmarks, str):
        return load_benchmark_list(benchmarks, storage_options)
    return list(benchmarks)


class DecontaminateConfig(StepConfig):
    step: Literal["decontaminate"] = "decontaminate"
    benchmarks: list[BenchmarkSpec] | str = Field(
        description="benchmark entries, or the path/URL of a YAML list of them")
    check: list[Literal["prompt", "response"]] = Field(["prompt", "response"], min_length=1)
    exact: bool = True
    containment: bool = True
    min_containment_tokens: int = Field(8, ge=1, description="shorter items are only matched "
                                                             "exactly")
    ngram: int = Field(13, ge=2, le=32)
    ngram_threshold: float = Field(0.5, gt=0, le=1, description="fraction of an item's distinct "
                                   "n-grams found in a training field that flags it")
    normalize: NormalizeConfig = NormalizeConfig()
    max_examples: int = Field(5, ge=0, description="example pairs per benchmark in the report")

    def identity(self, ctx: RunContext) -> Any:
        specs = resolve_benchmarks(self.benchmarks, ctx.storage_options)
        return {**self.model_dump(mode="json", exclude={"name", "benchmarks", "max_examples"}),
                "benchmarks": [{**s.model_dump(mode="json"), "content": _content_identity(s, ctx)}
                               for s in specs]}

    def build(self, ctx: RunContext) -> "Decontaminate":
        specs = resolve_benchmarks(self.benchmarks, ctx.storage_options)
        return Decontaminate(self, BenchmarkIndex.build(specs, self, ctx.storage_options))


def _content_identity(spec: BenchmarkSpec, ctx: RunContext) -> list[Any]:
    """sha256 of local benchmark files; size/etag/mtime of remote ones and dataset dirs."""
    from data_curation.io import discover, is_local, local_path

    out: list[Any] = []
    for s in discover([spec.path], ctx.storage_options):
        if is_local(s.url) and s.fmt != "hf":
            h = hashlib.sha256()
            with open(local_path(s.url), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out.append({"url": s.url, "sha256": h.hexdigest()})
        else:
            out.append({"url": s.url, "split": s.split, "identity": s.identity})
    return out


def iter_benchmark_rows(spec: BenchmarkSpec, storage_options: dict | None):
    """(source label, row index, row dict) of a benchmark; bad rows are errors (they are
    reference data, not training data)."""
    import json

    import fsspec

    from data_curation.io import discover, iter_batches

    sources = discover([spec.path], storage_options)
    if spec.split is not None:
        sources = [s for s in sources if s.split in (None, spec.split)]
        if not sources:
            raise CurationError(f"benchmark {spec.label}: no split {spec.split!r} in {spec.path}")
    for s in sources:
        if s.fmt == "jsonl":
            with fsspec.open(s.url, "rt", encoding="utf-8", compression=s.compression,
                             **(storage_options or {})) as f:
                head = f.read(1 << 16)
                f.seek(0)
                if head.lstrip().startswith("["):
                    rows = json.load(f)
                    for i, r in enumerate(rows):
                        yield s.label, i, r
                    continue
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        yield s.label, i, json.loads(line)
                    except json.JSONDecodeError as e:
                        raise CurationError(f"benchmark {spec.label}: {s.url} line {i + 1}: "
                                            f"invalid JSON ({e.msg})") from e
        else:
            i = 0
            for batch in iter_batches(s, storage_options, 1000):
                keys = list(batch)
                for vals in zip(*(batch[k] for k in keys)):
                    yield s.label, i, dict(zip(keys, vals))
                    i += 1


_FILTER_SIZE = 1 << 23


class BenchmarkIndex:
    """Normalised benchmark items and their hashes (built once, in the main process)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []   # name, file, row, field, norm, n_tokens
        self.exact: dict[bytes, list[int]] = {}
        self.ng_hash = np.zeros(0, np.uint64)    # sorted unique n-gram hashes
        self.ng_ptr = np.zeros(1, np.int64)      # CSR: items of ng_hash[k] = ng_items[ptr[k]:ptr[k+1]]
        self.ng_items = np.zeros(0, np.int64)
        self.item_ngrams: list[np.ndarray] = []  # distinct n-gram hashes per item
        self.short: dict[int, dict[int, list[int]]] = {}  # L -> whole-item L-gram hash -> items
        self.filter = np.zeros(0, dtype=bool)    # bitmap prefilter of ng_hash (low bits)
        self.per_benchmark: dict[str, dict[str, Any]] = {}

    @classmethod
    def build(cls, specs: list[BenchmarkSpec], cfg: DecontaminateConfig,
              storage_options: dict | None) -> "BenchmarkIndex":
        import xxhash

        from data_curation.hashing import ngram_hashes, word_hashes

        if not specs:
            raise CurationError("decontaminate: the benchmark list is empty")
        labels = [s.label for s in specs]
        dup = {x for x in labels if labels.count(x) > 1}
        if dup:
            raise CurationError(f"decontaminate: benchmark names must be unique, repeated: {sorted(dup)} "
                                "(set `name:` on the entries)")
        norm = Normalizer(cfg.normalize)
        self = cls()
        token_lists: list[list[str]] = []
        for spec in specs:
            n_rows, seen_fields, present = 0, set(), set()
            for file_label, i, row in iter_benchmark_rows(spec, storage_options):
                n_rows += 1
                if not isinstance(row, dict):
                    raise CurationError(f"benchmark {spec.label}: {file_label} row {i + 1} is not an object")
                seen_fields.update(row)
                for fld in spec.fields:
                    v = row.get(fld)
                    if v is None:
                        continue
                    present.add(fld)
                    text = v if isinstance(v, str) else str(v)
                    toks = norm.tokens(text)
                    if not toks:
                        continue
                    self.items.append({"benchmark": spec.label, "file": file_label, "row": i,
                                       "field": fld, "norm": " ".join(toks), "n_tokens": len(toks)})
                    token_lists.append(toks)
            missing = [f for f in spec.fields if f not in present]
            if n_rows == 0:
                raise CurationError(f"benchmark {spec.label}: {spec.path} has no rows")
            if missing and not present:
                raise CurationError(
                    f"benchmark {spec.label}: field(s) {missing} not found in any row of {spec.path}; "
                    f"fields present: {sorted(seen_fields)}")
            self.per_benchmark[spec.label] = {"path": spec.path, "rows": n_rows,
                                              "fields": spec.fields, "missing_fields": missing}
        for k, it in enumerate(self.items):
            self.exact.setdefault(xxhash.xxh3_128_digest(it["norm"].encode("utf-8", "surrogatepass")),
                                  []).append(k)
        flat, lengths = word_hashes(token_lists)
        h, doc, _ = ngram_hashes(flat, lengths, cfg.ngram)
        pairs = np.unique(np.stack([h, doc.astype(np.uint64)], axis=1), axis=0)
        self.ng_hash, first = np.unique(pairs[:, 0], return_index=True)
        self.ng_ptr = np.append(first, len(pairs)).astype(np.int64)
        self.ng_items = pairs[:, 1].astype(np.int64)
        self.filter = np.zeros(_FILTER_SIZE, dtype=bool)
        self.filter[(self.ng_hash & np.uint64(_FILTER_SIZE - 1)).astype(np.int64)] = True
        bounds = np.searchsorted(doc, np.arange(len(self.items) + 1))
        self.item_ngrams = [np.unique(h[bounds[k]:bounds[k + 1]]) for k in range(len(self.items))]
        if cfg.containment:
            starts = np.concatenate([[0], np.cumsum(lengths)])
            for k, it in enumerate(self.items):
                L = it["n_tokens"]
                if cfg.min_containment_tokens <= L < cfg.ngram:
                    whole, _, _ = ngram_hashes(flat[starts[k]:starts[k + 1]], np.array([L]), L)
                    self.short.setdefault(L, {}).setdefault(int(whole[0]), []).append(k)
        for name in self.per_benchmark:
            self.per_benchmark[name]["items"] = sum(1 for it in self.items if it["benchmark"] == name)
        return self


class Decontaminate(StepRunner):
    mode = "rows"

    def __init__(self, cfg: DecontaminateConfig, index: BenchmarkIndex):
        self.cfg = cfg
        self.index = index
        self.norm = Normalizer(cfg.normalize)

    def _hit(self, item: int, method: str, part: str, overlap: float, span: str) -> dict[str, Any]:
        it = self.index.items[item]
        return {"benchmark": it["benchmark"], "benchmark_file": it["file"],
                "benchmark_row": it["row"], "benchmark_field": it["field"], "method": method,
                "train_field": part, "overlap": round(overlap, 4), "span": span[:300]}

    def check_texts(self, texts: list[str], parts: list[str]) -> list[dict | None]:
        """The strongest contamination hit of each text (None if clean)."""
        import xxhash

        from data_curation.hashing import TokenBatch, word_hashes

        cfg, ix = self.cfg, self.index
        toks = [self.norm.tokens(t) for t in texts]
        norms = [" ".join(t) for t in toks]
        out: list[dict | None] = [None] * len(texts)
        rank = {"exact": 3, "containment": 2, "ngram": 1}

        def offer(i: int, hit: dict) -> None:
            cur = out[i]
            if cur is None or (rank[hit["method"]], hit["overlap"]) > (rank[cur["method"]], cur["overlap"]):
                out[i] = hit

        if cfg.exact:
            for i, s in enumerate(norms):
                if s:
                    items = ix.exact.get(xxhash.xxh3_128_digest(s.encode("utf-8", "surrogatepass")))
                    if items:
                        offer(i, self._hit(items[0], "exact", parts[i], 1.0, s))
        batch = TokenBatch(*word_hashes(toks))
        if len(ix.ng_hash):
            h, doc, pos = batch.ngrams(cfg.ngram)
            # bitmap prefilter, then an exact lookup of the few candidates
            cand = np.nonzero(ix.filter[(h & np.uint64(_FILTER_SIZE - 1)).astype(np.int64)])[0]
            k = np.zeros(len(h), dtype=np.int64)
            k[cand] = np.minimum(np.searchsorted(ix.ng_hash, h[cand]), len(ix.ng_hash) - 1)
            hit = np.zeros(len(h), dtype=bool)
            hit[cand] = ix.ng_hash[k[cand]] == h[cand]
            bounds = np.searchsorted(doc, np.arange(len(texts) + 1))
            for i in np.unique(doc[hit]).tolist():
                lo, hi = bounds[i], bounds[i + 1]
                hk = np.unique(k[lo:hi][hit[lo:hi]])
                cand = np.concatenate([ix.ng_items[ix.ng_ptr[j]:ix.ng_ptr[j + 1]] for j in hk])
                items, counts = np.unique(cand, return_counts=True)
                doc_h, doc_pos = h[lo:hi], pos[lo:hi]
                for item, c in zip(items.tolist(), counts.tolist()):
                    frac = c / len(ix.item_ngrams[item])
                    method = None
                    if frac >= 1.0 and cfg.containment and \
                            f" {ix.items[item]['norm']} " in f" {norms[i]} ":
                        method = "containment"
                    elif frac >= cfg.ngram_threshold:
                        method = "ngram"
                    if method is None:
                        continue
                    m = np.isin(doc_h, ix.item_ngrams[item])
                    a, b = int(doc_pos[m].min()), int(doc_pos[m].max()) + cfg.ngram
                    offer(i, self._hit(item, method, parts[i], frac, " ".join(toks[i][a:b])))
        for L, table in ix.short.items():
            h, doc, pos = batch.ngrams(L)
            for j in np.nonzero(np.isin(h, np.fromiter(table, np.uint64, len(table))))[0].tolist():
                i = int(doc[j])
                for item in table[int(h[j])]:
                    if f" {ix.items[item]['norm']} " in f" {norms[i]} ":
                        p = int(pos[j])
                        offer(i, self._hit(item, "containment", parts[i], 1.0,
                                           " ".join(toks[i][p:p + L])))
        return out

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
        hits = self.check_texts(texts, parts)
        best: dict[int, dict] = {}
        rank = {"exact": 3, "containment": 2, "ngram": 1}
        for i, h in zip(owners, hits):
            if h is not None and (i not in best or
                                  (rank[h["method"]], h["overlap"]) >
                                  (rank[best[i]["method"]], best[i]["overlap"])):
                best[i] = h
        keep = np.ones(n, dtype=bool)
        reasons: list[str | None] = [None] * n
        details: list[dict | None] = [None] * n
        rows = table.column("_row").to_pylist()
        stats: dict[str, Any] = {"benchmarks": {}}
        for i, h in sorted(best.items()):
            keep[i] = False
            reasons[i] = "contamination"
            details[i] = h
            b = stats["benchmarks"].setdefault(h["benchmark"], {
                "rows_flagged": 0, "by_method": {}, "by_train_field": {}, "benchmark_rows_hit": {},
                "examples": []})
            b["rows_flagged"] += 1
            bump(b["by_method"], h["method"])
            bump(b["by_train_field"], h["train_field"])
            bump(b["benchmark_rows_hit"], f"{h['benchmark_file']}#{h['benchmark_row']}")
            if len(b["examples"]) < self.cfg.max_examples:
                b["examples"].append({"row": rows[i], **h})
        return Decision(keep, reasons, details, stats=stats)

    def summarize(self, stats: dict[str, Any]) -> dict[str, Any]:
        per = {}
        for name, info in self.index.per_benchmark.items():
            s = stats.get("benchmarks", {}).get(name, {})
            per[name] = {**info, "rows_flagged": s.get("rows_flagged", 0),
                         "by_method": s.get("by_method", {}),
                         "by_train_field": s.get("by_train_field", {}),
                         "benchmark_rows_hit": len(s.get("benchmark_rows_hit", {})),
                         "examples": s.get("examples", [])[: self.cfg.max_examples]}
        return {"benchmarks": per, "items_indexed": len(self.index.items),
                "ngram": self.cfg.ngram, "ngram_threshold": self.cfg.ngram_threshold}

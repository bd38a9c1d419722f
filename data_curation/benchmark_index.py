"""The benchmark side of decontamination (decontaminate.py): every (benchmark row, text field)
as an `Item`, and the `BenchmarkIndex` over them: exact and template (numbers masked)
digests, word n-gram hashes in one sorted array with each n-gram's items, a bitmap
prefilter, the distinctive n-grams of each item, and whole-item hashes of short items."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from data_curation._base import CurationError
from data_curation.benchmarks import BenchmarkSpec, iter_benchmark_rows
from data_curation.hashing import NUMBER_TOKEN, TokenBatch, is_number_token, masked_word_hashes, ngram_hashes
from data_curation.normalize import Normalizer

if TYPE_CHECKING:
    from data_curation.decontaminate import DecontaminateConfig

# items with fewer words (non-number tokens) than this are never template-matched
TEMPLATE_MIN_WORDS = 8


@dataclass
class Item:
    benchmark: str
    file: str
    row: int                  # 1-based
    native_id: str | None
    field: str
    norm: str                 # normalised text
    masked: str               # normalised text, numbers masked
    n_tokens: int
    n_words: int

    @property
    def row_key(self) -> str:
        return f"{self.benchmark}\x1f{self.file}\x1f{self.row}"


FILTER_SIZE = 1 << 23
NUM = "\x00"   # a masked number in masked text (no token holds it)


def masked_text(tokens: list[str]) -> str:
    return " ".join(NUM if is_number_token(w) else w for w in tokens)


class BenchmarkIndex:
    """Normalised benchmark items and their n-gram hashes (built once, in the main process).

    Masked n-grams (numbers masked) find candidates; each item keeps its masked and raw
    n-gram hashes by position, so a candidate is checked with its numbers cheaply."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.exact: dict[bytes, list[int]] = {}          # normalised text -> items
        self.exact_masked: dict[int, list[int]] = {}     # masked whole-text hash -> items (>= 8 words)
        self.ng_hash = np.zeros(0, np.uint64)     # sorted unique masked n-gram hashes
        self.ng_ptr = np.zeros(1, np.int64)       # CSR: items of ng_hash[k] = ng_items[ptr[k]:ptr[k+1]]
        self.ng_items = np.zeros(0, np.int64)
        self.masked_pos: list[np.ndarray] = []    # per item: masked n-gram hash by position
        self.raw_pos: list[np.ndarray] = []       # per item: raw n-gram hash by position
        self.distinctive: list[np.ndarray] = []   # per item: masked n-gram in <= max items, by position
        self.distinctive_raw: list[np.ndarray] = []   # the same for the raw n-gram
        self.n_masked: np.ndarray = np.zeros(0, np.int64)   # distinct masked n-grams per item
        self.n_raw: np.ndarray = np.zeros(0, np.int64)      # distinct raw n-grams per item
        self.short: dict[int, dict[int, list[int]]] = {}    # L -> whole-item masked L-gram -> items
        self.short_keys: dict[int, np.ndarray] = {}          # L -> the keys of short[L], sorted
        self.filter = np.zeros(0, dtype=bool)     # bitmap prefilter of ng_hash (low bits)
        self.per_benchmark: dict[str, dict[str, Any]] = {}
        self.rows: dict[str, Item] = {}           # row key -> its first item

    @classmethod
    def build(cls, specs: list[BenchmarkSpec], cfg: "DecontaminateConfig",
              storage_options: dict | None) -> "BenchmarkIndex":
        import xxhash

        if not specs:
            raise CurationError("decontaminate: the benchmark list is empty")
        labels = [s.label for s in specs]
        dup = {x for x in labels if labels.count(x) > 1}
        if dup:
            raise CurationError(f"decontaminate: benchmark names must be unique, repeated: {sorted(dup)} "
                                "(set `name:` on the entries)")
        self = cls()
        token_lists = self._read_items(specs, Normalizer(cfg.normalize), storage_options)
        digest = lambda s: xxhash.xxh3_128_digest(s.encode("utf-8", "surrogatepass"))  # noqa: E731
        for k, it in enumerate(self.items):
            self.rows.setdefault(it.row_key, it)
            self.exact.setdefault(digest(it.norm), []).append(k)
        raw_flat, masked_flat, lengths = masked_word_hashes(token_lists)
        for k, whole in enumerate(TokenBatch(masked_flat, lengths).whole().tolist()):
            if self.items[k].n_words >= TEMPLATE_MIN_WORDS:
                self.exact_masked.setdefault(whole, []).append(k)
        self._index_ngrams(raw_flat, masked_flat, lengths, cfg)
        for name in self.per_benchmark:
            self.per_benchmark[name]["items"] = sum(1 for it in self.items if it.benchmark == name)
        return self

    def _read_items(self, specs: list[BenchmarkSpec], norm: Normalizer, storage_options: dict | None
                    ) -> list[list[str]]:
        """Every (benchmark row, text field) as an Item; returns each item's tokens."""
        token_lists: list[list[str]] = []
        for spec in specs:
            n_rows, seen_fields, present = 0, set(), set()
            for file_label, i, row in iter_benchmark_rows(spec, storage_options):
                n_rows += 1
                if not isinstance(row, dict):
                    raise CurationError(f"benchmark {spec.label}: {file_label} row {i} is not an object")
                seen_fields.update(row)
                native = spec.native_id(row)
                for fld in spec.fields:
                    v = row.get(fld)
                    if v is None:
                        continue
                    present.add(fld)
                    toks = norm.tokens(v if isinstance(v, str) else str(v))
                    if not toks:
                        continue
                    masked = masked_text(toks)
                    self.items.append(Item(spec.label, file_label, i, native, fld, " ".join(toks), masked,
                                           len(toks), sum(1 for w in masked.split(" ") if w != NUM)))
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
        return token_lists

    def _index_ngrams(self, raw_flat: np.ndarray, masked_flat: np.ndarray, lengths: np.ndarray,
                      cfg: "DecontaminateConfig") -> None:
        """The items' n-gram hashes (masked and raw), their document frequencies, the
        prefilter bitmap, and the whole-item hashes of items shorter than an n-gram."""
        n = cfg.ngram
        hm, doc, _ = ngram_hashes(masked_flat, lengths, n)
        hr, _, _ = ngram_hashes(raw_flat, lengths, n)
        # an n-gram of numbers only says nothing about a template: left out everywhere
        all_numbers, _, _ = ngram_hashes(np.full(n, NUMBER_TOKEN, np.uint64), np.array([n]), n)
        useful = hm != all_numbers[0]
        hm, hr, doc = hm[useful], hr[useful], doc[useful]
        pairs = np.unique(np.stack([hm, doc.astype(np.uint64)], axis=1), axis=0)
        self.ng_hash, first = np.unique(pairs[:, 0], return_index=True)
        self.ng_ptr = np.append(first, len(pairs)).astype(np.int64)
        self.ng_items = pairs[:, 1].astype(np.int64)
        df = np.diff(self.ng_ptr)
        raw_pairs = np.unique(np.stack([hr, doc.astype(np.uint64)], axis=1), axis=0)
        raw_hash, raw_df = np.unique(raw_pairs[:, 0], return_counts=True)
        self.filter = np.zeros(FILTER_SIZE, dtype=bool)
        self.filter[(self.ng_hash & np.uint64(FILTER_SIZE - 1)).astype(np.int64)] = True
        bounds = np.searchsorted(doc, np.arange(len(self.items) + 1))
        for k in range(len(self.items)):
            m, r = hm[bounds[k]:bounds[k + 1]], hr[bounds[k]:bounds[k + 1]]
            self.masked_pos.append(m)
            self.raw_pos.append(r)
            self.distinctive.append(df[np.searchsorted(self.ng_hash, m)] <= cfg.partial_max_items)
            self.distinctive_raw.append(raw_df[np.searchsorted(raw_hash, r)] <= cfg.partial_max_items)
        self.n_masked = np.array([len(np.unique(m)) for m in self.masked_pos], dtype=np.int64)
        self.n_raw = np.array([len(np.unique(r)) for r in self.raw_pos], dtype=np.int64)
        if cfg.containment:
            starts = np.concatenate([[0], np.cumsum(lengths)])
            for k, it in enumerate(self.items):
                L = it.n_tokens
                if cfg.min_containment_tokens <= L < n:
                    whole, _, _ = ngram_hashes(masked_flat[starts[k]:starts[k + 1]], np.array([L]), L)
                    self.short.setdefault(L, {}).setdefault(int(whole[0]), []).append(k)
        self.short_keys = {L: np.sort(np.fromiter(t, np.uint64, len(t))) for L, t in self.short.items()}

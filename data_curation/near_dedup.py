"""Near dedup: MinHash over word n-gram shingles, datasketch MinHashLSH, verified clusters.

1. Signatures, in parallel per part: normalised tokens -> word n-gram hashes -> MinHash
   signatures for the whole part in bulk (hashing.py; datasketch's affine32 scheme, so
   they are datasketch MinHash values).
2. Index, in the main process in row order: each signature is queried against a
   `datasketch.MinHashLSH` holding the earlier rows, then inserted (band keys for a whole
   part computed at once, exactly as MinHashLSH computes them). LSH parameters are
   `bands`/`rows` if given, else datasketch's optimal parameters for `lsh_threshold`
   (default threshold - 0.1) weighted towards recall, so pairs at `threshold` are almost
   never missed; candidates are pre-screened with the signature estimate.
3. Verification: the true Jaccard similarity of each candidate pair's shingle sets is
   computed (one more parallel pass over just the rows involved), or the signature
   estimate is used (`verify: estimate`). Pairs at or above `threshold` are edges.
4. Clusters = connected components of the edges (union-find); the member first in row
   order stays, every other member is removed naming the kept row and its best match.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import numpy as np
from pydantic import Field, model_validator

from data_curation.hashing import minhash_signatures, ngram_hashes, permutations, to_shingle32, word_hashes
from data_curation.normalize import NormalizeConfig, Normalizer
from data_curation.row_schema import field_text
from data_curation.step_api import Decision, RunContext, StepConfig, StepRunner


class NearDedupConfig(StepConfig):
    step: Literal["near_dedup"] = "near_dedup"
    field: Literal["text", "prompt", "response"] = "text"
    ngram: int = Field(3, ge=1, le=32, description="word n-gram shingle size")
    num_perm: int = Field(128, ge=16, le=1024)
    threshold: float = Field(0.8, gt=0, le=1, description="Jaccard (shingle sets) at which two "
                                                          "rows are duplicates")
    bands: int | None = Field(None, ge=2)
    rows: int | None = Field(None, ge=1)
    lsh_threshold: float | None = Field(None, gt=0, le=1, description="threshold the LSH "
                                        "parameters are tuned for (default: threshold - 0.1)")
    lsh_weights: tuple[float, float] = Field((0.1, 0.9), description="(false positive, false "
                                             "negative) weights for datasketch's optimal_param")
    seed: int = 1
    verify: Literal["exact", "estimate"] = "exact"
    max_candidates: int = Field(32, ge=1, description="candidates verified per row (best "
                                                       "signature estimates first)")
    prescreen_margin: float = Field(0.15, ge=0, le=1, description="candidates whose signature "
                                    "estimate is below threshold - margin are not verified")
    normalize: NormalizeConfig = NormalizeConfig()
    max_examples: int = Field(5, ge=0)

    @model_validator(mode="after")
    def _bands_rows(self) -> "NearDedupConfig":
        if (self.bands is None) != (self.rows is None):
            raise ValueError("give both bands and rows, or neither (then they are derived from "
                             "lsh_threshold)")
        if self.bands is not None and self.bands * self.rows > self.num_perm:
            raise ValueError(f"bands * rows = {self.bands * self.rows} exceeds num_perm = {self.num_perm}")
        return self

    def lsh_params(self) -> tuple[int, int]:
        if self.bands is not None:
            return self.bands, self.rows
        from datasketch.lsh import _optimal_param

        t = self.lsh_threshold if self.lsh_threshold is not None else max(0.05, self.threshold - 0.1)
        return _optimal_param(t, self.num_perm, *self.lsh_weights)

    def build(self, ctx: RunContext) -> "NearDedup":
        return NearDedup(self)


def _band_keys(sig: np.ndarray, hashranges: list[tuple[int, int]]) -> list[tuple[bytes, ...]]:
    """Per row, the LSH band keys `bytes(band.byteswap())` (what MinHashLSH._H computes)."""
    cols = []
    for start, end in hashranges:
        band = np.ascontiguousarray(sig[:, start:end]).byteswap()
        cols.append(band.view(f"V{band.shape[1] * band.itemsize}").ravel().tolist())
    return list(zip(*cols))


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        p = self.parent.setdefault(x, x)
        if p != x:
            root = self.find(p)
            self.parent[x] = root
            return root
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:  # the smaller index (earlier row) is the root
            self.parent[max(ra, rb)] = min(ra, rb)


class NearDedup(StepRunner):
    mode = "global"

    def __init__(self, cfg: NearDedupConfig):
        self.cfg = cfg
        self.norm = Normalizer(cfg.normalize)
        self.bands, self.rows = cfg.lsh_params()
        self.a, self.b = permutations(cfg.num_perm, cfg.seed)

    # -- worker side -----------------------------------------------------------------
    def _texts(self, table) -> list[str]:
        return [field_text(p, r, self.cfg.field) for p, r in
                zip(table.column("_prompt").to_pylist(), table.column("_response").to_pylist())]

    def shingles(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(64-bit shingle hashes, owning document index) of the texts."""
        flat, lengths = word_hashes([self.norm.tokens(t) for t in texts])
        h, doc, _ = ngram_hashes(flat, lengths, self.cfg.ngram, short="whole")
        return h, doc

    def features(self, table) -> tuple[np.ndarray, np.ndarray]:
        """(signatures of the rows that have shingles, their indices in the part)."""
        h, doc = self.shingles(self._texts(table))
        counts = np.bincount(doc, minlength=table.num_rows)
        has = np.nonzero(counts)[0]
        sig = minhash_signatures(to_shingle32(h), counts[has], self.a, self.b)
        return sig, has

    def shingle_sets(self, table, wanted: np.ndarray) -> dict[int, np.ndarray]:
        """Sorted distinct shingle hashes of the part's rows at positions `wanted`."""
        texts = self._texts(table)
        h, doc = self.shingles([texts[i] for i in wanted])
        bounds = np.searchsorted(doc, np.arange(len(wanted) + 1))
        rows = table.column("_row").to_numpy()
        return {int(rows[i]): np.unique(h[bounds[k]:bounds[k + 1]]) for k, i in enumerate(wanted)}

    # -- main process ----------------------------------------------------------------
    def resolve(self, stream: Iterator[tuple[int, Any, Any]], ctx: RunContext) -> list[Decision]:
        cfg = self.cfg
        keys, pairs, counts = self._candidate_pairs(stream, ctx)
        jac = self._verify(pairs, keys, ctx)
        uf = _UnionFind()
        best: dict[int, tuple[float, int]] = {}
        n_edges = 0
        for (a, b), j in jac.items():
            if j >= cfg.threshold:
                n_edges += 1
                uf.union(a, b)
                for x, y in ((a, b), (b, a)):   # each member's best verified match
                    if x not in best or j > best[x][0]:
                        best[x] = (j, y)
        members: dict[int, list[int]] = {}
        for k in list(uf.parent):
            members.setdefault(uf.find(k), []).append(k)
        decisions, hist, clusters = _decisions(keys, members, best)
        if decisions:
            decisions[0].stats = {
                "lsh": {"num_perm": cfg.num_perm, "bands": self.bands, "rows": self.rows,
                        "ngram": cfg.ngram, "threshold": cfg.threshold, "verify": cfg.verify},
                "indexed_rows": counts["indexed"], "lsh_candidates": counts["candidates"],
                "prescreened_out": counts["prescreened"], "pairs_verified": len(jac),
                "duplicate_pairs": n_edges, "clusters": len(clusters),
                "cluster_size_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
                "largest_clusters": [{"size": s, "kept_row": r, "rows": rs[:20]}
                                     for s, r, rs in clusters[: cfg.max_examples]]}
        return decisions

    def _candidate_pairs(self, stream: Iterator[tuple[int, Any, Any]], ctx: RunContext
                         ) -> tuple["_Keys", list[tuple[int, int, float]], dict[str, int]]:
        """Every row's signature through the LSH index, in row order: (the keys, the candidate
        pairs (later key, earlier key, signature estimate), counts)."""
        from datasketch import MinHashLSH

        cfg = self.cfg
        lsh = MinHashLSH(num_perm=cfg.num_perm, params=(self.bands, self.rows))
        tables = lsh.hashtables
        keys = _Keys()
        pairs: list[tuple[int, int, float]] = []   # (later key, earlier key, estimate)
        n_candidates = n_prescreened = 0
        min_est = cfg.threshold - cfg.prescreen_margin if cfg.verify == "exact" else cfg.threshold
        key = 0
        shape = (max(1, ctx.total_rows), cfg.num_perm)
        if shape[0] * shape[1] * 4 > (256 << 20):  # large corpora: signatures on local disk
            ctx.work_dir.mkdir(parents=True, exist_ok=True)
            all_sigs = np.memmap(ctx.work_dir / f"signatures-{id(self)}.u32", dtype=np.uint32,
                                 mode="w+", shape=shape)
        else:
            all_sigs = np.empty(shape, dtype=np.uint32)
        for _, rows, (sig, has) in stream:
            keys.part_rows.append(rows)
            keys.bases.append(key)
            keys.part_has.append(has)
            base = key
            all_sigs[base:base + len(has)] = sig
            # band keys exactly as MinHashLSH computes them (byteswapped band bytes), for the
            # whole part at once; then one query + insert per row against its hash tables
            for j, band_keys in enumerate(_band_keys(sig, lsh.hashranges)):
                k = base + j
                cands: set[int] = set()
                for h, table in zip(band_keys, tables):
                    got = table.get(h)
                    if got:
                        cands.update(got)
                if cands:
                    n_candidates += len(cands)
                    c = np.fromiter(cands, dtype=np.int64, count=len(cands))
                    est = (all_sigs[c] == sig[j]).mean(axis=1)
                    ok = est >= min_est
                    n_prescreened += int((~ok).sum())
                    c, est = c[ok], est[ok]
                    if len(c) > cfg.max_candidates:
                        top = np.argsort(-est, kind="stable")[: cfg.max_candidates]
                        c, est = c[top], est[top]
                    pairs.extend((k, int(x), float(e)) for x, e in zip(c, est))
                    if len(est) and est.max() == 1.0:
                        continue  # an identical signature is indexed already: no need to add it
                lsh.keys.insert(k, *band_keys)
                for h, table in zip(band_keys, tables):
                    table.insert(h, k)
            key = base + len(has)
        return keys, pairs, {"indexed": key, "candidates": n_candidates, "prescreened": n_prescreened}

    def _verify(self, pairs: list[tuple[int, int, float]], keys: "_Keys", ctx: RunContext
                ) -> dict[tuple[int, int], float]:
        """Each candidate pair's Jaccard similarity: exact (the workers send the shingle sets
        of the rows involved) or the signature estimate."""
        if not (pairs and self.cfg.verify == "exact"):
            return {(a, b): e for a, b, e in pairs}
        jac: dict[tuple[int, int], float] = {}
        involved = sorted({k for a, b, _ in pairs for k in (a, b)})
        by_part: dict[int, list[int]] = {}
        for k in involved:
            p, idx = keys.pos_of(k)
            by_part.setdefault(p, []).append(idx)
        sets: dict[int, np.ndarray] = {}
        results = ctx.map_parts("shingle_sets", {p: (np.array(v),) for p, v in by_part.items()})
        for r in results:
            sets.update(r)
        row_of = {k: keys.row(k) for k in involved}
        for a, b, _ in pairs:
            sa, sb = sets[row_of[a]], sets[row_of[b]]
            inter = len(np.intersect1d(sa, sb, assume_unique=True))
            jac[(a, b)] = inter / (len(sa) + len(sb) - inter)
        return jac


@dataclass
class _Keys:
    """Key k (a row with shingles, numbered in order) lives in part p = searchsorted(bases),
    at row part_has[p][k - bases[p]] of that part."""

    bases: list[int] = field(default_factory=list)
    part_has: list[np.ndarray] = field(default_factory=list)
    part_rows: list[np.ndarray] = field(default_factory=list)

    def pos_of(self, k: int) -> tuple[int, int]:
        p = int(np.searchsorted(self.bases, k, side="right")) - 1
        return p, int(self.part_has[p][k - self.bases[p]])

    def row(self, k: int) -> int:
        p, idx = self.pos_of(k)
        return int(self.part_rows[p][idx])


def _decisions(keys: _Keys, members: dict[int, list[int]], best: dict[int, tuple[float, int]]
               ) -> tuple[list[Decision], dict[str, int], list[tuple[int, int, list[int]]]]:
    """Per part: every member of a cluster but its first (root) row is removed, naming the
    kept row and its best match; with the cluster-size histogram and the clusters, largest first."""
    row = keys.row
    decisions = [Decision(np.ones(len(rows), dtype=bool), [None] * len(rows), [None] * len(rows))
                 for rows in keys.part_rows]
    hist: dict[str, int] = {}
    clusters = []
    for root, ks in members.items():
        if len(ks) < 2:
            continue
        hist[str(len(ks))] = hist.get(str(len(ks)), 0) + 1
        clusters.append((len(ks), row(root), sorted(row(k) for k in ks)))
        for k in ks:
            if k == root:
                continue
            p, idx = keys.pos_of(k)
            d = decisions[p]
            d.keep[idx] = False
            d.reasons[idx] = "near_duplicate"
            j, other = best.get(k, (None, None))
            d.details[idx] = {"kept_row": row(root), "cluster_size": len(ks),
                              **({"matched_row": row(other), "jaccard": round(j, 4)}
                                 if other is not None else {})}
    clusters.sort(key=lambda c: (-c[0], c[1]))
    return decisions, hist, clusters

"""Vectorised hashing: word hashes, word n-gram (shingle) hashes, MinHash signatures in bulk.

A batch of documents is a flat array of 64-bit word hashes plus per-document lengths;
n-gram hashes for the whole batch, of any n, come from prefix sums of power-weighted word
hashes (`TokenBatch`), so Python touches each word once.

MinHash signatures use datasketch's "affine32" scheme exactly: a 32-bit input hash is
pre-mixed with the MurmurHash3 finaliser and permuted by `a*h + b mod 2^32` with the
permutations of `datasketch.MinHash(num_perm, seed)`. A signature computed here equals
`datasketch.MinHash(num_perm, seed, hashfunc=identity).update_batch(shingle32)`'s
hashvalues (tests/curation checks this), so it can go into `datasketch.MinHashLSH` as a
`LeanMinHash`, just computed for thousands of documents per numpy call instead of per
document.
"""
from __future__ import annotations

import re

import numpy as np
import xxhash

_U64 = np.uint64
_MASK32 = _U64(0xFFFFFFFF)
_SEP = _U64(0x9E3779B97F4A7C15)


def splitmix64(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> _U64(30))
    h = h * _U64(0xBF58476D1CE4E5B9)
    h ^= h >> _U64(27)
    h *= _U64(0x94D049BB133111EB)
    h ^= h >> _U64(31)
    return h


def fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser (datasketch's affine32 pre-mix)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def word_hashes(docs: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """Flat uint64 hashes of every token of every document, and each document's length."""
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    h = xxhash.xxh3_64_intdigest
    flat = np.fromiter((h(w.encode("utf-8", "surrogatepass")) for d in docs for w in d),
                       dtype=np.uint64, count=int(lengths.sum()))
    return flat, lengths


# the hash every number-bearing token gets in masked hashing: no token hashes to it
NUMBER_TOKEN = np.uint64(xxhash.xxh3_64_intdigest(b"\x00<number>"))
_HAS_DIGIT = re.compile(r"\d").search


def _has_digit(text: str) -> bool:
    if text.isascii():   # ten substring searches beat one regex pass over a long text
        return any(d in text for d in "0123456789")
    return _HAS_DIGIT(text) is not None


def is_number_token(w: str) -> bool:
    return not w.isalpha() and _HAS_DIGIT(w) is not None


def masked_word_hashes(docs: list[list[str]], texts: list[str] | None = None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(raw, masked, lengths): `word_hashes`, and the same with every token that holds a
    digit hashed as NUMBER_TOKEN, so that n-grams of the masked hashes match a text whatever
    its numbers are (the same template with new numbers). `texts`: each document's tokens
    joined by spaces, if the caller has them (documents without a digit are skipped whole)."""
    raw, lengths = word_hashes(docs)
    masked = raw.copy()
    starts = np.zeros(len(docs), dtype=np.int64)
    if len(docs) > 1:
        np.cumsum(lengths[:-1], out=starts[1:])
    numbers: list[int] = []
    for d, toks in enumerate(docs):
        if _has_digit(texts[d] if texts is not None else " ".join(toks)):
            s = int(starts[d])
            numbers.extend(s + j for j, w in enumerate(toks) if not w.isalpha() and _HAS_DIGIT(w))
    masked[np.asarray(numbers, dtype=np.int64)] = NUMBER_TOKEN
    return raw, masked, lengths


class TokenBatch:
    """Word hashes of a batch of documents with prefix sums, so that the hash of every
    n-gram, for any n, is two vectorised operations: with W the word hashes and B an odd
    64-bit base, S[i] = sum_{k<i} W[k] B^k and hash(i, n) = (S[i+n] - S[i]) B^-i
    = sum_{j<n} W[i+j] B^j (mod 2^64), then the splitmix64 finaliser."""

    def __init__(self, flat: np.ndarray, lengths: np.ndarray):
        self.flat, self.lengths = flat, lengths
        total = len(flat)
        self.starts = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], out=self.starts[1:])
        pw, inv = _powers(total + 1)
        self.prefix = np.zeros(total + 1, dtype=np.uint64)
        np.cumsum(flat * pw[:total], out=self.prefix[1:])
        self.inv = inv[:total + 1]
        doc = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        self.doc = doc
        self.pos = np.arange(total, dtype=np.int64) - self.starts[doc]   # position in its doc
        self.left = lengths[doc] - self.pos                                # tokens from here to doc end

    def _hash(self, starts: np.ndarray, n: np.ndarray | int) -> np.ndarray:
        raw = (self.prefix[starts + n] - self.prefix[starts]) * self.inv[starts]
        return splitmix64(raw ^ _SEP)

    def whole(self) -> np.ndarray:
        """The hash of each document's whole token sequence (0 for an empty document)."""
        out = np.zeros(len(self.lengths), dtype=np.uint64)
        full = np.nonzero(self.lengths > 0)[0]
        if len(full):
            out[full] = self._hash(self.starts[full], self.lengths[full])
        return out

    def ngrams(self, n: int, short: str = "skip") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Hashes of every word n-gram inside one document: (hashes, doc index, position in
        the doc), in document order. `short="whole"`: a document with 1..n-1 tokens gets one
        n-gram, the hash of all its tokens; `short="skip"`: none."""
        if n < 1:
            raise ValueError(f"n-gram size must be >= 1, got {n}")
        if len(self.flat) >= n:
            idx = np.nonzero(self.left >= n)[0]
            hashes, docs, positions = self._hash(idx, n), self.doc[idx], self.pos[idx]
        else:
            hashes = np.zeros(0, np.uint64)
            docs = positions = np.zeros(0, np.int64)
        if short == "whole":
            small = np.nonzero((self.lengths > 0) & (self.lengths < n))[0]
            if len(small):
                extra = self._hash(self.starts[small], self.lengths[small])
                hashes = np.concatenate([hashes, extra])
                docs = np.concatenate([docs, small])
                positions = np.concatenate([positions, np.zeros(len(small), np.int64)])
                order = np.argsort(docs, kind="stable")
                hashes, docs, positions = hashes[order], docs[order], positions[order]
        return hashes, docs, positions


_BASE = 0x9FB21C651E98DF25   # odd: invertible mod 2^64
_POW_CACHE: list[np.ndarray] = [np.ones(1, np.uint64), np.ones(1, np.uint64)]


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(B^i, B^-i) mod 2^64 for i < n (cached, grown on demand)."""
    pw, inv = _POW_CACHE
    if len(pw) < n:
        size = max(n, 2 * len(pw))
        pw = np.full(size, _BASE, dtype=np.uint64)
        pw[0] = 1
        inv = np.full(size, pow(_BASE, -1, 1 << 64), dtype=np.uint64)
        inv[0] = 1
        with np.errstate(over="ignore"):
            pw, inv = np.cumprod(pw, dtype=np.uint64), np.cumprod(inv, dtype=np.uint64)
        _POW_CACHE[:] = [pw, inv]
    return pw, inv


def ngram_hashes(flat: np.ndarray, lengths: np.ndarray, n: int, short: str = "skip"
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`TokenBatch(flat, lengths).ngrams(n, short)`."""
    return TokenBatch(flat, lengths).ngrams(n, short)


def to_shingle32(h64: np.ndarray) -> np.ndarray:
    """The 32-bit input hash of a shingle for the affine32 MinHash scheme."""
    return ((h64 >> _U64(32)) ^ (h64 & _MASK32)).astype(np.uint32)


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's affine32 permutation parameters (a odd, b) for (num_perm, seed)."""
    from datasketch import MinHash

    a, b = MinHash(num_perm=num_perm, seed=seed, scheme="affine32").permutations
    return np.asarray(a, dtype=np.uint32), np.asarray(b, dtype=np.uint32)


def minhash_signatures(shingles32: np.ndarray, counts: np.ndarray, a: np.ndarray, b: np.ndarray,
                       chunk_docs: int = 64) -> np.ndarray:
    """Signatures (docs x num_perm, uint32) of documents given as consecutive runs of
    32-bit shingle hashes (`counts[i]` shingles for document i; every count must be >= 1)."""
    if len(counts) and counts.min() < 1:
        raise ValueError("every document needs at least one shingle")
    x = fmix32(shingles32.astype(np.uint32, copy=False))
    offsets = np.zeros(len(counts), dtype=np.int64)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=offsets[1:])
    num_perm = len(a)
    out = np.empty((num_perm, len(counts)), dtype=np.uint32)
    a_col = a[:, None]
    b_col = b[:, None]
    for s in range(0, len(counts), chunk_docs):
        e = min(len(counts), s + chunk_docs)
        lo = offsets[s]
        hi = offsets[e - 1] + counts[e - 1]
        t = a_col * x[lo:hi][None, :]   # (num_perm, shingles): uint32 arithmetic wraps mod 2^32
        t += b_col
        out[:, s:e] = np.minimum.reduceat(t, offsets[s:e] - lo, axis=1)
    return np.ascontiguousarray(out.T)

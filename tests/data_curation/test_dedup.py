import random

import numpy as np
import pytest

from data_curation.exact_dedup import ExactDedupConfig
from data_curation.near_dedup import NearDedupConfig
from data_curation.normalize import Normalizer

from .conftest import chat, table

VOCAB = ["".join(random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=6)) for i in range(5000)]


def words(rng, n=120):
    return [rng.choice(VOCAB) for _ in range(n)]


def jaccard(a, b, n=3):
    sa = {tuple(a[i:i + n]) for i in range(len(a) - n + 1)}
    sb = {tuple(b[i:i + n]) for i in range(len(b) - n + 1)}
    return len(sa & sb) / len(sa | sb)


def edit_to(rng, base, target, n=3):
    """A copy of `base` with words replaced one by one until its n-gram Jaccard to base
    drops to about `target`."""
    out = list(base)
    positions = list(range(0, len(base), n))   # spread edits so each touches new n-grams
    rng.shuffle(positions)
    for p in positions:
        if jaccard(base, out, n) <= target + 0.01:
            break
        out[p] = "zz" + rng.choice(VOCAB)
    return out


def resolve(cfg, rows, ctx, parts=1):
    runner = cfg.build(ctx)
    t = table(rows)
    bounds = np.linspace(0, len(rows), parts + 1).astype(int)
    tables = [t.slice(a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]

    def map_parts(method, per_part):
        return [getattr(runner, method)(tables[p], *per_part[p]) for p in sorted(per_part)]

    ctx.map_parts = map_parts
    ctx.total_rows = len(rows)
    stream = ((i, tb.column("_row").to_numpy(), runner.features(tb)) for i, tb in enumerate(tables))
    ds = runner.resolve(stream, ctx)
    keep = np.concatenate([d.keep for d in ds])
    details = sum((d.details for d in ds), [])
    return keep, details, ds[0].stats


def test_exact_dedup_on_normalised_text_keeps_first(ctx):
    rows = [chat(0, "What is 2+2?", "It is 4."),
            chat(1, "what  is 2 + 2", "IT IS \uff14!"),          # same after normalisation
            chat(2, "What is 2+2?", "It is four."),
            chat(3, "What\u200b is 2+2?", "It is 4.")]
    keep, details, stats = resolve(ExactDedupConfig(), rows, ctx, parts=2)
    assert keep.tolist() == [True, False, True, False]
    assert details[1] == {"duplicate_of": 1} and details[3] == {"duplicate_of": 1}   # row ids: 1-based lines
    assert stats["group_size_histogram"] == {"3": 1}
    keep, _, _ = resolve(ExactDedupConfig(key="prompt"), rows, ctx)
    assert keep.tolist() == [True, False, False, False]


def test_signatures_equal_datasketch_minhash(ctx):
    from datasketch import MinHash

    from data_curation.hashing import ngram_hashes, to_shingle32, word_hashes

    cfg = NearDedupConfig(num_perm=64, seed=7)
    runner = cfg.build(ctx)
    texts = [" ".join(words(random.Random(i), 40)) for i in range(5)]
    sig, has = runner.features(table([{"text": t} for t in texts]))
    flat, lengths = word_hashes([Normalizer().tokens(t) for t in texts])
    h, doc, _ = ngram_hashes(flat, lengths, 3)
    for i in range(5):
        m = MinHash(num_perm=64, seed=7, hashfunc=lambda x: x)
        m.update_batch(to_shingle32(h[doc == i]).tolist())
        assert np.array_equal(m.hashvalues, sig[i])


def test_near_duplicates_at_0_9_caught_at_0_5_not(ctx):
    rng = random.Random(0)
    rows, expect = [], []
    for k in range(40):
        base = words(rng)
        rows.append({"id": f"b{k}", "text": " ".join(base)})
        expect.append(True)
        for target, dup in ((0.9, True), (0.5, False)):
            copy = edit_to(rng, base, target)
            j = jaccard(base, copy)
            assert abs(j - target) < 0.03, j
            rows.append({"id": f"c{k}-{target}", "text": " ".join(copy)})
            expect.append(not dup)
    keep, details, stats = resolve(NearDedupConfig(), rows, ctx, parts=3)
    assert keep.tolist() == expect
    removed = [d for d in details if d]
    assert all(d["jaccard"] >= 0.8 and d["cluster_size"] == 2 for d in removed)
    assert stats["cluster_size_histogram"] == {"2": 40}


def test_clusters_keep_exactly_one_member(ctx):
    rng = random.Random(1)
    base = words(rng)
    rows = [{"text": " ".join(edit_to(rng, base, 0.9))} for _ in range(5)]   # 5 near copies
    rows.insert(2, {"text": " ".join(words(rng))})                            # unrelated
    keep, details, stats = resolve(NearDedupConfig(), rows, ctx)
    assert keep.tolist() == [True, False, True, False, False, False]
    assert {d["kept_row"] for d in details if d} == {1}
    assert all(d["jaccard"] >= 0.8 and "matched_row" in d for d in details if d)
    assert stats["clusters"] == 1


@pytest.mark.parametrize("verify", ["exact", "estimate"])
def test_verification_modes_and_short_docs(ctx, verify):
    rows = [{"text": "a b"}, {"text": "a b"}, {"text": "c"}, {"text": ""}]
    keep, _, _ = resolve(NearDedupConfig(verify=verify), rows, ctx)
    assert keep.tolist() == [True, False, True, True]


def test_lsh_parameters():
    assert NearDedupConfig(bands=10, rows=12).lsh_params() == (10, 12)
    b, r = NearDedupConfig().lsh_params()
    p = lambda s: 1 - (1 - s ** r) ** b   # noqa: E731
    assert b * r <= 128 and p(0.8) > 0.99 and p(0.3) < 0.05
    with pytest.raises(ValueError):
        NearDedupConfig(bands=20, rows=8)


def test_bulk_band_keys_are_minhashlsh_keys():
    from datasketch import LeanMinHash, MinHashLSH

    from data_curation.near_dedup import _band_keys

    sig = np.random.default_rng(0).integers(0, 2**32, (4, 128), dtype=np.uint64).astype(np.uint32)
    lsh = MinHashLSH(num_perm=128, params=(20, 6))
    for i, keys in enumerate(_band_keys(sig, lsh.hashranges)):
        m = LeanMinHash(seed=1, hashvalues=sig[i], scheme="affine32")
        assert keys == tuple(lsh._H(m.hashvalues[a:b]) for a, b in lsh.hashranges)
        lsh.insert(i, m)
    assert lsh.query(LeanMinHash(seed=1, hashvalues=sig[2], scheme="affine32")) == [2]

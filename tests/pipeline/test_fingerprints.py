"""Input fingerprints: content changes change them, unchanged content does not, and an object
store prefix is fingerprinted from its listing alone."""
from __future__ import annotations

import os

import pytest

from pipeline.fingerprints import find_inputs, fingerprint

HASH_ALL = 1 << 30


def _fp(value, options=None, hash_max=HASH_ALL):
    return fingerprint(value, options or {}, hash_max)


def test_local_file_by_content_and_by_mtime(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text('{"a": 1}\n' * 420)
    first = _fp(str(f))
    assert first.kind == "file" and "by content" in first.summary
    os.utime(f, (1, 1))  # touched, same bytes: same fingerprint
    assert _fp(str(f)) == first
    f.write_text('{"a": 1}\n' * 50)  # shrunk in place
    assert _fp(str(f)).digest != first.digest
    shrunk = _fp(str(f))
    f.write_text('{"a": 3}\n' * 50)  # same size, other bytes
    assert _fp(str(f)).digest != shrunk.digest
    # above the content-hash limit: size + mtime, so a rewrite counts even with equal bytes
    big = _fp(str(f), hash_max=10)
    assert "size+mtime" in big.summary
    os.utime(f, (2, 2))
    assert _fp(str(f), hash_max=10).digest != big.digest


def test_directory_and_glob(tmp_path):
    d = tmp_path / "dataset"  # a `save_to_disk` directory
    (d / "train").mkdir(parents=True)
    (d / "train" / "data-00000.arrow").write_bytes(b"\x01" * 100)
    (d / "dataset_dict.json").write_text('{"splits": ["train"]}')
    first = _fp(str(d))
    assert first.kind == "directory" and "2 files" in first.summary
    assert _fp(f"file://{d}") == first
    (d / "train" / "data-00000.arrow").write_bytes(b"\x02" * 100)  # rewritten in place
    changed = _fp(str(d))
    assert changed.digest != first.digest
    (d / "train" / "data-00001.arrow").write_bytes(b"")
    assert _fp(str(d)).digest != changed.digest
    g = _fp(f"{d}/train/*.arrow")
    assert g.kind == "glob" and "2 files" in g.summary
    (d / "train" / "data-00001.arrow").rename(d / "train" / "data-00002.arrow")
    assert _fp(f"{d}/train/*.arrow").digest != g.digest  # a renamed match is a change
    assert _fp(str(tmp_path / "nope.jsonl")).kind == "missing"


def test_which_config_values_are_inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text("{}\n")
    config = {"data": ["data/a.jsonl", "${stages.x.output}/b.jsonl", "s3://bucket/prefix/"],
              "patterns": ["*.gate.e_score_correction_bias", "*expert_bias*"],  # globs matching nothing
              "model": "hf://org/model@main", "regex": "####\\s*(.+)$", "device": "cpu",
              "nested": {"dir": str(tmp_path / "data"), "glob": "data/*.jsonl", "missing": "data/zz.jsonl"}}
    assert find_inputs(config) == sorted(["data/a.jsonl", "s3://bucket/prefix/", "hf://org/model@main",
                                          str(tmp_path / "data"), "data/*.jsonl"])


def test_hub_revision_from_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    commit = "a" * 40
    pinned = _fp(f"hf://org/model@{commit}/config.json")
    assert pinned.kind == "hub" and commit[:12] in pinned.summary
    unresolved = _fp("hf://org/model")
    assert "not in the local cache" in unresolved.summary
    refs = tmp_path / "models--org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(commit)
    assert _fp("hf://org/model").digest == pinned.digest  # main points at the pinned commit
    (refs / "main").write_text("b" * 40)  # the branch moved
    assert _fp("hf://org/model").digest != pinned.digest
    (tmp_path / "datasets--org--rows" / "refs").mkdir(parents=True)
    (tmp_path / "datasets--org--rows" / "refs" / "v1").write_text(commit)
    assert "= commit aaaaaaaaaaaa" in _fp("hf://datasets/org/rows@v1/train.jsonl").summary


def test_s3_prefix_is_one_paginated_listing_and_tracks_etags(s3_bucket):
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", **opts)
    n = 1001  # two pages of (at most) 1000
    fs.pipe({f"{bucket[5:]}/corpus/part-{i:05d}.jsonl": b"{}\n" for i in range(n)})
    calls: list[str] = []
    fs.connect()
    fs.s3.meta.events.register("before-call.s3.*", lambda model, **_: calls.append(model.name))
    first = _fp(f"{bucket}/corpus/", opts)
    assert first.kind == "objects" and f"{n} files" in first.summary
    assert calls == ["ListObjectsV2"] * 2, calls  # no HEAD or GET per object: nothing downloaded
    assert _fp(f"{bucket}/corpus/", opts) == first
    fs.pipe(f"{bucket[5:]}/corpus/part-00007.jsonl", b'{"x": 1}\n')  # one object replaced
    assert _fp(f"{bucket}/corpus/", opts).digest != first.digest
    one = _fp(f"{bucket}/corpus/part-00001.jsonl", opts)
    assert one.kind == "objects" and "1 file" in one.summary
    assert _fp(f"{bucket}/corpus/part-0000[0-2].jsonl", opts).summary.startswith("objects: 3 files")
    assert _fp(f"{bucket}/nothing-here/", opts).kind == "missing"


def test_unreachable_store_names_the_url(tmp_path, unreachable_port):
    from stages.common.artifact_inputs import StorageError

    opts = {"endpoint_url": f"http://127.0.0.1:{unreachable_port}", "key": "k", "secret": "s",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    with pytest.raises(StorageError, match="cannot list the input s3://down/prefix"):
        _fp("s3://down/prefix", opts)


def test_a_plan_asks_an_unreachable_endpoint_once_not_once_per_input(unreachable_port, monkeypatch):
    """`plan` with the store out of reach (tolerate_errors) spent the client's retries on every
    input of every stage (79 s for ring1t.yaml with no network): after one input could not connect,
    the endpoint's other inputs say so without asking, for a while; `run` (no tolerance) and other
    endpoints are unaffected."""
    import pipeline.fingerprints as fps
    from stages.common.artifact_inputs import StorageError

    monkeypatch.setattr(fps, "_unreachable", {})
    asked = []
    real = fps.fingerprint
    monkeypatch.setattr(fps, "fingerprint", lambda v, *a: asked.append(v) or real(v, *a))
    opts = {"endpoint_url": f"http://127.0.0.1:{unreachable_port}", "key": "k", "secret": "s",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    config = {"a": "s3://down/one/", "b": "s3://down/two/", "c": "s3://other-bucket/three.jsonl"}
    out = fps.fingerprint_inputs(config, opts, 1 << 20, tolerate_errors=True)
    assert asked == ["s3://down/one/"]
    assert out["s3://down/one/"].kind == "unreachable" and "cannot list the input s3://down/one" in out["s3://down/one/"].summary
    for v in ("s3://down/two/", "s3://other-bucket/three.jsonl"):
        assert out[v].kind == "unreachable"
        assert out[v].summary == (f"not asked: s3 at http://127.0.0.1:{unreachable_port} could not be reached "
                                  "for s3://down/one/")
    # the next stage of the same plan: not asked either; after the TTL it is asked again
    fps.fingerprint_inputs({"d": "s3://down/four/"}, opts, 1 << 20, tolerate_errors=True)
    assert asked == ["s3://down/one/"]
    monkeypatch.setattr(fps, "UNREACHABLE_TTL_S", 0.0)
    fps.fingerprint_inputs({"d": "s3://down/four/"}, opts, 1 << 20, tolerate_errors=True)
    assert asked == ["s3://down/one/", "s3://down/four/"]
    # another endpoint is asked; `run` (no tolerance) always asks and fails on the first input
    other = {**opts, "endpoint_url": f"http://127.0.0.1:{unreachable_port}/elsewhere"}
    fps.fingerprint_inputs({"e": "s3://down/five/"}, other, 1 << 20, tolerate_errors=True)
    assert asked[-1] == "s3://down/five/"
    monkeypatch.setattr(fps, "UNREACHABLE_TTL_S", 60.0)
    with pytest.raises(StorageError, match="cannot list the input s3://down/six"):
        fps.fingerprint_inputs({"f": "s3://down/six/"}, opts, 1 << 20)

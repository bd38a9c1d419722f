"""The artifact contract: publish (manifest last, then _SUCCESS), verified fetch, checkpoints."""
from __future__ import annotations

import json

import pytest

from data_curation.urls import join
from pipeline.artifacts import ArtifactStore
from stages.common.artifact_inputs import ArtifactError, fetch_input, read_manifest, verify_artifact
from stages.common.checkpoint_store import CheckpointStore


def _publish_sample(store_root: str, opts: dict, tmp_path):
    src = tmp_path / "out"
    (src / "model").mkdir(parents=True)
    (src / "model" / "weights.bin").write_bytes(b"\x00\x01" * 1000)
    (src / "data.jsonl").write_text('{"a": 1}\n')
    store = ArtifactStore(store_root, opts)
    url = store.stage_url("sft", "ab" * 32)
    manifest = store.publish(src, url, {"stage": "sft", "hash": "ab" * 32})
    return store, url, manifest


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_publish_fetch_roundtrip(backend, tmp_path, request):
    if backend == "s3":
        root, opts = request.getfixturevalue("s3_bucket")
    else:
        root, opts = f"file://{tmp_path}/store", {}
    store, url, manifest = _publish_sample(join(root, "tiny"), opts, tmp_path)
    assert url.endswith("/tiny/sft-" + "ab" * 6)
    assert store.is_done(url)
    assert {f["path"] for f in manifest["files"]} == {"model/weights.bin", "data.jsonl"}
    assert read_manifest(url, opts)["stage"] == "sft"
    verify_artifact(url, opts)
    local = fetch_input(join(url, "model"), tmp_path / "cache", opts, artifact_urls=[url])
    assert (local / "weights.bin").read_bytes() == b"\x00\x01" * 1000
    one = fetch_input(join(url, "data.jsonl"), tmp_path / "cache2", opts, artifact_urls=[url])
    assert json.loads(one.read_text()) == {"a": 1}


def test_unpublished_artifact_does_not_exist(tmp_path):
    store, url, _ = _publish_sample(f"file://{tmp_path}/store", {}, tmp_path)
    store.unpublish(url)
    assert not store.is_done(url)
    with pytest.raises(ArtifactError, match="not published"):
        fetch_input(url, tmp_path / "cache", {}, artifact_urls=[url])


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_corrupted_artifact_is_detected(backend, tmp_path, request):
    if backend == "s3":
        root, opts = request.getfixturevalue("s3_bucket")
    else:
        root, opts = f"file://{tmp_path}/store", {}
    store, url, _ = _publish_sample(root, opts, tmp_path)
    with store.fs.open(join(store._path(url), "model/weights.bin"), "wb") as f:
        f.write(b"\x00\x02" * 1000)  # same size, different bytes
    with pytest.raises(ArtifactError, match="integrity check failed .*weights.bin"):
        fetch_input(url, tmp_path / "cache", opts, artifact_urls=[url])
    with pytest.raises(ArtifactError, match="integrity check failed"):
        verify_artifact(url, opts)


def test_checkpoints_keep_latest_complete(tmp_path):
    ck = CheckpointStore(f"file://{tmp_path}/store/sft-x", {}, keep=2)
    for step in (10, 20, 30):
        d = tmp_path / f"local{step}"
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "state.pt").write_text(str(step))
        ck.save(d, step)
    # a checkpoint whose upload never finished is invisible
    ck.fs.makedirs(ck._step_path(40), exist_ok=True)
    assert ck.steps() == [20, 30] and ck.latest() == 30
    out = ck.restore(30, tmp_path / "restored")
    assert (out / "sub" / "state.pt").read_text() == "30"


def test_missing_external_input_is_clear(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        fetch_input(str(tmp_path / "nope.jsonl"), tmp_path / "cache", {})

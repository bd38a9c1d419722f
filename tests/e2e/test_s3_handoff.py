"""Stages hand artifacts to each other through a real S3 API (moto server on 127.0.0.1)."""
from __future__ import annotations

import json
import textwrap

import pytest
import s3fs

from pipeline.flow import pipeline_flow
from tests.mlflow_db import tracking_uri

pytestmark = pytest.mark.slow


def test_stages_hand_off_through_s3(tmp_path, s3_bucket, prefect_harness, monkeypatch):
    bucket_url, opts = s3_bucket
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "s3.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        name: s3demo
        storage:
          url: {bucket_url}/runs
          options: {json.dumps(opts)}
        tracking: {{uri: "{tracking_uri(tmp_path)}"}}
        stages:
          data:
            kind: synthetic_data
            files:
              sft.jsonl: {{generator: arithmetic_cot, n: 40}}
          base:
            kind: init_model
            architecture: {{hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2}}
            tokenizer: {{corpus: ["${{stages.data.output}}/sft.jsonl"]}}
        """))
    first = pipeline_flow(str(recipe))
    assert {k: v["status"] for k, v in first.items()} == {"data": "ran", "base": "ran"}
    fs = s3fs.S3FileSystem(**opts)
    fs.invalidate_cache()
    root = bucket_url[len("s3://"):] + "/runs/s3demo"
    dirs = {p.rsplit("/", 1)[-1].split("-")[0]: p for p in fs.ls(root)}
    assert set(dirs) == {"data", "base"}
    manifest = json.loads(fs.cat(dirs["base"] + "/manifest.json"))
    assert fs.exists(dirs["base"] + "/_SUCCESS")
    # base read data's sft.jsonl from S3: its manifest records data's hash as upstream
    data_manifest = json.loads(fs.cat(dirs["data"] + "/manifest.json"))
    assert manifest["upstream"] == {"data": data_manifest["hash"]}
    assert manifest["config"]["tokenizer"]["corpus"][0].startswith(bucket_url)
    assert any(f["path"] == "config.json" for f in manifest["files"])
    assert any(f["path"] == "logs/stage.log" for f in manifest["files"])
    # second run: both published, nothing reruns
    second = pipeline_flow(str(recipe))
    assert {k: v["status"] for k, v in second.items()} == {"data": "skipped", "base": "skipped"}
    assert second["base"]["url"] == first["base"]["url"]

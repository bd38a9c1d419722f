"""Benchmark sets named the way users have them: a Hugging Face dataset id with its
configuration and split, read through the hub cache (populated here, nothing downloaded), or
the local copy an air-gapped cluster gives under RING_BENCHMARKS_DIR; and a set that is in
neither is an error that names the set, its id and the setting."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from data_curation._base import CurationError
from data_curation.benchmarks import BENCHMARKS_DIR_ENV, BenchmarkSpec, EvalSuite, hub_benchmarks, iter_benchmark_rows
from data_curation.decontaminate import DecontaminateConfig
from tests.stages.common.hub_cache import cache_repo

CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: test
    path: socratic/test-*
---
# a dataset card
"""


def _table(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An offline hub cache holding org/mathset (two configurations, card metadata) and
    org/plain (a configuration as a directory, no card metadata)."""
    repo = tmp_path / "repo"
    _table(repo / "main" / "train-00000-of-00001.parquet", [{"question": "train q", "answer": "#### 1"}])
    _table(repo / "main" / "test-00000-of-00001.parquet", [{"question": f"main test q{i}", "answer": f"#### {i}"}
                                                           for i in range(3)])
    _table(repo / "socratic" / "test-00000-of-00001.parquet", [{"question": "socratic q", "answer": "#### 9"}])
    (repo / "README.md").write_text(CARD)
    plain = tmp_path / "plain"
    (plain / "sub").mkdir(parents=True)
    (plain / "sub" / "test.jsonl").write_text(json.dumps({"problem": "plain p"}) + "\n")
    cache = tmp_path / "hub"
    cache_repo(cache, "dataset", "org/mathset", repo)
    cache_repo(cache, "dataset", "org/plain", plain)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(BENCHMARKS_DIR_ENV, raising=False)
    return cache


def _texts(spec: BenchmarkSpec) -> list[str]:
    return [row.get("question") or row.get("problem") for _, _, row in iter_benchmark_rows(spec, None)]


def test_a_hub_set_is_read_by_id_configuration_and_split(hub):
    main = BenchmarkSpec(name="gsm", hub="org/mathset", config="main", split="test", fields=["question"])
    assert _texts(main) == ["main test q0", "main test q1", "main test q2"]
    assert _texts(main.model_copy(update={"split": "train"})) == ["train q"]
    assert _texts(BenchmarkSpec(hub="org/mathset", config="socratic", fields=["question"])) == ["socratic q"]
    # a configuration that is a directory of the snapshot, where the card lists none
    assert _texts(BenchmarkSpec(hub="org/plain", config="sub", fields=["problem"])) == ["plain p"]


@pytest.mark.parametrize("update, needle", [
    ({"config": "nope"}, r"no configuration 'nope'; it has \['main', 'socratic'\]"),
    ({"split": "validation"}, r"no split 'validation'; its splits are \['train', 'test'\]"),
    ({"config": "main", "split": None}, r"splits \['train', 'test'\]: name the one to read"),
])
def test_a_wrong_configuration_or_split_is_named(hub, update, needle):
    spec = BenchmarkSpec(name="gsm", hub="org/mathset", config="main", split="test", fields=["question"])
    with pytest.raises(CurationError, match=needle):
        _texts(spec.model_copy(update=update))


def test_the_local_copy_under_the_setting_stands_in_for_the_hub(hub, tmp_path, monkeypatch):
    local = tmp_path / "air-gapped"
    local.mkdir()
    (local / "gsm.jsonl").write_text(json.dumps({"question": "local copy q", "answer": "#### 4"}) + "\n")
    monkeypatch.setenv(BENCHMARKS_DIR_ENV, str(local))
    spec = BenchmarkSpec(name="gsm", hub="org/mathset", config="main", split="test", fields=["question"])
    assert _texts(spec) == ["local copy q"]
    # the set is found by its name; one without a copy there is named, with the directory and the hub id
    other = spec.model_copy(update={"name": "math500"})
    with pytest.raises(CurationError) as e:
        _texts(other)
    assert all(s in str(e.value) for s in ("math500 (hub org/mathset", f"{BENCHMARKS_DIR_ENV}={local}",
                                           "math500.jsonl"))
    assert other.unavailable("math500") == str(e.value)


def test_a_set_in_neither_names_the_set_its_id_and_the_setting(hub):
    spec = BenchmarkSpec(name="aime24", hub="org/not-cached", split="test", fields=["problem"])
    problem = spec.unavailable("aime24")
    assert problem is not None
    for needle in ("aime24", "org/not-cached", "not in the Hugging Face cache", BENCHMARKS_DIR_ENV, "aime24.jsonl"):
        assert needle in problem, (needle, problem)
    with pytest.raises(CurationError, match="org/not-cached"):
        _texts(spec)


@pytest.mark.parametrize("entry, needle", [
    ({"path": "a.jsonl", "hub": "org/a"}, "either `path` or `hub`"),
    ({}, "either `path` or `hub`"),
    ({"path": "a.jsonl", "config": "main"}, "go with `hub`"),
])
def test_an_entry_names_exactly_one_source(entry, needle):
    with pytest.raises(ValidationError, match=needle):
        BenchmarkSpec(fields=["q"], **entry)


def test_the_hub_sets_a_config_reads_are_found_wherever_they_are_named(tmp_path):
    blist = tmp_path / "list.yaml"
    blist.write_text("- {name: gsm8k, hub: openai/gsm8k, config: main, split: test, fields: [question]}\n"
                     "- {name: local, path: local.jsonl, fields: [q]}\n")
    decon = DecontaminateConfig(benchmarks=str(blist))
    assert list(hub_benchmarks(decon)) == ["gsm8k"]
    suite = EvalSuite(benchmarks=[{"name": "m5", "hub": "HuggingFaceH4/MATH-500", "split": "test", "fields": ["problem"]}])
    assert list(hub_benchmarks(suite)) == ["m5"]
    # a list that cannot be read here is the stage's to report when it runs, not the search's
    assert hub_benchmarks(DecontaminateConfig(benchmarks=str(tmp_path / "absent.yaml"))) == {}


def test_shipped_benchmark_list_names_every_set_by_hub_id():
    repo = Path(__file__).resolve().parents[2]
    decon = DecontaminateConfig(benchmarks=str(repo / "recipes" / "benchmarks.yaml"))
    found = hub_benchmarks(decon)
    assert set(found) == {"aime24", "aime25", "amc23", "gsm8k", "math500", "minerva_math"}
    assert found["gsm8k"].hub == "openai/gsm8k" and found["gsm8k"].config == "main" and found["gsm8k"].split == "test"

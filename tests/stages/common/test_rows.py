"""The stages' one row reader (stages/common/rows.py, on data_curation.discovery): every
format and input kind, splits selected and never merged, exact locations, rows of different
shapes in one file, bad rows named by file and line (or kept, marked, when asked)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_curation.discovery import DataInput
from stages.common.rows import DataError, input_rows
from tests.stages.common.hub_cache import cache_repo


def rows(value, what="data", keep_bad=False):
    return list(input_rows(Path, value, what, keep_bad))


def test_jsonl_rows_are_located_by_line_and_keep_their_own_shapes(tmp_path):
    f = tmp_path / "rl.jsonl"
    data = [{"reference": {"answer": "2"}}, {"reference": [1, 2]}, {"reference": "x", "extra": None}]
    f.write_text(json.dumps(data[0]) + "\n\n  \n" + json.dumps(data[1]) + "\n" + json.dumps(data[2]) + "\n")
    got = rows(str(f))
    assert [r.data for r in got] == data  # no schema imposed across rows
    assert [r.where for r in got] == [f"{f}:1", f"{f}:4", f"{f}:5"]


@pytest.mark.parametrize("text,line,reason", [
    ('{"a": 1}\n{"a": \n', 2, "invalid JSON"),
    ('{"a": 1}\nnot json\n', 2, "invalid JSON"),
    ('{"a": NaN}\n', 1, "NaN"),                       # not JSON, though Python's json takes it
    ('{"a": 1e999}\n', 1, "overflows"),
    ('[' * 150 + ']' * 150 + '\n{"a": 1}\n', 1, "nested"),
    (b'{"a": "\xff"}\n', 1, "UTF-8"),
])
def test_a_bad_line_is_named_or_kept_marked(tmp_path, text, line, reason):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DataError, match=rf"sft data {f}:{line}: .*{reason}"):
        rows(str(f), "sft data")
    kept = rows(str(f), "sft data", keep_bad=True)
    bad = [r for r in kept if r.error is not None]
    assert [r.number for r in bad] == [line] and bad[0].data is None and reason in bad[0].error


def test_json_lists_json_lines_under_a_json_name_compressed_parquet_and_arrow(tmp_path):
    import datasets

    lst, lines, gz, par = (tmp_path / n for n in ("a.json", "b.json", "c.jsonl.gz", "d.parquet"))
    lst.write_text(json.dumps([{"i": 1}, {"i": 2}]))
    lines.write_text('{"i": 3}\n{"i": 4}\n')
    gz.write_bytes(gzip.compress(b'{"i": 5}\n'))
    pq.write_table(pa.Table.from_pylist([{"i": 6}, {"i": 7}]), par)
    ds = datasets.Dataset.from_list([{"i": 8}])
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    got = [r for v in (lst, lines, gz, par, arrow) for r in rows(str(v))]
    assert [r.data["i"] for r in got] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r.where for r in got[:6]] == [f"{lst} row 1", f"{lst} row 2", f"{lines}:1", f"{lines}:2",
                                          f"{gz}:1", f"{par} row 1"]
    (tmp_path / "e.json").write_text('[{"not": "closed"')
    with pytest.raises(DataError, match=r"e.json: .*list of rows"):
        rows(str(tmp_path / "e.json"))
    (tmp_path / "f.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"f.parquet: cannot be read as parquet"):
        rows(str(tmp_path / "f.parquet"))


def test_a_directory_reads_its_data_files_not_its_metadata(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / ".hidden").mkdir()
    (d / "b.jsonl").write_text('{"i": 1}\n')
    pq.write_table(pa.Table.from_pylist([{"i": 2}]), d / "sub" / "a.parquet")
    for name, text in ((".hidden/x.jsonl", '{"i": 9}\n'), ("notes.txt", "x"), ("manifest.json", "{}"),
                       ("_SUCCESS", "")):
        (d / name).write_text(text)
    assert [r.data["i"] for r in rows(str(d))] == [1, 2]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="rl data .*empty: .*directory has no .jsonl"):
        rows(str(tmp_path / "empty"), "rl data")
    with pytest.raises(DataError, match="notes.txt: cannot tell its format"):
        rows(str(d / "notes.txt"))
    with pytest.raises(DataError, match="a file has no splits"):
        rows(DataInput(path=str(d / "b.jsonl"), split="train"))


def test_saved_datasets_and_their_splits_are_never_merged(tmp_path):
    import datasets

    one = datasets.Dataset.from_list([{"i": 1}, {"i": 2}])
    one.save_to_disk(str(tmp_path / "one"))
    got = rows(str(tmp_path / "one"))
    assert [r.data["i"] for r in got] == [1, 2] and got[1].where == f"{tmp_path / 'one'} row 2"
    with pytest.raises(DataError, match="a saved Dataset has no splits"):
        rows(DataInput(path=str(tmp_path / "one"), split="train"))
    dd = datasets.DatasetDict({"train": one, "test": datasets.Dataset.from_list([{"i": 3}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict with splits \['train', 'test'\]: name the one to read"):
        rows(str(tmp_path / "dd"))
    test = rows(DataInput(path=str(tmp_path / "dd"), split="test"))
    assert [r.data["i"] for r in test] == [3] and test[0].where == f"{tmp_path / 'dd'}[test] row 1"
    with pytest.raises(DataError, match=r"no split 'dev'; its splits are \['train', 'test'\]"):
        rows(DataInput(path=str(tmp_path / "dd"), split="dev"))
    # split-named files, as `datasets` names them
    d = tmp_path / "named"
    (d / "data").mkdir(parents=True)
    (d / "data" / "train-00000-of-00001.jsonl").write_text('{"i": 4}\n')
    (d / "data" / "validation-00000-of-00001.jsonl").write_text('{"i": 5}\n')
    with pytest.raises(DataError, match=r"splits \['train', 'validation'\]"):
        rows(str(d))
    assert [r.data["i"] for r in rows(DataInput(path=str(d), split="validation"))] == [5]


def test_hub_datasets_come_from_the_local_cache_offline(tmp_path, monkeypatch):
    src = tmp_path / "repo"
    (src / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"q": "a"}, {"q": "b"}]), src / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist([{"q": "c"}]), src / "data" / "test-00000-of-00001.parquet")
    (src / "README.md").write_text("# a dataset card, not data\n")
    cache = tmp_path / "hub"
    commit = cache_repo(cache, "dataset", "org/tiny-set", src)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = rows(DataInput(path="org/tiny-set", split="train"))
    assert [r.data["q"] for r in got] == ["a", "b"] and commit in got[0].file
    assert [r.data["q"] for r in rows(DataInput(path="org/tiny-set", split="test", revision=commit))] == ["c"]
    with pytest.raises(DataError, match=r"splits \['train', 'test'\]"):
        rows("org/tiny-set")
    with pytest.raises(DataError, match=r"org/missing .*not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        rows("org/missing")
    with pytest.raises(DataError, match="`revision` selects a version of a hub dataset"):
        rows(DataInput(path=str(src), revision="main"))

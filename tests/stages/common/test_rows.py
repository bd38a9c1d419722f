"""The stages' one row reader (stages/common/rows.py): every format, exact locations, rows of
different shapes in one file, and errors that name the file and line."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.common.rows import DataError, data_files, read_rows


def test_jsonl_rows_are_located_by_line_and_keep_their_own_shapes(tmp_path):
    f = tmp_path / "rl.jsonl"
    rows = [{"reference": {"answer": "2"}}, {"reference": [1, 2]}, {"reference": "x", "extra": None}]
    f.write_text(json.dumps(rows[0]) + "\n\n  \n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2]) + "\n")
    got = list(read_rows([f]))
    assert [r.data for r in got] == rows  # no schema imposed across rows
    assert [r.where for r in got] == [f"{f}:1", f"{f}:4", f"{f}:5"]


@pytest.mark.parametrize("text,line", [('{"a": 1}\n{"a": \n', 2), ('{"a": 1}\nnot json\n', 2)])
def test_a_bad_jsonl_line_is_named(tmp_path, text, line):
    f = tmp_path / "bad.jsonl"
    f.write_text(text)
    with pytest.raises(DataError, match=rf"sft data {f}:{line}: not valid JSON"):
        list(read_rows([f], "sft data"))


def test_json_list_json_lines_under_a_json_name_and_parquet(tmp_path):
    lst, lines, par = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.parquet"
    lst.write_text(json.dumps([{"i": 1}, {"i": 2}]))
    lines.write_text('{"i": 3}\n{"i": 4}\n')
    pq.write_table(pa.Table.from_pylist([{"i": 5}, {"i": 6}]), par)
    got = list(read_rows([lst, lines, par]))
    assert [r.data["i"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r.where for r in got] == [f"{lst} row 1", f"{lst} row 2", f"{lines}:1", f"{lines}:2",
                                      f"{par} row 1", f"{par} row 2"]
    (tmp_path / "d.json").write_text('{"not": "a list"}')
    with pytest.raises(DataError, match="holds a list of rows"):
        list(read_rows([tmp_path / "d.json"]))
    (tmp_path / "e.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"e.parquet: cannot be read as parquet"):
        list(read_rows([tmp_path / "e.parquet"]))


def test_data_files_of_a_directory(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / ".hidden").mkdir()
    for p in (d / "b.jsonl", d / "sub" / "a.parquet", d / ".hidden" / "x.jsonl", d / "notes.txt"):
        p.write_text("")
    assert data_files(d, "data/") == [d / "b.jsonl", d / "sub" / "a.parquet"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="rl data empty/: directory .* holds no .jsonl/.json/.parquet file"):
        data_files(tmp_path / "empty", "empty/", "rl data")
    with pytest.raises(DataError, match="notes.txt is not a"):
        data_files(d / "notes.txt", "notes.txt")

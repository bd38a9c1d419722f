"""Curation's own files: the parquet "parts" rows move in between steps (columns
`data_curation.row_reading.ROW_COLUMNS`), and small JSON / text side files, at any fsspec URL."""
from __future__ import annotations

import json
import os
from typing import Any

from data_curation.urls import filesystem, is_local, local_path


def write_table(table, url: str, storage_options: dict | None) -> None:
    import pyarrow.parquet as pq

    if is_local(url):
        p = local_path(url)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        pq.write_table(table, p + ".tmp", compression="snappy")
        os.replace(p + ".tmp", p)
        return
    fs, p = filesystem(url, storage_options)
    with fs.open(p, "wb") as f:
        pq.write_table(table, f, compression="snappy")


def read_table(url: str, storage_options: dict | None, columns: list[str] | None = None):
    import pyarrow.parquet as pq

    if is_local(url):
        return pq.read_table(local_path(url), columns=columns)
    fs, p = filesystem(url, storage_options)
    with fs.open(p, "rb") as f:
        return pq.read_table(f, columns=columns)


def batch_table(cols: dict[str, list]):
    import pyarrow as pa

    types = {"_row": pa.int64(), "_src": pa.int32(), "_line": pa.int64()}
    return pa.table({k: pa.array(v, type=types.get(k, pa.string())) for k, v in cols.items()})


def exists(url: str, storage_options: dict | None) -> bool:
    fs, p = filesystem(url, storage_options)
    return fs.exists(p)


def read_json(url: str, storage_options: dict | None) -> Any:
    fs, p = filesystem(url, storage_options)
    with fs.open(p, "r", encoding="utf-8") as f:
        return json.load(f)


def write_text(url: str, text: str, storage_options: dict | None) -> None:
    fs, p = filesystem(url, storage_options)
    if is_local(url):
        os.makedirs(os.path.dirname(p), exist_ok=True)
    with fs.open(p, "w", encoding="utf-8") as f:
        f.write(text)


def remove_tree(url: str, storage_options: dict | None) -> None:
    fs, p = filesystem(url, storage_options)
    if fs.exists(p):
        fs.rm(p, recursive=True)

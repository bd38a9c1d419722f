"""The one reader of the stages' data files: rows of jsonl / json / parquet files (a file, or a
directory of them), each with where it came from.

- `.jsonl`: one JSON value per line (blank lines skipped); a row is located by its line,
  `file:LINE`, so a parse error names the line too.
- `.json`: a list of rows (or JSON lines under a .json name, as `datasets` accepts); `file
  row N` (1-based) for a list.
- `.parquet`: read in record batches with pyarrow; `file row N` (1-based).
Rows are read as they are: no schema is imposed across rows (RL rows of different domains
carry differently shaped `reference`s in one file). Errors name the data (`what`, e.g. "sft
data"), the file, the line or row and the cause.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from pipeline.stage_api import StageError

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
_PARQUET_BATCH = 1024


class DataError(StageError):
    """Bad input data: the message names the file, the row and the reason."""


@dataclass(frozen=True)
class Row:
    file: Path
    number: int   # .jsonl: the line; otherwise the 1-based record number
    data: Any
    by_line: bool = True

    @property
    def where(self) -> str:
        return f"{self.file}:{self.number}" if self.by_line else f"{self.file} row {self.number}"


def data_files(path: Path, source: str, what: str = "data") -> list[Path]:
    """The data files of `path` (itself, or the files under a directory, recursive, sorted,
    hidden ones left out); `source` is the input as the user wrote it."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise DataError(f"{what} {source}: directory {path} holds no {'/'.join(DATA_SUFFIXES)} file")
        return files
    if path.suffix not in DATA_SUFFIXES:
        raise DataError(f"{what} {source}: {path.name} is not a {'/'.join(DATA_SUFFIXES)} file")
    return [path]


def read_rows(files: list[Path], what: str = "data") -> Iterator[Row]:
    """Every row of every file, in order."""
    for f in files:
        if f.suffix == ".parquet":
            yield from _parquet_rows(f, what)
        elif f.suffix == ".json":
            yield from _json_rows(f, what)
        else:
            yield from _jsonl_rows(f, f.read_text(encoding="utf-8"), what)


def _jsonl_rows(f: Path, text: str, what: str) -> Iterator[Row]:
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield Row(f, lineno, json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{what} {f}:{lineno}: not valid JSON ({e.msg})") from None


def _json_rows(f: Path, what: str) -> Iterator[Row]:
    text = f.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines under a .json name
            yield from _jsonl_rows(f, text, what)
            return
        raise DataError(f"{what} {f}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, list):
        raise DataError(f"{what} {f}: a .json data file holds a list of rows (or one row per line), "
                        f"not a {type(data).__name__}")
    for i, row in enumerate(data, 1):
        yield Row(f, i, row, by_line=False)


def _parquet_rows(f: Path, what: str) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(f).iter_batches(batch_size=_PARQUET_BATCH)
        n = 0
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield Row(f, n, row, by_line=False)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{what} {f}: cannot be read as parquet: {type(e).__name__}: {e}") from None

"""The one reader of the stages' data: rows of an input, each with where it came from.

An input is what a stage config names (`data_curation.discovery.DataInput`, or its path alone): a
file, a directory, a glob, a URL or an upstream artifact (fetched by the job, sha256-checked),
a `datasets.save_to_disk` directory, or a hub dataset id `org/name` from the local Hugging
Face cache; with `split:` where the input has splits. Which files and splits an input means
is decided by `data_curation.discovery.discover`, the reader curation uses too, so curate and the
training stages accept the same inputs.

- `.jsonl` / `.json` / `.ndjson` (optionally compressed): one JSON value per line, blank lines
  skipped, a row located as `file:LINE`; a file that is one JSON list is a list of rows,
  `file row N`. JSON is read strictly (no NaN, no overflowing numbers, no
  nesting deeper than 100), exactly as curation reads it.
- `.parquet`, `.arrow` and saved datasets: read in record batches, `file row N` (1-based;
  a dataset split is named `dir[split]`).
Rows are read as they are: no schema is imposed across rows (RL rows of different domains
carry differently shaped `reference`s in one file). A row that cannot be parsed is, by
default, a DataError naming the data (`what`), the file, the line or row and the cause; with
`keep_bad=True` it is yielded with `error` set, for stages that skip and count bad rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from data_curation import discovery, hub, row_reading, urls
from data_curation._base import CurationError
from stages.common.contract import StageError

_BATCH = 1024


class DataError(StageError):
    """Bad input data: the message names the file, the row and the reason."""


@dataclass(frozen=True)
class Row:
    file: str
    number: int   # JSON lines: the line; otherwise the 1-based record number
    data: Any     # None when `error` is set
    by_line: bool = True
    error: str | None = None  # why the row could not be read (keep_bad=True only)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.number}" if self.by_line else f"{self.file} row {self.number}"


def input_rows(fetch: Callable[[str], Path], value: "str | discovery.DataInput", what: str = "data",
               keep_bad: bool = False) -> Iterator[Row]:
    """Every row of the input `value`, in order; `fetch` is the job's (StageJob.fetch)."""
    inp = discovery.as_input(value)
    if not hub.is_hub_id(inp.path):
        inp = inp.model_copy(update={"path": str(fetch(inp.path))})
    try:
        sources = discovery.discover([inp])
    except CurationError as e:
        raise DataError(f"{what} {discovery.as_input(value).path}: {e}") from None
    for src in sources:
        rows = _json_rows(src, what) if src.fmt == "jsonl" else _batch_rows(src, what)
        for row in rows:
            if row.error is not None and not keep_bad:
                raise DataError(f"{what} {row.where}: {row.error}")
            yield row


def _label(src: discovery.Source) -> str:
    path = urls.local_path(src.url)
    return f"{path}[{src.split}]" if src.split else path


def _json_rows(src: discovery.Source, what: str) -> Iterator[Row]:
    import fsspec

    label = _label(src)
    with fsspec.open(src.url, "rb", compression=src.compression) as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.lstrip().startswith("["):
        try:
            rows = row_reading.parse_line(text)
        except ValueError as e:
            if "Extra data" in str(e):  # JSON lines whose first row is a list
                rows = None
            else:
                raise DataError(f"{what} {label}: a .json file that starts with `[` holds one list of rows; "
                                f"{e}") from None
    else:
        rows = None
    if rows is not None:  # text starting with `[` that parses whole: a list
        for i, row in enumerate(rows, 1):
            yield Row(label, i, row, by_line=False)
        return
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8").removeprefix("\ufeff").rstrip("\r")
        except UnicodeDecodeError as e:
            yield Row(label, lineno, None, error=f"not valid UTF-8 (byte {e.start} of the line)")
            continue
        if not line.strip():
            continue
        try:
            yield Row(label, lineno, row_reading.parse_line(line))
        except ValueError as e:
            yield Row(label, lineno, None, error=str(e))


def _batch_rows(src: discovery.Source, what: str) -> Iterator[Row]:
    label = _label(src)
    n = 0
    try:
        for batch in row_reading.iter_batches(src, None, _BATCH):
            keys = list(batch)
            for values in zip(*(batch[k] for k in keys)):
                n += 1
                yield Row(label, n, dict(zip(keys, values)), by_line=False)
    except CurationError as e:
        raise DataError(f"{what} {label}: {e}") from None
    except (OSError, ValueError) as e:  # pyarrow / datasets: not a readable table
        raise DataError(f"{what} {label}: cannot be read as {src.fmt}: {type(e).__name__}: {e}") from None

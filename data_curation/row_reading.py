"""Hardened row reading: every row of a discovered source becomes a kept row or a
quarantined one with its reason; reading never fails on a row (bad bytes, bad JSON, NaN,
a 5,000-digit number, 100k levels of nesting, wrong types).

Arrow files and dataset directories are read through `datasets`, parquet in pyarrow
row-group batches; JSON lines line by line, because a bad line must be quarantined with its
reason instead of failing the whole load (and ranges of one big file are read in parallel).
Rows come out as columns: `_row` (stable row id = source index << 40 | 1-based line or row
number in the source), `_src`, `_line` (that 1-based number), `_id`, `_raw` (the row as a
JSON object string, exactly as read for JSON lines), `_prompt`, `_response` (matching text,
see row_schema.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import fsspec

from data_curation._base import CurationError
from data_curation.discovery import Source
from data_curation.row_schema import FieldMap, RowError, RowPolicy, dump_row, extract
from data_curation.urls import filesystem, is_local, local_path

ROW_SHIFT = 40
ROW_COLUMNS = ("_row", "_src", "_line", "_id", "_raw", "_prompt", "_response")


@dataclass
class ReadTask:
    src_index: int
    source: Source
    local: str | None = None      # local copy/path of a jsonl file
    start: int = 0                # byte range [start, end) of a jsonl file, line-aligned
    end: int | None = None
    first_line: int = 0           # 0-based index of the first line in the range


def plan_reads(sources: list[Source], storage_options: dict | None, work_dir: Path,
               target_bytes: int) -> list[ReadTask]:
    """Read tasks: uncompressed JSON lines files split into line-aligned byte ranges (remote
    ones downloaded first), everything else one task per source."""
    tasks: list[ReadTask] = []
    for i, s in enumerate(sources):
        if s.fmt != "jsonl" or s.compression:
            tasks.append(ReadTask(i, s))
            continue
        if is_local(s.url):
            local = local_path(s.url)
        else:
            fs, p = filesystem(s.url, storage_options)
            local = str(work_dir / "inputs" / hashlib.sha1(s.url.encode()).hexdigest()[:16] / Path(p).name)
            Path(local).parent.mkdir(parents=True, exist_ok=True)
            if not (Path(local).exists() and Path(local).stat().st_size == fs.info(p)["size"]):
                fs.get_file(p, local + ".part")
                os.replace(local + ".part", local)
        with open(local, "rb") as f:
            first = f.read(1 << 16).removeprefix(b"\xef\xbb\xbf").lstrip()
        if first.startswith(b"["):
            tasks.append(ReadTask(i, replace(s, fmt="json_array"), local=local))
            continue
        tasks.extend(_line_ranges(i, s, local, target_bytes))
    return tasks


def _line_ranges(i: int, s: Source, local: str, target: int) -> list[ReadTask]:
    size = os.path.getsize(local)
    out: list[ReadTask] = []
    start, line = 0, 0
    with open(local, "rb") as f:
        while start < size:
            end = min(size, start + target)
            if end < size:
                f.seek(end)
                rest = f.readline()
                end += len(rest)
            # count lines of [start, end)
            f.seek(start)
            remaining, n = end - start, 0
            while remaining > 0:
                chunk = f.read(min(remaining, 1 << 24))
                n += chunk.count(b"\n")
                remaining -= len(chunk)
            out.append(ReadTask(i, s, local, start, end, line))
            line += n
            start = end
    return out or [ReadTask(i, s, local, 0, 0, 0)]


@dataclass
class ReadBatch:
    rows: dict[str, list]         # ROW_COLUMNS
    quarantine: dict[str, list]   # QUARANTINE_COLUMNS
    response_only: int = 0        # chat/pair rows with a response and no prompt (kept or not)


QUARANTINE_COLUMNS = ("_row", "_src", "_line", "_reason", "_rawtext")
# deeper rows are no chat data, and recursive code further on (json, pyarrow) must not meet them
MAX_DEPTH = 100


def _empty_batch() -> ReadBatch:
    return ReadBatch({c: [] for c in ROW_COLUMNS}, {c: [] for c in QUARANTINE_COLUMNS})


def _clean_surrogates(s: str) -> str:
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (NaN and infinities have no JSON form)")


def _finite_float(text: str) -> float:
    v = float(text)
    if v - v != 0:   # inf or nan: 1e999 parses to inf
        raise ValueError(f"number {text[:40]} overflows to infinity")
    return v


# strict JSON: NaN/Infinity literals and overflowing numbers are refused, not passed on
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def _too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    stack = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return True
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return False


def parse_line(text: str) -> Any:
    """One JSON value of a JSON line; ValueError with the quarantine reason on any defect."""
    try:
        obj = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise ValueError("invalid JSON: nested too deeply to parse") from None
    except ValueError as e:   # 5,000-digit integers, NaN, 1e999
        raise ValueError(f"invalid JSON: {e}") from None
    if text.count("[") + text.count("{") > MAX_DEPTH and _too_deep(obj):
        raise ValueError(f"row is nested deeper than {MAX_DEPTH} levels")
    return obj


class RowReader:
    """Turns one input row (a JSON line, or a row object of another format) into a kept
    row or a quarantined one. No exception raised by one row escapes: every failure is
    that row's quarantine reason."""

    def __init__(self, fm: FieldMap, policy: RowPolicy):
        self.fm, self.policy = fm, policy

    def line(self, b: ReadBatch, rid: int, src: int, line: int, data: bytes) -> None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            self.bad(b, rid, src, line, f"invalid UTF-8 at byte {e.start} of the line",
                     data.decode("utf-8", "backslashreplace").rstrip("\r\n"))
            return
        text = text.rstrip("\r\n")
        if text.startswith("\ufeff"):   # a byte order mark (first line of a file, or concatenated files)
            text = text[1:]
        if not text.strip():
            self.bad(b, rid, src, line, "blank line", text)
            return
        try:
            obj = parse_line(text)
        except ValueError as e:
            self.bad(b, rid, src, line, str(e), text)
            return
        self.row(b, rid, src, line, text, obj)

    def obj(self, b: ReadBatch, rid: int, src: int, line: int, obj: Any) -> None:
        """A row object of a JSON array, parquet, arrow or dataset source."""
        try:
            if _too_deep(obj):
                raise ValueError(f"row is nested deeper than {MAX_DEPTH} levels")
            raw = dump_row(_jsonable(obj))
        except (TypeError, ValueError, RecursionError) as e:
            self.bad(b, rid, src, line, f"row cannot be written as JSON: {e}", _safe_repr(obj))
            return
        self.row(b, rid, src, line, raw, obj)

    def row(self, b: ReadBatch, rid: int, src: int, line: int, raw: str, obj: Any) -> None:
        try:
            t = extract(obj, self.fm)
        except RowError as e:
            self.bad(b, rid, src, line, str(e), raw)
            return
        except Exception as e:  # noqa: BLE001 - one row never ends the run; the reason names it
            self.bad(b, rid, src, line, f"row cannot be read: {type(e).__name__}: {e}", raw)
            return
        if t.response_only:
            b.response_only += 1
            if self.policy.response_only == "quarantine":
                self.bad(b, rid, src, line, "response without a prompt (row_policy.response_only: "
                         "quarantine)", raw)
                return
        r = b.rows
        r["_row"].append(rid)
        r["_src"].append(src)
        r["_line"].append(line)
        r["_id"].append(None if t.id is None else _clean_surrogates(t.id))
        r["_raw"].append(raw)
        r["_prompt"].append(_clean_surrogates(t.prompt))
        r["_response"].append(_clean_surrogates(t.response))

    @staticmethod
    def bad(b: ReadBatch, rid: int, src: int, line: int, reason: str, raw: str) -> None:
        q = b.quarantine
        q["_row"].append(rid)
        q["_src"].append(src)
        q["_line"].append(line)
        q["_reason"].append(_clean_surrogates(reason))
        q["_rawtext"].append(_clean_surrogates(raw))


def _safe_repr(obj: Any) -> str:
    try:
        return repr(obj)[:10000]
    except Exception as e:  # noqa: BLE001 - a repr of a hostile object may itself fail
        return f"<unprintable {type(obj).__name__}: {type(e).__name__}>"


def _full(b: ReadBatch, batch_rows: int) -> bool:
    return len(b.rows["_row"]) + len(b.quarantine["_row"]) >= batch_rows


def iter_read(task: ReadTask, reader: RowReader, storage_options: dict | None, batch_rows: int
              ) -> Iterator[ReadBatch]:
    """Batches of rows (and quarantined rows) of one read task, in order. Row ids are
    `source index << ROW_SHIFT | 1-based line (or row) number`."""
    s = task.source
    base = task.src_index << ROW_SHIFT
    if s.fmt == "jsonl":
        yield from _iter_jsonl(task, reader, storage_options, batch_rows, base)
    elif s.fmt == "json_array":
        yield from _iter_json_array(task, reader, batch_rows, base)
    else:
        yield from _iter_datasets(task, reader, storage_options, batch_rows, base)


def _iter_jsonl(task, reader: RowReader, storage_options, batch_rows, base) -> Iterator[ReadBatch]:
    s = task.source
    if task.local is not None:
        f = open(task.local, "rb")
        f.seek(task.start)
        remaining = None if task.end is None else task.end - task.start
    else:
        f = fsspec.open(s.url, "rb", compression=s.compression, **(storage_options or {})).open()
        remaining = None
    b = _empty_batch()
    line = task.first_line
    try:
        while remaining is None or remaining > 0:
            data = f.readline() if remaining is None else f.readline(remaining)
            if not data:
                break
            if remaining is not None:
                remaining -= len(data)
            line += 1
            reader.line(b, base + line, task.src_index, line, data)
            if _full(b, batch_rows):
                yield b
                b = _empty_batch()
    finally:
        f.close()
    yield b


def _iter_json_array(task, reader: RowReader, batch_rows, base) -> Iterator[ReadBatch]:
    try:
        with open(task.local, "rb") as f:
            data = _DECODER.decode(f.read().decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CurationError(f"input {task.source.url}: not valid JSON ({e}); a .json input must be "
                            "JSON lines or one JSON array of rows") from e
    if not isinstance(data, list):
        raise CurationError(f"input {task.source.url}: a JSON file must hold a list of rows")
    b = _empty_batch()
    for i, obj in enumerate(data, 1):
        reader.obj(b, base + i, task.src_index, i, obj)
        if _full(b, batch_rows):
            yield b
            b = _empty_batch()
    yield b


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, bytes):
        raise TypeError("bytes value")
    return str(v)


def iter_batches(source: Source, storage_options: dict | None, batch_rows: int) -> Iterator[dict]:
    """Column batches (dict of lists) of a parquet/arrow/dataset-dir source, streamed.

    Parquet is read with pyarrow row-group batches (what `datasets` uses underneath; its
    streaming reader would import torch first); arrow files and saved dataset directories
    are opened with `datasets` (memory-mapped)."""
    so = storage_options or {}
    if source.fmt == "parquet":
        import pyarrow.parquet as pq

        if is_local(source.url):
            pf = pq.ParquetFile(local_path(source.url))
            yield from (b.to_pydict() for b in pf.iter_batches(batch_size=batch_rows))
            return
        fs, p = filesystem(source.url, so)
        with fs.open(p, "rb") as f:
            yield from (b.to_pydict() for b in pq.ParquetFile(f).iter_batches(batch_size=batch_rows))
        return
    import datasets

    if source.fmt == "arrow":
        if not is_local(source.url):
            raise CurationError(f"input {source.url}: .arrow files must be local (copy it, or use "
                                "parquet / a saved dataset directory for remote data)")
        ds = datasets.Dataset.from_file(local_path(source.url))
    else:
        ds = datasets.load_from_disk(local_path(source.url) if is_local(source.url) else source.url,
                                     storage_options=so or None)
        if isinstance(ds, datasets.DatasetDict):
            if source.split is None:
                raise CurationError(f"{source.url} is a DatasetDict; name a split")
            ds = ds[source.split]
    yield from ds.iter(batch_size=batch_rows)


def _iter_datasets(task, reader: RowReader, storage_options, batch_rows, base) -> Iterator[ReadBatch]:
    i = 0
    for batch in iter_batches(task.source, storage_options, batch_rows):
        keys = list(batch)
        b = _empty_batch()
        for vals in zip(*(batch[k] for k in keys)):
            i += 1
            reader.obj(b, base + i, task.src_index, i, dict(zip(keys, vals)))
        yield b


def reason_key(reason: str) -> str:
    """A quarantine reason without its row-specific part, for counting."""
    for prefix in ("invalid UTF-8", "duplicate id"):
        if reason.startswith(prefix):
            return prefix
    key = reason.split(" at column ", 1)[0] if reason.startswith("invalid JSON") else reason
    return key if len(key) < 80 else key[:77] + "..."


def row_label(sources: list[Source], row: int) -> str:
    """`source:line` of a row id (1-based line or row number)."""
    src, line = row >> ROW_SHIFT, row & ((1 << ROW_SHIFT) - 1)
    return f"{sources[src].label}:{line}" if 0 <= src < len(sources) else f"?:{line}"

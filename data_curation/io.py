"""Data in and out: input discovery, robust row reading with quarantine, step parts.

Inputs (`DataInput`: a path with an optional `split` and `revision`, or just the path) are
fsspec URLs or local paths: jsonl/json files (optionally compressed), parquet, arrow files,
Hugging Face dataset directories (`save_to_disk` output, or a directory of data files),
directories of such files, globs, and hub dataset ids `org/name` (a snapshot from the local
Hugging Face cache; offline with HF_HUB_OFFLINE=1). Splits: a saved DatasetDict, and a
directory (or hub dataset) whose file names carry split names (`train.jsonl`,
`data/test-00000-of-00001.parquet`, as `datasets` infers them), must be given a `split`;
their splits are never merged silently. Arrow files and dataset directories are read
through `datasets`, parquet in pyarrow row-group batches; JSON lines are read by this
module line by line, because a bad line must be quarantined with its reason instead of
failing the whole load (and ranges of one big file are read in parallel). The training
stages read through the same discovery (stages/common/rows.py).

Inside a run, rows move between steps as parquet "parts" with fixed internal columns:
`_row` (stable row id = source index << 40 | 1-based line or row number in the source),
`_src`, `_line` (that 1-based number), `_id`, `_raw` (the row as a JSON object string,
exactly as read for JSON lines), `_prompt`, `_response` (matching text, see row_schema.py).
Reading never fails on a row: whatever one row holds (bad bytes, bad JSON, NaN, a
5,000-digit number, 100k levels of nesting, wrong types) becomes its quarantine reason.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import fsspec

from pydantic import Field

from data_curation._base import CurationError, Strict
from data_curation.row_schema import FieldMap, RowError, RowPolicy, dump_row, extract

ROW_SHIFT = 40
JSONL_EXT = (".jsonl", ".json", ".ndjson")
COMPRESSED_EXT = (".gz", ".bz2", ".xz", ".zst", ".lz4")
PARQUET_EXT = (".parquet",)
ARROW_EXT = (".arrow",)
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
ROW_COLUMNS = ("_row", "_src", "_line", "_id", "_raw", "_prompt", "_response")


# -- URLs ---------------------------------------------------------------------------
def normalise_url(url: str) -> str:
    """Absolute URL: local paths (bare or file://, relative or not) become file:///abs."""
    if "://" not in url:
        return "file://" + str(Path(url).expanduser().resolve())
    proto, rest = url.split("://", 1)
    if proto == "file":
        return "file://" + str(Path(rest).expanduser().resolve())
    return url.rstrip("/")


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts if p)])


def filesystem(url: str, storage_options: dict[str, Any] | None = None):
    """(fsspec filesystem, path inside it) of `url`. An http(s) URL takes none of the store's
    options (s3fs's key, endpoint_url, client_kwargs are not aiohttp's): its credentials are
    its user info."""
    options = storage_options or {}
    if url.startswith(("http://", "https://")):
        options = {}
    return fsspec.core.url_to_fs(url, **options)


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def _info_identity(info: dict) -> dict:
    keep = {k: info.get(k) for k in ("size", "ETag", "etag", "md5", "LastModified", "mtime",
                                      "last_modified", "created") if info.get(k) is not None}
    return {k: str(v) for k, v in keep.items()}


# -- the Hugging Face hub (through its local cache) -------------------------------------
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def is_hub_id(value: str) -> bool:
    """`org/name` that is not a local path: a Hugging Face hub repository (as transformers and
    datasets read such a name)."""
    return "://" not in value and bool(_HUB_ID.match(value)) and not os.path.exists(value)


def _hub_offline() -> bool:
    # read at call time (huggingface_hub reads it once, at import)
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache_dir() -> str:
    """The hub cache in effect now: HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub.constants import HF_HUB_CACHE

    return HF_HUB_CACHE


def hub_snapshot(repo_id: str, repo_type: str, revision: str | None) -> tuple[str, str]:
    """(local directory, commit) of a hub repo's snapshot: from the local cache with
    HF_HUB_OFFLINE=1, else downloaded into it as needed. CurationError says what is missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    cache, offline = hub_cache_dir(), _hub_offline()
    what = f"hub {repo_type} {repo_id} (revision {revision or 'main'})"
    try:
        path = snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache,
                                 local_files_only=offline)
    except LocalEntryNotFoundError:
        raise CurationError(
            f"{what} is not in the Hugging Face cache {cache}" + (" and HF_HUB_OFFLINE is set" if offline else "")
            + f": download it first (`hf download {repo_id}"
            + (" --repo-type dataset" if repo_type == "dataset" else "") + "`), or give a local path") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise CurationError(f"{what}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    except (HfHubHTTPError, OSError) as e:
        raise CurationError(f"{what} cannot be fetched: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return path, Path(path).name


# -- input discovery ------------------------------------------------------------------
class DataInput(Strict):
    """One data input as a config names it; a plain string is `{path: ...}`."""

    path: str = Field(description="file, directory, glob, fsspec URL, saved dataset dir, or hub dataset id org/name")
    split: str | None = Field(None, description="the split to read, where the input has splits "
                              "(a saved DatasetDict, split-named files, a hub dataset)")
    revision: str | None = Field(None, description="hub dataset ids only: branch, tag or commit")


def as_input(value: "str | DataInput") -> DataInput:
    return value if isinstance(value, DataInput) else DataInput(path=value)


@dataclass
class Source:
    url: str                 # normalised URL of the file or dataset directory
    fmt: str                 # jsonl | json_array | parquet | arrow | hf
    identity: dict[str, Any]
    split: str | None = None  # hf DatasetDict split
    compression: str | None = None

    name: str | None = None   # shown in reports instead of the URL (e.g. a local copy's origin)

    @property
    def label(self) -> str:
        base = self.name or self.url
        return f"{base}[{self.split}]" if self.split else base

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rename_source(s: Source, names: dict[str, str]) -> Source:
    """Give a source a display name from {input URL -> name} (prefix match for dirs)."""
    for url, name in sorted(names.items(), key=lambda kv: -len(kv[0])):
        if s.url == url or s.url.startswith(url.rstrip("/") + "/"):
            return Source(s.url, s.fmt, s.identity, s.split, s.compression,
                          name.rstrip("/") + s.url[len(url.rstrip("/")):] if s.url != url else name)
    return s


def _file_format(path: str) -> tuple[str, str | None] | None:
    low = path.lower()
    comp = None
    for ext in COMPRESSED_EXT:
        if low.endswith(ext):
            comp, low = "infer", low[: -len(ext)]
    if low.endswith(JSONL_EXT):
        return "jsonl", comp
    if low.endswith(PARQUET_EXT) and comp is None:
        return "parquet", None
    if low.endswith(ARROW_EXT) and comp is None:
        return "arrow", None
    return None


def discover(inputs: "list[str | DataInput]", storage_options: dict | None = None) -> list[Source]:
    """Expand inputs (files, directories, globs, dataset dirs, hub dataset ids) into ordered
    sources, each split selected as the input says."""
    if not inputs:
        raise CurationError("no input data given")
    out: list[Source] = []
    for item in inputs:
        inp = as_input(item)
        raw, split = inp.path, inp.split
        if is_hub_id(raw):
            local, _ = hub_snapshot(raw, "dataset", inp.revision)
            out.extend(_discover_dir(*filesystem("file://" + local), lambda p: "file://" + p, raw, split))
            continue
        if inp.revision is not None:
            raise CurationError(f"input {raw}: `revision` selects a version of a hub dataset (org/name), "
                                "not of a path")
        url = normalise_url(raw)
        fs, path = filesystem(url, storage_options)
        proto = url.split("://", 1)[0]

        def to_url(p: str) -> str:
            return f"{proto}://{p}" if proto != "file" else "file://" + p

        if any(c in path for c in "*?["):
            matches = sorted(fs.glob(path))
            if not matches:
                raise CurationError(f"input {raw}: the glob matches no file")
            paths = matches
        elif not fs.exists(path):
            raise CurationError(f"input {raw} does not exist")
        else:
            paths = [path]
        for p in paths:
            if fs.isdir(p):
                out.extend(_discover_dir(fs, p, to_url, raw, split))
            else:
                if split is not None:
                    raise CurationError(f"input {raw}: a file has no splits; `split` goes with a dataset "
                                        "directory or a hub dataset")
                fmt = _file_format(p)
                if fmt is None:
                    raise CurationError(
                        f"input {to_url(p)}: cannot tell its format from the name (expected "
                        ".jsonl/.json (optionally compressed), .parquet, .arrow or a dataset directory)")
                out.append(Source(to_url(p), fmt[0], _info_identity(fs.info(p)), compression=fmt[1]))
    return out


def _discover_dir(fs, path: str, to_url, raw: str, split: str | None) -> list[Source]:
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    if "dataset_dict.json" in names:
        with fs.open(join(path, "dataset_dict.json"), "r") as f:
            splits = json.load(f)["splits"]
        chosen = _choose_split(raw, "a saved DatasetDict", splits, split)
        return [Source(to_url(path), "hf", _dir_identity(fs, join(path, chosen)), split=chosen)]
    if "state.json" in names and "dataset_info.json" in names:
        if split is not None:
            raise CurationError(f"input {raw}: a saved Dataset has no splits (a DatasetDict has); drop `split`")
        return [Source(to_url(path), "hf", _dir_identity(fs, path))]
    files = sorted(p for p in fs.find(path) if _file_format(p) is not None and not _skipped(path, p))
    if not files:
        raise CurationError(f"input {raw}: directory has no .jsonl/.json/.parquet/.arrow files "
                            "and is not a saved dataset")
    by_split = _files_by_split(path, files) if to_url("").startswith("file://") else None
    if split is not None or (by_split is not None and len(by_split) > 1):
        if by_split is None:
            raise CurationError(f"input {raw}: split selection needs a local directory or a hub dataset "
                                "(fetch a remote one first)")
        files = by_split[_choose_split(raw, "a directory whose file names carry splits", list(by_split), split)]
    out = []
    for p in files:
        fmt, comp = _file_format(p)
        out.append(Source(to_url(p), fmt, _info_identity(fs.info(p)), compression=comp))
    return out


def _choose_split(raw: str, what: str, splits: list[str], split: str | None) -> str:
    if split is None:
        raise CurationError(f"input {raw} is {what} with splits {splits}: name the one to read "
                            f"(`split: {splits[0]}`); splits are never merged")
    if split not in splits:
        raise CurationError(f"input {raw} has no split {split!r}; its splits are {splits}")
    return split


def _files_by_split(path: str, files: list[str]) -> dict[str, list[str]]:
    """{split: its data files} of a local directory by `datasets`' naming conventions
    (`train.jsonl`, `data/test-00000-of-00001.parquet`, `validation/`...); a directory whose
    names carry no split is all "train", as `datasets` reads it."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        patterns = get_data_patterns(path)
        resolved = DataFilesDict.from_patterns(patterns, base_path=path)
    except Exception:  # noqa: BLE001 - nothing datasets recognises: one split of every file
        return {"train": files}
    wanted = set(files)
    out = {str(k): [f for f in v if f in wanted] for k, v in resolved.items()}
    return {k: v for k, v in out.items() if v} or {"train": files}


# metadata files of artifacts / datasets that sit next to data files
_METADATA = {"manifest.json", "stage_summary.json", "dataset_info.json", "state.json",
             "dataset_dict.json", "report.json"}


def _skipped(root: str, path: str) -> bool:
    """Hidden/underscore entries (`.verified/`, `_SUCCESS`, `_curate_cache/`) and metadata."""
    rel = path[len(root.rstrip("/")) + 1:] if path.startswith(root.rstrip("/") + "/") else path
    parts = rel.split("/")
    return any(x.startswith((".", "_")) for x in parts) or parts[-1] in _METADATA


def _dir_identity(fs, path: str) -> dict[str, Any]:
    return {p.rsplit("/", 1)[-1]: _info_identity(fs.info(p)) for p in sorted(fs.find(path))}


# -- reading rows ---------------------------------------------------------------------
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


# -- parts ----------------------------------------------------------------------------
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

"""Input discovery: what a config names as data (`DataInput`: a path with an optional
`split` and `revision`, or just the path) expanded into ordered `Source`s.

Inputs are fsspec URLs or local paths: jsonl/json files (optionally compressed), parquet,
arrow files, Hugging Face dataset directories (`save_to_disk` output, or a directory of
data files), directories of such files, globs, and hub dataset ids `org/name` (a snapshot
from the local Hugging Face cache). Splits: a saved DatasetDict, and a directory (or hub
dataset) whose file names carry split names (`train.jsonl`,
`data/test-00000-of-00001.parquet`, as `datasets` infers them), must be given a `split`;
their splits are never merged silently. Curation and the training stages
(stages/common/rows.py) discover their inputs here.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from data_curation._base import CurationError, Strict
from data_curation.hub import hub_snapshot, is_hub_id
from data_curation.urls import file_identity, filesystem, join, normalise_url

JSONL_EXT = (".jsonl", ".json", ".ndjson")
COMPRESSED_EXT = (".gz", ".bz2", ".xz", ".zst", ".lz4")
PARQUET_EXT = (".parquet",)
ARROW_EXT = (".arrow",)


class DataInput(Strict):
    """One data input as a config names it; a plain string is `{path: ...}`."""

    path: str = Field(description="file, directory, glob, fsspec URL, saved dataset dir, or hub dataset id org/name")
    split: str | None = Field(None, description="the split to read, where the input has splits "
                              "(a saved DatasetDict, split-named files, a hub dataset)")
    revision: str | None = Field(None, description="hub dataset ids only: branch, tag or commit")
    # out of the stage hash at its default (pipeline/plan.py): inputs written before it keep their hashes
    config: str | None = Field(None, json_schema_extra={"hash_unless_default": True}, description=(
        "hub dataset ids only: the dataset's configuration (subset), e.g. `main` of openai/gsm8k"))


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
            if inp.config is not None:
                out.extend(_discover_hub_config(local, raw, inp.config, split))
                continue
            out.extend(_discover_dir(*filesystem("file://" + local), lambda p: "file://" + p, raw, split))
            continue
        for key, what in (("revision", "a version"), ("config", "a configuration (subset)")):
            if getattr(inp, key) is not None:
                raise CurationError(f"input {raw}: `{key}` selects {what} of a hub dataset (org/name), not of a path")
        url = normalise_url(raw)
        fs, path = filesystem(url, storage_options)
        proto = url.split("://", 1)[0]

        def to_url(p: str, proto: str = proto) -> str:
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
                out.append(Source(to_url(p), fmt[0], file_identity(fs.info(p)), compression=fmt[1]))
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
        out.append(Source(to_url(p), fmt, file_identity(fs.info(p)), compression=comp))
    return out


def _discover_hub_config(local: str, raw: str, config: str, split: str | None) -> list[Source]:
    """The files of configuration `config` of a hub dataset snapshot: as its dataset card's
    `configs:` metadata lists them (what `datasets.load_dataset(raw, config)` reads), else the
    snapshot's directory of that name (the layout of the hub's parquet exports)."""
    from datasets.data_files import DataFilesDict, sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    root = Path(local)
    readme = root / "README.md"
    configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data) if readme.is_file() else {}
    fs, _ = filesystem("file://" + local)
    if config not in configs:
        if (root / config).is_dir():
            return _discover_dir(fs, str(root / config), lambda p: "file://" + p, f"{raw} ({config})", split)
        known = sorted(set(configs) | {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")})
        raise CurationError(f"input {raw}: the dataset has no configuration {config!r}; it has {known}")
    meta = configs[config]
    base = root / meta.get("data_dir", "")
    patterns = sanitize_patterns(meta["data_files"]) if meta.get("data_files") else None
    if patterns is None:
        return _discover_dir(fs, str(base), lambda p: "file://" + p, f"{raw} ({config})", split)
    by_split = {str(k): sorted(str(f) for f in v)
                for k, v in DataFilesDict.from_patterns(patterns, base_path=str(base)).items() if v}
    chosen = _choose_split(f"{raw} ({config})", "a hub dataset configuration", list(by_split), split) \
        if split is not None or len(by_split) > 1 else next(iter(by_split))
    out = []
    for p in by_split[chosen]:
        fmt, comp = _file_format(p) or (None, None)
        if fmt is None:
            raise CurationError(f"input {raw} ({config}): cannot read {p} (expected .jsonl/.json, .parquet, .arrow)")
        out.append(Source("file://" + p, fmt, file_identity(fs.info(p)), compression=comp))
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
    return {p.rsplit("/", 1)[-1]: file_identity(fs.info(p)) for p in sorted(fs.find(path))}

"""Benchmark sets as decontamination references: where they are, which fields hold their
text, which field holds their own ids; reading their rows.

A benchmark set is read from a path (file, fsspec URL, dataset directory) or from the
Hugging Face Hub by dataset id, configuration and split (`BenchmarkSource`), through the
local hub cache. An air-gapped machine has no hub: there `RING_BENCHMARKS_DIR` names a
directory holding each hub-named set as `<name>.jsonl` (or .json, .parquet, a `<name>/`
dataset directory), read instead of the hub. Real files differ in their field names
(`problem`, `question`, ...): an entry lists the fields that hold benchmark text, and a set
must have at least one of them. Rows are numbered from 1: the line of a JSON lines file,
the row of a table. Imports only pydantic (and YAML/fsspec when reading), so configs that
hold benchmark lists stay light.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Iterator

from pydantic import BaseModel, Field, ValidationError, model_validator

from data_curation._base import CurationError, Strict
from data_curation.discovery import DataInput, discover
from data_curation.row_reading import iter_batches
from data_curation.urls import filesystem, is_local, local_path, normalise_url

# looked for, in this order, when a benchmark entry names no `id_field`
NATIVE_ID_FIELDS = ("id", "unique_id", "problem_id", "question_id", "task_id", "idx", "uid")

# the one setting of an air-gapped machine: a directory of the hub-named benchmark sets
BENCHMARKS_DIR_ENV = "RING_BENCHMARKS_DIR"
LOCAL_COPY_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".parquet", "")  # "": a dataset directory


_ADDED_LATER = {"hash_unless_default": True}


def benchmarks_dir() -> Path | None:
    """The directory `RING_BENCHMARKS_DIR` names (read at call time), or None when unset."""
    value = os.environ.get(BENCHMARKS_DIR_ENV, "").strip()
    return Path(value).expanduser().resolve() if value else None


class BenchmarkSource(Strict):
    """A benchmark set on the Hugging Face Hub: dataset id, configuration, split; or, with
    `RING_BENCHMARKS_DIR` set, its local copy there, found by the set's name."""

    # each stays out of the stage hash at its default (pipeline/plan.py's `hash_unless_default`):
    # configs written before the field existed keep their hashes
    hub: str | None = Field(None, json_schema_extra=_ADDED_LATER, description=(
        "Hugging Face dataset id, e.g. openai/gsm8k (read through the local hub cache; with "
        f"${BENCHMARKS_DIR_ENV} set, from <name>.jsonl there instead)"))
    config: str | None = Field(None, json_schema_extra=_ADDED_LATER,
                               description="the hub dataset's configuration (subset), e.g. main")
    split: str | None = Field(None, json_schema_extra=_ADDED_LATER, description="the split to read, e.g. test")
    revision: str | None = Field(None, json_schema_extra=_ADDED_LATER,
                                 description="hub datasets only: branch, tag or commit")

    def _one_source(self, has_path: bool) -> None:
        if has_path == (self.hub is not None):
            raise ValueError("give a benchmark set either `path` or `hub` (a Hugging Face dataset id), not "
                             + ("both" if has_path else "neither"))
        if self.hub is None and (self.config or self.revision):
            raise ValueError("`config` and `revision` select a hub dataset's subset and version: they go with `hub`")

    def describe(self, name: str) -> str:
        parts = [f"hub {self.hub}"] + [f"{k} {v}" for k in ("config", "split", "revision")
                                       if (v := getattr(self, k)) is not None]
        return f"{name} ({', '.join(parts)})"

    def hub_input(self, name: str) -> DataInput:
        """Where the hub-named set `name` is read from now: its local copy under
        RING_BENCHMARKS_DIR when that is set (CurationError when the copy is missing), else
        the hub dataset through the local cache."""
        root = benchmarks_dir()
        if root is None:
            return DataInput(path=self.hub, config=self.config, split=self.split, revision=self.revision)
        for suffix in LOCAL_COPY_SUFFIXES:
            candidate = root / f"{name}{suffix}"
            if candidate.is_file() or (suffix == "" and candidate.is_dir()):
                return DataInput(path=str(candidate), split=self.split if candidate.is_dir() else None)
        raise CurationError(
            f"benchmark {self.describe(name)} is not in {BENCHMARKS_DIR_ENV}={root}: expected {name}.jsonl "
            f"(or {name}.json, {name}.parquet, a {name}/ dataset directory) there; unset {BENCHMARKS_DIR_ENV} "
            f"to read {self.hub} from the Hugging Face Hub")

    def unavailable(self, name: str) -> str | None:
        """Why the hub-named set `name` cannot be read here (None: it can), checked without
        reading it: its local copy, else the hub cache (downloaded into it when online)."""
        try:
            inp = self.hub_input(name)
            if inp.path == self.hub:
                discover([inp])
        except CurationError as e:
            return self.unavailable_message(name, e)
        return None

    def unavailable_message(self, name: str, error: Exception) -> str:
        if benchmarks_dir() is not None:
            return str(error)
        return (f"benchmark {self.describe(name)} cannot be read: {error}. On a machine without the Hub, set "
                f"{BENCHMARKS_DIR_ENV} to a directory holding {name}.jsonl")


class BenchmarkSpec(BenchmarkSource):
    """One decontamination reference: a path or a hub dataset, and its text fields."""

    path: str | None = Field(None, description="file, fsspec URL, or Hugging Face dataset directory")
    fields: list[str] = Field(min_length=1, description="fields holding benchmark text (a set must have at "
                              "least one; list every name its copies use, e.g. [problem, question])")
    name: str | None = Field(None, description="label in reports and the set's name under "
                             f"{BENCHMARKS_DIR_ENV} (default: the file stem, or the hub id's name)")
    id_field: str | None = Field(None, description="field of the benchmark's own item ids "
                                 f"(default: the first of {', '.join(NATIVE_ID_FIELDS)} present)")

    @model_validator(mode="after")
    def _source(self) -> "BenchmarkSpec":
        self._one_source(self.path is not None)
        return self

    @property
    def label(self) -> str:
        return self.name or Path((self.path or self.hub or "").rstrip("/")).name.split(".")[0]

    def data_input(self) -> DataInput:
        """What to read: the path as it is (its `split` filters a dataset's splits), or the hub set."""
        if self.hub is not None:
            return self.hub_input(self.label)
        return DataInput(path=self.path)

    def native_id(self, row: dict[str, Any]) -> str | None:
        keys = (self.id_field,) if self.id_field else NATIVE_ID_FIELDS
        for k in keys:
            v = row.get(k)
            if v is not None and not isinstance(v, (dict, list)):
                return str(v)
        return None


def load_benchmark_list(url: str, storage_options: dict | None = None) -> list[BenchmarkSpec]:
    """A YAML/JSON list of `{path, fields, name}` (or `{benchmarks: [...]}`); relative paths
    are relative to the list file."""
    import yaml

    full = normalise_url(url)
    fs, p = filesystem(full, storage_options)
    if not fs.exists(p):
        raise CurationError(f"benchmark list {url} does not exist")
    with fs.open(p, "r", encoding="utf-8-sig") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise CurationError(f"benchmark list {url}: not valid YAML: {e}") from e
    if isinstance(data, dict) and "benchmarks" in data:
        data = data["benchmarks"]
    if not isinstance(data, list) or not data:
        raise CurationError(f"benchmark list {url}: expected a non-empty list of "
                            "{path, fields, name} entries")
    base = full.rsplit("/", 1)[0]
    out = []
    for i, entry in enumerate(data):
        try:
            spec = BenchmarkSpec.model_validate(entry)
        except ValidationError as e:
            raise CurationError(f"benchmark list {url}, entry {i + 1}: {e}") from e
        if spec.path is not None and "://" not in spec.path and not spec.path.startswith("/"):
            rel = f"{base}/{spec.path}"
            spec = spec.model_copy(update={"path": str(Path(local_path(rel)).resolve())
                                           if is_local(rel) else rel})
        out.append(spec)
    return out


def resolve_benchmarks(benchmarks: list[BenchmarkSpec] | str, storage_options: dict | None
                       ) -> list[BenchmarkSpec]:
    if isinstance(benchmarks, str):
        return load_benchmark_list(benchmarks, storage_options)
    return list(benchmarks)


def iter_benchmark_rows(spec: BenchmarkSpec, storage_options: dict | None
                        ) -> Iterator[tuple[str, int, Any]]:
    """(source label, 1-based row number, row) of a benchmark; bad rows are errors (they
    are reference data, not training data)."""
    import json

    import fsspec

    try:
        sources = discover([spec.data_input()], storage_options)
    except CurationError as e:
        if spec.hub is None:
            raise
        raise CurationError(spec.unavailable_message(spec.label, e)) from None
    if spec.split is not None and spec.hub is None:
        sources = [s for s in sources if s.split in (None, spec.split)]
        if not sources:
            raise CurationError(f"benchmark {spec.label}: no split {spec.split!r} in {spec.path}")
    for s in sources:
        if s.fmt == "jsonl":
            with fsspec.open(s.url, "rt", encoding="utf-8-sig", compression=s.compression,
                             **(storage_options or {})) as f:
                head = f.read(1 << 16)
                f.seek(0)
                if head.lstrip().startswith("["):
                    for i, r in enumerate(json.load(f), 1):
                        yield s.label, i, r
                    continue
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield s.label, i, json.loads(line)
                    except (ValueError, RecursionError) as e:
                        raise CurationError(f"benchmark {spec.label}: {s.url} line {i}: "
                                            f"invalid JSON ({e})") from e
        else:
            i = 0
            for batch in iter_batches(s, storage_options, 1000):
                keys = list(batch)
                for vals in zip(*(batch[k] for k in keys)):
                    i += 1
                    yield s.label, i, dict(zip(keys, vals))


class _BenchmarkListMarker:
    """Marks a config field that holds a benchmark list (entries, or the URL of a YAML list):
    `hub_benchmarks` loads such a list to find the hub-named sets a stage will read."""


BENCHMARK_LIST = _BenchmarkListMarker()
BenchmarkList = Annotated[list[BenchmarkSpec] | str, BENCHMARK_LIST,
                          Field(description="benchmark entries, or the path/URL of a YAML list of them")]


def hub_benchmarks(config: BaseModel, storage_options: dict | None = None) -> dict[str, BenchmarkSource]:
    """name -> source of every hub-named benchmark set a config reads, found by type wherever
    it sits: `BenchmarkSource`s (named by their label, or their key in a mapping) and the
    entries of benchmark lists (`BenchmarkList` fields; a list file that cannot be read here
    is skipped: the stage that reads it says why)."""
    found: dict[str, BenchmarkSource] = {}

    def visit(value: Any, name: str | None) -> None:
        if isinstance(value, BenchmarkSource) and value.hub is not None:
            found[getattr(value, "label", None) or name or value.hub] = value
        if isinstance(value, BaseModel):
            for key, info in type(value).model_fields.items():
                v = getattr(value, key)
                if BENCHMARK_LIST in info.metadata and isinstance(v, str):
                    try:
                        v = load_benchmark_list(v, storage_options)
                    except CurationError:
                        continue
                visit(v, None)
        elif isinstance(value, dict):
            for key, v in value.items():
                visit(v, str(key))
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v, name)

    visit(config, None)
    return found


class EvalSuite(Strict):
    """The evaluation suite a training stage will be judged on, declared in the recipe on
    that stage: the pipeline refuses to start the stage when its input data holds more than
    `max_overlap` of a benchmark's items (matched like the decontaminate step)."""

    benchmarks: BenchmarkList
    max_overlap: float = Field(0.0, ge=0, le=1, description="largest share of a benchmark's items "
                               "that may be found in the stage's input data (0: none)")

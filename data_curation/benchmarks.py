"""Benchmark sets as decontamination references: where they are, which fields hold their
text, which field holds their own ids; reading their rows.

A benchmark list names files / fsspec URLs / Hugging Face dataset directories and, for
each, the fields that hold benchmark text (real files differ: `problem`, `question`, ...)
and the field of the benchmark's own ids (aime `id`, math500 `unique_id`; found by itself
among the usual names when not given). Rows are numbered from 1: the line of a JSON lines
file, the row of a table. Imports only pydantic (and YAML/fsspec when reading), so configs
that hold benchmark lists stay light.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from pydantic import Field, ValidationError

from data_curation._base import CurationError, Strict
from data_curation.discovery import discover
from data_curation.row_reading import iter_batches
from data_curation.urls import filesystem, is_local, local_path, normalise_url

# looked for, in this order, when a benchmark entry names no `id_field`
NATIVE_ID_FIELDS = ("id", "unique_id", "problem_id", "question_id", "task_id", "idx", "uid")


class BenchmarkSpec(Strict):
    path: str = Field(description="file, fsspec URL, or Hugging Face dataset directory")
    fields: list[str] = Field(min_length=1, description="fields holding benchmark text")
    name: str | None = Field(None, description="label in reports (default: file stem)")
    split: str | None = Field(None, description="split of a DatasetDict directory")
    id_field: str | None = Field(None, description="field of the benchmark's own item ids "
                                 f"(default: the first of {', '.join(NATIVE_ID_FIELDS)} present)")

    @property
    def label(self) -> str:
        return self.name or Path(self.path.rstrip("/")).name.split(".")[0]

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
        if "://" not in spec.path and not spec.path.startswith("/"):
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

    sources = discover([spec.path], storage_options)
    if spec.split is not None:
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


class EvalSuite(Strict):
    """The evaluation suite a training stage will be judged on, declared in the recipe on
    that stage: the pipeline refuses to start the stage when its input data holds more than
    `max_overlap` of a benchmark's items (matched like the decontaminate step)."""

    benchmarks: list[BenchmarkSpec] | str = Field(
        description="benchmark entries, or the path/URL of a YAML list of them")
    max_overlap: float = Field(0.0, ge=0, le=1, description="largest share of a benchmark's items "
                               "that may be found in the stage's input data (0: none)")

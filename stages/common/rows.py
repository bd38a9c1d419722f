"""Rows of jsonl/json/parquet data files (a file, or a directory of them), read with
`datasets`. Errors name the data (`what`, e.g. "sft data"), the file and the cause."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DataError(RuntimeError):
    """Bad input data: the message names the file, the row and the reason."""


def data_files(path: Path, source: str, what: str = "data") -> list[Path]:
    """The data files of `path` (itself, or the files under a directory, recursive, sorted,
    hidden ones left out); `source` is the input as the user wrote it."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise DataError(f"{what} {source}: directory {path} holds no "
                            f"{'/'.join(DATA_SUFFIXES)} file")
        return files
    if path.suffix not in DATA_SUFFIXES:
        raise DataError(f"{what} {source}: {path.name} is not a {'/'.join(DATA_SUFFIXES)} file")
    return [path]


def read_rows(files: list[Path], cache_dir: Path | None = None, what: str = "data"
              ) -> Iterator[tuple[Path, int, dict]]:
    """(file, 1-based row number, row) for every row of every file, through `datasets`."""
    import datasets

    datasets.disable_progress_bars()
    for f in files:
        try:
            ds = datasets.load_dataset(DATA_SUFFIXES[f.suffix], data_files=str(f), split="train",
                                       cache_dir=str(cache_dir) if cache_dir else None)
        except Exception as e:  # noqa: BLE001 - datasets raises many types; name the file
            cause = e.__cause__ or e
            raise DataError(f"{what} {f}: cannot be read as {f.suffix[1:]}: "
                            f"{type(cause).__name__}: {cause}") from e
        for i, row in enumerate(ds, 1):
            yield f, i, row

"""URLs and filesystems: every path and fsspec URL of the project is read through these
(curation's inputs, the stages' data, the pipeline's artifact store), so a local path, a
`file://` URL and a remote URL mean the same thing everywhere."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec


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


def file_identity(info: dict) -> dict:
    """What tells a version of a file apart in an fsspec `info()` (size, etag, mtime...)."""
    keep = {k: info.get(k) for k in ("size", "ETag", "etag", "md5", "LastModified", "mtime",
                                      "last_modified", "created") if info.get(k) is not None}
    return {k: str(v) for k, v in keep.items()}

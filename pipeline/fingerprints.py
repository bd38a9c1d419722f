"""Content fingerprints of a stage's external inputs, for the stage hash.

A stage hash that covered only an input's *path* kept serving an artifact after the file
behind the path changed. Every external input a stage config names (a string value that is a
URL, an existing local path or a matching glob; `${stages.X.output}` references are covered by
the upstream hashes instead) contributes a fingerprint of its content:

- local file, directory or glob: the sorted listing of its files with their sizes, plus the
  sha256 of every file when the input totals at most `hash_max_bytes` (a recipe setting),
  else each file's mtime: touching a small file does not rerun anything, rewriting a big one
  does;
- object store prefix or object (s3://, gs://, ...): one (paginated) listing with each
  object's size and ETag; nothing is downloaded, so a 10k-object prefix costs ~10 requests;
- hub repo (`hf://org/name@revision/...`): the commit the revision points to, from the local
  Hugging Face cache's `refs/` files (a 40-hex revision is its own commit). A branch that is
  not in the cache cannot be resolved offline: the fingerprint then says so, and `plan` asks
  for a pinned commit;
- file inside an installed Python package (`pkg://<package>/<file>`, data_curation/package_files.py):
  the installing distribution's name and version and the sha256 its RECORD declares for the
  file (nothing is hashed); a file no RECORD lists is fingerprinted as a local file;
- hub-named benchmark set (`benchmark <name>`, data_curation/benchmarks.py): its local copy under
  RING_BENCHMARKS_DIR by content, else the commit of its snapshot in the hub cache;
- installed library a kind declares its results depend on (`StageKind.input_packages`, input
  `installed <distribution>`): the distribution's installed version (kept on the fingerprint
  too, `version`: the jobs' ranks check theirs against it, pipeline.execute.planned_packages).
"""
from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from data_curation.benchmarks import BENCHMARKS_DIR_ENV, BenchmarkSource, hub_benchmarks
from data_curation.hub import hub_snapshot
from data_curation.package_files import PackageFileError, resolve
from data_curation.urls import filesystem, normalise_url
from stages.common.artifact_inputs import StorageError, sha256_file, storage_errors

_GLOB_CHARS = re.compile(r"[*?\[]")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Fingerprint:
    """What an input looked like: `digest` enters the stage hash, `summary` is for people."""

    kind: str  # file | directory | glob | objects | hub | package | missing
    digest: str
    summary: str
    # an `installed <dist>` input's version as seen when planning, None where it was not installed:
    # what every rank checks its own against (pipeline.execute.planned_packages). Not hashed (its
    # digest covers it), and only set on distribution inputs, so other inputs' records are unchanged
    version: str | None = None

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _digest(entries: Any) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True, default=str).encode()).hexdigest()


def _size(n: float) -> str:
    units, i = ("B", "KB", "MB", "GB", "TB"), 0
    while n >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} {units[i]}" if i == 0 else f"{n:.1f} {units[i]}"


def _listing_summary(what: str, entries: list[tuple[str, int, Any]], by: str) -> str:
    total = sum(size for _, size, _ in entries)
    files = "1 file" if len(entries) == 1 else f"{len(entries)} files"
    return f"{what}: {files}, {_size(total)} (by {by})"


def _local_by(by_content: bool) -> str:
    return "content" if by_content else "size+mtime"


# -- local ---------------------------------------------------------------------------------
@lru_cache(maxsize=4096)
def _content_hash(path: str, size: int, mtime_ns: int) -> str:
    # keyed by size and mtime too: an in-place rewrite is hashed again, a re-plan is not
    return sha256_file(path)


def _local_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file())


def _local_listing(files: list[Path], base: Path | None, hash_max_bytes: int
                   ) -> tuple[list[tuple[str, int, Any]], bool]:
    stats = [(p, p.stat()) for p in files]
    by_content = sum(st.st_size for _, st in stats) <= hash_max_bytes
    entries = []
    for p, st in stats:
        name = p.relative_to(base).as_posix() if base else p.name
        tag = _content_hash(str(p), st.st_size, st.st_mtime_ns) if by_content else st.st_mtime_ns
        entries.append((name, st.st_size, tag))
    return entries, by_content


def local_fingerprint(value: str, hash_max_bytes: int) -> Fingerprint:
    raw = value[len("file://"):] if value.startswith("file://") else value
    if _GLOB_CHARS.search(raw):
        matches = sorted(Path(p) for p in globlib.glob(os.path.expanduser(raw), recursive=True))
        files = sorted({f for m in matches for f in _local_files(m)})
        if not files:
            return Fingerprint("missing", _digest(["missing"]), "no file matches")
        entries, by_content = _local_listing(files, None, hash_max_bytes)
        # the matched paths themselves, so a renamed match changes the fingerprint
        entries = [(str(f), size, tag) for f, (_, size, tag) in zip(files, entries)]
        return Fingerprint("glob", _digest(entries), _listing_summary("glob", entries, _local_by(by_content)))
    path = Path(raw).expanduser()
    if not path.exists():
        return Fingerprint("missing", _digest(["missing"]), "does not exist")
    kind = "directory" if path.is_dir() else "file"
    entries, by_content = _local_listing(_local_files(path), path if path.is_dir() else None,
                                         hash_max_bytes)
    return Fingerprint(kind, _digest(entries), _listing_summary(kind, entries, _local_by(by_content)))


# -- object stores -------------------------------------------------------------------------
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "crc32c", "LastModified", "mtime", "last_modified")


def object_store_fingerprint(value: str, storage_options: dict[str, Any]) -> Fingerprint:
    with storage_errors("list the input", value):
        fs, path = filesystem(value, storage_options)
        fs.invalidate_cache()  # a cached listing would hide a change made by another process
        if _GLOB_CHARS.search(path):
            found = fs.glob(path, detail=True)
        else:
            found = fs.find(path, detail=True)  # a prefix: one paginated listing, no downloads
    objects = sorted((name, info) for name, info in found.items() if info.get("type") != "directory")
    if not objects:
        return Fingerprint("missing", _digest(["missing"]), "no object at this URL")
    entries = [(name, int(info.get("size") or 0),
                next((str(info[k]) for k in _VERSION_KEYS if info.get(k)), None))
               for name, info in objects]
    return Fingerprint("objects", _digest(entries), _listing_summary("objects", entries, "ETag"))


# -- Hugging Face hub ----------------------------------------------------------------------
_HF_RE = re.compile(r"^hf://(?:(?P<type>datasets|spaces)/)?(?P<repo>[^/@]+/[^/@]+)(?:@(?P<rev>[^/]+))?")


def hub_fingerprint(value: str) -> Fingerprint:
    m = _HF_RE.match(value)
    if not m:
        return Fingerprint("missing", _digest(["unparsed", value]), "not an hf://org/name URL")
    from urllib.parse import unquote

    from huggingface_hub.constants import HF_HUB_CACHE

    repo, rev = m.group("repo"), unquote(m.group("rev") or "main")
    if _COMMIT.match(rev):
        return Fingerprint("hub", _digest([repo, rev]), f"hub {repo} at commit {rev[:12]}")
    repo_type = (m.group("type") or "models").rstrip("s")
    ref = Path(HF_HUB_CACHE) / f"{repo_type}s--{repo.replace('/', '--')}" / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
        return Fingerprint("hub", _digest([repo, commit]), f"hub {repo}@{rev} = commit {commit[:12]} "
                                                              "(local cache)")
    return Fingerprint("hub", _digest([repo, "unresolved", rev]),
                       f"hub {repo}@{rev}: not in the local cache, so its commit is unknown "
                       "(pin a commit: @<40-hex sha>)")


# -- files inside installed packages ------------------------------------------------------
def package_fingerprint(value: str, hash_max_bytes: int) -> Fingerprint:
    try:
        f = resolve(value)
    except PackageFileError as e:
        return Fingerprint("missing", _digest(["missing", value]), str(e))
    if f.record_sha256 is None:
        return local_fingerprint(str(f.path), hash_max_bytes)
    return Fingerprint("package", _digest([f.distribution, f.version, f.record_sha256]),
                       f"{f.distribution} {f.version}: {f.path.name}, {_size(f.path.stat().st_size)} "
                       f"(sha256 {f.record_sha256[:12]} per its RECORD)")


def installed_version(name: str) -> str | None:
    """The installed version of distribution `name` in this process's environment, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def distribution_fingerprint(name: str) -> Fingerprint:
    """An installed distribution a stage's results come from (a generator's library): its version."""
    installed = installed_version(name)
    if installed is None:
        return Fingerprint("missing", _digest(["missing distribution", name]), f"{name} is not installed")
    return Fingerprint("package", _digest(["distribution", name, installed]), f"version {installed}",
                       version=installed)


PACKAGE_INPUT = "installed "  # the input key of a distribution a kind declares: `installed <name>`
BENCHMARK_INPUT = "benchmark "  # the input key of a hub-named benchmark set: `benchmark <name>`


def benchmark_fingerprint(name: str, source: BenchmarkSource, hash_max_bytes: int) -> Fingerprint:
    """A hub-named benchmark set where this machine reads it: its local copy under
    RING_BENCHMARKS_DIR (by content), else the hub cache's commit; `missing` (the summary
    saying what to do) when it is in neither. Online, the check downloads it into the cache."""
    problem = source.unavailable(name)
    if problem is not None:
        return Fingerprint("missing", _digest(["missing benchmark", name]), problem)
    where = source.hub_input(name)
    if where.path != source.hub:
        local = local_fingerprint(where.path, hash_max_bytes)
        return Fingerprint(local.kind, local.digest, f"{BENCHMARKS_DIR_ENV} copy of {source.hub}: {local.summary}")
    _, commit = hub_snapshot(source.hub, "dataset", source.revision)
    return Fingerprint("hub", _digest([source.hub, commit, source.config, source.split]),
                       f"hub {source.hub} at commit {commit[:12]} (local cache)")


def benchmark_inputs(config: Any, storage_options: dict[str, Any], hash_max_bytes: int) -> dict[str, Fingerprint]:
    """`benchmark <name>` -> its fingerprint, for every hub-named benchmark set the config reads."""
    return {f"{BENCHMARK_INPUT}{name}": benchmark_fingerprint(name, source, hash_max_bytes)
            for name, source in sorted(hub_benchmarks(config, storage_options).items())}


def package_inputs(names: Iterable[str]) -> dict[str, Fingerprint]:
    """`installed <name>` -> its fingerprint, for the distributions a stage's kind declares."""
    return {f"{PACKAGE_INPUT}{n}": distribution_fingerprint(n) for n in sorted(set(names))}


# -- which config values are inputs --------------------------------------------------------
Fingerprinter = Callable[[str, dict[str, Any], int], Fingerprint]

# by URL protocol; any other protocol fsspec knows is listed as an object store
FINGERPRINTERS: dict[str, Fingerprinter] = {
    "file": lambda value, options, hash_max: local_fingerprint(value, hash_max),
    "hf": lambda value, options, hash_max: hub_fingerprint(value),
    "pkg": lambda value, options, hash_max: package_fingerprint(value, hash_max),
}


def _protocol(value: str) -> str | None:
    """The URL protocol of an input, or None when the string is not an input."""
    if "${stages." in value:
        return None  # an upstream artifact: its stage hash covers it
    if "://" in value:
        proto = value.split("://", 1)[0]
        from fsspec.registry import known_implementations

        return proto if proto in FINGERPRINTERS or proto in known_implementations else None
    raw = os.path.expanduser(value)
    if _GLOB_CHARS.search(raw):
        return "file" if "/" in raw and globlib.glob(raw, recursive=True) else None
    return "file" if os.path.exists(raw) else None


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def find_inputs(result_config: Any) -> list[str]:
    """The external inputs among the string values of a stage's (hash-relevant) config."""
    return sorted({s for s in _strings(result_config) if _protocol(s)})


def fingerprint(value: str, storage_options: dict[str, Any], hash_max_bytes: int) -> Fingerprint:
    proto = _protocol(value) or "file"
    make = FINGERPRINTERS.get(proto)
    if make is None:
        return object_store_fingerprint(normalise_url(value), storage_options)
    return make(value, storage_options, hash_max_bytes)


# A `plan` with the store out of reach (no network, a wrong endpoint) spent the client's retries,
# ~8 s, on every object-store input of every stage: 79 s for recipes/ring1t.yaml. An endpoint that
# could not be connected to is not asked again for UNREACHABLE_TTL_S; its other inputs say so at once.
UNREACHABLE_TTL_S = 60.0
_unreachable: dict[str, tuple[float, str]] = {}  # endpoint -> (when, what failed)
_CONNECTION_ERRORS = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                      "ClientConnectorError", "ServerTimeoutError"}  # botocore's and aiohttp's


def _endpoint(url: str, storage_options: dict[str, Any]) -> str | None:
    """The object-store endpoint an input is read from (None: a local file, package or hub input)."""
    protocol = url.split("://", 1)[0] if "://" in url else None
    if protocol in (None, "file", "pkg", "hf"):
        return None
    client = storage_options.get("client_kwargs") or {}
    return f"{protocol} at {client.get('endpoint_url') or storage_options.get('endpoint_url') or 'its default endpoint'}"


def _could_not_connect(error: BaseException) -> bool:
    """Whether a storage error was a failure to reach the endpoint at all (not a refusal of it)."""
    seen: BaseException | None = error
    for _ in range(8):  # the cause chain, bounded
        if seen is None:
            return False
        if isinstance(seen, ConnectionError) or type(seen).__name__ in _CONNECTION_ERRORS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def fingerprint_inputs(result_config: Any, storage_options: dict[str, Any], hash_max_bytes: int,
                       tolerate_errors: bool = False) -> dict[str, Fingerprint]:
    """input -> fingerprint. A store that cannot be listed raises StorageError, unless
    `tolerate_errors` (a `plan` of a store out of reach): then the input says so, and an endpoint
    that could not be reached is not asked again for the next inputs (UNREACHABLE_TTL_S)."""
    out = {}
    for v in find_inputs(result_config):
        endpoint = _endpoint(v, storage_options) if tolerate_errors else None
        down = _unreachable.get(endpoint) if endpoint else None
        if down and time.monotonic() - down[0] < UNREACHABLE_TTL_S:
            out[v] = Fingerprint("unreachable", _digest(["unreachable"]), f"not asked: {down[1]}")
            continue
        try:
            out[v] = fingerprint(v, storage_options, hash_max_bytes)
        except StorageError as e:
            if not tolerate_errors:
                raise
            out[v] = Fingerprint("unreachable", _digest(["unreachable"]), str(e))
            if endpoint and _could_not_connect(e):
                _unreachable[endpoint] = (time.monotonic(), f"{endpoint} could not be reached for {v}")
    return out

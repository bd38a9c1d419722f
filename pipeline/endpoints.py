"""The artifact store's and the tracking server's URLs: their form is checked when a recipe is
read (an unknown protocol, a backend that is not installed: `form_problem`), their answer by
`ring-pipeline validate` and before `run` starts anything (`probe_store`, `probe_tracking`:
unreachable, no credentials, credentials refused, no such bucket), each as one sentence
that names the URL (never its credentials: stages.common.secrets) and what to do.

A probe waits at most `PROBE_TIMEOUT_S`: an endpoint that does not answer is reported, not
waited for (botocore alone retries a dead endpoint for minutes).
"""
from __future__ import annotations

import base64
import importlib.util
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from data_curation.urls import filesystem
from stages.common import secrets
from stages.common.store_writes import within

PROBE_TIMEOUT_S = float(os.environ.get("RING_PROBE_TIMEOUT_S", "20"))
# MLflow's tracking stores by URI scheme (a DB scheme may name its driver: postgresql+psycopg2)
TRACKING_SCHEMES = {"", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks"}
_DB_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}
_BUCKETED = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}
# botocore's signals, by exception class name (no botocore import: a file store needs none)
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
_REFUSED_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                  "ExpiredToken", "403", "401", "Forbidden"}
_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionRefusedError", "ClientConnectorError",
                "gaierror", "ServerTimeoutError", "ReadTimeoutError", "ConnectionClosedError", "TimeoutError"}


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def form_problem(url: str) -> str | None:
    """Why fsspec cannot open `url` at all (unknown protocol, backend not installed), or None."""
    import fsspec
    from fsspec.registry import known_implementations, registry

    protocol = protocol_of(url)
    if protocol in _BUCKETED and not url.split("://", 1)[1].split("/", 1)[0]:
        return f"{secrets.redact(url)} names no bucket ({protocol}://BUCKET/prefix)"
    if protocol in registry:  # imported already
        return None
    if protocol not in fsspec.available_protocols():
        common = ", ".join(sorted(p for p in ("file", "s3", "gs", "gcs", "az", "abfs", "hdfs", "memory")
                                  if p in fsspec.available_protocols()))
        return f"unknown storage protocol {protocol!r} in {secrets.redact(url)} (known: {common}, ...)"
    impl = known_implementations.get(protocol, {})
    module = impl.get("class", "").split(".", 1)[0]
    if module and importlib.util.find_spec(module) is None:
        return f"{protocol}:// needs the package {module}, which is not installed ({impl.get('err', '')})"
    return None


def tracking_form_problem(uri: str) -> str | None:
    scheme = uri.split("://", 1)[0].lower().split("+", 1)[0] if "://" in uri else ""
    if scheme not in TRACKING_SCHEMES:
        return (f"unknown tracking URI scheme {scheme!r} in {secrets.redact(uri)} (MLflow takes "
                "sqlite:///path, a directory, http(s)://server, postgresql://, mysql://, mssql://, databricks)")
    if scheme == "sqlite" and not uri.startswith("sqlite:///"):
        return f"a SQLite tracking URI is sqlite:///relative/path.db or sqlite:////absolute/path.db, not {uri!r}"
    if scheme in ("http", "https", *_DB_PORTS):
        try:
            parts = urlsplit(uri)
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError as e:
            return f"{secrets.redact(uri)} is not a valid URL: {e}"
        if not parts.hostname:
            return f"{secrets.redact(uri)} names no host"
    return None


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _error_code(e: BaseException) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        return str(err.get("Code", "")) or str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""


def explain_store_error(url: str, e: BaseException) -> str:
    """One sentence about why the store at `url` cannot be used."""
    names = {type(x).__name__ for x in _chain(e)}
    codes = {_error_code(x) for x in _chain(e)} - {""}
    where = secrets.redact(url)
    if names & _NO_CREDENTIALS:
        return (f"no credentials for the store {where}: set storage.options key and secret "
                "(as ${env:NAME}), or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / a profile")
    if codes & _REFUSED_CODES or any(isinstance(x, PermissionError) for x in _chain(e)):
        return f"the store {where} refused the credentials ({', '.join(sorted(codes)) or 'permission denied'})"
    if codes & {"NoSuchBucket"}:
        return f"the bucket of the store {where} does not exist: create it first"
    if names & _UNREACHABLE or any(isinstance(x, (ConnectionError, socket.timeout)) for x in _chain(e)):
        return f"the store {where} is unreachable: {secrets.redact(str(e)) or type(e).__name__}"
    return f"cannot use the store {where}: {type(e).__name__}: {secrets.redact(str(e))}"


def _fast_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """The store's options with short timeouts and one retry, for a probe (s3fs / botocore)."""
    if protocol_of(url) not in ("s3", "s3a"):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", 5)
    config.setdefault("read_timeout", 10)
    config.setdefault("retries", {"max_attempts": 1})
    return {**options, "config_kwargs": config}


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _local_writable(path: Path, what: str) -> str | None:
    existing = _nearest_existing(path)
    if not existing.is_dir():
        return f"{what} {path}: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{what} {path}: {existing} is not writable"
    return None


def probe_store(url: str, options: dict[str, Any]) -> str | None:
    """Why the store at `url` cannot be used now, or None. A missing root is fine (the first
    run creates it); its bucket must exist and answer with these credentials."""
    if protocol_of(url) == "file":
        return _local_writable(Path(url.removeprefix("file://")), "the store")

    def check() -> None:
        fs, path = filesystem(url, _fast_options(url, options))
        bucket = path.split("/", 1)[0]
        fs.ls(bucket, detail=False) if protocol_of(url) in ("s3", "s3a", "gs", "gcs") else fs.exists(path)

    try:
        within(PROBE_TIMEOUT_S, check)
    except FileNotFoundError:
        return f"the bucket of the store {secrets.redact(url)} does not exist: create it first"
    except Exception as e:  # noqa: BLE001 - every backend has its own errors
        return explain_store_error(url, e)
    return None


def _http_probe(uri: str) -> str | None:
    parts = urlsplit(uri)
    headers = {}
    user, password = parts.username, parts.password
    if user is None and os.environ.get("MLFLOW_TRACKING_USERNAME"):
        user, password = os.environ["MLFLOW_TRACKING_USERNAME"], os.environ.get("MLFLOW_TRACKING_PASSWORD", "")
    if user is not None:
        from urllib.parse import unquote

        pair = f"{unquote(user)}:{unquote(password or '')}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
    elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = "Bearer " + os.environ["MLFLOW_TRACKING_TOKEN"]
    host = parts.hostname + (f":{parts.port}" if parts.port else "")
    base = urlunsplit((parts.scheme, host, parts.path.rstrip("/"), "", ""))
    request = urllib.request.Request(f"{base}/api/2.0/mlflow/experiments/search?max_results=1", headers=headers)
    where = secrets.redact(uri)
    try:
        with urllib.request.urlopen(request, timeout=min(10.0, PROBE_TIMEOUT_S)):
            return None
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            given = "were refused" if "Authorization" in headers else "are missing"
            return (f"the tracking server {where} answered HTTP {e.code}: its credentials {given} (the URI's "
                    "user info, or MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD / MLFLOW_TRACKING_TOKEN)")
        return f"the tracking server {where} answered HTTP {e.code}: is it an MLflow tracking server?"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return f"the tracking server {where} is unreachable: {secrets.redact(str(reason))}"


def probe_tracking(uri: str) -> str | None:
    """Why MLflow cannot track to `uri` now, or None (a DB server: reachable; its login is
    checked when the run opens it)."""
    scheme = uri.split("://", 1)[0].lower().split("+", 1)[0] if "://" in uri else ""
    if scheme in ("http", "https"):
        return _http_probe(uri)
    if scheme == "sqlite":
        return _local_writable(Path(uri[len("sqlite:///"):]).parent, "the tracking database's directory")
    if scheme in ("", "file"):
        return _local_writable(Path(uri.removeprefix("file://")), "the tracking directory")
    if scheme in _DB_PORTS:
        parts = urlsplit(uri)
        try:
            socket.create_connection((parts.hostname or "localhost", parts.port or _DB_PORTS[scheme]),
                                     timeout=min(10.0, PROBE_TIMEOUT_S)).close()
        except OSError as e:
            return f"the tracking database {secrets.redact(uri)} is unreachable: {e}"
    return None

"""Credentials stay out of everything the pipeline writes.

A recipe takes credentials in three ways: `${env:NAME}` (any value substituted from the
environment counts as one), a value under a credential's key name (`key`, `secret`,
`token`, `password`, `aws_secret_access_key`, ...: `CREDENTIAL_KEY`), and the user info of a
URL (`https://user:pass@host/...`, `postgresql://user:pass@db/mlflow`). The loader
(`pipeline.loader`) registers each one here as it reads a recipe; from then on
- `public(data)` / `redact(text)` is what every writer uses (MLflow params, tags and
  artifacts, manifests and notes in the store, the console, stage logs, Prefect artifacts,
  logs and results): a value from the environment reads `${env:NAME}`, a literal credential
  `***` (also its URL-encoded, JSON-escaped and base64 forms);
- `for_job(data)` is what a stage's job file holds: every credential as `${env:NAME}` (a
  literal one under a name of its own, `RING_SECRET_<n>`), with `job_env(text)` the
  variables the job's processes get; the job puts the values back with `resolve(data)`.

The registry is per process and only grows: a value once seen as a credential is redacted
for the rest of the process, whatever recipe printed it.
"""
from __future__ import annotations

import base64
import functools
import json
import os
import re
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, quote_plus, unquote

# key names whose values are credentials (s3fs/botocore, gcsfs, adlfs, HTTP clients, DB URLs)
CREDENTIAL_KEY = re.compile(
    r"^(?:key|secret|token|password|passwd|pwd|credentials?|auth|authorization|"
    r"(?:.*[_-])?(?:secret|password|passwd|api_?key|access_?key(?:_?id)?|secret_?key|session_?token|"
    r"access_?token|auth_?token|bearer_?token|private_?key|account_?key|sas_?token|client_?secret|"
    r"connection_?string))$", re.IGNORECASE)
# scheme://USERINFO@host: the user info (a token alone, or user:password) is a credential
URL_USERINFO = re.compile(r"\b[a-z][a-z0-9+.-]*://([^/?#@\s]+)@", re.IGNORECASE)
ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
MASK = "***"
_JOB_PREFIX = "RING_SECRET_"


@dataclass(frozen=True)
class _Secret:
    value: str
    env: str  # the variable that carries it into a job
    from_env: bool  # substituted from the environment (shown as its reference) or literal (masked)
    credential: bool = True  # by its key name or place (a URL's user info); else only from the environment

    @property
    def min_text_len(self) -> int:
        """Shorter values are replaced only where a whole string equals them (a `${env:N}` of
        "5" must not rewrite every 5 in a log; a short password still goes)."""
        return 3 if self.credential else 6

    @property
    def public(self) -> str:
        return f"${{env:{self.env}}}" if self.from_env else MASK

    @property
    def reference(self) -> str:
        return f"${{env:{self.env}}}"


_lock = threading.Lock()
_secrets: dict[str, _Secret] = {}  # value -> secret
_order: list[_Secret] = []  # longest value first: a URL secret is replaced before a part of it


def _add(secret: _Secret) -> _Secret:
    with _lock:
        known = _secrets.get(secret.value)
        if known is not None:
            return known
        _secrets[secret.value] = secret
        _order.append(secret)
        _order.sort(key=lambda s: -len(s.value))
        return secret


def remember_env(name: str, value: str) -> None:
    """A value the recipe took from the environment variable `name`."""
    if value:
        _add(_Secret(value, name, True, credential=False))


def remember_credential(value: str) -> None:
    """A credential written in the recipe (or a `--set`) itself, or a value from the
    environment found to be one (under a credential's key name)."""
    if not value:
        return
    with _lock:
        known = _secrets.get(value)
        if known is not None and not known.credential:  # from the environment: redacted more eagerly
            _secrets[value] = _Secret(value, known.env, True, credential=True)
            _order[_order.index(known)] = _secrets[value]
        if value in _secrets or any(s.value in value for s in _order if s.from_env):
            return  # (one that holds a value from the environment keeps that value's reference)
        n = sum(1 for s in _order if not s.from_env) + 1
    _add(_Secret(value, f"{_JOB_PREFIX}{n}", False))


def url_credentials(text: str) -> list[str]:
    """The user info of every URL in `text` (`user:pass` of `https://user:pass@host/`)."""
    return [m.group(1) for m in URL_USERINFO.finditer(text)]


def scan(data: Any, key: str = "") -> None:
    """Register every credential of recipe data: values under a credential's key name and
    the user info of URLs."""
    if isinstance(data, dict):
        for k, v in data.items():
            scan(v, str(k))
    elif isinstance(data, (list, tuple)):
        for v in data:
            scan(v, key)
    elif isinstance(data, str):
        if CREDENTIAL_KEY.match(key) and not is_reference_only(data):
            remember_credential(data)
        for info in url_credentials(data):
            remember_credential(info)
            if ":" in info:  # the password alone, as the client decodes it
                remember_credential(unquote(info.split(":", 1)[1]))


def is_reference_only(text: str) -> bool:
    """`${env:NAME}` and nothing else (what a --set may carry instead of a credential)."""
    return bool(ENV_REF.fullmatch(text.strip()))


@functools.lru_cache(maxsize=1024)
def _forms(value: str) -> frozenset[str]:
    """How a value can appear in text: as it is, URL-encoded, JSON-escaped, base64."""
    raw = value.encode()
    forms = {value, quote(value, safe=""), quote(value), quote_plus(value), json.dumps(value)[1:-1]}
    for enc in (base64.b64encode, base64.urlsafe_b64encode):
        forms.add(enc(raw).decode().rstrip("="))
    return frozenset(f for f in forms if f)


def _replace(text: str, attr: str) -> str:
    with _lock:
        order = list(_order)
    for s in order:
        if text == s.value:
            return getattr(s, attr)
    for s in order:
        if len(s.value) < s.min_text_len:
            continue
        if s.value in text:
            text = text.replace(s.value, getattr(s, attr))
        if attr == "public":
            for form in _forms(s.value) - {s.value}:
                if len(form) >= s.min_text_len and form in text:
                    text = text.replace(form, s.public)
    return text


def redact(text: str) -> str:
    """`text` with every known credential replaced by its public form."""
    return _replace(text, "public") if _order and isinstance(text, str) else text


def _map(data: Any, fn) -> Any:
    if isinstance(data, str):
        return fn(data)
    if isinstance(data, dict):
        return {fn(k) if isinstance(k, str) else k: _map(v, fn) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_map(v, fn) for v in data)
    return data


def public(data: Any) -> Any:
    """A copy of `data` (dicts, lists, strings) safe to write anywhere."""
    return _map(data, redact) if _order else data


def for_job(data: Any) -> Any:
    """A copy of `data` with every credential as its `${env:NAME}` reference (a job file)."""
    return _map(data, lambda t: _replace(t, "reference")) if _order else data


def job_env(text: str) -> dict[str, str]:
    """The variables a job whose file is `text` needs: every secret it references."""
    with _lock:
        by_env = {s.env: s.value for s in _order}
    return {name: by_env[name] for name in ENV_REF.findall(text) if name in by_env}


class MissingSecret(KeyError):
    """A job file references a variable its process was not given."""


def resolve(data: Any, environ: dict[str, str] | None = None) -> Any:
    """A job file's data with every `${env:NAME}` replaced by the variable's value (and
    the value registered, so the job's own MLflow writes redact it too)."""
    env = os.environ if environ is None else environ

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in env:
            raise MissingSecret(f"the job file refers to ${{env:{name}}}, which is not set in this process's "
                                "environment (a remote node must be given the variable too)")
        remember_env(name, env[name])
        return env[name]

    return _map(data, lambda t: ENV_REF.sub(sub, t) if "${env:" in t else t)


def scrub_exception(error: BaseException) -> None:
    """Redact an exception's message (and its causes'), in place: what Prefect stores and
    prints of a failed task is built from it."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        try:
            e.args = tuple(redact(a) if isinstance(a, str) else a for a in e.args)
        except (AttributeError, TypeError):
            pass
        for attr in ("reason", "excerpt"):  # launch.StageFailed keeps the whole story beside its args
            if isinstance(getattr(e, attr, None), (str, list)):
                setattr(e, attr, public(getattr(e, attr)))
        e = e.__cause__ or e.__context__


_TEXT_SUFFIXES = {".json", ".txt", ".log", ".yaml", ".yml", ".md", ".html"}  # reports, not data rows
_SCRUB_MAX_BYTES = 64 << 20


def scrub_files(root: str | os.PathLike) -> list[str]:
    """Redact, in place, the text files under `root` (or the file `root`): a stage's outputs
    before they are published or logged (summaries and reports may quote a config value).
    Returns those changed."""
    from pathlib import Path

    root = Path(root)
    if not _order:
        return []
    paths = root.rglob("*") if root.is_dir() else [root]
    return [str(p) for p in paths if _scrub_file(p)]


def _scrub_file(path: Any) -> bool:
    if path.suffix not in _TEXT_SUFFIXES or not path.is_file() or path.stat().st_size > _SCRUB_MAX_BYTES:
        return False
    text = path.read_text(encoding="utf-8", errors="surrogateescape")
    clean = redact(text)
    if clean != text:
        path.write_text(clean, encoding="utf-8", errors="surrogateescape")
    return clean != text


class RedactingStream:
    """A text stream (sys.stdout / sys.stderr) that redacts what is written to it."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(redact(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class RedactingFilter:
    """A logging filter: the record's message (and traceback) redacted before any handler
    formats it (the console's, Prefect's API log handler)."""

    def filter(self, record: Any) -> bool:
        import traceback

        if _order:
            record.msg, record.args = redact(record.getMessage()), None
            if record.exc_info and not record.exc_text:
                record.exc_text = redact("".join(traceback.format_exception(*record.exc_info)).rstrip())
            elif record.exc_text:
                record.exc_text = redact(record.exc_text)
        return True


def redact_console() -> Any:
    """While open: sys.stdout and sys.stderr redacted, and every logging handler of the
    process (root's, Prefect's) filtered through `RedactingFilter`."""
    import contextlib
    import logging
    import sys

    @contextlib.contextmanager
    def scope():
        saved = sys.stdout, sys.stderr
        if not isinstance(sys.stdout, RedactingStream):
            sys.stdout = RedactingStream(sys.stdout)
        if not isinstance(sys.stderr, RedactingStream):
            sys.stderr = RedactingStream(sys.stderr)
        log_filter = RedactingFilter()
        loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
        handlers = {h for lg in loggers for h in getattr(lg, "handlers", [])}
        for h in handlers:
            h.addFilter(log_filter)
        try:
            yield
        finally:
            for h in handlers:
                h.removeFilter(log_filter)
            sys.stdout, sys.stderr = saved

    return scope()

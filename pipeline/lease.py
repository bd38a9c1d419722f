"""The `_RUNNING` lease of a stage: at most one executor of a stage at a time.

A lease is a small JSON note next to `_SUCCESS`/`_FAILED`: an owner token, host, pid, start
time, heartbeat time and the run's ids. Its holder rewrites the heartbeat every quarter of
the timeout; a lease whose heartbeat is older than the timeout was left by a run that died
(kill -9, a lost node) and is taken over. On the holder's own host a lease whose process is
gone is taken over at once (hosts that share a store need distinct host names). Heartbeats
use the writer's clock, so the hosts of one store need roughly synchronised clocks (NTP),
well within the timeout.

Every change is a compare-and-swap against what the executor last read:
- file://: read, compare and write under a lock file next to the lease (flock; hosts that
  share the directory over NFS need working NFS locks);
- s3://: conditional requests: create with `If-None-Match: *`, heartbeat and takeover with
  `If-Match: <ETag read>`, release with a conditional delete (AWS S3 since 2024; moto);
- any other fsspec store: write, then read back and compare the owner token. Two executors
  writing within the same moment can both read back their own token; the next heartbeat
  reads the lease again and the loser stops its job, so two jobs overlap for at most one
  heartbeat interval.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from data_curation.urls import filesystem, join, local_path, normalise_url
from stages.common import secrets
from stages.common.artifact_inputs import StorageError, storage_errors

RUNNING = "_RUNNING"


class LeaseHeld(RuntimeError):
    """Another live executor holds the stage's lease."""

    def __init__(self, stage_url: str, holder: dict[str, Any]):
        self.holder = holder
        super().__init__(f"stage {stage_url} is running since {describe_holder(holder)}")


def describe_holder(holder: dict[str, Any]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    run = f", flow run {holder['flow_run_id']}" if holder.get("flow_run_id") else ""
    return f"{started} by {holder.get('host', '?')} pid {holder.get('pid', '?')}{run}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process its parent has not reaped yet is a zombie: dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def is_live(holder: dict[str, Any], now: float | None = None) -> bool:
    """A fresh heartbeat, and (on the holder's own host) a holder process that exists: a
    run killed on this host is taken over at once instead of after the timeout."""
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
        return False
    age = (now or time.time()) - float(holder.get("heartbeat", 0))
    return age <= float(holder.get("timeout_s", 60))


def new_owner_token() -> str:
    """Sortable and unique: names the attempt's work directory too."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


# -- backends: atomic create / replace-if-unchanged / delete-if-unchanged --------------------
class _LocalBackend:
    """Under a lock file; the version of a lease is its exact content."""

    def __init__(self, url: str, _options: dict[str, Any]):
        self.path = Path(local_path(url))
        self.lock = FileLock(str(self.path) + ".lock")

    def read(self) -> tuple[dict | None, Any]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None, None
        return _parse(text, str(self.path)), text

    def _write(self, data: dict) -> Any:
        text = json.dumps(secrets.public(data))  # the holder's tracking URI: never its password
        tmp = self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
        return text

    def create(self, data: dict) -> Any | None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            return None if self.path.exists() else self._write(data)

    def replace(self, data: dict, version: Any) -> Any | None:
        with self.lock:
            return self._write(data) if self.read()[1] == version else None

    def delete(self, version: Any) -> bool:
        with self.lock:
            if self.read()[1] != version:
                return False
            self.path.unlink(missing_ok=True)
            return True


def _precondition_failed(e: BaseException) -> bool:
    cause = e.__cause__ or e
    code = str(getattr(cause, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409") \
        or isinstance(e, FileExistsError)


class _S3Backend:
    """Conditional requests; the version of a lease is its ETag."""

    def __init__(self, url: str, options: dict[str, Any]):
        self.fs, path = filesystem(url, options)
        self.bucket, _, self.key = path.partition("/")

    def read(self) -> tuple[dict | None, Any]:
        try:
            obj = self.fs.call_s3("get_object", Bucket=self.bucket, Key=self.key)
        except FileNotFoundError:
            return None, None
        return _parse(_read_body(self.fs, obj), f"s3://{self.bucket}/{self.key}"), obj["ETag"]

    def _put(self, data: dict, **condition: str) -> Any | None:
        try:
            out = self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key,
                                  Body=json.dumps(secrets.public(data)).encode(), **condition)
        except OSError as e:
            if _precondition_failed(e):
                return None
            raise
        return out["ETag"]

    def create(self, data: dict) -> Any | None:
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: dict, version: Any) -> Any | None:
        return self._put(data, IfMatch=version)

    def delete(self, version: Any) -> bool:
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key, IfMatch=version)
        except FileNotFoundError:
            return False
        except OSError as e:
            if _precondition_failed(e):
                return False
            raise
        return True


def _read_body(fs, obj: dict) -> str:
    from fsspec.asyn import sync

    async def read() -> bytes:
        async with obj["Body"] as body:
            return await body.read()

    return sync(fs.loop, read).decode()


class _ReadBackBackend:
    """Any fsspec store: write, then read back and compare (see the module docstring)."""

    def __init__(self, url: str, options: dict[str, Any]):
        self.fs, self.path = filesystem(url, options)

    def read(self) -> tuple[dict | None, Any]:
        try:
            with self.fs.open(self.path, "r") as f:
                text = f.read()
        except FileNotFoundError:
            return None, None
        return _parse(text, self.path), text

    def _write_and_confirm(self, data: dict) -> Any | None:
        text = json.dumps(secrets.public(data))  # the holder's tracking URI: never its password
        with self.fs.open(self.path, "w") as f:
            f.write(text)
        current, version = self.read()
        return version if current and current.get("owner") == data["owner"] else None

    def create(self, data: dict) -> Any | None:
        return None if self.fs.exists(self.path) else self._write_and_confirm(data)

    def replace(self, data: dict, version: Any) -> Any | None:
        return self._write_and_confirm(data) if self.read()[1] == version else None

    def delete(self, version: Any) -> bool:
        if self.read()[1] != version:
            return False
        self.fs.rm(self.path)
        return True


def _parse(text: str, where: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    # a torn or foreign file is a lease nobody heartbeats: it goes stale and is taken over
    return data if isinstance(data, dict) else {"owner": "?", "heartbeat": 0, "corrupt": where}


BACKENDS: dict[str, Callable[[str, dict[str, Any]], Any]] = {"file": _LocalBackend, "s3": _S3Backend}


def _backend(stage_url: str, options: dict[str, Any]):
    url = join(normalise_url(stage_url), RUNNING)
    return BACKENDS.get(url.split("://", 1)[0], _ReadBackBackend)(url, options)


def read_lease(stage_url: str, options: dict[str, Any]) -> dict[str, Any] | None:
    with storage_errors(f"read {RUNNING} at", stage_url):
        return _backend(stage_url, options).read()[0]


# -- the lease an executor holds -----------------------------------------------------------
@dataclass
class Lease:
    stage_url: str
    options: dict[str, Any]
    data: dict[str, Any]
    version: Any = None
    lost: str | None = None  # why the lease is no longer ours (then the job must stop)
    taken_over: dict[str, Any] | None = None  # the dead holder this lease replaced
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    @property
    def owner(self) -> str:
        return self.data["owner"]

    @property
    def timeout_s(self) -> float:
        return float(self.data["timeout_s"])

    def _heartbeat(self) -> None:
        """Rewrite the lease with a fresh heartbeat if it is still ours (else set `lost`)."""
        with self._lock:
            if self.lost:
                return
            backend = _backend(self.stage_url, self.options)
            with storage_errors(f"heartbeat {RUNNING} at", self.stage_url):
                now = time.time()
                version = backend.replace({**self.data, "heartbeat": now}, self.version)
                if version is None:
                    holder = backend.read()[0]
                    self.lost = (f"the lease was taken over by {describe_holder(holder)}"
                                 if holder else "the lease was removed")
                    return
            self.version, self.data["heartbeat"] = version, now

    def update(self, **info: Any) -> None:
        """Record more about the holder (e.g. its MLflow run id) right away."""
        self.data.update(info)
        try:
            self._heartbeat()
        except StorageError:
            pass  # the heartbeat thread retries

    def _beat(self) -> None:
        while not self._stop.wait(self.timeout_s / 4) and not self.lost:
            try:
                self._heartbeat()
            except StorageError as e:  # an outage: retry until the lease would expire
                if time.time() - float(self.data["heartbeat"]) > self.timeout_s:
                    self.lost = f"its heartbeat could not be written for {self.timeout_s:.0f} s ({e})"

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"lease {self.stage_url}")
        self._thread.start()

    def release(self) -> None:
        """Stop heartbeating and remove the lease if it is still ours. A store that cannot be
        reached leaves it behind; it goes stale and is taken over."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)
        with self._lock:
            if self.lost is None:
                with contextlib.suppress(StorageError), \
                        storage_errors(f"release {RUNNING} at", self.stage_url):
                    _backend(self.stage_url, self.options).delete(self.version)
                self.lost = "released"


def try_acquire(stage_url: str, options: dict[str, Any], timeout_s: float,
                info: dict[str, Any], owner: str | None = None) -> Lease:
    """The stage's lease, taking over a stale one; LeaseHeld when a live executor has it."""
    owner = owner or new_owner_token()
    now = time.time()
    data = {"owner": owner, "host": socket.gethostname(), "pid": os.getpid(), "started": now,
            "heartbeat": now, "timeout_s": timeout_s, **info}
    taken_over = held_by = None
    with storage_errors(f"acquire {RUNNING} at", stage_url):
        backend = _backend(stage_url, options)
        version = backend.create(data)
        if version is None:
            holder, held_version = backend.read()
            if holder is not None and is_live(holder):
                held_by = holder
            else:
                version = backend.replace(data, held_version) if holder is not None else backend.create(data)
                if version is None:  # someone else was quicker
                    held_by = backend.read()[0] or {}
                taken_over = holder
    if held_by is not None:
        raise LeaseHeld(stage_url, held_by)
    lease = Lease(stage_url, options, data, version, taken_over=taken_over)
    lease.start_heartbeat()
    return lease

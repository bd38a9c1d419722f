"""`ring-pipeline gc`: what a recipe's store and work directory hold that nothing needs.

- work dirs (`{work_dir}/{recipe}/{stage}-{hash12}/{attempt}/`): every attempt of a published
  stage; other attempts once older than the age limit (a stage resumes from the store's
  checkpoints, not from a work dir; a recent failed attempt keeps its log for reading);
- checkpoints of published artifacts beyond the keep count (recipe `storage.keep_checkpoints`);
- artifacts the current plan does not reference (an older hash of a stage): published ones
  beyond the newest `keep_artifacts` of each stage, and unpublished ones (failed or killed
  attempts of an old hash), once older than the age limit.

Never touched: anything under a live `_RUNNING` lease, and the current plan's artifacts and
their resumable checkpoints. Artifacts made with other `--set` overrides are "not referenced"
unless gc is given the same overrides; the age limit protects recent ones.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from data_curation.urls import filesystem
from pipeline.artifacts import ArtifactStore
from pipeline.lease import is_live, read_lease
from pipeline.plan import Plan
from stages.common.artifact_inputs import ArtifactError, storage_errors


@dataclass
class Leftover:
    what: str  # work | checkpoint | artifact
    location: str  # a local path or a store URL
    reason: str


@dataclass(frozen=True)
class GcPolicy:
    keep_checkpoints: int
    keep_artifacts: int = 1
    older_than_s: float = 7 * 86400


def _age_s(store: ArtifactStore, url: str, now: float) -> float:
    """Seconds since anything under `url` last changed."""
    with storage_errors("list", url):
        fs, path = filesystem(url, store.storage_options)
        infos = fs.find(path, detail=True).values()
    stamps = []
    for info in infos:
        t = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
        if isinstance(t, datetime):
            t = t.timestamp()
        if isinstance(t, (int, float)):
            stamps.append(float(t))
    return now - max(stamps) if stamps else float("inf")


def _leased(store: ArtifactStore, url: str) -> dict | None:
    holder = read_lease(url, store.storage_options)
    return holder if holder is not None and is_live(holder) else None


def _store_leftovers(plan: Plan, policy: GcPolicy, now: float) -> list[Leftover]:
    store, out = plan.store, []
    current = {s.url for s in plan.stages}
    for stage in plan.stages:
        if store.is_done(stage.url) and not _leased(store, stage.url):
            for url in store.prune_checkpoints(stage.url, policy.keep_checkpoints, dry_run=True):
                out.append(Leftover("checkpoint", url, f"beyond the newest {policy.keep_checkpoints} "
                                                       "of a published artifact"))
    for _stage, urls in sorted(store.stage_dirs().items()):
        old = [u for u in urls if u not in current and not _leased(store, u)]
        published = []
        for url in old:
            if store.is_done(url):
                try:
                    published.append((store.read_manifest(url).get("published_at", 0), url))
                except ArtifactError:
                    published.append((0, url))  # a corrupt artifact: oldest
        kept = {u for _, u in sorted(published, reverse=True)[:policy.keep_artifacts]}
        for url in old:
            if url in kept:
                continue
            age = _age_s(store, url, now)
            if age < policy.older_than_s:
                continue
            what = "published" if any(u == url for _, u in published) else "unfinished"
            out.append(Leftover("artifact", url, f"{what}, not in the current plan, "
                                                 f"unchanged for {age / 86400:.1f} days"))
    return out


def _work_leftovers(plan: Plan, work_root: Path, policy: GcPolicy, now: float) -> list[Leftover]:
    root = work_root.resolve() / plan.recipe.name
    if not root.is_dir():
        return []
    store, out = plan.store, []
    for stage_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        url = f"{store.root}/{stage_dir.name}"
        done = store.is_done(url)
        holder = _leased(store, url)
        for attempt in sorted(p for p in stage_dir.iterdir() if p.is_dir()):
            if holder and holder.get("owner") == attempt.name:
                continue
            age = now - max((p.stat().st_mtime for p in attempt.rglob("*")), default=attempt.stat().st_mtime)
            if done:
                out.append(Leftover("work", str(attempt), "its stage is published"))
            elif age >= policy.older_than_s:
                out.append(Leftover("work", str(attempt), f"an unfinished attempt, unchanged for "
                                                          f"{age / 86400:.1f} days"))
    return out


def find_leftovers(plan: Plan, work_root: Path, policy: GcPolicy, now: float | None = None) -> list[Leftover]:
    now = now or time.time()
    return _work_leftovers(plan, work_root, policy, now) + _store_leftovers(plan, policy, now)


def remove(plan: Plan, leftovers: list[Leftover]) -> None:
    for item in leftovers:
        if item.what == "work":
            shutil.rmtree(item.location, ignore_errors=True)
            parent = Path(item.location).parent
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
        else:
            plan.store.remove_all(item.location)

"""What changed: why `plan` reruns a stage, and whether a finished stage's code drifted.

A manifest records what its stage hash covered (`hashed`: kind version, result config,
upstream hashes, input fingerprints; `inputs` with readable summaries) and the code that
made it (`code`: declared version, source digest, git commit). Comparing the plan with the
newest earlier artifact of the same stage names the cause of a rerun; comparing the recorded
source digest with today's names code that changed without a version bump.
"""
from __future__ import annotations

import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.artifacts import ArtifactStore
from stages.common.artifact_inputs import ArtifactError
from stages.registry import StageKind

_MAX_CONFIG_CHANGES = 5


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The commit of the checkout the stage code runs from (None outside a git checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_record(kind: StageKind) -> dict[str, Any]:
    return {"version": kind.version, "digest": kind.code_version, "git_commit": git_commit()}


def code_drift(stage: str, kind: StageKind, manifest: dict[str, Any]) -> str | None:
    """A warning when the artifact was made by other code than today's (same version)."""
    recorded = manifest.get("code") or {}
    if not recorded.get("digest") or recorded["digest"] == kind.code_version:
        return None
    now = code_record(kind)
    commits = ""
    if recorded.get("git_commit") and recorded["git_commit"] != now["git_commit"]:
        commits = f", git {str(recorded['git_commit'])[:10]} -> {str(now['git_commit'])[:10]}"
    return (f"the code of {kind.name} changed since this artifact was made (source digest "
            f"{recorded['digest']} -> {now['digest']}{commits}); its results are reused because "
            f"version {kind.version} is unchanged: `--force {stage}` reruns it (bump the kind's "
            "version when a change alters results)")


def previous_manifest(store: ArtifactStore, dirs: list[str], current_url: str) -> dict[str, Any] | None:
    """The newest published manifest among a stage's other artifact directories."""
    best: dict[str, Any] | None = None
    for url in dirs:
        if url == current_url or not store.is_done(url):
            continue
        try:
            m = store.read_manifest(url)
        except ArtifactError:
            continue  # a corrupt old artifact explains nothing
        if best is None or m.get("published_at", 0) > best.get("published_at", 0):
            best = m
    return best


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def why_rerun(hashed: dict[str, Any], inputs: dict[str, Any], previous: dict[str, Any] | None
              ) -> list[str]:
    """Reasons the planned hash differs from the newest earlier artifact of the stage.

    `hashed` is the plan's hash payload, `inputs` its input fingerprints (name -> dict with
    kind, digest, summary)."""
    if previous is None:
        return ["no earlier artifact of this stage"]
    old = previous.get("hashed")
    if not old:
        return [f"the earlier artifact {previous.get('hash', '?')[:12]} predates recorded hash inputs"]
    reasons = []
    if old.get("version") != hashed["version"]:
        reasons.append(f"{hashed['kind']} version {old.get('version')} -> {hashed['version']}")
    before, after = _flat(old.get("config", {})), _flat(hashed["config"])
    changed = [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
    for k in changed[:_MAX_CONFIG_CHANGES]:
        reasons.append(f"config {k}: {before.get(k, '(unset)')!r} -> {after.get(k, '(unset)')!r}")
    if len(changed) > _MAX_CONFIG_CHANGES:
        reasons.append(f"... and {len(changed) - _MAX_CONFIG_CHANGES} more config changes")
    old_up, new_up = old.get("upstream", {}), hashed["upstream"]
    for d in sorted(set(old_up) | set(new_up)):
        if old_up.get(d) != new_up.get(d):
            reasons.append(f"upstream {d} changed ({str(old_up.get(d, '-'))[:12]} -> "
                           f"{str(new_up.get(d, '-'))[:12]})")
    old_in = previous.get("inputs") or {}
    old_digests, new_digests = old.get("inputs", {}), hashed["inputs"]
    for name in sorted(set(old_digests) | set(new_digests)):
        if old_digests.get(name) == new_digests.get(name):
            continue
        was = (f"{(old_in.get(name) or {}).get('summary', '?')} [{old_digests[name][:8]}]"
               if name in old_digests else "not an input")
        now = f"{inputs[name]['summary']} [{new_digests[name][:8]}]" if name in new_digests else "not an input"
        reasons.append(f"input {name} changed: {was} -> {now}")
    return reasons or ["the hash covers something this version does not compare"]

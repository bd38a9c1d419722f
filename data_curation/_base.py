"""Small shared pieces: the strict config base, stable hashing, mergeable stats."""
from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Config models reject unknown keys: a typo must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CurationError(RuntimeError):
    """A problem the user can fix (bad input, bad config, missing cache); the message says where."""


def stable_hash(obj: Any, n: int | None = None) -> str:
    blob = json.dumps(obj, sort_keys=True, default=str, ensure_ascii=False).encode()
    h = hashlib.sha256(blob).hexdigest()
    return h[:n] if n else h


def merge_stats(a: dict[str, Any], b: dict[str, Any], max_list: int = 20) -> dict[str, Any]:
    """Merge two stats dicts: numbers add, dicts merge recursively, lists concatenate (capped)."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v[:max_list] if isinstance(v, list) else v
        elif isinstance(v, bool) or not isinstance(v, (int, float, dict, list)):
            out[k] = v
        elif isinstance(v, (int, float)):
            out[k] = out[k] + v
        elif isinstance(v, dict):
            out[k] = merge_stats(out[k], v, max_list)
        else:
            out[k] = (out[k] + v)[:max_list]
    return out


def bump(counter: dict[str, int], key: str, n: int = 1) -> None:
    counter[key] = counter.get(key, 0) + n

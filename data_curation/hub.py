"""The Hugging Face hub, through its local cache: which names are hub ids, where the cache
is, and a repository's snapshot (offline with HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import os
import re
from pathlib import Path

from data_curation._base import CurationError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def is_hub_id(value: str) -> bool:
    """`org/name` that is not a local path: a Hugging Face hub repository (as transformers and
    datasets read such a name)."""
    return "://" not in value and bool(_HUB_ID.match(value)) and not os.path.exists(value)


def _hub_offline() -> bool:
    # read at call time (huggingface_hub reads it once, at import)
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache_dir() -> str:
    """The hub cache in effect now: HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub.constants import HF_HUB_CACHE

    return HF_HUB_CACHE


def hub_snapshot(repo_id: str, repo_type: str, revision: str | None) -> tuple[str, str]:
    """(local directory, commit) of a hub repo's snapshot: from the local cache with
    HF_HUB_OFFLINE=1, else downloaded into it as needed. CurationError says what is missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    cache, offline = hub_cache_dir(), _hub_offline()
    what = f"hub {repo_type} {repo_id} (revision {revision or 'main'})"
    try:
        path = snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache,
                                 local_files_only=offline)
    except LocalEntryNotFoundError:
        raise CurationError(
            f"{what} is not in the Hugging Face cache {cache}" + (" and HF_HUB_OFFLINE is set" if offline else "")
            + f": download it first (`hf download {repo_id}"
            + (" --repo-type dataset" if repo_type == "dataset" else "") + "`), or give a local path") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise CurationError(f"{what}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    except (HfHubHTTPError, OSError) as e:
        raise CurationError(f"{what} cannot be fetched: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return path, Path(path).name

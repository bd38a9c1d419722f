"""`init_model` from an existing Hugging Face model: found (a local directory, an fsspec URL
or upstream artifact fetched by the job, or a hub id `org/name` resolved through the local
Hugging Face cache), checked (config.json, weights, tokenizer present; config and tokenizer
load, the model's own code only with `trust_remote_code`), then copied into the output as
it is, custom code files included."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from data_curation._base import CurationError
from data_curation.hub import hub_snapshot, is_hub_id
from stages.common.contract import StageError
from stages.common.hf_io import load_config, load_tokenizer

# bookkeeping of a published artifact, not part of a model directory
ARTIFACT_FILES = {"_SUCCESS", "_FAILED", "manifest.json", "stage_summary.json"}
ARTIFACT_DIRS = {"logs", "checkpoints"}
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json",
                   "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def resolve_pretrained(pretrained: str, revision: str | None, fetch: Callable[[str], Path]
                       ) -> tuple[Path, dict[str, Any]]:
    """The local directory of `pretrained` and where it came from (a hub id: its commit)."""
    if not is_hub_id(pretrained):
        return Path(fetch(pretrained)), {}
    try:
        path, commit = hub_snapshot(pretrained, "model", revision)
    except CurationError as e:
        raise StageError(f"pretrained model {pretrained}: not a local directory, and as a {e}") from None
    return Path(path), {"hub_revision": revision or "main", "hub_commit": commit}


def check_hf_model_dir(path: Path, source: str, trust_remote_code: bool) -> list[str]:
    """StageError naming what is missing or does not load; returns warnings (e.g. no chat template)."""
    if not path.is_dir():
        raise StageError(f"pretrained model {source}: {path} is not a directory "
                             "(expected a Hugging Face model directory)")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(any(path.glob(p)) for p in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append("tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if missing:
        found = sorted(p.name for p in path.iterdir())
        raise StageError(f"pretrained model {source} ({path}) is missing: {', '.join(missing)}. "
                             f"Files found: {found[:20]}")
    what = f"pretrained model {source}:"
    try:
        config = load_config(path, trust_remote_code=trust_remote_code, what=what)
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise StageError(f"pretrained model {source}: {path / 'config.json'} does not load: {e}") from e
    try:
        tok = load_tokenizer(path, trust_remote_code=trust_remote_code, what=what)
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001
        raise StageError(f"pretrained model {source}: the tokenizer in {path} does not load: {e}") from e
    warnings = []
    if not getattr(tok, "chat_template", None):
        warnings.append("the tokenizer has no chat template: the sft stage needs one")
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tok) > vocab:
        raise StageError(f"pretrained model {source}: tokenizer has {len(tok)} tokens but the "
                             f"model's vocab_size is {vocab}")
    return warnings


def copy_pretrained(src: Path, out: Path) -> int:
    n = 0
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file() or p.suffix == ".lock" \
                or rel.as_posix() in ARTIFACT_FILES or rel.parts[0] in ARTIFACT_DIRS:
            continue  # fetch markers (.verified/), locks, hidden files, artifact bookkeeping
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        try:  # large checkpoints: a hard link when input and output share a filesystem
            os.link(p, out / rel)
        except OSError:
            shutil.copy2(p, out / rel)
        n += 1
    return n

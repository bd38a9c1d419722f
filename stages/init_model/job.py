"""The `init_model` stage: the base model every later stage starts from.

Three sources (exactly one per recipe):
- `pretrained`: an existing Hugging Face model directory (local path, fsspec URL, an upstream
  artifact, or a hub id resolved through the Hugging Face cache), checked (loading its
  config and tokenizer, its own code only with `trust_remote_code`) and copied into the
  output as it is (pretrained.py);
- `pretrained: {gguf: ...}`: a GGUF file (a path, URL or `pkg://` file of an installed
  package), dequantized and written as a HF model directory in `dtype` (gguf_import.py);
- `architecture` + `tokenizer`: a byte-level BPE trained locally on the corpus files with the
  chat special tokens and template (tokenizer.py), and a causal LM built from a config with
  seeded random weights (model.py): dense qwen2 / llama, or the MoE `ring_moe`, written with
  its custom code files.

Run: `python -m stages.init_model.job --job job.json` (one process).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from stages.common.contract import StageJob
from stages.common.entry import run_job
from stages.common.hf_io import custom_code
from stages.common.rows import input_rows
from stages.common.stage_log import StageLogger, info
from stages.init_model.config import GGUFImport, InitModelConfig
from stages.init_model.gguf_import import import_gguf
from stages.init_model.model import build_model, save_model
from stages.init_model.pretrained import check_hf_model_dir, copy_pretrained, resolve_pretrained
from stages.init_model.tokenizer import check_reload, train_tokenizer


def from_pretrained(cfg: InitModelConfig, job: StageJob, out: Path, log: StageLogger) -> dict[str, Any]:
    assert isinstance(cfg.pretrained, str)  # the config's `source` says so
    src, origin = resolve_pretrained(cfg.pretrained, cfg.revision, job.fetch)
    warnings = check_hf_model_dir(src, cfg.pretrained, cfg.trust_remote_code)
    for w in warnings:
        info(f"init_model: warning: {w}")
    n = copy_pretrained(src, out)
    info(f"init_model: copied {n} files of {cfg.pretrained}")
    return {"source": "pretrained", "pretrained": cfg.pretrained, **origin,
            "files": n, "warnings": warnings, "trust_remote_code": cfg.trust_remote_code}


def from_gguf(cfg: InitModelConfig, job: StageJob, out: Path, log: StageLogger) -> dict[str, Any]:
    assert isinstance(cfg.pretrained, GGUFImport)
    summary = import_gguf(cfg.pretrained, job.fetch, out)
    for w in summary["warnings"]:
        info(f"init_model: warning: {w}")
    info(f"init_model: imported {summary['gguf_file']} ({summary['architecture']}, {summary['quantization']}, "
         f"{summary['parameters']:,} parameters, sha256 {summary['sha256'][:12]}) as {cfg.pretrained.dtype}")
    log.params({"model.parameters": summary["parameters"], "model.vocab_size": summary["vocab_size"],
                "gguf.sha256": summary["sha256"], "gguf.quantization": summary["quantization"]})
    return summary


def from_architecture(cfg: InitModelConfig, job: StageJob, out: Path, log: StageLogger) -> dict[str, Any]:
    assert cfg.architecture is not None and cfg.tokenizer is not None  # the config guarantees it

    def corpus():
        return (row for ref in cfg.tokenizer.corpus for row in input_rows(job.fetch, ref, "tokenizer corpus"))

    tokenizer, stats = train_tokenizer(corpus, cfg.tokenizer, cfg.architecture.max_position_embeddings)
    info(f"init_model: trained a byte-level BPE of {len(tokenizer)} tokens on "
         f"{stats['rows']} rows ({stats['chars']} chars) of {len(cfg.tokenizer.corpus)} input(s)")
    model = build_model(cfg.architecture, tokenizer, cfg.seed)
    save_model(model, cfg.architecture.model_type, out)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # template inline in tokenizer_config
    check_reload(out, tokenizer, corpus)
    n_params = sum(p.numel() for p in model.parameters())
    info(f"init_model: built {cfg.architecture.model_type} with {n_params:,} parameters, vocab {len(tokenizer)}")
    log.params({"model.parameters": n_params, "model.vocab_size": len(tokenizer)})
    return {"source": "architecture", "model_type": cfg.architecture.model_type,
            "custom_code": sorted(custom_code(out).values()),
            "parameters": n_params, "vocab_size": len(tokenizer),
            "tokenizer_corpus_rows": stats["rows"], "tokenizer_corpus_chars": stats["chars"]}


# InitModelConfig.source -> how the model directory is made
SOURCES = {"pretrained": from_pretrained, "gguf": from_gguf, "architecture": from_architecture}


def main(job: StageJob, cfg: InitModelConfig) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    log = StageLogger.for_job(job)
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = SOURCES[cfg.source](cfg, job, out, log)
    (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(run_job(main, InitModelConfig))

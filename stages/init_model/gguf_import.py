"""`init_model` from a GGUF file (llama.cpp's format): a standard Hugging Face model directory.

1. Find the file: `pkg://<package>/<file>` inside an installed Python package
   (data_curation/package_files.py; its content must match the sha256 the package's RECORD
   declares), else a local path, URL or upstream artifact through the job's `fetch`.
2. Read its header (`gguf.GGUFReader`): a file that is not a readable GGUF, an architecture
   transformers cannot load from GGUF, or a tensor type `gguf` cannot dequantize is a
   StageError naming the file and what is unsupported, before any weight is converted.
3. Load it with transformers' own GGUF support (the tokenizer with the file's vocabulary,
   merges, special tokens and chat template; the model with every tensor dequantized by
   `gguf.dequantize`, llama.cpp's q/k row permutation undone). transformers marks that
   model as quantized and refuses to save it, so its weights are handed to a plain model
   of the same config (built on the meta device and given the loaded tensors themselves:
   no second float32 copy), which is written in `dtype` through the project's one save
   (`stages.common.hf_io.save_hf_model`), with the tokenizer files.
4. The written directory is loaded back as every later stage loads it: its tokenizer must
   tokenise like the GGUF one.
The summary (-> manifest) holds the file's sha256, its architecture and quantization: the
file type its metadata declares and the count of tensors per type (e.g. Q4_1: 211, F32: 61).
"""
from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

from data_curation.package_files import SCHEME as PKG_SCHEME
from data_curation.package_files import PackageFileError
from data_curation.package_files import resolve as resolve_package_file
from stages.common.artifact_inputs import sha256_file
from stages.common.contract import StageError
from stages.common.hf_io import load_tokenizer, save_hf_model
from stages.init_model.config import GGUFImport
from stages.init_model.tokenizer import first_difference

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# text every import tokenises with both the GGUF tokenizer and the written one
PROBE_TEXT = "What is 7 + 5? Let's think: 7 + 5 = 12.\n  Ünïcödé, tabs\tand 1,234.5 numbers!"


@dataclass(frozen=True)
class GGUFFacts:
    """What the header of a GGUF file says."""

    architecture: str
    name: str | None
    file_type: str | None           # general.file_type, e.g. MOSTLY_Q4_1
    tensor_types: dict[str, int]    # tensor type -> count
    tensors: int

    @property
    def quantization(self) -> str:
        """The most common quantized tensor type (a file of floats: its most common float type)."""
        quantized = {t: n for t, n in self.tensor_types.items() if t not in FLOAT_TYPES}
        pool = quantized or self.tensor_types
        return max(sorted(pool), key=lambda t: pool[t])


def locate(source: str, fetch: Callable[[str], Path]) -> tuple[Path, str | None]:
    """The local GGUF file of `source` and, for a pkg:// file, the sha256 its RECORD declares."""
    if source.startswith(PKG_SCHEME):
        try:
            f = resolve_package_file(source)
        except PackageFileError as e:
            raise StageError(f"pretrained.gguf = {e}") from None
        return f.path, f.record_sha256
    path = Path(fetch(source))
    if not path.is_file():
        raise StageError(f"pretrained.gguf = {source}: {path} is not a file")
    return path, None


def _field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_header(path: Path, source: str) -> GGUFFacts:
    """The file's architecture and tensor types; StageError for an unreadable or unsupported file."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        arch = _field(reader, "general.architecture")
        file_type = _field(reader, "general.file_type")
        types = Counter(t.tensor_type.name for t in reader.tensors)
        name = _field(reader, "general.name")
    except Exception as e:  # noqa: BLE001 - any parse failure means the file is not a usable GGUF
        raise StageError(f"pretrained.gguf = {source}: {path} is not a readable GGUF file "
                         f"({type(e).__name__}: {e})") from None
    if not isinstance(arch, str) or not reader.tensors:
        raise StageError(f"pretrained.gguf = {source}: {path} has no general.architecture or no tensors")
    try:
        file_type = gguf.LlamaFileType(file_type).name if file_type is not None else None
    except ValueError:
        file_type = str(file_type)
    facts = GGUFFacts(arch, name if isinstance(name, str) else None, file_type, dict(sorted(types.items())),
                      len(reader.tensors))
    _check_supported(facts, path, source)
    return facts


def _check_supported(facts: GGUFFacts, path: Path, source: str) -> None:
    import gguf
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # transformers reads a few architectures under another name (qwen2moe -> qwen2_moe, ...)
    known = {a.replace("_", "") for a in GGUF_SUPPORTED_ARCHITECTURES} | set(GGUF_SUPPORTED_ARCHITECTURES)
    if facts.architecture not in known and facts.architecture.replace("-", "_") not in known:
        raise StageError(f"pretrained.gguf = {source}: architecture {facts.architecture!r} of {path} is not "
                         f"supported (transformers loads these from GGUF: {sorted(GGUF_SUPPORTED_ARCHITECTURES)})")
    unsupported = []
    for name in facts.tensor_types:
        qtype = gguf.GGMLQuantizationType[name]
        _, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        try:  # one block of zeros: does this gguf version dequantize the type at all?
            gguf.dequantize(np.zeros(nbytes, dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError, KeyError):
            unsupported.append(name)
    if unsupported:
        counts = {t: facts.tensor_types[t] for t in unsupported}
        raise StageError(f"pretrained.gguf = {source}: {path} holds tensors of quantization type(s) {counts} "
                         f"that gguf {version('gguf')} cannot dequantize (unsupported quantization); supported: "
                         "F32, F16 and the block types gguf.quants implements (Q4_0 ... Q8_0, K-quants, IQ-quants)")


def _load_gguf(path: Path, source: str):
    """(tokenizer, plain float32 causal LM) from the file, through transformers' GGUF support."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise StageError(f"pretrained.gguf = {source}: transformers cannot load {path}: {e}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes the loaded model "not serializable"
    # the plain model is built without storage (meta) and takes the loaded tensors themselves
    # (assign): one float32 copy of the weights, not a second initialised one they are copied into
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if k not in _tied_keys(plain)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF model of {path} does not fit its own config: missing {missing}, "
                           f"unexpected {unexpected}")
    plain.tie_weights()
    for name, buffer in list(plain.named_buffers()):
        if buffer.is_meta:  # non-persistent buffers (rotary inv_freq) are no part of the state dict
            module, _, leaf = name.rpartition(".")
            plain.get_submodule(module).register_buffer(leaf, loaded.get_buffer(name), persistent=False)
    plain.generation_config = loaded.generation_config
    return tokenizer, plain


def _tied_keys(model) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied if not isinstance(tied, dict) else tied.keys())


def import_gguf(spec: GGUFImport, fetch: Callable[[str], Path], out: Path) -> dict[str, Any]:
    """Write the GGUF model of `spec` to `out` as a HF model directory; returns the summary."""
    import torch

    path, record_sha256 = locate(spec.gguf, fetch)
    sha256 = sha256_file(path)
    if record_sha256 is not None and sha256 != record_sha256:
        raise StageError(f"pretrained.gguf = {spec.gguf}: {path} has sha256 {sha256}, but its package's "
                         f"RECORD says {record_sha256}: the installed file was changed or truncated; reinstall it")
    facts = read_header(path, spec.gguf)
    tokenizer, model = _load_gguf(path, spec.gguf)
    dtype = getattr(torch, spec.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp, save_jinja_files=False)  # the chat template inline, as init_model writes it
        save_hf_model(None, model, Path(tmp), out, zero_stage=0, rank=0, dtype=dtype)
    warnings = check_written(out, tokenizer, spec.gguf)
    return {"source": "gguf", "gguf": spec.gguf, "gguf_file": path.name, "sha256": sha256,
            "architecture": facts.architecture, "model_name": facts.name, "model_type": model.config.model_type,
            "quantization": facts.quantization, "file_type": facts.file_type, "tensor_types": facts.tensor_types,
            "tensors": facts.tensors, "dtype": spec.dtype, "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": model.config.vocab_size, "chat_template": bool(tokenizer.chat_template),
            "warnings": warnings}


def check_written(out: Path, gguf_tokenizer, source: str) -> list[str]:
    """The written tokenizer, loaded as later stages load it, tokenises like the GGUF one;
    returns warnings (no chat template)."""
    loaded = load_tokenizer(out, trust_remote_code=False, what=f"GGUF import of {source}:")
    probe = [PROBE_TEXT]
    if gguf_tokenizer.chat_template:
        probe.append(gguf_tokenizer.apply_chat_template([{"role": "user", "content": PROBE_TEXT}], tokenize=False,
                                                        add_generation_prompt=True))
    differs = first_difference(gguf_tokenizer, loaded, probe)
    if differs is not None:
        raise RuntimeError(f"the tokenizer written to {out} tokenises {differs[:60]!r} differently from the "
                           f"GGUF one of {source}")
    if loaded.chat_template:
        return []
    return ["the GGUF file has no chat template (tokenizer.chat_template): the sft stage needs one"]

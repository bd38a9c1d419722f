"""init_model from a GGUF file: a tiny llama written here with the `gguf` package (a byte-level
BPE's vocabulary and merges and a chat template in its metadata, tensors quantized Q8_0 /
Q4_1 / F16 / F32 the way llama.cpp writes them, q/k rows permuted), imported through the
stage, loaded back with plain transformers. Nothing is downloaded."""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.execute import run_stage
from pipeline.fingerprints import fingerprint
from stages.common.contract import StageJob
from stages.common.entry import run_job
from stages.init_model import job as init_model_job
from stages.init_model.config import GGUFImport, InitModelConfig

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["What is 7 + 5? The answer is 12.", "Janet has 16 eggs and sells 9 of them for $2 each.",
          "Let's think step by step: 3 * 4 = 12, then 12 + 30 = 42.", "Ünïcödé text, tabs\tand newlines\n"] * 20
# tensor -> its type in the file (the rest: F32 norms)
TYPES = {"token_embd": Q.F16, "attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q8_0,
         "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0}


def _bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf's `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {"attn_norm": p + "input_layernorm", "attn_q": p + "self_attn.q_proj", "attn_k": p + "self_attn.k_proj",
            "attn_v": p + "self_attn.v_proj", "attn_output": p + "self_attn.o_proj",
            "ffn_norm": p + "post_attention_layernorm", "ffn_gate": p + "mlp.gate_proj", "ffn_up": p + "mlp.up_proj",
            "ffn_down": p + "mlp.down_proj"}


def write_tiny_gguf(path: Path, arch: str = "llama", override_type: Q | None = None, template: bool = True
                    ) -> dict[str, np.ndarray]:
    """A tiny llama GGUF; returns HF parameter name -> the dequantized weights the file holds."""
    tok = _bpe()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|im_end|>"])
    if template:
        w.add_chat_template(TEMPLATE)
    expected: dict[str, np.ndarray] = {}

    def tensor(gguf_name: str, hf_name: str, shape: tuple[int, ...], kind: str, unpermute: int = 0):
        data = rng.normal(0, 0.05, size=shape).astype(np.float32) if len(shape) == 2 else \
            (1 + rng.normal(0, 0.1, size=shape)).astype(np.float32)
        if unpermute:
            data = _permute(data, unpermute)
        qtype = override_type if override_type is not None and kind == "ffn_down" else TYPES.get(kind, Q.F32)
        if qtype in (Q.F32, Q.F16):
            stored = data.astype(np.float16 if qtype == Q.F16 else np.float32)
            w.add_tensor(gguf_name, stored)
            back = stored.astype(np.float32)
        elif qtype in (Q.Q8_0, Q.Q4_1):
            stored = gguf.quants.quantize(data, qtype)
            w.add_tensor(gguf_name, stored, raw_dtype=qtype)
            back = gguf.dequantize(stored, qtype).reshape(shape)
        else:  # a type gguf cannot dequantize: bytes of the right size
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            stored = np.zeros((shape[0], shape[1] // block * nbytes), dtype=np.uint8)
            w.add_tensor(gguf_name, stored, raw_dtype=qtype)
            back = data
        if unpermute:  # the HF model holds the rows in HF order
            n = unpermute
            back = back.reshape(n, back.shape[0] // n // 2, 2, *back.shape[1:]).swapaxes(1, 2).reshape(back.shape)
        expected[hf_name + ".weight"] = back

    tensor("token_embd.weight", "model.embed_tokens", (len(tokens), HIDDEN), "token_embd")
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        names = _hf_names(i)
        shapes = {"attn_norm": (HIDDEN,), "attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
                  "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN), "ffn_norm": (HIDDEN,),
                  "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
        for kind, shape in shapes.items():
            perm = HEADS if kind == "attn_q" else KV_HEADS if kind == "attn_k" else 0
            tensor(f"blk.{i}.{kind}.weight", names[kind], shape, kind, perm)
    tensor("output_norm.weight", "model.norm", (HIDDEN,), "output_norm")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    return path, write_tiny_gguf(path)


def _job(tmp: Path, pretrained, name: str = "g") -> StageJob:
    return StageJob(recipe="t", stage=name, kind="init_model", hash="0" * 16,
                    config={"kind": "init_model", "pretrained": pretrained}, stage_url=f"file://{tmp}/store/{name}",
                    output_dir=str(tmp / name / "out"), work_dir=str(tmp / name / "work"))


def _run_failing(tmp: Path, pretrained, capsys) -> str:
    path = tmp / "job.json"
    _job(tmp, pretrained, "bad").write(path)
    assert run_job(init_model_job.main, InitModelConfig, ["--job", str(path)]) == 2
    return capsys.readouterr().err


@pytest.mark.slow
def test_gguf_imports_as_a_plain_hf_model(tmp_path, tiny_gguf):
    """Through run_stage (its own process, the manifest): config, weights = the file's
    dequantized tensors in bf16, tokenizer round trip, chat template, manifest fields."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, expected = tiny_gguf
    run = run_stage("init_model", {"kind": "init_model", "pretrained": {"gguf": str(path)}}, stage="gguf",
                    storage=f"file://{tmp_path}/store", launcher="local", work_root=tmp_path / "work")
    out = Path(run.url.removeprefix("file://"))
    manifest = json.loads((out / "manifest.json").read_text())
    summary = run.summary
    assert summary["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert summary["architecture"] == "llama" and summary["quantization"] == "Q8_0"
    assert summary["file_type"] == "MOSTLY_Q8_0" and summary["dtype"] == "bfloat16"
    assert summary["tensor_types"] == {"F16": 1, "F32": 2 * LAYERS + 1, "Q4_1": 2 * LAYERS, "Q8_0": 5 * LAYERS}
    assert json.dumps(summary["tensor_types"]) in json.dumps(manifest)  # the summary lands in the manifest
    assert summary["sha256"] in json.dumps(manifest)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["dtype"] == "bfloat16"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (HIDDEN, LAYERS, HEADS, KV_HEADS, FFN)
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    weights = load_file(out / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    for name, want in expected.items():
        assert torch.equal(weights[name], torch.from_numpy(want).to(torch.bfloat16)), name

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)  # plain transformers: no gguf_file, no quantizer
    assert getattr(model, "hf_quantizer", None) is None and model.dtype == torch.bfloat16
    trained = _bpe()
    for text in CORPUS[:4] + ["unseen words: zebra 98765!"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == trained.encode(text).ids and tok.decode(ids) == text
    chat = [{"role": "user", "content": "What is 7 + 5?"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n"
    assert len(tok("<|im_end|>", add_special_tokens=False)["input_ids"]) == 1
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    enc = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out_ids = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert out_ids.shape[1] <= enc["input_ids"].shape[1] + 3


def test_fp32_import_holds_the_dequantized_tensors_exactly(tmp_path, tiny_gguf):
    from safetensors.torch import load_file

    path, expected = tiny_gguf
    job = _job(tmp_path, {"gguf": str(path), "dtype": "float32"})
    summary = init_model_job.main(job, job.typed_config(InitModelConfig))
    weights = load_file(Path(job.output_dir) / "model.safetensors")
    assert summary["dtype"] == "float32" and summary["parameters"] == sum(v.size for v in expected.values())
    for name, want in expected.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], torch.from_numpy(want)), name


def test_the_plain_model_takes_the_dequantized_tensors_without_a_copy(tiny_gguf, monkeypatch):
    """Peak memory: the plain model that is written holds the very tensors transformers
    dequantized (no second float32 model they are copied into), none left on the meta device,
    and computes what the loaded model computes."""
    from transformers import AutoModelForCausalLM

    from stages.init_model.gguf_import import _load_gguf

    path, _ = tiny_gguf
    loaded = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def keep(cls, *args, **kwargs):
        loaded.append(real(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(keep))
    _, plain = _load_gguf(path, str(path))
    (original,) = loaded
    storage = {t.untyped_storage().data_ptr() for t in original.state_dict().values()}
    assert all(t.untyped_storage().data_ptr() in storage for t in plain.state_dict().values())
    assert not any(t.is_meta for t in [*plain.parameters(), *plain.buffers()])
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, original(input_ids=ids).logits, rtol=0, atol=0)


def _install_package(site: Path, gguf_file: Path, version: str = "1.0") -> Path:
    """A distribution `tiny-gguf-pkg` installed in `site`: package tiny_gguf_pkg holding the
    file, with a RECORD (an __init__ that fails proves the package is never imported)."""
    pkg = site / "tiny_gguf_pkg"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('needs a dependency that is not installed')\n")
    target = pkg / "model.gguf"
    target.write_bytes(gguf_file.read_bytes())
    digest = base64.urlsafe_b64encode(hashlib.sha256(target.read_bytes()).digest()).rstrip(b"=").decode()
    for old in site.glob("tiny_gguf_pkg-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = site / f"tiny_gguf_pkg-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tiny-gguf-pkg\nVersion: {version}\n")
    (info / "top_level.txt").write_text("tiny_gguf_pkg\n")
    (info / "RECORD").write_text(f"tiny_gguf_pkg/__init__.py,,\ntiny_gguf_pkg/model.gguf,sha256={digest},"
                                 f"{target.stat().st_size}\n{info.name}/RECORD,,\n")
    return target


def test_pkg_scheme_resolves_fingerprints_and_verifies_the_installed_file(tmp_path, tiny_gguf, monkeypatch,
                                                                           capsys):
    path, _ = tiny_gguf
    site = tmp_path / "site"
    target = _install_package(site, path)
    monkeypatch.syspath_prepend(str(site))
    url = "pkg://tiny_gguf_pkg/model.gguf"
    fp = fingerprint(url, {}, 0)
    assert fp.kind == "package" and "tiny-gguf-pkg 1.0" in fp.summary
    job = _job(tmp_path, url)  # a bare *.gguf string is a GGUF import
    summary = init_model_job.main(job, job.typed_config(InitModelConfig))
    assert summary["gguf"] == url and summary["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (Path(job.output_dir) / "model.safetensors").is_file()
    # a new version of the package is a new input; the same install is the same input
    assert fingerprint(url, {}, 0).digest == fp.digest
    _install_package(site, path, version="1.1")
    assert fingerprint(url, {}, 0).digest != fp.digest
    # an installed file changed after installation: refused, naming both digests
    target.write_bytes(target.read_bytes()[:-7] + b"garbage")
    assert "RECORD says" in _run_failing(tmp_path, url, capsys)
    # not installed / no such file / a path leaving the package
    assert "no installed Python package 'nope_pkg'" in _run_failing(tmp_path, "pkg://nope_pkg/x.gguf", capsys)
    err = _run_failing(tmp_path, "pkg://tiny_gguf_pkg/other.gguf", capsys)
    assert "has no file 'other.gguf'" in err and "model.gguf" in err
    assert "must stay inside" in _run_failing(tmp_path, "pkg://tiny_gguf_pkg/../x.gguf", capsys)
    assert fingerprint("pkg://nope_pkg/x.gguf", {}, 0).kind == "missing"


def test_unsupported_architecture_and_quantization_are_named(tmp_path, capsys):
    arch = tmp_path / "mamba-ish.gguf"
    write_tiny_gguf(arch, arch="notanarch")
    err = _run_failing(tmp_path, {"gguf": str(arch)}, capsys)
    assert str(arch) in err and "architecture 'notanarch'" in err and "not supported" in err
    quant = tmp_path / "q8_1.gguf"
    write_tiny_gguf(quant, override_type=Q.Q8_1)
    err = _run_failing(tmp_path, {"gguf": str(quant)}, capsys)
    assert str(quant) in err and "'Q8_1': 2" in err and "unsupported quantization" in err


def test_missing_truncated_and_foreign_files_fail_clearly(tmp_path, tiny_gguf, capsys):
    path, _ = tiny_gguf
    err = _run_failing(tmp_path, {"gguf": str(tmp_path / "absent.gguf")}, capsys)
    assert "absent.gguf" in err and "does not exist" in err
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:3000])
    err = _run_failing(tmp_path, {"gguf": str(truncated)}, capsys)
    assert str(truncated) in err and "not a readable GGUF file" in err
    foreign = tmp_path / "weights.gguf"
    foreign.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 10)
    err = _run_failing(tmp_path, {"gguf": str(foreign)}, capsys)
    assert str(foreign) in err and "not a readable GGUF file" in err


def test_gguf_config_is_validated_and_keeps_old_hashes():
    cfg = InitModelConfig.model_validate({"kind": "init_model", "pretrained": "pkg://p/m.Q4_1.gguf"})
    assert cfg.source == "gguf" and isinstance(cfg.pretrained, GGUFImport) and cfg.pretrained.dtype == "bfloat16"
    assert InitModelConfig.model_validate({"kind": "init_model", "pretrained": "org/name"}).source == "pretrained"
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="dtype"):
        InitModelConfig.model_validate({"kind": "init_model", "pretrained": {"gguf": "m.gguf", "dtype": "int8"}})
    with pytest.raises(ValidationError, match="`revision` selects a version of a hub model"):
        InitModelConfig.model_validate({"kind": "init_model", "pretrained": "m.gguf", "revision": "main"})
    # a plain `pretrained` string dumps as before: existing stage hashes do not move
    from pipeline.plan import result_config

    dumped = result_config(InitModelConfig.model_validate({"kind": "init_model", "pretrained": "/m"}))
    assert dumped["pretrained"] == "/m" and "gguf" not in dumped and "dtype" not in dumped

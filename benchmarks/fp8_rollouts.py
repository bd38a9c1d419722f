"""FP8 rollouts (issue 34): the torch engine's decode speed-up with `dtype: fp8` over bf16, and
the train-inference mismatch FP8 adds, measured on the same model in the same run.

    # on the GPU machine (Hopper / Ada; our wheels in /tmp/site via scripts/gpu_wheels.sh):
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    python3 benchmarks/fp8_rollouts.py --out $OUT --shape moe-1b --header
    python3 benchmarks/fp8_rollouts.py --out $OUT --shape 0.5B --model-dir /path/to/a/trained/model
    # here (CPU): the same orchestration on a tiny model, the FP8 weights dequantised on the fly
    # (no speed-up to measure: it only proves the script runs)
    python benchmarks/fp8_rollouts.py --smoke --out /tmp/fp8_smoke

Per engine variant -- bf16, fp8 with per-tensor scales, fp8 with per-row scales (each a
fresh `create_engine("torch", ...)` over the same model dir, CUDA graphs on):
- decode throughput: batch x new tokens of EOS-free sampling, the best of --repeats calls
  after a warm-up call (the warm-up captures the graphs), end to end and decode-only
  (batch * (new - 1) / (time(new) - time(1)));
- the mismatch against the trainer's forward in bf16 (`load_causal_lm`, the learner's own
  collate + PolicyHead: stages/rl/engines/agreement.py) on --agree-requests sampled
  responses: mean / p50 / p99 / max |log k|, IcePop's masked fraction, the k3 KL, and for a
  MoE model the share of (token, layer) routings where the trainer's experts differ from the
  engine's (routing.py).
A random-init model's logits are far flatter than a trained one's (its mismatch is not a
trained model's): `--model-dir` measures a real one (an SFT artifact).

Results: OUT/fp8_rollouts.json (rewritten after each variant) and a markdown row per variant
on stdout for benchmarks/RESULTS.md (--header prints the header first). Needs only torch +
transformers (no DeepSpeed / MLflow / Prefect).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere

COLUMNS = ["date", "device", "model", "engine dtype", "batch", "prompt", "new", "tok/s", "decode tok/s",
           "decode speed-up", "|log k| mean", "|log k| p99", "|log k| max", "masked", "mismatch KL",
           "expert disagreement"]
VARIANTS = {"bf16": dict(dtype="bfloat16"), "fp8-tensor": dict(dtype="fp8", fp8_scaling="tensor"),
            "fp8-row": dict(dtype="fp8", fp8_scaling="row")}
# random-init shapes (nothing is downloaded): dense Qwen2-0.5B, and a ring_moe of ~1B total
SHAPES = {
    "0.5B": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           intermediate_size=4864, vocab_size=32768)),
    "moe-1b": ("ring_moe", dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                                num_key_value_heads=4, intermediate_size=2816, vocab_size=32768, num_experts=32,
                                num_experts_per_tok=4, moe_intermediate_size=512,
                                shared_expert_intermediate_size=512, first_k_dense_replace=1)),
    "tiny-moe": ("ring_moe", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=96, vocab_size=512, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                  first_k_dense_replace=1)),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/fp8_rollouts")
    p.add_argument("--shape", choices=sorted(SHAPES), default="moe-1b")
    p.add_argument("--model-dir", help="a HF model dir to measure instead of a random-init --shape")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--agree-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--compile", action="store_true",
                   help="every variant with `rollout.compile: true` (the decode step through torch.compile): "
                        "FP8's activation quantisation (eager: five or six kernels a matmul) can fuse there")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny-moe, fp32 around dequantised FP8 weights")
    p.add_argument("--header", action="store_true")
    a = p.parse_args()
    if a.smoke:
        a.shape, a.batch, a.prompt_len, a.new_tokens, a.agree_requests, a.repeats = "tiny-moe", 4, 8, 8, 4, 1
    return a


def build_model_dir(a: argparse.Namespace, where: Path) -> tuple[Path, bool]:
    """(model dir, trust_remote_code)."""
    if a.model_dir:
        from stages.common.hf_io import load_config

        trust = load_config(Path(a.model_dir), trust_remote_code=True).model_type == "ring_moe"
        return Path(a.model_dir), trust
    from stages.init_model.model import MODEL_KINDS, save_model

    model_type, sizes = SHAPES[a.shape]
    torch.manual_seed(0)
    common = dict(max_position_embeddings=a.prompt_len + a.new_tokens + 8, eos_token_id=1, pad_token_id=0,
                  bos_token_id=None)
    if model_type in MODEL_KINDS:
        config_cls, model_cls = MODEL_KINDS[model_type].classes()
        config = config_cls(**sizes, **common)
        config.auto_map = dict(MODEL_KINDS[model_type].auto_map)
        save_model(model_cls(config), model_type, where)
        return where, True
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes, **common)).save_pretrained(where)
    return where, False


def requests(n: int, prompt_len: int, new: int, vocab: int, seed: int):
    from stages.rl.engines import RolloutRequest

    g = torch.Generator().manual_seed(seed)
    return [RolloutRequest(f"r{i}", torch.randint(2, vocab, (prompt_len,), generator=g).tolist(), new)
            for i in range(n)]


def best_seconds(engine, reqs, sampling, repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        engine.generate(reqs, sampling)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(a, name: str, model_dir: Path, trust: bool, trainer, device: torch.device) -> dict:
    from stages.rl.engines import SamplingParams, create_engine
    from stages.rl.engines.agreement import measure_agreement

    options = {**VARIANTS[name], "compile": a.compile}
    if a.smoke:  # no FP8 tensor cores here: the dequantising reference path, fp32 around it
        options = {**options, "dtype": "float32" if name == "bf16" else "fp8", "fp8_reference": name != "bf16"}
    engine = create_engine("torch", str(model_dir), device=str(device), max_batch=a.batch,
                           max_len=a.prompt_len + a.new_tokens + 1, eos_token_ids=[], trust_remote_code=trust, record_routes=True,
                           **options)
    vocab = engine.vocab
    sampling = SamplingParams(temperature=1.0, seed=1)
    full = requests(a.batch, a.prompt_len, a.new_tokens, vocab, 0)
    one = [type(r)(r.uid, r.prompt_ids, 1) for r in full]
    engine.generate(full, sampling)  # warm-up: graphs captured
    t_full = best_seconds(engine, full, sampling, a.repeats, device)
    t_one = best_seconds(engine, one, sampling, a.repeats, device)
    agree = measure_agreement(engine, trainer, requests(a.agree_requests, a.prompt_len, a.new_tokens, vocab, 1),
                              SamplingParams(temperature=1.0, seed=2), pad_id=0, device=device)
    s = agree.stats
    return {"variant": name + ("+compile" if a.compile else ""), "tok_per_s": a.batch * a.new_tokens / t_full,
            "decode_tok_per_s": a.batch * (a.new_tokens - 1) / max(t_full - t_one, 1e-9),
            "fp8_matmuls": len(engine.fp8.matmuls) if engine.fp8 else 0,
            "fp8_skipped": engine.fp8.skipped if engine.fp8 else [],
            **{k: s.get(k) for k in ("abs_log_k_mean", "abs_log_k_p50", "abs_log_k_p99", "abs_log_k_max",
                                     "masked_fraction", "mismatch_kl", "expert_disagreement",
                                     "expert_miss_fraction")}}


def row(a, device: torch.device, model: str, r: dict, base: dict | None) -> str:
    import datetime as dt

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    speedup = r["decode_tok_per_s"] / base["decode_tok_per_s"] if base else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cells = [dt.date.today().isoformat(), name, model, r["variant"], a.batch, a.prompt_len, a.new_tokens,
             f(r["tok_per_s"], ".0f"), f(r["decode_tok_per_s"], ".0f"), f(speedup, ".2f"),
             f(r["abs_log_k_mean"], ".2e"), f(r["abs_log_k_p99"], ".2e"), f(r["abs_log_k_max"], ".2e"),
             f(r["masked_fraction"], ".2e"), f(r["mismatch_kl"], ".2e"), f(r["expert_disagreement"], ".3f")]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    a = parse()
    from stages.common.hf_io import load_causal_lm

    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.header:
        print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, trust = build_model_dir(a, Path(tmp) / "model")
        trainer_dtype = torch.float32 if a.smoke else torch.bfloat16
        trainer = load_causal_lm(model_dir, trainer_dtype, trust_remote_code=trust).to(device)
        results: list[dict] = []
        model = a.model_dir or a.shape
        for name in a.variants:
            results.append(measure(a, name, model_dir, trust, trainer, device))
            base = next((r for r in results if r["variant"].startswith("bf16")), None)
            print(row(a, device, model, results[-1], base), flush=True)
            (out / "fp8_rollouts.json").write_text(json.dumps(
                {"args": vars(a), "device": str(device), "results": results}, indent=2))


if __name__ == "__main__":
    main()

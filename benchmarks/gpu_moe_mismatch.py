"""The torch rollout engine against the trainer's forward, dense and MoE, in bf16 on a GPU
(issue 12): the training-inference mismatch IcePop corrects, and the engine's MoE decode
step running under CUDA graphs.

    # on the GPU machine (our wheels in /tmp/site via scripts/gpu_wheels.sh), ~2-3 minutes:
    export PYTHONPATH=/tmp/site:$PWD
    python3 benchmarks/gpu_moe_mismatch.py --out "$OUT"
    # here (CPU): the same orchestration, tiny and short, graphs not applicable
    python benchmarks/gpu_moe_mismatch.py --smoke --out /tmp/moe_smoke

What it does, through the project's own entry points (pipeline.execute.run_stage):
1. synthetic_data (sft.jsonl, rl.jsonl), then per model -- `dense` (qwen2) and `moe`
   (init_model's ring_moe: sigmoid router + expert bias, shared expert; custom code,
   trust_remote_code) -- init_model and a short SFT, so the distributions are a trained
   model's, not a random one's.
2. `mismatch`: on each SFT'd model, the torch engine (bf16, CUDA graphs on) samples
   responses to RL prompts; the trainer's forward (the HF model through `load_causal_lm`,
   in bf16 and in fp32) scores the same tokens (stages/rl/engines/agreement.py, the
   learner's own collate + PolicyHead). Reported: mean / max |log k| (k = pi_train /
   pi_infer), the share of tokens outside IcePop's [0.5, 5], the k3 KL; plus whether the
   decode step was captured as CUDA graphs (how many) and whether the MoE layers took the
   grouped_mm path. On CUDA the run fails at the end (exit 1) if a decode was not captured.
3. `decode`: the MoE model's decode throughput with CUDA graphs vs eager (same requests).
With `--engine vllm` (issue 32) vLLM samples in part 2 (the MoE model through vLLM's
Transformers backend, `model_impl: transformers`) and part 3 is skipped.

Each result is appended to OUT/moe_mismatch.json as soon as it exists; progress with
timestamps goes to stdout (PYTHONUNBUFFERED).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._record import SAFE_ENV, ResultFile, device_name, log  # noqa: E402 - needs ROOT on sys.path

os.environ.update(SAFE_ENV)  # this process and every one it starts

LAYERS = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
          "intermediate_size": 1536, "max_position_embeddings": 1024}
MODELS = {  # tens of millions of parameters each on the GPU
    "dense": {"model_type": "qwen2", **LAYERS},
    "moe": {"model_type": "ring_moe", **LAYERS,
            "moe": {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
                    "shared_expert_intermediate_size": 512, "first_k_dense_replace": 1}},
}
SMOKE_LAYERS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 128, "max_position_embeddings": 1024}
SMOKE_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 64, "first_k_dense_replace": 1}




def architecture(name: str, smoke: bool) -> dict:
    if not smoke:
        return MODELS[name]
    arch = {"model_type": MODELS[name]["model_type"], **SMOKE_LAYERS}
    return {**arch, "moe": SMOKE_MOE} if name == "moe" else arch


def train_models(args) -> dict[str, str]:
    """{model name: its SFT'd model dir}, each built through run_stage."""
    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    gpu = not args.smoke
    kw = dict(storage=str(args.work / "store"), work_root=args.work / "work", recipe="moe-mismatch",
              launcher="deepspeed" if gpu else "local")
    res = Resources(gpus_per_node=1) if gpu else Resources(cpu_ranks=1)
    data = run_stage("synthetic_data", {"files": {
        "sft.jsonl": {"generator": "arithmetic_cot", "n": 1500, "seed": 0, "params": {"max_digits": 1}},
        "rl.jsonl": {"generator": "arithmetic_rl", "n": 256, "seed": 1, "params": {"max_digits": 1}}}},
        stage="data", **kw)
    args.rl_data = Path(local_path(data.url)) / "rl.jsonl"
    out = {}
    for name in MODELS:
        t0 = time.perf_counter()
        base = run_stage("init_model", {"architecture": architecture(name, args.smoke),
                                        "tokenizer": {"corpus": ["${stages.data.output}/sft.jsonl"],
                                                      "vocab_size": 512}},
                         stage=f"base-{name}", upstream={"data": data.url}, **kw)
        trust = name == "moe"
        sft = run_stage("sft", {"model": "${stages.base.output}", "trust_remote_code": trust,
                                "data": "${stages.data.output}/sft.jsonl", "max_seq_len": 512, "epochs": 1,
                                "max_steps": args.sft_steps, "micro_batch_size": 8, "lr": 2.0e-3,
                                "warmup_steps": 2, "zero_stage": 0, "checkpoint_every": 1000},
                        stage=f"sft-{name}", upstream={"base": base.url, "data": data.url}, resources=res, **kw)
        out[name] = str(Path(local_path(sft.url)))
        log(f"{name}: init_model + {args.sft_steps} SFT steps in {time.perf_counter() - t0:.0f}s -> {out[name]}")
    return out


def rollout_requests(model_dir: str, rl_data: Path, n: int, new_tokens: int, trust: bool):
    from stages.common.hf_io import load_tokenizer
    from stages.reasoning_rl.config import RLData
    from stages.reasoning_rl.data import load_rows
    from stages.rl.engines import RolloutRequest
    from stages.rl.prompts import render_prompts

    tok = load_tokenizer(model_dir, trust_remote_code=trust)
    _, ids, _ = render_prompts(load_rows(Path, [RLData(path=str(rl_data))]), tok, 256)
    return [RolloutRequest(f"r{i}", ids[i % len(ids)], new_tokens) for i in range(n)], tok.pad_token_id


def part_mismatch(args, name: str, model_dir: str) -> dict:
    import torch

    from stages.common.hf_io import load_causal_lm
    from stages.rl.engines import SamplingParams, create_engine
    from stages.rl.engines.agreement import measure_agreement
    from stages.rl.engines.torch_engine.moe import MoEFeedForward

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    trust = name == "moe"
    requests, pad = rollout_requests(model_dir, args.rl_data, args.requests, args.new_tokens, trust)
    # vllm (issue 32): ring_moe's custom code runs in vLLM's Transformers backend (its own router,
    # vLLM's fused experts); the dense model in vLLM's own Qwen2
    options = ({"gpu_memory_utilization": 0.3, **({"model_impl": "transformers"} if trust else {})}
               if args.engine == "vllm" else {})
    engine = create_engine(args.engine, model_dir, device=device, dtype="bfloat16", max_batch=args.batch,
                           max_len=256 + args.new_tokens + 8, seed=0, trust_remote_code=trust, **options)
    sampling = SamplingParams(temperature=1.0, seed=1)
    result: dict = {"model_dir": model_dir, "device": device_name(cuda),
                    "requests": len(requests), "max_new_tokens": args.new_tokens}
    for trainer_dtype in (torch.bfloat16, torch.float32):
        trainer = load_causal_lm(model_dir, trainer_dtype, trust_remote_code=trust).to(device)
        t0 = time.perf_counter()
        got = measure_agreement(engine, trainer, requests, sampling, pad_id=pad, device=device)
        tokens = sum(map(len, got.engine_logprobs))
        key = f"engine_bf16_vs_trainer_{str(trainer_dtype).removeprefix('torch.')}"
        result[key] = {**got.stats, "tokens": tokens, "seconds": round(time.perf_counter() - t0, 2)}
        log(f"mismatch {name} {key}: {tokens} tokens, |log k| mean {got.stats.get('abs_log_k_mean'):.3g} "
            f"max {got.stats.get('abs_log_k_max'):.3g}, outside [0.5, 5] {got.stats.get('masked_fraction'):.3g}")
        del trainer
    if args.engine == "vllm":
        engine.close()
        return result
    moe_layers = [f for f in engine.mlps if isinstance(f, MoEFeedForward)]
    result["cuda_graphs"] = {"enabled": engine.graphs.enabled, "captured": len(engine.graphs)}
    result["moe_layers"] = len(moe_layers)
    result["moe_grouped_mm"] = all(f.grouped for f in moe_layers) if moe_layers else None
    result["params"] = sum(p.numel() for p in engine.model.parameters())
    return result


def part_decode(args, model_dir: str) -> dict:
    import torch

    from stages.rl.engines import SamplingParams, create_engine

    if args.smoke or not torch.cuda.is_available():
        return {"skipped": "CUDA graphs need a GPU"}
    requests, _ = rollout_requests(model_dir, args.rl_data, args.batch, args.new_tokens, True)
    out = {}
    for graphs in (True, False):
        eng = create_engine("torch", model_dir, device="cuda", dtype="bfloat16", max_batch=args.batch,
                            max_len=256 + args.new_tokens + 8, seed=0, trust_remote_code=True,
                            eos_token_ids=[], cuda_graphs=graphs)
        sp = SamplingParams(temperature=1.0, seed=1)
        eng.generate(requests, sp)  # warm-up: captures the graphs
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ups = eng.generate(requests, sp)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n = sum(len(u.token_ids) for u in ups)
        label = "cuda_graphs" if graphs else "eager"
        out[label] = {"tokens": n, "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 1),
                      "graphs_captured": len(eng.graphs)}
        log(f"decode moe {label}: {n} tokens in {dt:.2f}s = {n / dt:,.0f} tok/s")
        del eng
        torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/moe_mismatch")))
    parser.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temporary one)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models, 2 SFT steps")
    parser.add_argument("--sft-steps", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                        help="the engine that samples (vllm: the mismatch parts only, no decode part)")
    args = parser.parse_args()
    smoke = args.smoke
    args.sft_steps = args.sft_steps or (2 if smoke else 40)
    args.requests = args.requests or (8 if smoke else 256)
    args.batch = args.batch or (4 if smoke else 64)
    args.new_tokens = args.new_tokens or (16 if smoke else 256)
    args.out.mkdir(parents=True, exist_ok=True)
    results = ResultFile.resume(args.out / ("moe_mismatch.json" if args.engine == "torch" else
                                            f"moe_mismatch_{args.engine}.json"))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="moe_mismatch_") as tmp:
        args.work = args.work or Path(tmp)
        log(f"train the models (smoke={smoke}) under {args.work}")
        models = train_models(args)
        failures = []
        for name, model_dir in models.items():
            try:
                res = part_mismatch(args, name, model_dir)
            except Exception as e:  # noqa: BLE001 - record it, measure the other model
                res = {"error": f"{type(e).__name__}: {e}"}
                failures.append(f"mismatch {name}: {res['error']}")
            results.put(f"mismatch_{name}", result=res)
            if not smoke and "cuda_graphs" in res and not res["cuda_graphs"]["captured"]:
                failures.append(f"{name}: the decode step was not captured as CUDA graphs ({res['cuda_graphs']})")
        try:
            if args.engine == "torch":
                results.put("decode_moe", result=part_decode(args, models["moe"]))
        except Exception as e:  # noqa: BLE001
            results.put("decode_moe", result={"error": f"{type(e).__name__}: {e}"})
            failures.append(f"decode moe: {type(e).__name__}: {e}")
    for f in failures:
        log(f"FAILED {f}")
    log(f"done; results in {results.path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

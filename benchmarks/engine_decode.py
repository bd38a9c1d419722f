"""Decode throughput of the torch rollout engine next to transformers' `generate`.

Same random-init model (default: the Qwen2-0.5B shape; nothing is downloaded), same batch,
prompt length and number of new tokens, both measured in this run. Both sample at
temperature 1 (no top-k/top-p), EOS off so every row generates exactly --new-tokens;
the engine also returns every token's logprob, `generate` does not.

Reported, per system: end-to-end generated tokens/s (prefill included) and decode-only
tokens/s = batch * (new - 1) / (time(new tokens) - time(1 token)). Plus a sanity check:
the share of rows whose first --check-tokens greedy tokens agree between the two (1.0 in
fp32; in bf16 the two code paths round differently and some rows drift apart).

Also per decode step: its time (ms/step), the memory-bandwidth bound = (the model's weight
bytes + the batch's KV bytes at the mean context) / bandwidth, with the bandwidth measured
in this run (a large device-to-device copy: bytes read + written / time), and the share of
the bound the step reaches. `--compile` turns the engine's `compile` option on (its compile
seconds are a column; warm-up includes them). `--no-pack` runs q/k/v and gate/up as separate
matmuls (pack_projections=False: the engine before fused_linear.py), for an A/B in one run;
`--autotune` compiles with inductor's GEMM autotuning (compile_mode). `--profile` traces ~20 steady decode steps
(kernel times of a 21-token call minus those of a 1-token call) and prints the top kernels
and the per-step GPU time by kind: attention / GEMM / elementwise+norm / sampling / other.

Needs only torch + transformers (no DeepSpeed / MLflow / Prefect). Prints a markdown row
for benchmarks/RESULTS.md (--header prints the header first).

    python benchmarks/engine_decode.py --device cuda --dtype bfloat16 --batch 256 \\
        --prompt-len 128 --new-tokens 512 --header
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

COLUMNS = ["date", "device", "model", "dtype", "batch", "prompt", "new", "engine tok/s",
           "generate tok/s", "speedup", "engine decode tok/s", "generate decode tok/s",
           "greedy agree", "engine warm-up s", "compile s", "compile mode", "graphs", "packed", "ms/step", "bound ms/step",
           "% of bound", "bandwidth GB/s", "torch / transformers"]

# kernel (or, on CPU, aten op) name fragments per kind, first match wins: fused Triton
# kernels are named after their ops (e.g. triton_red_fused__log_softmax_argmax_...)
KERNEL_KINDS = [
    ("other", ("memcpy", "memset")),  # the per-step token copy to the host, cache growth
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("GEMM", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "matmul", "aten::mm", "aten::addmm",
              "aten::bmm", "splitk")),
    ("sampling", ("softmax", "argmax", "topk", "sort", "exponential", "gather", "cumsum")),
    ("elementwise+norm", ("elementwise", "vectorized", "triton", "norm", "rsqrt", "pow", "mean",
                          "mul", "add", "scatter", "index", "copy", "cat", "neg", "silu", "reduce",
                          "fill", "aten::")),
]


def add_decode_shape_args(p: argparse.ArgumentParser) -> None:
    """The model shape (Qwen2-0.5B's by default) and the decode batch of a decode benchmark
    (benchmarks/vllm_decode.py's 0.5B / 1.5B cases are the same shapes)."""
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_decode_shape_args(p)
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on cuda, float32 on cpu")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (best kept)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="engine decodes eagerly")
    p.add_argument("--compile", action="store_true", help="engine option compile=True (torch.compile)")
    p.add_argument("--no-pack", action="store_true",
                   help="engine option pack_projections=False (q/k/v and gate/up as separate matmuls)")
    p.add_argument("--autotune", action="store_true",
                   help="with --compile: compile_mode max-autotune-no-cudagraphs (compiled_step.py)")
    p.add_argument("--profile", action="store_true",
                   help="profile ~20 steady decode steps: top kernels, time per kind")
    p.add_argument("--top-kernels", type=int, default=15)
    p.add_argument("--skip-generate", action="store_true", help="engine only")
    p.add_argument("--check-tokens", type=int, default=16, help="greedy agreement check (0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--header", action="store_true")
    return p.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(device: torch.device, repeats: int = 10) -> float:
    """Bytes/s of a large copy on `device` (read + written), best of `repeats`."""
    n = (1 << 30) if device.type == "cuda" else (1 << 27)  # bytes per buffer
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = best_time(lambda: dst.copy_(src), repeats, device)
    return 2 * n / seconds


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in low for p in parts)), "other")


def kernel_times(fn, device: torch.device) -> dict[str, float]:
    """Total self time (us) per GPU kernel of one `fn()` call; on CPU per profiled event
    (self times do not overlap; a compiled graph's fused C++ kernels count under its call)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        t = ev.self_device_time_total if device.type == "cuda" else ev.self_cpu_time_total
        is_kernel = ev.device_type.name == "CUDA" if device.type == "cuda" else True
        if is_kernel and t > 0:
            times[ev.key] = times.get(ev.key, 0.0) + t
    return times


def print_profile(run_engine, device: torch.device, steps: int, top: int) -> None:
    """Kernels of `steps` steady decode steps = a (steps + 1)-token call minus a 1-token call
    (same prefill, same graphs: the difference is the decode steps)."""
    run_engine(steps + 1)  # any graph of these shapes is captured before tracing
    full, one = kernel_times(lambda: run_engine(steps + 1), device), kernel_times(lambda: run_engine(1), device)
    per_step = {k: (v - one.get(k, 0.0)) / steps for k, v in full.items()}
    per_step = {k: v for k, v in per_step.items() if v > 0}
    total = sum(per_step.values())
    print(f"\nprofile: {steps} decode steps, {total / 1000:.3f} ms of {'GPU' if device.type == 'cuda' else 'CPU'} "
          f"time per step")
    print("| kernel | kind | us/step | share |\n|---|---|---|---|")
    for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {k[:90]} | {kernel_kind(k)} | {v:.1f} | {v / total:.1%} |")
    kinds: dict[str, float] = {}
    for k, v in per_step.items():
        kinds[kernel_kind(k)] = kinds.get(kernel_kind(k), 0.0) + v
    print("\n| kind | ms/step | share |\n|---|---|---|")
    for kind, v in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {v / 1000:.3f} | {v / total:.1%} |")
    print(flush=True)


def step_bytes(engine, batch: int, mean_context: float) -> float:
    """Bytes one decode step must read at least: every weight once (a tied lm_head once) and
    the batch's cached keys and values at the mean context length."""
    params = {id(p): p for p in engine.model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    kv_per_token = 2 * len(engine.layers) * engine.n_kv * engine.head_dim * torch.finfo(engine.dtype).bits // 8
    return weights + batch * mean_context * kv_per_token


def build_model(a, dtype: torch.dtype, device: torch.device):
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      intermediate_size=a.intermediate, max_position_embeddings=32768,
                      rope_theta=1_000_000.0, tie_word_embeddings=True, eos_token_id=None,
                      bos_token_id=None, pad_token_id=0)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
    torch.manual_seed(a.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, **kw)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0, bos_token_id=None)
    return model


def main() -> None:
    a = parse()
    if a.threads:
        torch.set_num_threads(a.threads)
    import transformers

    from stages.rl.engines import RolloutRequest, SamplingParams, create_engine
    from stages.rl.engines.torch_engine import resolve_dtype

    device = torch.device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    model = build_model(a, dtype, device)
    g = torch.Generator().manual_seed(a.seed + 1)
    prompts = torch.randint(1, a.vocab, (a.batch, a.prompt_len), generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        engine = create_engine("torch", tmp, device=a.device, dtype=str(dtype).split(".")[1],
                               max_batch=a.batch, max_len=a.prompt_len + a.new_tokens,
                               seed=a.seed, eos_token_ids=[],
                               compile=a.compile, pack_projections=not a.no_pack,
                               compile_mode="max-autotune-no-cudagraphs" if a.autotune else "default",
                               **({"cuda_graphs": False} if a.no_cuda_graphs else {}))

    sample = SamplingParams(temperature=1.0, seed=a.seed)

    def run_engine(new: int, sampling=sample):
        reqs = [RolloutRequest(uid=str(i), prompt_ids=p, max_new_tokens=new)
                for i, p in enumerate(prompts.tolist())]
        return engine.generate(reqs, sampling)

    t0 = time.perf_counter()
    run_engine(a.new_tokens)  # warm-up: captures every graph the timed runs replay
    sync(device)
    warm = time.perf_counter() - t0
    e_full = best_time(lambda: run_engine(a.new_tokens), a.repeats, device)
    e_one = best_time(lambda: run_engine(1), a.repeats, device)
    n_new = a.batch * a.new_tokens
    step_s = max(e_full - e_one, 1e-9) / max(a.new_tokens - 1, 1)
    bandwidth = measure_bandwidth(device)
    bound_s = step_bytes(engine, a.batch, a.prompt_len + a.new_tokens / 2) / bandwidth
    row = {"engine tok/s": n_new / e_full,
           "engine decode tok/s": a.batch * (a.new_tokens - 1) / max(e_full - e_one, 1e-9),
           "engine warm-up s": warm, "graphs": len(engine.graphs) if engine.use_graphs else "off",
           "packed": engine.packed_projections,
           "compile mode": engine.compiled.mode if engine.compiled.enabled else "-",
           "compile s": (f"{engine.compiled.compile_seconds:.1f}" if engine.compiled.enabled
                         else ("failed" if a.compile else "off")),
           "ms/step": f"{step_s * 1000:.2f}", "bound ms/step": f"{bound_s * 1000:.3f}",
           "% of bound": f"{bound_s / step_s:.1%}", "bandwidth GB/s": bandwidth / 1e9}
    if a.profile:
        print_profile(run_engine, device, min(20, a.new_tokens - 1), a.top_kernels)

    if not a.skip_generate:
        ids = prompts.to(device)
        mask = torch.ones_like(ids)

        def run_generate(new: int, greedy: bool = False):
            with torch.inference_mode():
                kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0,
                                                               top_k=0, top_p=1.0)
                return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                      min_new_tokens=new, pad_token_id=0, **kw)

        run_generate(8)  # warm-up
        g_full = best_time(lambda: run_generate(a.new_tokens), a.repeats, device)
        g_one = best_time(lambda: run_generate(1), a.repeats, device)
        row["generate tok/s"] = n_new / g_full
        row["generate decode tok/s"] = a.batch * (a.new_tokens - 1) / max(g_full - g_one, 1e-9)
        row["speedup"] = f"{row['engine tok/s'] / row['generate tok/s']:.1f}x"
        if a.check_tokens:
            k = min(a.check_tokens, a.new_tokens)
            ref = run_generate(k, greedy=True)[:, a.prompt_len:].tolist()
            got = [u.token_ids for u in run_engine(k, SamplingParams(temperature=0.0))]
            row["greedy agree"] = f"{sum(r == o for r, o in zip(ref, got)) / a.batch:.2f}"

    shape = f"Qwen2 h{a.hidden} L{a.layers} q{a.heads}/kv{a.kv_heads} ff{a.intermediate} V{a.vocab}"
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    row.update({"date": dt.date.today().isoformat(), "device": dev, "model": shape,
                "dtype": str(dtype).split(".")[1], "batch": a.batch, "prompt": a.prompt_len,
                "new": a.new_tokens,
                "torch / transformers": f"{torch.__version__} / {transformers.__version__}"})

    def fmt(v):
        return f"{v:,.0f}" if isinstance(v, float) and v >= 100 else (
            f"{v:.2f}" if isinstance(v, float) else str(v))

    if a.header:
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "|".join("---" for _ in COLUMNS) + "|")
    print("| " + " | ".join(fmt(row.get(c, "-")) for c in COLUMNS) + " |", flush=True)


if __name__ == "__main__":
    main()

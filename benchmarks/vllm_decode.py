"""The vLLM decode anchor (issue 32): vLLM's own `LLM.generate` next to our vllm engine and the
torch engine (compiled step), on the same random-init model dir, prompts, sampling parameters
(temperature 1, no truncation, the same per-request seeds, logprobs=0, EOS off) and batch; plus
the weight sync into our vllm engine against the GPU's copy bandwidth.

    # GPU (vllm installed: scripts/gpu_vllm.sh's payload; PYTHONPATH=/tmp/site_vllm:/tmp/site:$PWD)
    python3 benchmarks/vllm_decode.py --out $OUT                                  # every case and runner
    python3 benchmarks/vllm_decode.py --out $OUT --cases 1.5B --runners native,ours,sync
    python3 benchmarks/vllm_decode.py --out $OUT --cases 0.5B --runners sync --tp 2   # the sync into a TP=2 engine
    # CPU: the orchestration with the torch runner only, a tiny shape
    python benchmarks/vllm_decode.py --smoke --out /tmp/vllm_decode

Cases: `0.5B` and `1.5B` (Qwen2 shapes, batch 256, prompt 128, 512 new tokens) and `0.5B-8k`
(batch 64, prompt 128, 8192 new tokens). Runners:
- `native`: `vllm.LLM(...).generate(prompts, [SamplingParams per request])`, what vLLM does alone.
  (`native_unseeded`, not run by default: the same without per-request seeds, what they cost.)
- `ours`: `create_engine("vllm", ...)` and its `generate` (stages/rl/engines/vllm_engine.py).
  (`ours_unseeded`, not run by default: with rollout.options request_seeds: false.)
  (`native_nologprobs`, not run by default: `LLM.generate` asked for no log-probs, what they cost.)
  (`native_flat` / `ours_flat`, not run by default: log-probs in vLLM's FlatLogprobs layout,
  `flat_logprobs=True`; round 20 found the log-probs cost half of vLLM's step.)
- `torch`: `create_engine("torch", ..., compile=True)`, the torch engine's fastest step.
- `sync`: `update_weights` of the model's own weights (bf16, from the HF model on this GPU)
  into our engine, best of 3: seconds and GB/s, next to one device-to-device copy of the same
  bytes (the HBM bound of moving them once; the sync moves them twice: into the staging buffer
  and into the model, plus the peer copy of a second tensor-parallel GPU with --tp 2).
  (`sync_fitkv`, not run by default: the same into an engine whose KV cache holds batch x
  (prompt + new) tokens, no more: the prefix-cache reset walks every block of the cache.)
Each (case, runner) runs in a process of its own (GPU memory comes back between them) under
--part-timeout-s; one warm-up call on other prompts (an eighth of the batch, at most 512 new
tokens), then the best of --repeats timed calls (one for the 8k case).
Results land in OUT/vllm_decode.json as each finishes (a call cut short keeps what it
finished), with the ratios ours / native and torch / native per case.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from benchmarks._record import SAFE_ENV, ResultFile, device_name, log, versions  # noqa: E402

os.environ.update(SAFE_ENV)

QWEN2_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864}
QWEN2_15B = {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960}
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64}
CASES = {  # name: (shape, vocab, batch, prompt, new tokens)
    "0.5B": (QWEN2_05B, 151936, 256, 128, 512),
    "1.5B": (QWEN2_15B, 151936, 256, 128, 512),
    "0.5B-8k": (QWEN2_05B, 151936, 64, 128, 8192),
    # a quarter of the batch: vLLM's step took 12-14 ms at 0.5B and 1.5B alike (rounds 13, 17); a step
    # time that falls with the batch while the GPU's work hardly does points at per-request CPU work
    "0.5B-b64": (QWEN2_05B, 151936, 64, 128, 512),
    "smoke": (TINY, 256, 8, 8, 16),
}
RUNNERS = ("native", "ours", "torch", "sync")
WARMUP_TOKENS = 512  # new tokens of the warm-up call (other prompts, an eighth of the batch)
SEED = 1  # SamplingParams.seed of every run: per-request seeds derived from it and the request's uid


def model_dir(work: Path, case: str) -> Path:
    """The case's random-init model (bf16, tied embeddings as Qwen2-0.5B / 1.5B), made once."""
    out = work / f"model-{case}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape, vocab, *_ = CASES[case]
    cfg = AutoConfig.for_model("qwen2", vocab_size=vocab, max_position_embeddings=16384,
                               tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    # initialised on the GPU where there is one: on the CPU the 1.5B init took 98 s of a GPU job (round 17)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def prompts(case: str, seed: int) -> list[list[int]]:
    import torch

    _, vocab, batch, prompt_len, _ = CASES[case]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, prompt_len), generator=g).tolist()


def _timed(fn, repeats: int, cuda: bool) -> tuple[float, int]:
    """(best seconds, tokens of that call) of `fn() -> tokens`."""
    import torch

    best, tokens = math.inf, 0
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = fn()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if seconds < best:
            best, tokens = seconds, n
    return best, tokens


# -- the runners (each in its own process) ----------------------------------------------------
def run_native(args, case: str, mdir: Path, seeded: bool = True, logprobs: int | None = 0, flat: bool = False) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    from stages.rl.engines.vllm_engine import _request_seed

    _, _, batch, prompt_len, new = CASES[case]
    llm = LLM(model=str(mdir), dtype="bfloat16", seed=0, max_model_len=prompt_len + new + 8, max_num_seqs=batch,
              gpu_memory_utilization=args.gpu_mem, enable_prefix_caching=True, logprobs_mode="processed_logprobs")

    def call(ps: list[list[int]], tokens: int = new) -> int:
        params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1,
                                 seed=_request_seed(SEED, f"r{i}", 0) if seeded else None, max_tokens=tokens,
                                 logprobs=logprobs, stop_token_ids=[], ignore_eos=True, detokenize=False,
                                 flat_logprobs=flat)
                  for i in range(len(ps))]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
        assert logprobs is None or all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in outs)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    t0 = time.perf_counter()
    call(prompts(case, seed=99)[: max(1, batch // 8)], min(new, WARMUP_TOKENS))  # warm-up: graphs, compilation
    warm = time.perf_counter() - t0
    real = prompts(case, seed=0)
    return {**_row(*_timed(lambda: call(real), _repeats(args, new), True)), "warmup_s": round(warm, 1)}


def _engine(args, name: str, case: str, mdir: Path, cuda: bool, **extra):
    from stages.rl.engines import create_engine

    _, _, batch, prompt_len, new = CASES[case]
    if name == "vllm":
        extra = {"gpu_memory_utilization": args.gpu_mem, **extra}
    return create_engine(name, str(mdir), device="cuda" if cuda else "cpu", dtype="auto", max_batch=batch,
                         max_len=prompt_len + new + 8, seed=0, eos_token_ids=[], **extra)


def run_engine(args, case: str, mdir: Path, name: str, **options) -> dict:
    from stages.rl.engines import RolloutRequest, SamplingParams

    cuda = not args.smoke
    _, _, batch, _, new = CASES[case]
    eng = _engine(args, name, case, mdir, cuda, **({"compile": True} if name == "torch" and cuda else {}), **options)
    sp = SamplingParams(temperature=1.0, seed=SEED)

    def call(ps: list[list[int]], tokens: int = new) -> int:
        reqs = [RolloutRequest(f"r{i}", p, tokens) for i, p in enumerate(ps)]
        return sum(len(u.token_ids) for u in eng.generate(reqs, sp))

    t0 = time.perf_counter()
    call(prompts(case, seed=99)[: max(1, batch // 8)], min(new, WARMUP_TOKENS))  # warm-up: graphs, compilation
    warm = time.perf_counter() - t0
    real = prompts(case, seed=0)
    return {**_row(*_timed(lambda: call(real), _repeats(args, new), cuda)), "warmup_s": round(warm, 1)}


def run_sync(args, case: str, mdir: Path, fit_kv: bool = False) -> dict:
    """fit_kv: a KV cache of what the engine can hold at once, `max_batch` sequences of `max_len`
    tokens (vLLM's `num_gpu_blocks_override`, blocks of 16 tokens): the prefix-cache reset walks
    every block of the cache (round 18), and a sync resets the cache, so in RL a larger cache
    holds nothing past the next sync."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.bfloat16).cuda()
    weights = list(model.named_parameters())
    nbytes = sum(p.numel() * p.element_size() for _, p in weights)
    _, _, batch, prompt_len, new = CASES[case]
    blocks = {"num_gpu_blocks_override": batch * math.ceil((prompt_len + new + 8) / 16)} if fit_kv else {}
    eng = _engine(args, "vllm", case, mdir, True, gpu_memory_utilization=min(args.gpu_mem, 0.5),
                  tensor_parallel_size=args.tp, sync_bucket_mb=args.bucket_mb, **blocks)
    runs, parts = [], []
    for _ in range(3):
        eng.update_weights(weights)
        runs.append(eng.last_sync_seconds)
        r = eng.last_sync  # where the time went (vllm_weights.SyncReport)
        parts.append({k: round(getattr(r, k), 4) for k in ("copy_seconds", "rpc_seconds", "map_seconds",
                                                           "load_seconds", "reset_seconds")})
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bound, _ = _timed(lambda: (dst.copy_(src), 0)[1], 5, True)
    best = min(runs)
    return {"bytes": nbytes, "buckets": eng.last_sync.buckets, "bucket_mb": args.bucket_mb, "tp": args.tp, **blocks,
            "seconds": [round(s, 4) for s in runs], "gb_per_s": round(nbytes / best / 1e9, 1),
            "copy_bound_s": round(bound, 5), "copy_bound_gb_per_s": round(nbytes / bound / 1e9, 1),
            "x_bound": round(best / bound, 2), "parts_of_best": parts[runs.index(best)], "parts": parts}


def _repeats(args, new_tokens: int) -> int:
    """One timed call of a long generation (minutes; its variance is small), else --repeats."""
    return 1 if new_tokens > 4096 else args.repeats


def _row(seconds: float, tokens: int) -> dict:
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds)}


def child(args) -> dict:
    case, runner = args.child.split(":")
    mdir = model_dir(args.work, case)
    fn = {"native": lambda: run_native(args, case, mdir), "native_unseeded": lambda: run_native(args, case, mdir, False),
          # no log-probs asked for: what vLLM's per-token log-prob output costs (RL needs it; round 17)
          "native_nologprobs": lambda: run_native(args, case, mdir, logprobs=None),
          # vLLM's FlatLogprobs: the log-probs without a dict and a Logprob object per token (round 20)
          "native_flat": lambda: run_native(args, case, mdir, flat=True),
          "ours_flat": lambda: run_engine(args, case, mdir, "vllm", flat_logprobs=True),
          "ours": lambda: run_engine(args, case, mdir, "vllm"),
          "ours_unseeded": lambda: run_engine(args, case, mdir, "vllm", request_seeds=False),
          "torch": lambda: run_engine(args, case, mdir, "torch"), "sync": lambda: run_sync(args, case, mdir),
          "sync_fitkv": lambda: run_sync(args, case, mdir, fit_kv=True)}[runner]
    return {**fn(), "device": device_name(not args.smoke)}


# -- the parent: one process per (case, runner) -------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/vllm_decode")))
    p.add_argument("--work", type=Path, default=Path("/tmp/vllm_decode_work"), help="the model dirs")
    p.add_argument("--cases", default="0.5B,1.5B,0.5B-8k")
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--gpu-mem", type=float, default=0.85, help="gpu_memory_utilization of native and ours")
    p.add_argument("--tp", type=int, default=1, help="sync runner: tensor_parallel_size of the engine")
    p.add_argument("--bucket-mb", type=int, default=512, help="sync runner: sync_bucket_mb")
    p.add_argument("--part-timeout-s", type=float, default=300)
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, the torch runner only")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # CASE:RUNNER, in a child process
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    from gpu_vllm_check import _run_part  # one part per process group, stacks on a timeout

    if args.smoke:
        args.cases, args.runners = "smoke", "torch"
    args.out.mkdir(parents=True, exist_ok=True)
    results = ResultFile.resume(args.out / "vllm_decode.json")
    results.put("setup", result={**versions(), "cases": {c: CASES[c][1:] for c in args.cases.split(",")},
                                 "columns": "vocab, batch, prompt, new tokens"})
    for case in args.cases.split(","):
        model_dir(args.work, case)  # made once, here, not in each timed child
        for runner in args.runners.split(","):
            log(f"{case} {runner} ...")
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", f"{case}:{runner}"]
            rc, stdout, stderr = _run_part(cmd, args.part_timeout_s)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(lines[-1][len("RESULT "):]) if lines else {"rc": rc, "tail": (stdout + stderr)[-3000:]}
            with open(args.out / "vllm_decode.log", "a") as f:
                f.write(f"==== {case} {runner} (rc {rc})\n{stdout}\n{stderr}\n")
            results.put(case, runner, result=row)
            log(f"{case} {runner}: {row.get('tokens_per_s', row.get('gb_per_s', row.get('rc')))}")
        rows = results.data.get(case, {})
        native = rows.get("native", {}).get("tokens_per_s")
        if native:
            results.put(case, "ratio_to_native", result={r: round(rows[r]["tokens_per_s"] / native, 3)
                                                         for r in ("ours", "torch") if "tokens_per_s" in rows.get(r, {})})
    return 0


if __name__ == "__main__":
    sys.exit(main())

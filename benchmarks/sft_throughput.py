"""Training-step speed where the GPU hours go: the `sft` stage's own step next to a plain
transformers + fused AdamW loop, and the RL learner's step, on one GPU, in one run.

    # on the GPU machine (one GPU), from the repo root, after scripts/gpu_wheels.sh's wheels are
    # installed into /tmp/site; at most ~8 minutes, each result lands in $OUT when it is measured:
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    timeout 480 python3 benchmarks/sft_throughput.py --out "$OUT" 2>&1 | tee "$OUT/sft_throughput.log"
    # LoRA next to full training (issue 35; NOT run yet): the stage's step and the RL learner's,
    # each variant with its `_lora` twin (rank 16 on every projection), memory and tokens/s
    timeout 480 python3 benchmarks/sft_throughput.py --out "$OUT" --only 0.5B@4096 learner --lora \
        --variants stage_mixed stage_z2 --learner-variants causal_loss 2>&1 | tee "$OUT/sft_throughput.log"
    # one case only (e.g. a second run for what the first did not reach):
    timeout 480 python3 benchmarks/sft_throughput.py --out "$OUT" --only 1.5B@16384 2>&1 | tee "$OUT/sft_throughput.log"
    # here (CPU): the whole orchestration on a tiny shape (compile_layers traced with aot_eager:
    # the smoke sets RING_COMPILE_BACKEND=aot_eager unless it is set, stages/common/compile_layers.py)
    python benchmarks/sft_throughput.py --smoke --out /tmp/sft_smoke
    # where the stage's step goes (issue 19): operator tables of plain vs stage variants
    timeout 480 python3 benchmarks/sft_throughput.py --out "$OUT" --only 1.5B@4096 --profile \
        --variants plain stage stage_z1 stage_mixed stage_mixed_z1 2>&1 | tee "$OUT/sft_throughput.log"

Cases, in this order (`--only` picks some; names: `<shape>@<tokens>` and `learner`):
  1.5B@4096, learner, 0.5B@4096, 0.5B@16384, 1.5B@16384
Shapes are Qwen2-0.5B / Qwen2-1.5B built from a config (random init, tied embeddings, the
151,936-token vocabulary; the smoke's tiny shape has 2,048); the chat tokenizer comes from the `init_model` stage (a small BPE
on the synthetic CoT rows, whose ids all fit the model's vocabulary).

Variants of an SFT case (`<tokens>` tokens per micro batch, micro batch 1, ZeRO-0, bf16):
  plain         transformers + torch AdamW(fused) on bf16 weights, SDPA causal over the whole
                row (no packing mask), HF's own loss; the pack's tokens as one sequence
  stage_defaults  the headline: the `sft` stage given no speed setting, so every `auto` is decided
                for this GPU, model, sequence length and GPU count (stages/common/speed_defaults.py;
                what it decided is the result's `resolved_speed`); `--grad-accum` packs per step.
                Since round 22 on an H200 at 1.5B@4096: 8 packs per micro batch (stage_mb8 below),
                with the next step's batches collated during the step before (stage_no_prefetch)
  stage_round16  what `auto` ran before round 20 (rounds 16 and 20's stage_defaults): the defaults
                with 2 packs per micro batch, loss_chunk_tokens 8192, async_micro_batches and
                lean_optimizer_step off pinned (2 packs: that rule's choice at 1.5B@4096 on a GPU;
                the smoke runs 2 packs on CPU too): beside stage_defaults, the gain in one run
  stage         the `sft` stage through pipeline.execute.run_stage with the settings it had before
                `auto` (ZeRO-0, bf16, eager layers, 1 pack a micro batch, loss chunks of 8192 tokens,
                no async micro batches nor lean optimizer step; the rest of the variants change one
                or more of these): attention `auto` (flash_attention_2 if flash-attn is
                installed, else flex_attention for packs), LM head + cross-entropy in chunks of 8192 tokens
  stage_flex    the stage with flex_attention (a document-masked FlexAttention kernel), chunked loss
  stage_before  the stage as it was before issue 19: sdpa, the whole micro batch's logits at once
  stage_z1, stage_z2  the stage under ZeRO-1 / ZeRO-2 instead of ZeRO-0 (DeepSpeed's ZeRO optimizer
                instead of its BF16_Optimizer; ZeRO-2 is the stage's default)
  stage_mixed, stage_mixed_z1  the stage with `precision: bf16-mixed` (fp32 weights, bf16
                autocast compute, the fused AdamW on the weights themselves), ZeRO-0 / ZeRO-1
  stage_mixed_compiled  stage_mixed with `compile_layers: true` (each decoder layer compiled)
  stage_mixed_compiled_mb2  the same with 2 packs per micro batch, half the micro batches per step
  *_eager_loss  the variant with the loss's chunk math eager (RING_COMPILE_LOSS=off; compiled on
                CUDA by default since round 10, stages/common/fused_loss.py)
Issue 36 item 4 (>= 50% MFU at 1.5B@4096 on one GPU): round 20 (one H200) measured the three
options below together (stage_mfu, 48.6% MFU vs 44.3% for round 16's defaults) and `auto` takes
them where they apply; each on its own is not measured yet: each is round 16's defaults
(stage_round16) plus one option, the same training as stage_defaults (MFU50_VARIANTS lists them
with plain, stage_defaults and stage_round16, the order they run in):
  stage_async   `async_micro_batches`: no device sync between a step's micro batches (DeepSpeed's
                throughput timer, pageable batch copies and transformers' packed-sequence check
                each synchronized once per micro batch or more)
  stage_lean_step  `lean_optimizer_step`: foreach gradient clipping, no one-rank all-reduce, one host
                sync a step (zero_stage 0 pinned: auto's choice on one GPU, and the smoke's path)
  stage_mb4     4 packs per micro batch, loss_chunk_tokens 16,384: one head chunk
  stage_mfu     the three together, pinned (round 20's row)
Round 22 (one H200): stage_defaults with the prefetch against
  stage_no_prefetch  the defaults with $RING_SFT_PREFETCH=off: each step's batches collated after
                the step before ended, while the GPU idles
  stage_mb8     8 packs per micro batch (one micro batch a step at --grad-accum 8), one head chunk of
                32,768 tokens, checkpointing pinned off (auto's choice on an H200 since round 22)
  stage_round20  4 packs per micro batch, the rest auto: auto's choice on an H200 before round 22
  Each stage variant's result has `same_training`: the largest relative difference of its per-step
  losses and gradient norms from stage_defaults' (same packs per step); the smoke fails above 1e-4
  (CPU, fp32, lr 1e-3 so that the updates move the losses):
    python benchmarks/sft_throughput.py --smoke --only tiny@256 --grad-accum 8 \
        --variants stage_defaults stage_round16 stage_mfu stage_async stage_lean_step stage_mb4
    timeout 550 python3 benchmarks/sft_throughput.py --out "$OUT" --only 1.5B@4096 --grad-accum 8 \
        --rows 6000 --variants plain stage_defaults stage_round16 stage_async stage_lean_step stage_mb4
With `--profile`, two more steps after the timed ones run under torch.profiler (the stage's
`profile` setting; the plain loop the same way; they are not in the rates): OUT/profile_<case>_
<variant>.txt is the operator table (key_averages by device time, top 40), the first place to
look for where a step goes. The learner profiles one more step of each variant the same way
(OUT/profile_learner-<shape>_<variant>.txt).
Gradient checkpointing is on for the 16k-token cases (plain and stage alike), off at 4096.
`--grad-accum K` (plain and stage alike) makes a step K micro batches and one optimizer step:
at micro batch 1 the optimizer (AdamW over every parameter, plus the stage's gradient clipping)
runs after every pack, a share of the step that a real SFT batch of many packs amortises.
The stage's rate is the median of its logged per-step tokens/s after `--skip` warm-up steps
(FlexAttention compiles in the first); its peak memory is torch.cuda.max_memory_allocated,
logged by the stage.

The learner case: stages/rl/learner.py `Learner.train` (theta_old pass + one update) with the
plain-torch backend (fused AdamW on bf16 weights, sdpa attention), 32 rollouts (prompts 256
tokens, responses 512-2048), the head in chunks of 2048 response tokens, on one model in one run:
  before           the learner as it was: collate's [B, T] padding mask passed to the model, which
                   HF turns into a dense 4D mask (SDPA cannot take its flash kernel)
  causal           no mask (rows are right-padded; `PolicyHead` drops it for causal model types)
  causal_compiled  no mask + every decoder layer compiled (stages/common/compile_layers.py, as
                   the RL stages' `compile_layers: true`; dynamic shapes), the first step compiles
  causal_loss, causal_compiled_loss  the same two with the head's chunk math (log-softmax,
                   gather, entropy) through torch.compile (stages/common/fused_loss.py: the default
                   on CUDA since round 10; the three variants above run it eagerly, as before)
(`--learner-variants` picks some.)
`--learner-shape 0.5B` (default) runs micro batches of 16384 padded tokens; `--learner-shape
1.5B` runs 12288: by arithmetic from the 0.5B run's 33.2 GiB peak at 16384 (benchmarks/RESULTS.md,
issue 19), activations are ~74 KB per token per layer at 0.5B, ~1.8x that per layer at 1.5B
(10 h + 4 ffn elements per token) and 28 layers: ~57 GiB at 16384 tokens, plus 11.5 GiB of bf16
weights, grads and AdamW state and ~2 GiB of head chunks, ~71 GiB of an H100's ~79; 12288 tokens
(~43 GiB of activations, ~57 GiB in all) leaves room for the allocator's fragmentation over
micro batches of changing shapes. A variant's rate is the median of 2 timed steps after one
warm-up step (which also compiles); its peak memory is torch.cuda.max_memory_allocated.
    timeout 480 python3 benchmarks/sft_throughput.py --out "$OUT" --only learner --learner-shape 1.5B

MFU = model FLOPs / s / the card's dense bf16 peak (from the device name: H100 SXM / H200
989e12, H100 PCIe 756e12, A100 312e12; unknown card: no MFU). Model FLOPs, forward + backward:
6 * N * T for the matmul weights (N = every parameter; the embedding is tied to the head, so
it counts once, as the head) plus 6 * L * d_attn * sum(s^2) for causal attention over the
spans that actually attend (s = each sample's length in the stage, the whole row in the plain
loop; d_attn = heads * head_dim). Recomputation (gradient checkpointing, the chunked loss's
head) is not counted. The learner: its theta_old forward is 2/6 of that, its head runs on
response tokens only.

Results: OUT/sft_throughput.json, rewritten after every measurement (a run cut short keeps
what it finished); progress lines with timestamps on stdout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._record import SAFE_ENV, ResultFile, device_name, log, versions  # noqa: E402 - needs ROOT on sys.path
from stages.common.compile_layers import BACKEND_ENV  # noqa: E402
from stages.common.step_profile import StepProfiler  # noqa: E402

os.environ.update(SAFE_ENV)  # this process and every one it starts

SHAPES = {  # Qwen2 configs (tied embeddings); the real vocabulary, a small one for the CPU smoke
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=2048),
}
CASES = ["1.5B@4096", "learner", "0.5B@4096", "0.5B@16384", "1.5B@16384"]
SMOKE_CASES = ["tiny@256", "learner"]
TOKENS = object()  # stands for the micro batch's tokens in VARIANTS
VARIANTS = {  # the sft stage's config per variant
    # the headline: no speed setting given, every `auto` decided by the stage for this GPU, model,
    # sequence length and GPU count (stages/common/speed_defaults.py); grad_accum = packs per step
    "stage_defaults": {"_defaults": True},
    # what `auto` ran before round 20 (rounds 16 and 20's stage_defaults): 2 packs pinned, that rule's
    # choice at 1.5B@4096 on a GPU; next to stage_defaults it shows round 20's gain in one run
    "stage_round16": {"_defaults": True, "micro_batch_size": 2, "loss_chunk_tokens": 8192,
                      "async_micro_batches": False, "lean_optimizer_step": False},
    # the others pin what the stage ran before `auto` (ZeRO-0, precision bf16 on GPU, eager layers,
    # 1 pack a micro batch, run_stage_variant's `pinned`) and change one thing each
    "stage": {},
    "stage_flex": {"attn_implementation": "flex_attention"},
    "stage_before": {"attn_implementation": "sdpa", "loss_chunk_tokens": TOKENS},
    # DeepSpeed's optimizer path on one GPU: ZeRO-0 + bf16 runs BF16_Optimizer (fp32 master
    # weights, per-micro-batch fp32 gradient accumulation); ZeRO-1/2 run DeepSpeedZeroOptimizer
    # (flat fp32 partitions, bucketed gradient reduction); 2 is the stage's own default
    "stage_z1": {"zero_stage": 1},
    "stage_z2": {"zero_stage": 2},
    # precision bf16-mixed: fp32 weights stepped by the fused AdamW itself, bf16 compute under
    # torch.autocast; no optimizer wrapper copying between bf16 weights and fp32 masters
    "stage_mixed": {"precision": "bf16-mixed"},
    "stage_mixed_z1": {"precision": "bf16-mixed", "zero_stage": 1},
    # and every decoder layer through torch.compile (the step is host-bound at micro batch 1)
    "stage_mixed_compiled": {"precision": "bf16-mixed", "compile_layers": True},
    # the same with the loss's chunk math eager (as before it was compiled on CUDA: fused_loss.py)
    "stage_mixed_compiled_eager_loss": {"precision": "bf16-mixed", "compile_layers": True,
                                        "_env": {"RING_COMPILE_LOSS": "off"}},
    "stage_compiled": {"compile_layers": True},  # DeepSpeed's bf16 optimizer, ZeRO-0, compiled layers
    # two packs per micro batch (half the micro batches per optimizer step: the same tokens
    # per step): half the per-micro-batch costs (autocast weight casts, launches) per token
    "stage_mixed_compiled_mb2": {"precision": "bf16-mixed", "compile_layers": True, "micro_batch_size": 2},
    # four packs per micro batch, the loss over the whole micro batch at once (one head chunk)
    "stage_mixed_compiled_mb4": {"precision": "bf16-mixed", "compile_layers": True, "micro_batch_size": 4,
                                 "loss_chunk_tokens": 16384},
    "stage_mixed_compiled_mb2_eager_loss": {"precision": "bf16-mixed", "compile_layers": True, "micro_batch_size": 2,
                                            "_env": {"RING_COMPILE_LOSS": "off"}},
    # issue 36 item 4 (>= 50% MFU at 1.5B@4096 on one GPU): round 20's options, each alone on top of
    # round 16's defaults (measured only together so far), each the same training as stage_defaults
    # (its per-step losses are compared: `same_training`)
    # no device sync between micro batches (DeepSpeed's throughput timer synchronizes at every forward
    # and engine step, pageable copies and transformers' packed-sequence check wait for the GPU)
    "stage_async": {"_defaults": True, "micro_batch_size": 2, "loss_chunk_tokens": 8192,
                    "async_micro_batches": True, "lean_optimizer_step": False},
    # the optimizer step without DeepSpeed's per-parameter clip and one-rank all-reduce, one host sync
    # a step; zero_stage 0 pinned: what auto picks on one GPU, and the CPU smoke then takes this path too
    "stage_lean_step": {"_defaults": True, "zero_stage": 0, "micro_batch_size": 2, "loss_chunk_tokens": 8192,
                        "async_micro_batches": False, "lean_optimizer_step": True},
    # 4 packs per micro batch (an H200's memory), the loss over them in one head chunk: half the micro
    # batches, so half the per-micro-batch weight casts, gradient casts and launches
    "stage_mb4": {"_defaults": True, "micro_batch_size": 4, "loss_chunk_tokens": 16384,
                  "async_micro_batches": False, "lean_optimizer_step": False},
    # the defaults without the prefetch of each step's host batches during the step before (the
    # collate's Python then runs while the GPU idles between steps): the A/B of that prefetch
    "stage_no_prefetch": {"_defaults": True, "_env": {"RING_SFT_PREFETCH": "off"}},
    # 8 packs per micro batch (one micro batch a step at --grad-accum 8), the loss in one head chunk:
    # no gradient accumulation add and half of stage_mb4's weight casts. Checkpointing pinned off:
    # left to auto (its memory estimate over an H200's budget) it turned on and cost 20% (round 22)
    "stage_mb8": {"_defaults": True, "micro_batch_size": 8, "loss_chunk_tokens": 32768,
                  "gradient_checkpointing": False},
    # 4 packs per micro batch, the rest auto: round 20's stage_mfu, auto's choice on an H200 before round 22
    "stage_round20": {"_defaults": True, "micro_batch_size": 4, "loss_chunk_tokens": 16384},
    # the three together, pinned: round 20's row (auto's choice on an H200 since then)
    "stage_mfu": {"_defaults": True, "zero_stage": 0, "micro_batch_size": 4, "loss_chunk_tokens": 16384,
                  "async_micro_batches": True, "lean_optimizer_step": True},
}
MFU50_VARIANTS = ["plain", "stage_defaults", "stage_round16", "stage_async", "stage_lean_step", "stage_mb4",
                  "stage_mfu"]
# LoRA twins (issue 35): every stage variant as `<variant>_lora`, training rank-16 adapters on
# every projection (the `lora:` block's defaults) instead of every weight; `--lora` adds the twin
# of each variant it runs, the learner's too
LORA = {"rank": 16, "alpha": 32}
VARIANTS.update({f"{name}_lora": {**v, "lora": LORA} for name, v in list(VARIANTS.items())})
DEFAULT_VARIANTS = {"1.5B@4096": ["plain", "stage_defaults", "stage", "stage_mixed_compiled_mb2"]}
PROFILED_STEPS = 2  # with --profile, after the timed steps
PEAK_BF16 = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12)]


def peak_flops(device_name: str) -> float | None:
    return next((f for name, f in PEAK_BF16 if name in device_name), None)


def model_numbers(shape: str) -> dict:
    s = SHAPES[shape]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    return {"layers": s["num_hidden_layers"], "d_attn": s["num_attention_heads"] * head_dim,
            "head_params": s["vocab_size"] * s["hidden_size"]}


def mfu(flops_per_s: float, peak: float | None) -> float | None:
    return None if peak is None else flops_per_s / peak


# -- set-up: data, tokenizer, model dirs -----------------------------------------------------------
def prepare(args, work: Path) -> tuple[Path, Path]:
    """(sft rows file, tokenizer dir), made by the project's own stages."""
    from data_curation.urls import local_path
    from pipeline.execute import run_stage

    kw = dict(storage=f"file://{work}/store", work_root=work / "runs", launcher="local")
    data = run_stage("synthetic_data", {"files": {"sft.jsonl": {
        "generator": "arithmetic_cot", "n": args.rows, "seed": 0, "params": {"max_digits": 3}}}},
        stage="data", **kw)
    base = run_stage("init_model", {
        "architecture": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 1,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                         "max_position_embeddings": 1024},
        "tokenizer": {"corpus": ["${stages.data.output}/sft.jsonl"], "vocab_size": 512}},
        stage="tokenizer", upstream={"data": data.url}, **kw)
    return Path(local_path(data.url)) / "sft.jsonl", Path(local_path(base.url))


def model_dir(shape: str, tokenizer_dir: Path | None, root: Path, device: str) -> Path:
    """A random-init model of `shape` (bf16 on GPU), with the chat tokenizer when given, built once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    path = root / f"model-{shape}"
    if (path / "config.json").exists():
        return path
    tok = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir is not None else None
    cfg = Qwen2Config(max_position_embeddings=32768, tie_word_embeddings=True, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    del model
    return path


def packs_of(rows_file: Path, tokenizer_dir: Path, tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """The stage's own samples and packs for these rows (stages/sft/data.py, seed 0): per pack,
    its token ids and its samples' lengths."""
    from transformers import AutoTokenizer

    from stages.common.rows import input_rows
    from stages.sft.config import SFTData
    from stages.sft.data import build_samples, pack_samples

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = input_rows(Path, str(rows_file), "sft data", keep_bad=True)
    samples, _ = build_samples(rows, tok, tokens, "fail", SFTData(path=str(rows_file)))
    packs = pack_samples([len(s) for s in samples], tokens, 0, True)
    ids = [[t for i in p for t in samples[i].input_ids] for p in packs]
    return ids, [[len(samples[i]) for i in p] for p in packs]


# -- SFT variants ------------------------------------------------------------------------------------
def run_plain(path: Path, shape: str, pack_ids: list[list[int]], tokens: int, ckpt: bool, args, device: str,
              peak: float | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    profiler = StepProfiler(profile_settings(args), args.work / "plain_profile", active=True)
    stream = [t for p in pack_ids for t in p]
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    k = args.grad_accum
    for step in range(args.total_steps):
        batches = []
        for micro in range(k):
            start = ((step * k + micro) * tokens) % max(1, len(stream) - tokens)
            batches.append(torch.tensor([stream[start:start + tokens]], device=device))
        profiler.before(step + 1)
        sync(device)
        t0 = time.perf_counter()
        for ids in batches:  # one optimizer step per k micro batches, as the stage's grad_accum
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss / k
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if args.skip <= step < args.skip + args.steps:
            times.append(time.perf_counter() - t0)
        profiler.after(step + 1, last=step + 1 == args.total_steps)
    dt = statistics.median(times)
    n = sum(p.numel() for p in model.parameters())
    m = model_numbers(shape)
    flops = k * (6 * n * tokens + 6 * m["layers"] * m["d_attn"] * tokens ** 2)
    out = {"tokens_per_s": k * tokens / dt, "step_seconds": dt, "params": n, "gradient_checkpointing": ckpt,
           "grad_accum": k,
           "flops_per_step": flops, "mfu": mfu(flops / dt, peak),
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None}
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def stage_config(variant: str, path: Path, rows_file: Path, tokens: int, ckpt: bool, args,
                 gpu: bool) -> tuple[dict, dict[str, str]]:
    """The sft config a stage variant runs (the packs per optimizer step `--grad-accum` whatever its
    micro batch), and the environment its processes get."""
    overrides = {k: tokens if v is TOKENS else v for k, v in VARIANTS[variant].items()}
    env = overrides.pop("_env", {})  # for the stage's processes (they inherit ours)
    packs_per_micro = overrides.get("micro_batch_size", 1)  # tokens per optimizer step held equal
    pinned = {} if overrides.pop("_defaults", False) else {  # what the stage ran before `auto`
        "micro_batch_size": 1, "zero_stage": 0, "gradient_checkpointing": ckpt, "compile_layers": False,
        "precision": "bf16" if gpu else "fp32", "loss_chunk_tokens": 8192, "async_micro_batches": False,
        "lean_optimizer_step": False}
    config = {"model": str(path), "data": str(rows_file), "max_seq_len": tokens,
              "grad_accum": max(1, args.grad_accum // packs_per_micro), "max_steps": args.total_steps,
              # the smoke's larger lr: updates that move its losses, so the same-training check sees them
              "warmup_steps": 1, "lr": 1e-3 if args.smoke else 1e-5, "checkpoint_every": 10 ** 6, "log_every": 1,
              **pinned, **overrides}
    if args.profile:
        config["profile"] = profile_settings(args).model_dump()
    return config, env


def run_stage_variant(variant: str, path: Path, rows_file: Path, shape: str, tokens: int, ckpt: bool,
                      pack_lengths: list[list[int]], args, work: Path, gpu: bool, peak: float | None) -> dict:
    from data_curation.urls import local_path
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    config, env = stage_config(variant, path, rows_file, tokens, ckpt, args, gpu)
    res = Resources(gpus_per_node=1) if gpu else Resources(cpu_ranks=1)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run = run_stage("sft", config, stage=f"sft-{shape}-{tokens}-{variant}", storage=f"file://{work}/store",
                        work_root=work / "runs", launcher="deepspeed" if gpu else "local", resources=res)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    out_dir = Path(local_path(run.url))
    steps = [json.loads(line.split("[metrics] ", 1)[1])  # the stage's per-step metrics lines
             for line in (out_dir / "logs" / "stage.log").read_text().splitlines() if "[metrics] " in line]
    timed = [m for m in steps if args.skip < m["step"] <= args.skip + args.steps]
    rate = statistics.median(m["tokens_per_s"] for m in timed)
    n = _param_count(path)
    m = model_numbers(shape)
    # per token of the stage's data: the attention spans are the samples (document mask)
    toks = sum(sum(p) for p in pack_lengths)
    attn_per_token = 6 * m["layers"] * m["d_attn"] * sum(s * s for p in pack_lengths for s in p) / toks
    # LoRA: the frozen weights get no weight gradients (4 * N, not 6 * N); adapters not counted
    flops_per_token = (4 if "lora" in config else 6) * n + attn_per_token
    peaks = [m["peak_memory_gib"] for m in steps if "peak_memory_gib" in m]
    speed = json.loads((out_dir / "manifest.json").read_text()).get("resolved_speed") or {}
    if args.profile:
        keep_profile(out_dir / "logs" / "profile", args, f"{shape}@{tokens}", variant)
    shutil.rmtree(out_dir, ignore_errors=True)  # the trained model: GBs of disk not needed
    settled = {**config, **(speed.get("config_updates") or {})}
    micro = settled.get("micro_batch_size", 1)
    return {"loss_by_step": [m["loss"] for m in steps], "grad_norm_by_step": [m["grad_norm"] for m in steps],
            "packs_per_step": (micro if isinstance(micro, int) else 1) * settled["grad_accum"],
            "tokens_per_s": rate, "tokens_per_s_by_step": [round(m["tokens_per_s"]) for m in steps],
            "params": n, "config": config, "resolved_speed": speed.get("config_updates"),
            "gradient_checkpointing": {**config, **(speed.get("config_updates") or {})}["gradient_checkpointing"],
            "attn_implementation": run.summary.get("attn_implementation") if run.summary else None,
            "flops_per_token": flops_per_token, "mfu": mfu(flops_per_token * rate, peak),
            "peak_memory_gib": max(peaks) if peaks else None, "stage_seconds": run.seconds}


SAME_TRAINING_BASE = "stage_defaults"
SMOKE_LOSS_RTOL = 1e-4  # fp32 on CPU: rounding only (clip order, ZeRO-2's flat buffers vs ZeRO-0)


def same_training(case: dict) -> dict[str, dict]:
    """Per stage variant that ran beside stage_defaults with the same packs per optimizer step (so
    the same data in each step), the largest relative difference of its per-step losses and gradient
    norms from stage_defaults': a speed option must train the same model (to float rounding; on a
    GPU bf16 and nondeterministic kernels add their own)."""
    base = case.get(SAME_TRAINING_BASE) or {}
    out = {}
    for variant, r in case.items():
        if variant in ("plain", SAME_TRAINING_BASE) or "loss_by_step" not in r or "loss_by_step" not in base:
            continue
        if r["packs_per_step"] != base["packs_per_step"]:
            out[variant] = {"vs": SAME_TRAINING_BASE, "comparable": False,
                            "why": f"{r['packs_per_step']} packs per step vs {base['packs_per_step']}"}
            continue
        out[variant] = {"vs": SAME_TRAINING_BASE, "comparable": True, "steps": len(r["loss_by_step"]),
                        **{f"max_rel_{key}_diff": _max_rel_diff(r[f"{key}_by_step"], base[f"{key}_by_step"])
                           for key in ("loss", "grad_norm")}}
    return out


def _max_rel_diff(got: list[float], want: list[float]) -> float:
    if len(got) != len(want):
        return math.inf
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))


def profile_settings(args):
    """The profiled window: the steps after the timed ones (profiling slows a step), or none
    without --profile."""
    from stages.common.step_profile import ProfileSettings

    start = args.skip + args.steps + 1
    return ProfileSettings(start_step=start, steps=args.total_steps - start + 1) if args.profile else None


def keep_profile(profile_dir: Path, args, case: str, variant: str) -> None:
    """Copy a run's operator table into OUT, and the GPU's idle gaps read from its chrome trace
    (benchmarks/trace_gaps.py; the trace itself stays behind: it is large)."""
    from benchmarks.trace_gaps import summarize

    table, trace = profile_dir / "profile_table.txt", profile_dir / "profile_trace.json"
    name = f"{case}_{variant}".replace("@", "_at_")  # a device call brings back only [A-Za-z0-9._-] names
    if table.is_file():
        shutil.copy(table, args.out / f"profile_{name}.txt")
        log(f"{case} {variant}: profile table {args.out / f'profile_{name}.txt'}")
    else:
        log(f"{case} {variant}: no profile table in {profile_dir}")
    if trace.is_file():
        gaps = args.out / f"profile_gaps_{name}.txt"
        gaps.write_text(summarize(trace, top=25, min_gap_us=200.0) + "\n")
        log(f"{case} {variant}: GPU idle gaps {gaps}")


def _param_count(path: Path) -> int:
    """Parameters of a model dir without building it (tied head counted once)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n += math.prod(st.get_slice(k).get_shape())
    return n


# -- the RL learner ------------------------------------------------------------------------------------
@dataclass
class LearnerSample:
    """What Learner.train reads of a rollout."""

    prompt_ids: list[int]
    response_ids: list[int]
    infer_logprobs: list[float]
    advantage: float

    def token_versions(self) -> list[int]:
        return [0] * len(self.response_ids)


LEARNER_VARIANTS = {  # PolicyHead's padding mask, decoder layers compiled, the head's math compiled
    "before": {"keep_padding_mask": True, "compiled": False, "loss": "off"},     # the learner before: HF's 4D mask
    "causal": {"keep_padding_mask": False, "compiled": False, "loss": "off"},    # no mask: SDPA is_causal (flash)
    "causal_compiled": {"keep_padding_mask": False, "compiled": True, "loss": "off"},  # and compile_layers
    # the chunk math of the head (stages/common/fused_loss.py) compiled: the default on CUDA
    "causal_loss": {"keep_padding_mask": False, "compiled": False, "loss": "auto"},
    "causal_compiled_loss": {"keep_padding_mask": False, "compiled": True, "loss": "auto"},
}
FULL_LEARNER_VARIANTS = list(LEARNER_VARIANTS)  # what runs by default; `--lora` adds their twins
LEARNER_VARIANTS.update({f"{name}_lora": {**v, "lora": True} for name, v in list(LEARNER_VARIANTS.items())})
LEARNER_MICRO_TOKENS = {"0.5B": 16384, "1.5B": 12288, "tiny": 256}  # module docstring: why 12288


def run_learner(path: Path, shape: str, args, device: str, peak: float | None) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from stages.common.compile_layers import compile_decoder_layers
    from stages.common.fused_loss import LOSS_COMPILE_ENV
    from stages.rl.learner import Learner, LearnerConfig, PolicyHead, TorchBackend
    from stages.rl.loss import LossConfig

    g = torch.Generator().manual_seed(0)
    n_roll, prompt, (lo, hi) = args.learner_batch
    mb_tokens, chunk = LEARNER_MICRO_TOKENS[shape], 2048 if device == "cuda" else 64
    samples = []
    for i in range(n_roll):
        r = int(torch.randint(lo, hi + 1, (1,), generator=g))
        samples.append(LearnerSample(torch.randint(3, 500, (prompt,), generator=g).tolist(),
                                     torch.randint(3, 500, (r,), generator=g).tolist(),
                                     [-1.0] * r, float(i % 2) - 0.5))
    all_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    resp_tokens = sum(len(s.response_ids) for s in samples)
    m = model_numbers(shape)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = {"shape": shape, "rollouts": n_roll, "tokens": all_tokens, "response_tokens": resp_tokens,
           "micro_batch_tokens": mb_tokens, "logit_chunk": chunk}
    for variant in args.learner_variants:
        how = LEARNER_VARIANTS[variant]
        model = opt = learner = head = None
        os.environ[LOSS_COMPILE_ENV] = how["loss"]
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
            model.config.use_cache = False
            n = sum(p.numel() for p in model.parameters())
            body = n - m["head_params"]
            if how.get("lora"):  # as build_policy does with `lora:` (the optimizer: adapters only)
                from stages.common.lora import apply_lora
                from stages.common.training_settings import LoraSettings

                apply_lora(model, LoraSettings(**LORA))
            if how["compiled"]:  # as stages/rl/policy.py build_policy does with compile_layers
                torch._dynamo.reset()
                counters.clear()
                compile_decoder_layers(model, shape, dynamic=True)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6,
                                    fused=device == "cuda")
            head = PolicyHead(model, keep_padding_mask=how["keep_padding_mask"])
            learner = Learner(TorchBackend(head, opt, grad_clip=1.0),
                              LearnerConfig(loss=LossConfig(correction="icepop"), pad_id=0,
                                            micro_batch_tokens=mb_tokens, logit_chunk=chunk))
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(1 + args.learner_steps):  # the first: warm-up (and compiles)
                sync(device)
                t0 = time.perf_counter()
                learner.train(samples, version=0)
                sync(device)
                times.append(time.perf_counter() - t0)
            dt = statistics.median(times[1:])
            # theta_old forward (2/8) + update forward and backward (6/8); the head on responses only.
            # LoRA: no weight gradients of the frozen matrices (2 of the 8 go), adapters not counted
            weights = 6 if how.get("lora") else 8
            flops = (weights * body * all_tokens + 8 * m["head_params"] * resp_tokens
                     + 8 * m["layers"] * m["d_attn"] * sum((len(s.prompt_ids) + len(s.response_ids)) ** 2
                                                           for s in samples))
            out[variant] = {**how, "step_seconds": dt, "first_step_seconds": times[0],
                            "tokens_per_s": all_tokens / dt, "mfu": mfu(flops / dt, peak),
                            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else None}
            if how["compiled"]:
                out[variant]["compiled_graphs"] = counters["stats"]["unique_graphs"]
            if args.profile:  # one more step, untimed, under torch.profiler: where the step goes
                from stages.common.step_profile import ProfileSettings

                where = args.work / f"learner_profile_{variant}"
                profiler = StepProfiler(ProfileSettings(start_step=1, steps=1), where, active=True)
                profiler.before(1)
                learner.train(samples, version=0)
                profiler.after(1, last=True)
                keep_profile(where, args, f"learner-{shape}", variant)
            log(f"learner {shape} {variant}: {all_tokens / dt:,.0f} tok/s, step {dt:.2f}s (first {times[0]:.1f}s), "
                f"MFU {fmt(out[variant]['mfu'])}")
        except Exception as e:  # noqa: BLE001 - a failed variant is a result (OOM, ...), the run goes on
            out[variant] = {**how, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
            log(f"learner {shape} {variant} FAILED: {out[variant]['error'][:300]}")
        finally:
            model = opt = learner = head = None
            if device == "cuda":
                torch.cuda.empty_cache()
    os.environ.pop(LOSS_COMPILE_ENV, None)
    return out


# -- driver ----------------------------------------------------------------------------------------------
def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 2 steps: checks the orchestration")
    p.add_argument("--only", nargs="*", help=f"cases to run (default: {' '.join(CASES)})")
    p.add_argument("--variants", nargs="*", help="SFT variants for every case (default: plain stage_flex "
                                                 "stage_before; 1.5B@4096 also stage)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per SFT variant (default 8, smoke 2)")
    p.add_argument("--skip", type=int, default=None, help="warm-up steps not timed (default 3, smoke 1)")
    p.add_argument("--rows", type=int, default=None, help="synthetic CoT rows (default 3000, smoke 300)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro batches per optimizer step, plain loop and stage alike (default 1: the "
                        "optimizer steps after every pack)")
    p.add_argument("--learner-variants", nargs="*", default=FULL_LEARNER_VARIANTS, choices=list(LEARNER_VARIANTS),
                   help="the learner case's variants (default: all)")
    p.add_argument("--learner-shape", choices=["0.5B", "1.5B"], default="0.5B",
                   help="the learner case's model shape (the smoke: tiny)")
    p.add_argument("--lora", action="store_true",
                   help="also run the LoRA twin (`<variant>_lora`, rank 16 on every projection) of every SFT "
                        "and learner variant run: memory and tokens/s of LoRA next to full training")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over two more steps after the timed ones of every SFT variant: "
                        "OUT/profile_<case>_<variant>.txt")
    a = p.parse_args(argv)
    if a.variants:
        unknown = sorted(set(a.variants) - set(VARIANTS) - {"plain"})
        if unknown:
            p.error(f"unknown --variants {unknown}; known: plain {' '.join(VARIANTS)}")
    if a.lora:
        a.learner_variants = [*a.learner_variants, *(f"{v}_lora" for v in a.learner_variants
                                                     if not v.endswith("_lora"))]
    a.steps = a.steps or (2 if a.smoke else 8)
    a.skip = a.skip if a.skip is not None else (1 if a.smoke else 3)
    a.rows = a.rows or (300 if a.smoke else 3000)
    a.total_steps = a.skip + a.steps + (PROFILED_STEPS if a.profile else 0)
    a.learner_steps = 1 if a.smoke else 2
    # rollouts, prompt tokens, (min, max) response tokens
    a.learner_batch = (4, 16, (16, 48)) if a.smoke else (32, 256, (512, 2048))
    return a


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    if args.smoke:  # inductor's C++ build of CPU graphs takes minutes here; the same graphs, traced
        os.environ.setdefault(BACKEND_ENV, "aot_eager")
    gpu = torch.cuda.is_available() and not args.smoke
    device = "cuda" if gpu else "cpu"
    name = device_name(gpu)
    peak = peak_flops(name) if gpu else None
    args.out.mkdir(parents=True, exist_ok=True)
    results = ResultFile(args.out / "sft_throughput.json", {
        "device": name, "peak_bf16_flops": peak, **versions(), "smoke": args.smoke, "steps": args.steps,
        "skip": args.skip, "profiled_steps": args.total_steps - args.skip - args.steps,
        "mfu_formula": "(6*N*T + 6*L*d_attn*sum(s^2)) / s / peak; learner: 8*N_body*T + 8*N_head*T_resp + "
                       "8*L*d_attn*sum(s^2); recomputation not counted",
        "cases": {}})
    results.write()
    cases = args.only or (SMOKE_CASES if args.smoke else CASES)
    log(f"device {name}, peak {peak}, cases {cases}, out {args.out}")
    failed: list[str] = []  # the smoke's same-training checks that failed
    with tempfile.TemporaryDirectory(prefix="sft_throughput_") as tmp:
        work = args.work = Path(tmp)
        rows_file = tokenizer_dir = None
        for case in cases:
            if case == "learner":  # random token ids: no data, no tokenizer
                shape = "tiny" if args.smoke else args.learner_shape
                try:
                    path = model_dir(shape, None, work, device)
                    results.put("cases", "learner", shape, result=run_learner(path, shape, args, device, peak))
                    shutil.rmtree(path, ignore_errors=True)  # it has no tokenizer: no SFT case may reuse it
                except Exception as e:  # noqa: BLE001
                    results.put("cases", "learner", shape, result={"error": f"{type(e).__name__}: {e}"})
                    log(f"learner FAILED: {traceback.format_exc()[-1500:]}")
                continue
            if rows_file is None:
                rows_file, tokenizer_dir = prepare(args, work)
                log(f"data and tokenizer ready: {rows_file}")
            shape, tokens = case.split("@")
            tokens = int(tokens)
            ckpt = tokens > 4096
            path = model_dir(shape, tokenizer_dir, work, device)
            pack_ids, pack_lengths = packs_of(rows_file, tokenizer_dir, tokens)
            variants = args.variants or DEFAULT_VARIANTS.get(
                case, ["plain", "stage_defaults", "stage"] if args.smoke else ["plain", "stage_defaults", "stage_flex"])
            if args.lora:
                variants = [*variants, *(f"{v}_lora" for v in variants if f"{v}_lora" in VARIANTS)]
            for variant in variants:
                log(f"{case} {variant}: start")
                try:
                    if variant == "plain":
                        r = run_plain(path, shape, pack_ids, tokens, ckpt, args, device, peak)
                        if args.profile:
                            keep_profile(work / "plain_profile", args, case, variant)
                    else:
                        r = run_stage_variant(variant, path, rows_file, shape, tokens, ckpt, pack_lengths, args,
                                              work, gpu, peak)
                    log(f"{case} {variant}: {r['tokens_per_s']:,.0f} tok/s, MFU {fmt(r['mfu'])}, "
                        f"peak {r['peak_memory_gib'] or 0:.1f} GiB")
                except Exception as e:  # noqa: BLE001 - a failed variant is a result; the run goes on
                    r = {"error": f"{type(e).__name__}: {str(e)[-3000:]}"}
                    log(f"{case} {variant} FAILED: {traceback.format_exc()[-3000:]}")
                results.put("cases", case, variant, result=r)
            for variant, check in same_training(results.data["cases"][case]).items():
                results.put("cases", case, variant, "same_training", result=check)
                log(f"{case} {variant}: same training as {SAME_TRAINING_BASE}: {check}")
                worst = max(check.get("max_rel_loss_diff", 0), check.get("max_rel_grad_norm_diff", 0))
                if args.smoke and check["comparable"] and not worst <= SMOKE_LOSS_RTOL:
                    failed.append(f"{case} {variant}: losses or gradient norms differ from {SAME_TRAINING_BASE}'s "
                                  f"by {worst:.2e} (relative; at most {SMOKE_LOSS_RTOL})")
            shutil.rmtree(path, ignore_errors=True)
    log(f"done: {results.path}")
    for line in failed:
        log(f"NOT THE SAME TRAINING: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

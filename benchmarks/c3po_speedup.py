"""C3PO++ vs synchronous rollouts in one run, and IcePop's loss-step overhead vs plain GRPO.

Both schedulers drive the same rollout engine (torch engine by default) and the same policy
update (stages/rl/learner.py with a plain torch AdamW: no DeepSpeed, MLflow or
Prefect needed), starting from the same random-init weights, on the same prompts.

Fairness of the comparison (what is held equal, and why):
- Lengths: a random-init model has no natural stopping point, so EOS is switched off in the
  engine and every rollout's response length is drawn from one long-tailed distribution
  (log-normal, median --median-len, sigma --len-sigma, capped at --max-len): the n-th
  rollout either scheduler starts gets the same length (seeded by n). Both modes therefore
  decode i.i.d. lengths from the same tail; what differs is only how they schedule them.
- Hardware: one engine, same `max_batch` decode slots, same CUDA graphs (one untimed
  warm-up step per mode captures them), same model and optimizer settings.
- Work per step: sync trains on --prompts x --group rollouts; C3PO++'s token budget Phi is
  the expected tokens of that batch (prompts x group x E[length]), so both update on the
  same number of tokens on average. The report also gives seconds per 1k trained tokens,
  which does not depend on that equality.
- C3PO++ sizes: Omega = --pool-factor x max_batch (queued rollouts refill freed decode
  slots inside an engine call), sigma = --retention (default: enough partitions for a
  rollout at the cap to finish). Purged rollouts are reported.
- Reward: a verifiable token-level reward (the share of response tokens whose id is a
  multiple of 4) that a random-init policy can learn; "reward after N steps" shows both
  modes learn at the same rate (the paper's "same reward curve").

Reported per mode (means over the timed steps): rollout-phase seconds per step (engine
calls only), end-to-end seconds per step (rollout + update + weight sync), generated
tokens/s, engine idle fraction (decode slots left empty: 1 - decode tokens / (decode steps
x max_batch), from the engine's counters via the scheduler; and the time share of the step
the engine is not generating),
trained tokens per step, reward; the speedups sync / C3PO++. Then IcePop's overhead: the
learner step (theta_old pass + update) and the bare loss (forward + backward of
`policy_loss`) with correction icepop vs none, alternated, medians.

    python benchmarks/c3po_speedup.py --device cuda --out /tmp/c3po.json        # one H200
    python benchmarks/c3po_speedup.py --preset tiny --device cpu                 # smoke
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from stages.rl.engines import ENGINES, SamplingParams  # noqa: E402
from stages.rl.learner import Learner, LearnerConfig, TorchBackend  # noqa: E402
from stages.rl.loss import LossConfig, policy_loss  # noqa: E402
from stages.rl.prompt_sampler import PromptSampler  # noqa: E402
from stages.rl.rollout_records import SchedulerConfig  # noqa: E402
from stages.rl.scheduler import make_scheduler  # noqa: E402

PRESETS = {
    # ~170M-parameter Qwen2 shape, 2k-token cap: a few minutes on one H200
    "h200": dict(hidden=1024, layers=12, heads=16, kv_heads=4, intermediate=2816, vocab=32768,
                 prompts=16, group=8, max_batch=128, max_len=2048, median_len=256, len_sigma=1.0,
                 prompt_len=(32, 128), steps=5, warmup=1, micro_tokens=32768, lr=1e-5, overhead_reps=5),
    # a CPU smoke run: proves the code path, numbers mean little
    "tiny": dict(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=256,
                 prompts=4, group=4, max_batch=16, max_len=48, median_len=8, len_sigma=1.0,
                 prompt_len=(4, 12), steps=2, warmup=1, micro_tokens=2048, lr=1e-3, overhead_reps=2),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--engine", default="torch")
    p.add_argument("--model", default=None, help="HF model dir (default: random-init Qwen2 of the preset)")
    for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "prompts", "group", "max_batch",
              "max_len", "median_len", "steps", "warmup", "micro_tokens", "overhead_reps"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    p.add_argument("--len-sigma", type=float, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--pool-factor", type=float, default=2.0, help="Omega = pool_factor x max_batch")
    p.add_argument("--retention", type=int, default=None, help="sigma (default: cap / E[len] + 1)")
    p.add_argument("--budget", type=int, default=None, help="Phi (default: prompts x group x E[len])")
    p.add_argument("--modes", default="sync,c3po")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--out", default=None, help="write the full results as JSON here")
    p.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="torch.backends.cuda.enable_cudnn_sdp(False): SDPA (the engine's prefill, the "
                        "learner) never takes cuDNN's kernel, whose plans are built per new shape")
    a = p.parse_args()
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    return a


def sync_dev(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the workload --------------------------------------------------------------------------------
def length_of(seed: int, n: int, median: int, sigma: float, cap: int) -> int:
    """The response length of the n-th rollout started (same for both schedulers)."""
    z = random.Random(f"len/{seed}/{n}").gauss(0.0, 1.0)
    return max(1, min(cap, int(round(median * math.exp(sigma * z)))))


def expected_length(a) -> float:
    return statistics.fmean(length_of(a.seed + 1, n, a.median_len, a.len_sigma, a.max_len) for n in range(20000))


def token_reward(rows, texts, groups):
    """Share of response tokens whose id is a multiple of 4 (texts are space-joined ids)."""
    out = []
    for t in texts:
        ids = [int(x) for x in t.split()]
        out.append(SimpleNamespace(score=sum(i % 4 == 0 for i in ids) / max(1, len(ids)), reason="token share"))
    return out


def build_model_dir(a, root: Path) -> Path:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      intermediate_size=a.intermediate, max_position_embeddings=a.max_len + a.prompt_len[1] + 8,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(a.seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0)
    path = root / "model"
    model.save_pretrained(path)
    return path


# -- one mode --------------------------------------------------------------------------------------
def run_mode(mode: str, a, engine, init_state, policy, device, rows, prompt_ids, phi, sigma):
    policy.load_state_dict(init_state)
    engine.update_weights(policy.named_parameters())
    opt = torch.optim.AdamW(policy.parameters(), lr=a.lr, betas=(0.9, 0.999), weight_decay=0.01)
    learner = Learner(TorchBackend(policy, opt, grad_clip=1.0),
                      LearnerConfig(loss=LossConfig(correction="icepop"), pad_id=0, temperature=1.0,
                                    micro_batch_tokens=a.micro_tokens, logit_chunk=2048))
    omega = max(a.group, int(a.pool_factor * a.max_batch))
    cfg = SchedulerConfig(rollouts_per_prompt=a.group, max_new_tokens=a.max_len, prompts_per_step=a.prompts,
                          pool_capacity=omega, token_budget=phi, retention_limit=sigma)
    sampler = PromptSampler({"synthetic": list(range(len(rows)))}, None, seed=a.seed)
    sched = make_scheduler(mode, engine, cfg, rows, prompt_ids, sampler, SamplingParams(seed=a.seed),
                           lambda ids: " ".join(map(str, ids)), token_reward,
                           max_new_tokens_fn=lambda n: length_of(a.seed + 1, n, a.median_len, a.len_sigma, a.max_len))
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    steps = []
    for step in range(a.warmup + a.steps):
        sync_dev(device)
        t0 = time.perf_counter()
        batch = sched.next_batch(step)
        sync_dev(device)
        t_roll_phase = time.perf_counter() - t0
        with autocast:
            stats = learner.train(batch.samples, step)
        t1 = time.perf_counter()
        engine.update_weights(policy.named_parameters())
        sync_dev(device)
        t_sync = time.perf_counter() - t1
        t_e2e = time.perf_counter() - t0
        gen = batch.stats["generated_tokens"]
        # where the engine's time went (its counters cover its last generate call: one per step
        # here, `generate_calls`): refill prefills (eager forwards) vs decode steps
        es = getattr(engine, "last_stats", None) or {}
        decode_s = es.get("seconds", 0.0) - es.get("prefill_seconds", 0.0)
        engine_rec = {"engine_prefill_s": es.get("prefill_seconds", float("nan")),
                      "engine_prefills": es.get("prefills", float("nan")),
                      "engine_prefill_tokens": es.get("prefill_tokens", float("nan")),
                      "engine_prefill_padded_tokens": es.get("prefill_padded_tokens", float("nan")),
                      "engine_decode_steps": es.get("decode_steps", float("nan")),
                      "engine_decode_ms_per_step": (1e3 * decode_s / es["decode_steps"] if es.get("decode_steps")
                                                    else float("nan"))}
        rec = {**engine_rec,
            "step": step, "timed": step >= a.warmup,
            "rollout_s": batch.stats["rollout_seconds"], "rollout_phase_s": t_roll_phase, "e2e_s": t_e2e,
            "update_s": stats["old_logprob_seconds"] + stats["update_seconds"], "sync_s": t_sync,
            "generated_tokens": gen, "tokens_per_s": gen / batch.stats["rollout_seconds"],
            "slot_idle_fraction": 1 - batch.stats["slot_utilization"],
            "engine_time_idle_fraction": 1 - batch.stats["rollout_seconds"] / t_e2e,
            "train_rollouts": batch.stats["train_rollouts"], "train_tokens": batch.stats["train_tokens"],
            "reward": statistics.fmean(s.reward for s in batch.samples),
            "generate_calls": batch.stats["generate_calls"], "purged": batch.stats["purged"],
            "carried_over": batch.stats["carried_over"], "carried_over_finished": batch.stats["carried_over_finished"],
            "masked_fraction": stats["masked_fraction"], "mismatch_kl": stats["mismatch_kl"],
        }
        steps.append(rec)
        print(f"[{mode}] step {step}{'' if rec['timed'] else ' (warm-up)'}: rollout {rec['rollout_s']:.2f}s "
              f"e2e {t_e2e:.2f}s  {rec['tokens_per_s']:.0f} tok/s  slot idle {rec['slot_idle_fraction']:.2f}  "
              f"trained {int(rec['train_tokens'])} tok  reward {rec['reward']:.3f}  purged {int(rec['purged'])}",
              flush=True)
    timed = [s for s in steps if s["timed"]]
    keys = ["rollout_s", "rollout_phase_s", "e2e_s", "update_s", "sync_s", "tokens_per_s", "slot_idle_fraction",
            "engine_time_idle_fraction", "train_tokens", "train_rollouts", "generate_calls", "purged",
            "masked_fraction", "mismatch_kl", "engine_prefill_s", "engine_prefills", "engine_prefill_tokens",
            "engine_prefill_padded_tokens", "engine_decode_steps", "engine_decode_ms_per_step"]
    summary = {k: statistics.fmean(s[k] for s in timed) for k in keys}
    summary["e2e_s_per_1k_trained_tokens"] = 1000 * sum(s["e2e_s"] for s in timed) / sum(s["train_tokens"] for s in timed)
    summary["rollout_s_per_1k_trained_tokens"] = (1000 * sum(s["rollout_s"] for s in timed)
                                                  / sum(s["train_tokens"] for s in timed))
    summary["reward_curve"] = [round(s["reward"], 4) for s in steps]
    summary["reward_after_n"] = steps[-1]["reward"]
    summary["carried_over_finished_total"] = sum(s["carried_over_finished"] for s in steps)
    return {"steps": steps, "summary": summary, "last_batch": batch.samples, "learner": learner}


# -- IcePop overhead ------------------------------------------------------------------------------
def icepop_overhead(a, policy, device, samples, reps: int) -> dict:
    """Learner step and bare loss, icepop vs none, alternated; medians."""
    init = {k: v.clone() for k, v in policy.state_dict().items()}
    learners = {}
    for corr in ("icepop", "none"):
        opt = torch.optim.AdamW(policy.parameters(), lr=a.lr)
        learners[corr] = Learner(TorchBackend(policy, opt, grad_clip=1.0),
                                 LearnerConfig(loss=LossConfig(correction=corr), pad_id=0,
                                               micro_batch_tokens=a.micro_tokens, logit_chunk=2048))
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    times = {"icepop": [], "none": []}
    for r in range(reps + 1):
        for corr in (("icepop", "none") if r % 2 == 0 else ("none", "icepop")):
            policy.load_state_dict(init)
            sync_dev(device)
            t0 = time.perf_counter()
            with autocast:
                learners[corr].train(samples, 0)
            sync_dev(device)
            if r > 0:  # the first round warms up
                times[corr].append(time.perf_counter() - t0)
    step = {c: statistics.median(v) for c, v in times.items()}
    # the bare loss on a batch shaped like the step's: [B, R]
    B = len(samples)
    R = max(len(s.response_ids) for s in samples)
    g = torch.Generator(device="cpu").manual_seed(0)
    base = -torch.rand(B, R, generator=g) * 3
    infer = (base + torch.randn(B, R, generator=g) * 0.05).to(device)
    old = base.to(device)
    mask = torch.ones(B, R, dtype=torch.bool, device=device)
    adv = torch.randn(B, generator=g).to(device)
    loss_t = {"icepop": [], "none": []}
    for r in range(max(reps, 5) * 4 + 1):
        for corr in ("icepop", "none"):
            lp = old.clone().requires_grad_(True)
            sync_dev(device)
            t0 = time.perf_counter()
            policy_loss(lp, old, infer, adv, mask, LossConfig(correction=corr)).loss.backward()
            sync_dev(device)
            if r > 0:
                loss_t[corr].append(time.perf_counter() - t0)
    loss = {c: statistics.median(v) for c, v in loss_t.items()}
    policy.load_state_dict(init)
    return {
        "learner_step_s": step, "learner_step_overhead": step["icepop"] / step["none"] - 1,
        "loss_s": loss, "loss_overhead": loss["icepop"] / loss["none"] - 1,
        "loss_share_of_step": loss["icepop"] / step["icepop"],
        # what IcePop adds to a step through its loss: (loss_icepop - loss_none) / step_none
        "loss_overhead_of_step": (loss["icepop"] - loss["none"]) / step["none"],
        "batch_rollouts": B, "batch_max_len": R,
        "batch_tokens": sum(len(s.response_ids) for s in samples),
    }


def print_table(modes: dict, columns: list) -> None:
    """A markdown table, a row per mode: `columns` = (header, formatter of the mode's summary)."""
    print("\n| mode | " + " | ".join(h for h, _ in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for mode, r in modes.items():
        print(f"| {mode} | " + " | ".join(f(r["summary"]) for _, f in columns) + " |")


def main() -> None:
    a = parse()
    if a.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    tmp = tempfile.TemporaryDirectory()
    model_dir = Path(a.model) if a.model else build_model_dir(a, Path(tmp.name))
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_dir).to(device).float()
    init_state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    vocab = policy.get_output_embeddings().weight.shape[0]
    rng = random.Random(a.seed)
    n_prompts = 512
    prompt_ids = [[rng.randrange(2, vocab) for _ in range(rng.randint(*a.prompt_len))] for _ in range(n_prompts)]
    rows = [{"id": i, "domain": "synthetic", "prompt": "", "reference": None} for i in range(n_prompts)]
    e_len = expected_length(a)
    phi = a.budget or int(a.prompts * a.group * e_len)
    sigma = a.retention if a.retention is not None else int(math.ceil(a.max_len / e_len)) + 1
    engine = ENGINES[a.engine](str(model_dir), device=str(device), dtype="auto", max_batch=a.max_batch,
                               max_len=a.max_len + a.prompt_len[1], seed=a.seed, eos_token_ids=[])
    print(f"model {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M params on {device}; lengths: median "
          f"{a.median_len}, sigma {a.len_sigma}, cap {a.max_len}, E[len] {e_len:.0f}; sync batch "
          f"{a.prompts}x{a.group}; max_batch {a.max_batch}; C3PO++ Omega {int(a.pool_factor * a.max_batch)} "
          f"Phi {phi} sigma {sigma}", flush=True)
    results = {"args": {k: v for k, v in vars(a).items()}, "device_name":
               torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "expected_length": e_len, "phi": phi, "sigma": sigma, "modes": {}}
    last = None
    for mode in a.modes.split(","):
        r = run_mode(mode, a, engine, init_state, policy, device, rows, prompt_ids, phi, sigma)
        results["modes"][mode] = {"summary": r["summary"], "steps": r["steps"]}
        last = r["last_batch"]
    m = results["modes"]
    if "sync" in m and "c3po" in m:
        s, c = m["sync"]["summary"], m["c3po"]["summary"]
        results["speedup"] = {
            "rollout_phase": s["rollout_s"] / c["rollout_s"],
            "end_to_end": s["e2e_s"] / c["e2e_s"],
            "rollout_per_trained_token": s["rollout_s_per_1k_trained_tokens"] / c["rollout_s_per_1k_trained_tokens"],
            "end_to_end_per_trained_token": s["e2e_s_per_1k_trained_tokens"] / c["e2e_s_per_1k_trained_tokens"],
            "tokens_per_s": c["tokens_per_s"] / s["tokens_per_s"],
        }
    results["icepop_overhead"] = icepop_overhead(a, policy, device, last, a.overhead_reps)

    print_table(m, [
        ("rollout s/step", lambda s: f"{s['rollout_s']:.2f}"), ("e2e s/step", lambda s: f"{s['e2e_s']:.2f}"),
        ("gen tok/s", lambda s: f"{s['tokens_per_s']:.0f}"), ("slot idle", lambda s: f"{s['slot_idle_fraction']:.2f}"),
        ("engine time idle", lambda s: f"{s['engine_time_idle_fraction']:.2f}"),
        ("trained tok/step", lambda s: f"{s['train_tokens']:.0f}"),
        ("e2e s / 1k trained tok", lambda s: f"{s['e2e_s_per_1k_trained_tokens']:.3f}"),
        ("purged/step", lambda s: f"{s['purged']:.1f}"),
        ("reward (first -> after N)", lambda s: f"{s['reward_curve'][0]:.3f} -> {s['reward_after_n']:.3f}")])
    print_table(m, [  # where the engine's time goes
        ("engine prefills/step", lambda s: f"{s['engine_prefills']:.1f}"),
        ("prefill s/step", lambda s: f"{s['engine_prefill_s']:.2f}"),
        ("prefill tokens (padded)",
         lambda s: f"{s['engine_prefill_tokens']:.0f} ({s['engine_prefill_padded_tokens']:.0f})"),
        ("decode steps/step", lambda s: f"{s['engine_decode_steps']:.0f}"),
        ("decode ms/step (incl. host)", lambda s: f"{s['engine_decode_ms_per_step']:.2f}")])
    if "speedup" in results:
        sp = results["speedup"]
        print(f"\nspeedup C3PO++ over sync: rollout phase {sp['rollout_phase']:.2f}x, end-to-end "
              f"{sp['end_to_end']:.2f}x (per trained token: {sp['rollout_per_trained_token']:.2f}x / "
              f"{sp['end_to_end_per_trained_token']:.2f}x); goal >= 2.5x / 1.5x")
    o = results["icepop_overhead"]
    print(f"IcePop vs plain GRPO: learner step {o['learner_step_s']['icepop']:.3f}s vs {o['learner_step_s']['none']:.3f}s "
          f"({100 * o['learner_step_overhead']:+.1f}%), bare loss fwd+bwd {1e3 * o['loss_s']['icepop']:.2f}ms vs "
          f"{1e3 * o['loss_s']['none']:.2f}ms ({100 * o['loss_overhead']:+.1f}%, the loss is "
          f"{100 * o['loss_share_of_step']:.2f}% of the step, so IcePop adds "
          f"{100 * o['loss_overhead_of_step']:+.3f}% to it); goal < 3%")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2, default=str))
        print(f"results: {a.out}")


if __name__ == "__main__":
    main()

"""The vLLM rollout engine, run for real on a GPU (issue 20), next to the torch engine.

    # on the GPU machine, after scripts/gpu_wheels.sh + scripts/gpu_vllm.sh's payload is installed
    # into /tmp/site (PYTHONPATH=/tmp/site:$PWD):
    python3 benchmarks/gpu_vllm_check.py --out "$OUT"
    # here (CPU): the same orchestration with the torch engine standing in for vLLM
    python benchmarks/gpu_vllm_check.py --smoke --out /tmp/vllm_smoke

Parts, each in its own process (GPU memory is returned between them), each appending its result
to OUT/vllm_check.json as soon as it ends:
1. `contract`: the engine contract tests (tests/stages/rl/test_engines.py -k vllm) on this GPU.
2. `rl`: a tiny SFT'd policy built through run_stage (synthetic_data -> init_model -> sft), then
   reasoning_rl with C3PO++ + IcePop and `rollout.engine: vllm` for a few steps through run_stage
   on --rl-gpus GPUs: colocated, or split with --rl-split K (the last K GPUs generate), the engine
   tensor-parallel over --rl-tp GPUs, ZeRO --zero-stage; the stage's per-step mismatch metrics
   (|log k|, masked fraction, mismatch KL) and step-time breakdown are reported.
3. `mismatch`: vLLM's bf16 log-probs of sampled tokens vs the trainer's forward (the HF model in
   bf16 and in fp32) on the SFT'd weights of part 3: mean |log k|, share of tokens outside
   IcePop's [0.5, 5], and the k3 estimate of KL(pi_infer || pi_train).
The decode table (vLLM's own LLM.generate vs the engines) is benchmarks/vllm_decode.py.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._record import SAFE_ENV, ResultFile, log  # noqa: E402 - needs ROOT on sys.path
from benchmarks._stage_ranks import dump_rank_stacks  # noqa: E402

os.environ.update(SAFE_ENV)  # this process and every one it starts


# -- part 3: reasoning_rl with engine vllm -------------------------------------------------------
def _stage_kwargs(args, gpus: int = 1) -> tuple[dict, object]:
    from stages.common.contract import Resources

    gpu = not args.smoke
    res = Resources(gpus_per_node=gpus) if gpu else Resources(cpu_ranks=1)
    return dict(storage=str(args.work / "store"), work_root=args.work / "work",
                launcher="deepspeed" if gpu else "local"), res


def _sft_model(args):
    """data -> init_model -> sft through `run_stage`: the model the RL and mismatch parts start
    from. A part run after another finds these stages published and reuses them, so the
    mismatch part no longer needs the RL part to have finished (round 7 lost it that way)."""
    from pipeline.execute import run_stage

    kw, res = _stage_kwargs(args)
    gpu = not args.smoke
    data = run_stage("synthetic_data", {"files": {
        "sft.jsonl": {"generator": "arithmetic_cot", "n": 1500, "seed": 0, "params": {"max_digits": 1}},
        "rl.jsonl": {"generator": "arithmetic_rl", "n": 256, "seed": 1, "params": {"max_digits": 1}}}},
        stage="data", **kw)
    base = run_stage("init_model", {
        "architecture": {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
                         "max_position_embeddings": 1024},
        "tokenizer": {"corpus": ["${stages.data.output}/sft.jsonl"], "vocab_size": 512}},
        stage="base", upstream={"data": data.url}, **kw)
    sft = run_stage("sft", {"model": "${stages.base.output}", "data": "${stages.data.output}/sft.jsonl",
                            "max_seq_len": 512, "epochs": 1, "max_steps": 60 if gpu else 8,
                            "micro_batch_size": 8, "lr": 2.0e-3, "warmup_steps": 4, "zero_stage": 0,
                            "checkpoint_every": 100},
                    stage="sft", upstream={"base": base.url, "data": data.url}, resources=res, **kw)
    return data, sft


def part_rl(args, engine: str) -> dict:
    from pipeline.execute import run_stage

    kw, res = _stage_kwargs(args, args.rl_gpus)
    data, sft = _sft_model(args)
    rollout = {"engine": engine, "device": "auto", "max_batch": 64, **({"gpus": args.rl_split} if args.rl_split else {})}
    if args.rollout_sleep != "cache":
        rollout["sleep"] = args.rollout_sleep
    if engine == "vllm":  # colocated: it sleeps while the trainer steps, unless rollout.sleep is none
        rollout["options"] = {"gpu_memory_utilization": args.gpu_mem, "enforce_eager": args.enforce_eager,
                              "enable_sleep_mode": args.rollout_sleep != "none" and not args.rl_split,
                              **({"tensor_parallel_size": args.rl_tp} if args.rl_tp > 1 else {})}
    rl = run_stage("reasoning_rl", {
        "model": "${stages.sft.output}", "data": "${stages.data.output}/rl.jsonl", "steps": args.rl_steps,
        "prompts_per_step": 8, "rollouts_per_prompt": 8, "max_len": 128, "prompt_max_len": 128,
        "lr": 1.0e-5, "correction": "icepop", "scheduler": "c3po",
        "c3po": {"pool_capacity": 96, "token_budget": 4096, "retention_limit": 3},
        "rollout": rollout, "verifier_workers": 2, "zero_stage": args.zero_stage, "checkpoint_every": 100},
        stage=f"rl-{engine}-g{args.rl_gpus}-s{args.rl_split}-tp{args.rl_tp}",
        upstream={"sft": sft.url, "data": data.url}, resources=res, **kw)
    metrics = [json.loads(line) for line in Path(_local(rl.url), "metrics.jsonl").read_text().splitlines()]
    keys = ("reward_mean", "masked_fraction", "mismatch_kl", "abs_log_k_mean", "weight_sync_seconds",
            "weight_sync_gbytes_per_second", "rollout_seconds", "rollout_phase_seconds", "train_seconds",
            "engine_sleep_seconds", "step_seconds", "generated_tokens_per_second")
    return {"summary": rl.summary, "per_step": [{k: m.get(k) for k in ("step", *keys) if k in m} for m in metrics]}


def _run_part(cmd: list[str], timeout_s: float) -> tuple[int | str, str, str]:
    """Run one part in a session of its own; past `timeout_s` the whole session (the stage
    launcher's ranks included, which hold GPU memory) is killed, so a part that hangs does not
    take the next parts' time or memory. Every process runs with Python's faulthandler on, and
    a hung part first gets SIGABRT: each process writes its threads' stacks to its stderr before
    it dies. The stage ranks a part launched sit in process groups of their own (the
    pipeline's job guard): they are asked for their stacks first (SIGUSR2, into the stage logs,
    whose tails the result keeps), which says where a stage hung (rounds 5b and 7: the first
    generate of reasoning_rl with engine: vllm).
    Returns (exit code or "timeout", stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **SAFE_ENV, "PYTHONFAULTHANDLER": "1"}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        dump_rank_stacks(proc.pid, "stages.")
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process of the session still holds the pipes
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        with contextlib.suppress(ProcessLookupError):  # ranks writing to files hold no pipe
            os.killpg(proc.pid, signal.SIGKILL)
        return "timeout", stdout, stderr


def _stage_log_tails(work: Path, chars: int = 4000) -> str:
    """The ends of the stage logs under `work` (newest last): where a timed-out part was."""
    logs = sorted(work.rglob("*.log"), key=lambda p: p.stat().st_mtime)[-3:]
    return "".join(f"\n---- {p}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def _local(url: str) -> str:
    return url.removeprefix("file://")


# -- part 4: mismatch --------------------------------------------------------------------------
def part_mismatch(args, engine: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from stages.rl.engines import RolloutRequest, SamplingParams, create_engine

    model_dir = _local(_sft_model(args)[1].url)
    device = "cuda" if not args.smoke else "cpu"
    opts = {}
    if engine == "vllm":
        opts.update(gpu_memory_utilization=args.gpu_mem, enforce_eager=args.enforce_eager)
    eng = create_engine(engine, model_dir, device=device, dtype="auto", max_batch=64, max_len=512, seed=0, **opts)
    from transformers import AutoTokenizer

    from stages.common.chat import encode_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [encode_prompt(tok, [{"role": "user", "content": f"What is {a} + {b}?"}])
               for a, b in zip(range(10, 74), range(31, 95))]
    ups = eng.generate([RolloutRequest(f"m{i}", p, 96) for i, p in enumerate(prompts)],
                       SamplingParams(temperature=1.0, seed=3))
    getattr(eng, "close", lambda: None)()  # the vllm engine's processes end, their GPU memory comes back
    del eng
    if device == "cuda":
        torch.cuda.empty_cache()
    out = {"rollouts": len(ups), "tokens": sum(len(u.token_ids) for u in ups)}
    for dtype in ([torch.bfloat16, torch.float32] if device == "cuda" else [torch.float32]):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        logk, k3 = [], []
        with torch.no_grad():
            for p, u in zip(prompts, ups):
                if not u.token_ids:
                    continue
                ids = torch.tensor([p + u.token_ids], device=device)
                logits = model(ids).logits[0, len(p) - 1:-1].float()
                lp_train = torch.log_softmax(logits, -1).gather(1, ids[0, len(p):, None])[:, 0].cpu()
                lp_infer = torch.tensor(u.logprobs)
                d = lp_train - lp_infer  # log k = log pi_train - log pi_infer
                logk.append(d)
                k3.append(torch.exp(d) - 1 - d)  # E_infer[k - 1 - log k] >= 0: KL(infer || train)
        lk = torch.cat(logk)
        name = str(dtype).removeprefix("torch.")
        out[f"trainer_{name}"] = {
            "abs_log_k_mean": float(lk.abs().mean()), "abs_log_k_max": float(lk.abs().max()),
            "outside_icepop_band": float(((lk < math.log(0.5)) | (lk > math.log(5.0))).float().mean()),
            "mismatch_kl_k3": float(torch.cat(k3).mean())}
        log(f"mismatch vs trainer {name}: {out[f'trainer_{name}']}")
        del model
    return out


PARTS = ("contract", "rl", "mismatch")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/vllm_check")))
    p.add_argument("--work", type=Path, default=Path("/tmp/vllm_check_work"))
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # one part, in a child process
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, torch engine stands in for vllm")
    p.add_argument("--rl-steps", type=int, default=4)
    p.add_argument("--rl-gpus", type=int, default=1, help="rl part: GPUs (ranks) of the stage")
    p.add_argument("--rl-split", type=int, default=0, help="rl part: rollout.gpus (split placement); 0: colocated")
    p.add_argument("--rl-tp", type=int, default=1, help="rl part: rollout.options.tensor_parallel_size")
    p.add_argument("--zero-stage", type=int, default=0, help="rl part: the trainers' ZeRO stage")
    p.add_argument("--gpu-mem", type=float, default=0.35)
    p.add_argument("--part-timeout-s", type=float, default=420, help="a part still running then is killed")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs / compilation")
    p.add_argument("--rollout-sleep", choices=["cache", "weights", "none"], default="cache",
                   help="rl part: rollout.sleep of the stage (none: vLLM built without its sleep mode, "
                        "an A/B for the first generate that hung in rounds 5b and 7)")
    args = p.parse_args()
    if args.smoke:
        args.rl_steps = 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    engine = "torch" if args.smoke else "vllm"

    if args.part:  # a child: one part, result as JSON on the last line
        fn = {"rl": lambda: part_rl(args, engine), "mismatch": lambda: part_mismatch(args, engine)}[args.part]
        print("RESULT " + json.dumps(fn()), flush=True)
        return 0

    results = ResultFile.resume(args.out / "vllm_check.json")
    for part in args.parts.split(","):
        log(f"part {part} ...")
        t0 = time.time()
        if part == "contract":
            # one test at a time (`-n 0` over the suite's xdist addopts): each test starts a vLLM
            # engine that takes a share of the one GPU; three at once stalled in engine start-up (round 20)
            cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
                   "tests/stages/rl/test_engines.py", "-k", "vllm"]
        else:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--part", part]
        rc, stdout, stderr = _run_part(cmd, args.part_timeout_s)
        if rc == "timeout":
            stderr += _stage_log_tails(args.work)
        tail = (stdout + stderr)[-3000:]
        with open(args.out / "vllm_check.log", "a") as f:
            f.write(f"==== {part} (rc {rc}, {time.time() - t0:.0f}s)\n{stdout}\n{stderr}\n")
        result: dict = {"rc": rc, "seconds": round(time.time() - t0, 1)}
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        if lines:
            result.update(json.loads(lines[-1][len("RESULT "):]))
        else:
            result["tail"] = tail
        results.put(part, result=result)
        log(f"part {part}: rc {rc} in {result['seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

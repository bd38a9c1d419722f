"""Issue 17 on one host of several GPUs, in one run of about 8 minutes: data-parallel RL
rollouts, NCCL weight sync, SFT scaling, faults. Every GPU present is used (2, or 4 when lent).

Commands (the lead runs them):

    # on a machine with internet, once: the wheels the GPU machine lacks -> .whl/ (git-ignored)
    scripts/gpu_wheels.sh
    # on the GPU machine, from the repo root, .whl/ carried along (run(carry=[".whl"])):
    bash benchmarks/gpu_scaling.sh        # = install .whl into /tmp/site, then this script --out $OUT
    # CPU smoke of the same code paths (2 gloo ranks, tiny shapes; no timing claims):
    python benchmarks/gpu_scaling.py --smoke --out /tmp/gpu_scaling_smoke

What it measures, most wanted first (each result goes to $OUT/gpu_scaling.json as soon as it
is done; a measurement that would overrun the time budget is skipped, with the reason):

1. setup: synthetic data, a 0.5B-shape base (Qwen2-0.5B's body: h896 L24 q14/kv2 ff4864, the
   vocabulary of a BPE trained here) and a small base (for the fault run), all through
   `pipeline.execute.run_stage`, as every stage run below.
2. rl-c3po@1 and sft@1 side by side, each pinned to a GPU of its own (CUDA_VISIBLE_DEVICES):
   `reasoning_rl` (C3PO++) and `sft` on one GPU, with the stages' default speed settings (every
   `auto` decided for the GPU, the model and the GPU count: stages/common/speed_defaults.py;
   each run's decision is in the results as `resolved_speed`); `--settings zero3` runs them
   under ZeRO-3 as rounds 4-6 measured.
3. rl-c3po@all: the same `reasoning_rl` on all GPUs, colocated (an engine on every GPU, the
   trainer over all): rollout tokens/s, step time, engine idle fraction, and the
   rollout phase's speed-up over one GPU (goal >= 1.8x on 2 GPUs, >= 3.5x on 4). A random
   policy never ends, so the engines stop on 1 token id in 128 (geometric lengths, mean
   ~128, capped at max_len 512). This is strong scaling: the same step (token budget, pool,
   prompts) split over the engines, so each engine's call is 1/n as long and its fixed costs
   (wake, weight sync, prefill of carried-over rollouts) weigh n times more.
4. rl-c3po-weak@all: weak scaling, the step's budget, pool and prompts n times one GPU's (each
   engine as loaded as the single one): the rollout phase's throughput when GPUs are added to
   generate more per step, as RL runs use them.
5. sft@all: tokens/s per GPU and scaling efficiency over one GPU (goal >= 90%); on 4 GPUs
   sft@2 runs in step 2.
6. interconnect + weight sync, colocated: NCCL all-reduce bus bandwidth and broadcast
   bandwidth, then `stages.rl.weight_sync` (the trainer's own code) for the Qwen2 0.5B / 1.5B
   / 7B parameter shapes, ZeRO-3 modules gathered into a torch engine on every GPU; seconds
   per sync next to the bound bytes / all-reduce bus bandwidth (goal: 7B within 3x). The
   engines load the shapes from sparse safetensors files (zeros, no disk traffic); the 7B
   shape is only synced, never trained.
7. rl-sync@1, rl-sync@all: the sync baseline on one and all GPUs.
8. weight sync, split: half the GPUs train, the other half only generate; trainer 0
   broadcasts each bucket to them.
9. faults: `reasoning_rl` on all GPUs (small model, a checkpoint every step); rank 1 is
   killed with SIGKILL after the first checkpoint: the stage must fail within a bound with
   no process left, and the rerun resume from the last checkpoint with the same unfinished
   rollouts (the pools in the checkpoint's per-rank files).
10. sft-pairs@n (`--only sft-pairs@n`; issue 36 item 2): `--sft-pairs` K pairs of `sft` runs on one
   GPU and on all n, interleaved (1, n, then n, 1, ...) so a drift of the host hits both sides
   alike, at the `--sft-shape` (0.5B, or 1.5B: a base of Qwen2-1.5B's body built for it); each
   pair's scaling efficiency (tokens/s per GPU on n over one) and their min / median / max. Each
   pair is a step of its own: the time budget drops whole pairs.

`--only` runs a subset (setup always runs); a stage run past `--stage-timeout-s` is killed and
reported with the tails of its logs (its own and its job's stage.log). GPUs are indices into
the script's own CUDA_VISIBLE_DEVICES when one is set (a run pinned to GPUs 2,3 stays there).

Every process keeps NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1, also passed to every child). Stage runs use torchrun (it honours
CUDA_VISIBLE_DEVICES); their logs stay under --work, the tail of a failed one goes to the log.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere

from benchmarks._record import SAFE_ENV  # noqa: E402 - needs ROOT on sys.path
from benchmarks._stage_ranks import dump_rank_stacks, rank_process  # noqa: E402
from pipeline.launch import pinned_gpus  # noqa: E402

# the stages' speed settings per --settings: `defaults` names none (each `auto`, decided before
# launch: stages/common/speed_defaults.py; sft's grad_accum = packs per rank per step, re-split
# into micro batches by `auto`), `zero3` is what rounds 4-6 measured (ZeRO-3, 8 packs a micro batch)
SETTINGS = {"defaults": {"sft": {}, "rl": {}},
            "zero3": {"sft": {"zero_stage": 3, "micro_batch_size": 8, "grad_accum": 1}, "rl": {"zero_stage": 3}}}

os.environ.update(SAFE_ENV)  # this process and every one it starts

# Qwen2 parameter shapes (the released models' configs)
QWEN2 = {
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}
TINY_SHAPES = {
    "tiny-a": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "tiny-b": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, vocab_size=512, tie_word_embeddings=False),
}
BODY_05B = {k: v for k, v in QWEN2["qwen2-0.5b"].items() if k not in ("vocab_size", "tie_word_embeddings")}
BODY_15B = {k: v for k, v in QWEN2["qwen2-1.5b"].items() if k not in ("vocab_size", "tie_word_embeddings")}
SMALL_BODY = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=768)
TINY_BODY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128)


# -- output -------------------------------------------------------------------------------------------
class Report:
    """One JSON of results (rewritten after every measurement) and one log, both under --out."""

    def __init__(self, out: Path, started: float):
        self.out, self.started = out, started
        out.mkdir(parents=True, exist_ok=True)
        self.path, self.log_path = out / "gpu_scaling.json", out / "gpu_scaling.log"
        self.data: dict[str, Any] = {"skipped": [], "errors": []}
        self.lock = threading.Lock()

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.time() - self.started:6.1f}s] {msg}"
        with self.lock:
            print(line, flush=True)
            with open(self.log_path, "a") as f:
                f.write(line + "\n")

    def put(self, path: str, value: Any) -> None:
        with self.lock:
            node = self.data
            *parents, leaf = path.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
            self.path.write_text(json.dumps(self.data, indent=2, default=str))

    def append(self, key: str, value: Any) -> None:
        with self.lock:
            self.data.setdefault(key, []).append(value)
            self.path.write_text(json.dumps(self.data, indent=2, default=str))


# -- one stage run, in a child process (pinned to its GPUs) ----------------------------------------------
@dataclass
class StageSpec:
    name: str                  # the stage's name (unique in this run: its artifact directory)
    kind: str
    config: dict[str, Any]
    gpus: int                  # GPUs it runs on (CPU smoke: CPU ranks)
    upstream: dict[str, str] = field(default_factory=dict)


class Runner:
    """Starts stage runs (`pipeline.execute.run_stage` in a child process of this script) on
    free GPUs; a run's result is its StageRun dict or its failure."""

    def __init__(self, args, report: Report):
        self.args, self.report = args, report
        self.gpus_total = args.gpus
        self.free = list(range(args.gpus))
        self.cond = threading.Condition()
        self.storage = f"file://{args.work}/store"
        self.visible = pinned_gpus() or [str(i) for i in range(args.gpus)]

    def env(self, gpu_ids: list[int]) -> dict[str, str]:
        """A child's environment on GPUs `gpu_ids`: indices into the GPUs this script sees (a
        CUDA_VISIBLE_DEVICES of its own is honoured: index 0 is its first GPU, not the host's)."""
        env = {**os.environ, **SAFE_ENV, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        if self.args.smoke:
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.visible[i] for i in gpu_ids)
        return env

    def resources(self, n: int) -> dict[str, int]:
        return {"cpu_ranks": n} if self.args.smoke else {"gpus_per_node": n}

    def start(self, spec: StageSpec, gpu_ids: list[int]) -> subprocess.Popen:
        payload = {"kind": spec.kind, "config": spec.config, "stage": spec.name, "storage": self.storage,
                   "recipe": "gpu-scaling", "work_root": str(Path(self.args.work) / "runs"),
                   "resources": self.resources(spec.gpus), "upstream": spec.upstream, "launcher": "torchrun"}
        log = open(Path(self.args.work) / f"{spec.name}.log", "a")  # a rerun (faults) keeps the first log
        return subprocess.Popen([sys.executable, __file__, "--worker", "stage", "--spec", json.dumps(payload)],
                                stdout=log, stderr=subprocess.STDOUT, env=self.env(gpu_ids), cwd=ROOT,
                                start_new_session=True)

    def result(self, spec: StageSpec, proc: subprocess.Popen) -> dict[str, Any]:
        """The run's StageRun dict; a run past --stage-timeout-s is killed (its job dies with
        it: pipeline.job_guard) and reported with the tails of its logs."""
        try:
            proc.wait(timeout=self.args.stage_timeout_s)
            hung = ""
        except subprocess.TimeoutExpired:
            stacks = dump_rank_stacks(proc.pid, f"stages.{spec.kind}.job")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            hung = f"still running after {self.args.stage_timeout_s:.0f}s, killed (stacks of {stacks} rank(s) in its log); "
        text = (Path(self.args.work) / f"{spec.name}.log").read_text(errors="replace")
        for line in reversed(text.splitlines()):
            if line.startswith("RESULT ") and not hung:
                return json.loads(line[len("RESULT "):])
        tail = "\n".join(text.splitlines()[-40:])
        raise RuntimeError(f"stage run {spec.name} failed ({hung}exit {proc.returncode}); its log ends:\n{tail}"
                           f"{self.job_log_tail(spec, lines=400 if hung else 60)}")

    def job_log_tail(self, spec: StageSpec, lines: int = 60) -> str:
        """The end of the newest stage.log of this run's job (what its ranks printed)."""
        logs = sorted((Path(self.args.work) / "runs").glob(f"*/{spec.name}-*/*/stage.log"),
                      key=lambda p: p.stat().st_mtime)
        if not logs:
            return ""
        tail = logs[-1].read_text(errors="replace").splitlines()[-lines:]
        return f"\n--- {logs[-1]} ends:\n" + "\n".join(tail)

    def run(self, spec: StageSpec) -> dict[str, Any]:
        """Run on `spec.gpus` GPUs as soon as they are free (blocks)."""
        with self.cond:
            self.cond.wait_for(lambda: len(self.free) >= spec.gpus)
            ids, self.free = self.free[:spec.gpus], self.free[spec.gpus:]
        where = f"GPUs {ids}" if not self.args.smoke else f"{spec.gpus} CPU rank(s)"
        self.report.log(f"start {spec.name} ({spec.kind}) on {where}")
        t0 = time.time()
        try:
            return self.result(spec, self.start(spec, ids))
        finally:
            with self.cond:
                self.free = sorted(self.free + ids)
                self.cond.notify_all()
            self.report.log(f"end {spec.name} after {time.time() - t0:.0f}s")


def stage_worker(payload: dict[str, Any]) -> None:
    from pipeline.execute import run_stage
    from stages.common.contract import Resources

    kind, config = payload.pop("kind"), payload.pop("config")
    payload["work_root"] = Path(payload["work_root"])
    run = run_stage(kind, config, resources=Resources(**payload.pop("resources")), **payload)
    print("RESULT " + json.dumps(run.as_dict(), default=str), flush=True)


# -- measurements -------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args, report: Report):
        self.args, self.report = args, report
        self.runner = Runner(args, report)
        self.deadline = report.started + args.budget_s if args.budget_s else math.inf
        self.costs: dict[str, float] = {}  # measured wall seconds of earlier steps, to plan the rest
        self.n = args.gpus
        self.runs: dict[str, dict[str, Any]] = {}

    # budget ---------------------------------------------------------------------------------------------
    def step(self, name: str, estimate_s: float, fn: Callable[[], Any]) -> Any:
        """Run one measurement if `estimate_s` fits the time left; failures are recorded, not fatal."""
        left = self.deadline - time.time()
        if estimate_s > left:
            self.report.log(f"skip {name}: needs ~{estimate_s:.0f}s, {left:.0f}s left")
            self.report.append("skipped", {"what": name, "why": f"time budget: ~{estimate_s:.0f}s needed, "
                                                                 f"{left:.0f}s left"})
            return None
        self.report.log(f"== {name}")
        t0 = time.time()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - recorded; the other measurements go on
            self.report.log(f"{name} FAILED: {type(e).__name__}: {e}")
            self.report.append("errors", {"what": name, "error": f"{type(e).__name__}: {e}"[-6000:]})
            return None
        finally:
            self.costs[name] = time.time() - t0
            self.report.log(f"== {name} took {self.costs[name]:.0f}s")

    def stage(self, spec: StageSpec) -> dict[str, Any]:
        run = self.runner.run(spec)
        self.runs[spec.name] = run
        return run

    def parallel(self, specs: list[StageSpec]) -> dict[str, dict[str, Any] | Exception]:
        out: dict[str, dict[str, Any] | Exception] = {}

        def go(spec: StageSpec) -> None:
            try:
                out[spec.name] = self.stage(spec)
            except Exception as e:  # noqa: BLE001 - reported per run
                out[spec.name] = e

        threads = [threading.Thread(target=go, args=(s,)) for s in specs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    # 1. setup ---------------------------------------------------------------------------------------------
    def setup(self) -> None:
        a = self.args
        data = self.stage(StageSpec("data", "synthetic_data", {"files": {
            "sft.jsonl": {"generator": "arithmetic_cot", "n": 600 if a.smoke else 6000, "seed": 0,
                          "params": {"max_digits": 3}},
            "rl.jsonl": {"generator": "arithmetic_rl", "n": 64 if a.smoke else 2048, "seed": 1}}}, 1))
        self.data_url = data["url"]

        def base(name: str, body: dict[str, int], vocab: int) -> StageSpec:
            return StageSpec(name, "init_model", {
                "architecture": {"model_type": "qwen2", "max_position_embeddings": 4096, **body},
                "tokenizer": {"corpus": ["${stages.data.output}/sft.jsonl"], "vocab_size": vocab}, "seed": 0},
                1, {"data": self.data_url})

        policy_body, fault_body = (TINY_BODY, TINY_BODY) if a.smoke else (BODY_05B, SMALL_BODY)
        vocab = 512 if a.smoke else 8192
        bases = [base("base", policy_body, vocab), base("small", fault_body, vocab)]
        if a.sft_shape == "1.5B":  # the sft runs' own base (smoke: a wider tiny body, the same path)
            bases.append(base("sft_base", {**TINY_BODY, "hidden_size": 96} if a.smoke else BODY_15B, vocab))
        runs = self.parallel(bases)
        for run in runs.values():
            if isinstance(run, Exception):
                raise run
        self.base_url, self.small_url = runs["base"]["url"], runs["small"]["url"]
        self.sft_base_url = runs["sft_base"]["url"] if "sft_base" in runs else self.base_url
        from transformers import AutoConfig, AutoTokenizer

        path = self.base_url.removeprefix("file://")
        tok, cfg = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
        # a random policy never says EOS; stopping on 1 in `stop_every` tokens gives rollouts of
        # geometric lengths (mean ~stop_every, capped at max_len), as a real policy's spread
        stop_every = 8 if a.smoke else 128
        self.stop_ids = sorted({int(tok.eos_token_id), *range(3, cfg.vocab_size, stop_every)})
        params = _param_count(cfg)
        self.report.put("setup", {"data": self.data_url, "base": self.base_url, "small": self.small_url,
                                  "policy_shape": {**policy_body, "vocab_size": cfg.vocab_size},
                                  "policy_params": params, "stop_every": stop_every})
        self.report.log(f"setup: policy {params / 1e6:.0f}M params (vocab {cfg.vocab_size})")

    # configs ---------------------------------------------------------------------------------------------
    def rl_config(self, scheduler: str, small: bool = False, per_engine_of: int = 1, **over) -> dict[str, Any]:
        """`per_engine_of` = k: the step's work (budget, pool, prompts) k times one GPU's, so each
        of k engines gets as much as the single engine did (weak scaling)."""
        a = self.args
        group = 4 if a.smoke else 8
        omega = (16 if a.smoke else 512) * per_engine_of      # global pool: 4x one engine's slots
        max_batch = 8 if a.smoke else 128
        phi = (160 if a.smoke else 48 * 1024) * per_engine_of  # finished tokens per partition (~375 rollouts)
        cfg = {
            "model": "${stages.small.output}" if small else "${stages.base.output}",
            "data": "${stages.data.output}/rl.jsonl", "steps": 2 if a.smoke else 4,
            "prompts_per_step": phi // ((8 if a.smoke else 128) * group), "rollouts_per_prompt": group,
            "max_len": 24 if a.smoke else 512, "prompt_max_len": 64 if a.smoke else 128,
            "lr": 1e-6, "scheduler": scheduler,
            "c3po": {"pool_capacity": omega, "token_budget": phi, "retention_limit": 8},
            "rollout": {"engine": "torch", "max_batch": max_batch, "options": {"eos_token_ids": self.stop_ids}},
            **SETTINGS[a.settings]["rl"], "micro_batch_tokens": 2048 if a.smoke else 16384, "verifier_workers": 0,
            "checkpoint_every": 1000, "sample_rollouts": 0, "seed": 0,
        }
        cfg.update(over)
        return cfg

    def sft_config(self) -> dict[str, Any]:
        a = self.args
        return {"model": "${stages.sft_base.output}", "data": "${stages.data.output}/sft.jsonl",
                "max_seq_len": 256 if a.smoke else 2048, "epochs": 4, "max_steps": 3 if a.smoke else 12,
                "grad_accum": 2 if a.smoke else 8, "lr": 1e-4, "warmup_steps": 1, "checkpoint_every": 1000,
                **SETTINGS[a.settings]["sft"]}

    def upstream(self, small: bool = False) -> dict[str, str]:
        return {"data": self.data_url, ("small" if small else "base"): self.small_url if small else self.base_url}

    # 2.-3. rl and sft --------------------------------------------------------------------------------------
    def rl(self, scheduler: str, gpus: int, weak: bool = False) -> StageSpec:
        """`weak`: the step's work scales with the GPUs (each engine as loaded as one GPU's);
        otherwise the same step (budget, pool, prompts) is split over the GPUs (strong scaling)."""
        name = f"rl-{scheduler}{'_weak' if weak else ''}-{gpus}g"
        cfg = self.rl_config(scheduler, per_engine_of=gpus if weak else 1)
        return StageSpec(name, "reasoning_rl", cfg, gpus, self.upstream())

    def sft(self, gpus: int, name: str | None = None) -> StageSpec:
        return StageSpec(name or f"sft-{gpus}g", "sft", self.sft_config(), gpus,
                         {"data": self.data_url, "sft_base": self.sft_base_url})

    def sft_pair(self, i: int) -> None:
        """Pair `i` of sft runs on 1 GPU and on all n, in the order 1, n (even i) or n, 1 (odd i)."""
        shape, n = self.args.sft_shape, self.n
        got = {}
        for gpus in ((1, n) if i % 2 == 0 else (n, 1)):
            run = self.stage(self.sft(gpus, name=f"sftpair{i}-{gpus}g"))
            out = Path(run["url"].removeprefix("file://"))
            got[gpus] = {**sft_metrics(out, gpus), "resolved_speed": resolved_speed(out)}
            self.report.put(f"sft_pairs/{shape}/pair{i}/{gpus}g", got[gpus])
        efficiency = got[n]["tokens_per_s_per_gpu"] / got[1]["tokens_per_s_per_gpu"]
        self.report.put(f"sft_pairs/{shape}/pair{i}/efficiency", efficiency)
        pairs = self.report.data["sft_pairs"][shape]
        effs = sorted(v["efficiency"] for k, v in pairs.items() if k.startswith("pair") and "efficiency" in v)
        ones = sorted(v["1g"]["tokens_per_s"] for k, v in pairs.items() if k.startswith("pair") and "1g" in v)
        self.report.put(f"sft_pairs/{shape}/summary", {
            "gpus": n, "pairs": len(effs), "efficiency_min": effs[0], "efficiency_median": statistics.median(effs),
            "efficiency_max": effs[-1], "tokens_per_s_1g_min": ones[0], "tokens_per_s_1g_max": ones[-1],
            "goal": 0.9})

    def side_by_side(self, specs: list[StageSpec]) -> None:
        """Runs that fit the GPUs together go together (each on GPUs of its own)."""
        for name, run in self.parallel(specs).items():
            self._record(name, run)

    def record_rl(self, spec: StageSpec) -> None:
        self._record(spec.name, self.stage(spec))

    def _record(self, name: str, run: dict[str, Any] | Exception) -> None:
        if isinstance(run, Exception):
            raise run
        out = Path(run["url"].removeprefix("file://"))
        if name.startswith("rl-"):
            _, scheduler, gpus = name.split("-")
            self.report.put(f"rl/{scheduler}/{gpus}", {**rl_metrics(out, run), "resolved_speed": resolved_speed(out)})
            self._rl_speedup(scheduler)
        else:
            gpus = int(name.split("-")[1].removesuffix("g"))
            self.report.put(f"sft/{gpus}g", {**sft_metrics(out, gpus), "resolved_speed": resolved_speed(out)})
            self._sft_efficiency()

    def _rl_speedup(self, scheduler: str) -> None:
        got = self.report.data.get("rl", {}).get(scheduler, {})
        one = got.get("1g") or self.report.data.get("rl", {}).get(scheduler.removesuffix("_weak"), {}).get("1g")
        all_ = got.get(f"{self.n}g")
        if one and all_ and self.n > 1:
            self.report.put(f"rl/{scheduler}/scaling", {
                "gpus": self.n,
                "rollout_tokens_per_s_speedup": all_["rollout_tokens_per_s"] / one["rollout_tokens_per_s"],
                "step_seconds_speedup": one["step_seconds_mean"] / all_["step_seconds_mean"],
                "goal": 1.8 if self.n == 2 else 3.5 if self.n == 4 else None})

    def _sft_efficiency(self) -> None:
        got = self.report.data.get("sft", {})
        one = got.get("1g")
        for key, m in list(got.items()):  # "2g", "4g": runs; "efficiency_2g": what this writes
            if key.removesuffix("g").isdigit() and key != "1g" and one:
                self.report.put(f"sft/efficiency_{key}", m["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"])

    # 4. weight sync ------------------------------------------------------------------------------------------
    def weight_sync(self, placement: str) -> None:
        a = self.args
        shapes = TINY_SHAPES if a.smoke else QWEN2
        root = Path(a.work) / "shapes"
        for name, shape in shapes.items():
            if not (root / name / "model.safetensors").exists():
                write_sparse_model(root / name, shape, "float32" if a.smoke else "bfloat16")
        spec = {"placement": placement, "root": str(root), "shapes": list(shapes), "repeats": 3,
                "bucket_mb": 512, "bandwidth_mb": 16 if a.smoke else 1024, "dtype": "float32" if a.smoke else "bfloat16",
                "out": str(Path(a.work) / f"sync-{placement}.json")}
        from stages.common.ports import reserved_port

        log_path = Path(a.work) / f"sync-{placement}.log"
        with reserved_port() as port, open(log_path, "w") as log:  # held until torchrun's store bound it
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.n), "--master-port",
                   str(port), __file__, "--worker", "sync", "--spec", json.dumps(spec)]
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.runner.env(list(range(self.n))),
                                  cwd=ROOT, start_new_session=True)
        results = json.loads(Path(spec["out"]).read_text()) if Path(spec["out"]).exists() else {}
        if "interconnect" in results:
            self.report.put("interconnect", results.pop("interconnect"))
        busbw = self.report.data.get("interconnect", {}).get("allreduce_busbw_gbytes_per_s")
        for name, r in results.items():
            if busbw and self.n > 1:
                r["bound_seconds"] = r["bytes"] / (busbw * 1e9)
                r["seconds_over_bound"] = r["seconds_median"] / r["bound_seconds"]
            self.report.put(f"weight_sync/{placement}/{name}", r)
        if proc.returncode != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"the weight-sync run exited {proc.returncode}; its log ends:\n{tail}")

    # 6. faults ------------------------------------------------------------------------------------------------
    def faults(self) -> None:
        import psutil

        from pipeline.execute import adhoc_target
        from stages.common.checkpoint import rank_state_file, read_state
        from stages.common.checkpoint_store import CheckpointStore

        cfg = self.rl_config("c3po", small=True, steps=4, checkpoint_every=1, zero_stage=3)  # as rounds 6-8
        spec = StageSpec("faults", "reasoning_rl", cfg, self.n, self.upstream(small=True))
        url = adhoc_target("reasoning_rl", cfg, stage=spec.name, storage=self.runner.storage, recipe="gpu-scaling",
                           upstream=spec.upstream).url
        store = CheckpointStore(url, {})
        proc = self.runner.start(spec, list(range(self.n)))
        deadline = time.time() + 300
        while store.latest() is None:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the fault run ended or stalled before its first checkpoint (exit {proc.poll()})")
            time.sleep(0.2)
        victim = rank_process(proc.pid, "stages.reasoning_rl.job", rank=1)
        victim.kill()
        killed = time.time()
        self.report.log(f"faults: killed rank 1 (pid {victim.pid}) after checkpoint step {store.latest()}")
        try:
            self.runner.result(spec, proc)
            failed, message = False, "the stage did not fail"
        except RuntimeError as e:
            failed, message = True, str(e)
        fail_s = time.time() - killed
        left = [p.pid for p in psutil.process_iter(["cmdline"])
                if "stages.reasoning_rl.job" in (cmd := " ".join(p.info["cmdline"] or [])) and str(self.args.work) in cmd]
        latest = store.latest()
        saved = store.restore(latest, Path(self.args.work) / "fault-inspect")
        pools = [read_state(saved, rank_state_file(r))["rollouts"] for r in range(self.n)]
        in_pools = sum(len(p["pool"]) for p in pools)
        self.report.put("faults/kill", {"stage_failed": failed, "seconds_to_fail": fail_s, "processes_left": left,
                                        "error_tail": message[-1500:], "checkpoint_step": latest,
                                        "checkpoint_pool_rollouts": in_pools,
                                        "checkpoint_pool_rollouts_per_rank": [len(p["pool"]) for p in pools]})
        run = self.runner.result(spec, self.runner.start(spec, list(range(self.n))))
        s = run["summary"]
        self.report.put("faults/resume", {
            "resumed_from_step": s["resumed_from_step"], "resumed_pool_rollouts": s["resumed_pool_rollouts"],
            "same_unfinished_rollouts": s["resumed_from_step"] == latest and s["resumed_pool_rollouts"] == in_pools,
            "steps": s["steps"]})

    # the plan ----------------------------------------------------------------------------------------------------
    def all(self) -> None:
        """Most wanted first; the estimates (seconds on an H100/H200 host) decide what still fits.
        The fault run goes last: its kill and rerun are the least predictable in time."""
        n, est = self.n, (lambda s: 0.0 if self.args.smoke else s)
        self.step("setup", est(60), self.setup)
        if not hasattr(self, "base_url"):
            return
        first = [self.rl("c3po", 1), self.sft(1)] + ([self.sft(2)] if n >= 4 else [])
        plan: list[tuple[str, float, Callable[[], Any]]] = [
            ("rl-c3po@1", 80 if n > 1 else 130, lambda: self.side_by_side(first))]
        if n > 1:
            plan += [("rl-c3po@n", 70, lambda: self.record_rl(self.rl("c3po", n))),
                     ("rl-c3po-weak@n", 90, lambda: self.record_rl(self.rl("c3po", n, weak=True))),
                     ("sft@n", 50, lambda: self._record(f"sft-{n}g", self.stage(self.sft(n))))]
            shape_s = 200 if self.args.sft_shape == "1.5B" else 100
            plan += [("sft-pairs@n", shape_s, (lambda i=i: self.sft_pair(i))) for i in range(self.args.sft_pairs)]
        plan.append(("sync-colocated", 80, lambda: self.weight_sync("colocated")))
        plan.append(("rl-sync@1", 60, lambda: self.record_rl(self.rl("sync", 1))))
        if n > 1:
            plan += [("rl-sync@n", 70, lambda: self.record_rl(self.rl("sync", n))),
                     ("sync-split", 80, lambda: self.weight_sync("split")),
                     ("faults", 150, self.faults)]
        for name, seconds, fn in plan:
            if self.args.only and name not in self.args.only:
                continue
            self.step(name.replace("@n", f"@{n}"), est(seconds), fn)


# -- reading a run's outputs ------------------------------------------------------------------------------------
def resolved_speed(out: Path) -> dict[str, Any] | None:
    """What the stage's `auto` speed settings became (its manifest's `resolved_speed`)."""
    record = json.loads((out / "manifest.json").read_text()).get("resolved_speed")
    return record and record["config_updates"]


def _timed(rows: list[dict[str, Any]], skip: int) -> list[dict[str, Any]]:
    return rows[skip:] or rows[-1:]


def rl_metrics(out: Path, run: dict[str, Any]) -> dict[str, Any]:
    """Per-step means over the steps after the first (CUDA graph captures, allocator warm-up)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = _timed(rows, 1)

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in timed)

    s = run["summary"]
    return {"placement": s["placement"], "engines": s["engines"], "steps_timed": len(timed),
            "rollout_tokens_per_s": sum(r["generated_tokens"] for r in timed) / sum(r["rollout_seconds"] for r in timed),
            "rollout_seconds_mean": mean("rollout_seconds"), "step_seconds_mean": mean("step_seconds"),
            "train_seconds_mean": mean("train_seconds"), "weight_sync_seconds_mean": mean("weight_sync_seconds"),
            "engine_idle_fraction_mean": mean("engine_idle_fraction"),
            # rank 0's wait for the step's batch (the slowest engine, the reward, the send) and
            # the engines' sleep + wake: where the rest of step_seconds goes
            "rollout_phase_seconds_mean": mean("rollout_phase_seconds"),
            "engine_sleep_seconds_mean": mean("engine_sleep_seconds"),
            "generate_seconds_max_mean": mean("generate_seconds_max"),
            "generated_tokens_mean": mean("generated_tokens"), "train_tokens_mean": mean("train_tokens"),
            "generate_calls_mean": mean("generate_calls"), "slot_utilization_mean": mean("slot_utilization"),
            "weight_sync_bytes": s["weight_sync_bytes"], "stage_seconds": run["seconds"]}


def sft_metrics(out: Path, gpus: int) -> dict[str, Any]:
    """tokens/s per step from the stage log's `[metrics]` lines, the first two steps left out."""
    lines = (out / "logs" / "stage.log").read_text(errors="replace").splitlines()
    rows = [json.loads(x.split("[metrics] ", 1)[1]) for x in lines if "[metrics] " in x]
    rows = [r for r in rows if "tokens_per_s" in r]
    timed = _timed(rows, 2)
    tps = statistics.fmean(r["tokens_per_s"] for r in timed)
    return {"gpus": gpus, "steps_timed": len(timed), "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / gpus}


# -- the weight-sync worker (every rank, under torchrun) ------------------------------------------------------------
def sync_worker(spec: dict[str, Any]) -> None:
    import gc

    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.common.deepspeed_setup import ds_config
    from stages.common.distributed import init_distributed
    from stages.rl.engines import create_engine
    from stages.rl.placement import Placement
    from stages.rl.weight_sync import make_weight_sync

    world = int(os.environ["WORLD_SIZE"])
    split = spec["placement"] == "split"
    k = world // 2 if split else 0
    ranks = init_distributed(split_last=k)
    rank = ranks.rank
    placement = Placement(rank, world, range(world - k) if split else range(world),
                          range(world - k, world) if split else range(world))
    dtype = getattr(torch, spec["dtype"])
    results: dict[str, Any] = {}

    def save() -> None:
        if rank == 0:
            Path(spec["out"]).write_text(json.dumps(results, indent=2))

    def sync_device() -> None:
        if ranks.on_gpu:
            torch.cuda.synchronize()

    if not split and world > 1:
        results["interconnect"] = bandwidth(ranks, spec["bandwidth_mb"] << 20, dtype, dist, torch, sync_device)
        save()
    for name in spec["shapes"]:
        path = Path(spec["root"]) / name
        module = engine = sync = None
        t0 = time.time()
        if placement.is_trainer:
            config = AutoConfig.from_pretrained(path)
            # the model's module (and torch._dynamo, which it imports) must be imported before
            # zero.Init patches the tensor constructors: dynamo's import checks their signatures
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(config)
            with deepspeed.zero.Init(config_dict_or_path=ds_config(3, 1.0, dtype == torch.bfloat16), dtype=dtype):
                module = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if placement.is_engine:
            engine = create_engine("torch", str(path), device=str(ranks.device), dtype=spec["dtype"], max_batch=8,
                                   max_len=64)
        build_s = time.time() - t0
        sync = make_weight_sync(placement, ranks, module, engine, True, spec["bucket_mb"] << 20)
        pushes = []
        for version in range(spec["repeats"] + 1):  # the first push warms up (allocations, NCCL channels)
            ranks.everyone.barrier()
            sync_device()
            pushes.append(sync.push(version))
        per_rank = ranks.everyone.all_gather_objects(pushes)
        walls = [max(r[i] for r in per_rank) for i in range(len(pushes))]
        results[name] = {"params": sync.bytes // (2 if dtype == torch.bfloat16 else 4), "bytes": sync.bytes,
                         "placement": placement.describe, "bucket_mb": spec["bucket_mb"],
                         "seconds_median": statistics.median(walls[1:]), "seconds_all": walls,
                         "seconds_warmup": walls[0], "gbytes_per_s": sync.bytes / statistics.median(walls[1:]) / 1e9,
                         "build_seconds": build_s}
        save()
        del module, engine, sync
        gc.collect()
        if ranks.on_gpu:
            torch.cuda.empty_cache()
    ranks.everyone.barrier()
    dist.destroy_process_group()


def bandwidth(ranks, nbytes: int, dtype, dist, torch, sync_device) -> dict[str, float]:
    """NCCL (gloo on CPU) all-reduce bus bandwidth and broadcast bandwidth over every rank, as
    nccl-tests define them: all-reduce busbw = bytes / t x 2(n-1)/n; broadcast busbw = bytes / t."""
    n = ranks.world
    t = torch.ones(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=ranks.device)
    out = {"bytes": nbytes, "ranks": n}
    for op, factor in (("allreduce", 2 * (n - 1) / n), ("broadcast", 1.0)):
        times = []
        for i in range(7):
            sync_device()
            t0 = time.perf_counter()
            if op == "allreduce":
                dist.all_reduce(t)
            else:
                dist.broadcast(t, 0)
            sync_device()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out[f"{op}_busbw_gbytes_per_s"] = nbytes / statistics.median(times) * factor / 1e9
    return out


# -- helpers -------------------------------------------------------------------------------------------------------
def write_sparse_model(path: Path, shape: dict[str, Any], dtype: str) -> None:
    """A Qwen2 HF directory whose safetensors file has the shape's tensors, all zeros, as a
    sparse file: written in no time, read back without disk traffic."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model("qwen2", max_position_embeddings=4096, **shape)
    cfg.save_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    code, size = {"bfloat16": ("BF16", 2), "float32": ("F32", 4)}[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        n = t.numel() * size
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)


def _param_count(cfg) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()  # NVML: no CUDA context in this process


def _gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_scaling_out"), help="results dir ($OUT)")
    ap.add_argument("--work", default=None, help="scratch dir (store, stage logs); default: a temp dir")
    ap.add_argument("--smoke", action="store_true", help="CPU: 2 gloo ranks, tiny shapes")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; smoke: 2 ranks)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip what would end past this many seconds (default 480 on GPU, none in --smoke)")
    ap.add_argument("--only", type=lambda v: set(v.split(",")), default=None,
                    help="a comma-separated subset of: rl-c3po@1 (with sft@1), rl-c3po@n, rl-c3po-weak@n, sft@n, "
                         "sync-colocated, rl-sync@1, rl-sync@n, sync-split, faults, sft-pairs@n (setup always runs)")
    ap.add_argument("--stage-timeout-s", type=float, default=None,
                    help="a stage run still going after this long is killed and reported with its logs' tails "
                         "(default 300 on GPU, none in --smoke)")
    ap.add_argument("--settings", choices=sorted(SETTINGS), default="defaults",
                    help="the sft / RL stages' speed settings: defaults (none given: the `auto` the stages "
                         "decide, the headline rows) or zero3 (ZeRO-3, as rounds 4-6 measured)")
    ap.add_argument("--sft-pairs", type=int, default=3, help="sft-pairs@n: pairs of 1-GPU / n-GPU sft runs")
    ap.add_argument("--sft-shape", choices=["0.5B", "1.5B"], default="0.5B",
                    help="the sft runs' model shape (1.5B: a base of Qwen2-1.5B's body, built in setup)")
    ap.add_argument("--worker", choices=["stage", "sync"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "stage":
        return stage_worker(json.loads(args.spec))
    if args.worker == "sync":
        return sync_worker(json.loads(args.spec))

    started = time.time()
    report = Report(Path(args.out), started)
    args.gpus = args.gpus or (2 if args.smoke else _gpu_count())
    if not args.smoke and args.gpus < 1:
        raise SystemExit("no GPU visible (use --smoke on CPU)")
    if args.budget_s is None:
        args.budget_s = 0 if args.smoke else 480
    if args.stage_timeout_s is None and not args.smoke:
        args.stage_timeout_s = 300.0
    own_work = args.work is None  # a scratch dir this run made (removed at the end); a given one stays
    args.work = args.work or tempfile.mkdtemp(prefix="gpu_scaling_")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    import torch

    report.put("machine", {"gpus": args.gpus, "smoke": args.smoke, "torch": torch.__version__,
                           "gpu": "cpu" if args.smoke else _gpu_name(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "work": args.work,
                           "budget_s": args.budget_s, "settings": args.settings,
                           "sft_shape": args.sft_shape})
    report.log(f"gpu_scaling: {args.gpus} {'CPU rank(s) (smoke)' if args.smoke else 'GPU(s)'}, work dir {args.work}")
    Bench(args, report).all()
    report.log(f"done in {time.time() - started:.0f}s; results in {report.path}")
    if own_work:
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

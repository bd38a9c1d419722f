"""The `torch` rollout engine: a transformers causal LM decoded with our own static KV cache.

What it does, top to bottom (the pieces: kv_cache.py, attention.py, sampling.py,
cuda_graphs.py, fused_linear.py, moe.py):
- Loads the HF directory with `AutoModelForCausalLM` into its *own* copy of the weights
  (eval, no grad; never shares a tensor with the trainer). dtype "auto" = bfloat16 on CUDA,
  float32 on CPU; "fp8" = bf16 with the linear layers' matmuls in FP8 (fp8.py).
- A MoE model's expert choices are recorded per position (route_log.py: routing replay).
- Keeps a static KV cache `[slots, kv_heads, capacity, head_dim]` per layer (kv_cache.py) and
  runs the model's own modules (embeddings, RMSNorms, q/k/v/o projections, rotary embedding,
  MLP, lm_head) around it; only attention, the cache and the MoE dispatch (moe.py: static
  shapes, graph-safe) are ours. Models are accepted by structure, not by name: decoder layers
  with q/k/v/o projections (qwen3's q/k norms too), full attention, and a dense gate/up/down
  MLP or a MoE block of transformers' fused-experts layout (qwen2/llama/qwen3, qwen2_moe /
  qwen3_moe, init_model's ring_moe); anything else is refused with a clear message (use the
  vllm engine for it). A layer's q/k/v projections, and a dense MLP's gate/up, run as one
  matmul each over a packed weight whose slices are the modules' parameters (fused_linear.py).
- Continuous batching over `max_batch` slots: requests are prefilled (prompt +
  generated_ids, right-padded, one causal forward) into free slots, then decoded one token
  per step for all busy slots; finished slots are refilled from the pending requests once
  `refill_min_free` of them (default max_batch / 8) are free, or all the pending fit, or no
  slot is busy: a prefill is an eager forward whose launch overhead costs several decode
  steps (measured on an H200: ~18-20 ms per refill prefill vs ~2-3 ms per decode step at batch
  128), so refilling slot by slot spent more time in prefills than in decoding. When
  nothing is pending, the busy slots are compacted to the front once
  they fit a smaller batch bucket, so finished rollouts stop costing compute.
- On CUDA the decode step (forward + sampling) is captured as a CUDA graph per
  (batch bucket, kv-length bucket, sampling setting) and replayed (cuda_graphs.py); buckets
  are powers of two, captured lazily. On CPU (or with `cuda_graphs=False`) the same step
  runs eagerly with exact sizes (`static_shapes=True` keeps the buckets without graphs: the
  tests use it to check the GPU's bookkeeping on CPU).
- Decode attention (`decode_attention`, attention.py): "varlen" (CUDA default) reads only
  each row's own cached positions; "sdpa_masked" (CPU default, and the fallback when the
  varlen kernel is unavailable) runs SDPA over the whole kv-length bucket with a mask.
- Sampling (sampling.py): temperature / top-k / top-p with a `torch.Generator` seeded per
  call (`SamplingParams.seed`, else engine seed + call index). The reported logprob
  (pi_infer) is that of the untruncated softmax(logits / temperature), before top-k/top-p:
  the engine `reports_untruncated_logprobs`.
- `compile=True` runs the decode step (layers, final norm, lm_head, sampling) through
  torch.compile (compiled_step.py), one compile per shape, inside the same CUDA graphs; a
  failure warns once and falls back to the eager step.
- `update_weights` copies the trainer's full tensors by name into the engine's parameters
  in place (CUDA graphs stay valid), handles tied embeddings and `module.` prefixes, and
  records `last_sync_seconds`.

Not thread-safe: one `generate` / `update_weights` at a time.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from stages.common.hf_io import eos_token_ids_of, load_causal_lm, load_config
from stages.common.packed_attention import sdpa_without_cudnn
from stages.rl.engines.protocol import RolloutRequest, RolloutUpdate, SamplingParams, SyncTiming
from stages.rl.settings import WEIGHT_DTYPE_NAMES

from .attention import DecodeAttention, rotate_half
from .batching import ContinuousBatch
from .call_log import CallLog
from .compiled_step import DEFAULT_MAX_COMPILES, CompiledDecode
from .cuda_graphs import DecodeGraphs
from .fp8 import Fp8Weights, scaled_mm_unavailable
from .fused_linear import FusedLinear, pack_dense_mlp
from .kv_cache import KVCache, pow2_at_least
from .moe import MoEFeedForward, feed_forward
from .route_log import RouteLog
from .sampling import SamplingMode, sample
from .structure import check_structure
from .weights import EngineWeights, on_device

log = logging.getLogger(__name__)

_DTYPES = {name: getattr(torch, attr) for name, attr in WEIGHT_DTYPE_NAMES.items()}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype (fp8: bf16 on CUDA around the FP8 matmuls, fp32 on CPU: fp8.py)."""
    if dtype in ("auto", "fp8"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"torch engine: unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class TorchEngine(EngineWeights, SyncTiming):
    """See the module docstring. Construct through `create_engine("torch", model_dir, ...)`."""

    name = "torch"
    reports_untruncated_logprobs = True
    takes_stochastic_rounding = True  # every weight in `dtype` (fp8: refused by the recipe)

    def __init__(self, model_dir: str, *, device: str = "cpu", dtype: str = "auto",
                 max_batch: int = 64, max_len: int = 4096, seed: int = 0,
                 cuda_graphs: bool | None = None, static_shapes: bool | None = None,
                 eos_token_ids: list[int] | None = None, prefill_chunk_tokens: int = 16384,
                 decode_attention: str = "auto", refill_min_free: int | None = None,
                 compile: bool = False, compile_max_shapes: int = DEFAULT_MAX_COMPILES,
                 compile_mode: str = "default",
                 pack_projections: bool = True, trust_remote_code: bool = False, record_routes: bool = False,
                 fp8_scaling: str = "tensor", fp8_reference: bool = False):
        path = Path(model_dir)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"torch engine: {model_dir} is not a Hugging Face model "
                                    f"directory (no config.json)")
        if max_batch < 1 or max_len < 2:
            raise ValueError(f"torch engine: max_batch must be >= 1 and max_len >= 2, got "
                             f"{max_batch}, {max_len}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"torch engine: device {device!r} requested but CUDA is not available")
        self.dtype = resolve_dtype(dtype, self.device)
        fp8_missing = scaled_mm_unavailable(self.device) if dtype == "fp8" and not fp8_reference else None
        if fp8_missing:
            raise ValueError(f"torch engine: rollout.dtype fp8 multiplies through torch._scaled_mm, and {fp8_missing}; "
                             f"use rollout.dtype auto / bf16 on this machine")
        self.max_batch, self.max_len, self.seed = int(max_batch), int(max_len), int(seed)
        self.prefill_chunk_tokens = int(prefill_chunk_tokens)
        use_graphs = self._choose_shapes(cuda_graphs, static_shapes, compile)

        config = load_config(path, trust_remote_code=trust_remote_code)
        if getattr(config, "use_sliding_window", False) or any(
                t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
            raise ValueError(f"torch engine: {model_dir} uses sliding-window attention, which "
                             f"this engine does not implement; use the vllm engine")
        check_structure(config, model_dir, trust_remote_code)
        model = load_causal_lm(path, self.dtype, trust_remote_code=trust_remote_code)
        self.model = on_device(model, self.device, self.dtype).eval().requires_grad_(False)
        self.config = config
        inner = self.model.model
        for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(inner, attr):
                raise ValueError(f"torch engine: {config.model_type} model of this transformers "
                                 f"version has no model.{attr}; cannot run the static-cache path")
        rope_type = getattr(inner.rotary_emb, "rope_type", "default")
        if use_graphs and isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope"):
            # these recompute their frequencies from the positions on the host: not capturable
            log.warning("torch engine: %s RoPE recomputes on the host; decoding without CUDA "
                        "graphs", rope_type)
            use_graphs = False
        self.graphs = DecodeGraphs(self.device, use_graphs)
        self.compiled = CompiledDecode(self._decode_body, compile, compile_max_shapes, compile_mode)
        self.layers = list(inner.layers)
        self._pack_projections(model_dir, pack_projections)
        self.fp8 = Fp8Weights.attach(self.layers, self._packs, fp8_scaling, fp8_reference) if dtype == "fp8" else None
        attn0 = self.layers[0].self_attn
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(attn0, "head_dim", None) or config.hidden_size // self.n_heads)
        self.scaling = float(getattr(attn0, "scaling", self.head_dim ** -0.5))
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = (list(eos_token_ids) if eos_token_ids is not None
                              else eos_token_ids_of(path, trust_remote_code=trust_remote_code))

        self.attention = DecodeAttention(decode_attention, self.device, self.dtype, self.n_heads, self.n_kv,
                                         self.head_dim, self.scaling)
        self.decode_attention = self.attention.kind
        self.refill_min_free = max(1, self.max_batch // 8) if refill_min_free is None else int(refill_min_free)
        if self.refill_min_free < 1:
            raise ValueError(f"torch engine: refill_min_free must be >= 1, got {refill_min_free}")
        self.cache = self._make_cache(record_routes)

        # name -> parameter, tied names included (lm_head.weight is embed_tokens.weight)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))

        self._calls = 0
        self._gen = torch.Generator(device=self.device)
        self.last_stats: dict[str, float] = {}
        # sleep(weights=True): the parameters whose storage is released, with their shapes;
        # after wake() their contents are undefined until update_weights
        self._released: list[tuple[torch.nn.Parameter, torch.Size]] | None = None
        self._stale_weights = False

    def _make_cache(self, record_routes: bool) -> KVCache:
        """The static KV cache; with a routes row per slot when `record_routes` and the model
        has MoE blocks that route (`moe_ffns`, route_log.py)."""
        self.moe_ffns = [m for m in self.mlps if isinstance(m, MoEFeedForward)]
        record_routes = record_routes and bool(self.moe_ffns) and all(m.top_k > 0 for m in self.moe_ffns)
        return KVCache(len(self.layers), self.n_kv, self.head_dim, self.vocab, self.dtype, self.device,
                       self.max_len, self.static_shapes, on_realloc=self.graphs.clear,
                       route_shape=(len(self.moe_ffns), self.moe_ffns[0].top_k) if record_routes else None)

    def _choose_shapes(self, cuda_graphs: bool | None, static_shapes: bool | None, compile: bool) -> bool:
        """Whether decode steps are captured as CUDA graphs; sets `static_shapes`."""
        use_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        if use_graphs and self.device.type != "cuda":
            raise ValueError("torch engine: cuda_graphs=True needs a CUDA device")
        # power-of-two batch / kv-length buckets (what graphs need); testable on CPU
        # compile=True too: exact shapes would compile the step anew at every kv length
        self.static_shapes = (use_graphs or compile) if static_shapes is None else bool(static_shapes)
        if use_graphs and not self.static_shapes:
            raise ValueError("torch engine: cuda_graphs=True needs static_shapes=True")
        if compile and not self.static_shapes:
            raise ValueError("torch engine: compile=True needs static_shapes=True (one compile per "
                             "batch / kv-length bucket; exact shapes would compile every step)")
        return use_graphs

    def _pack_projections(self, model_dir: str, pack_projections: bool) -> None:
        """The layers' feed-forward blocks (`mlps`) and q/k/v projections (`qkv`): q/k/v and a
        dense MLP's gate/up as one matmul each (fused_linear.py); `_packs` own the storage of the
        parameters they hold (sleep / wake go through them). pack_projections=False keeps the
        modules' own matmuls (the A/B of benchmarks/engine_decode.py)."""
        self.mlps = [feed_forward(layer.mlp, f"layer {i} mlp of {model_dir}") for i, layer in enumerate(self.layers)]
        self.qkv = [FusedLinear.pack([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                    if pack_projections else None for layer in self.layers]
        self._packs = [p for p in self.qkv if p is not None]
        for i, mlp in enumerate(self.mlps):
            if pack_projections and mlp is self.layers[i].mlp:  # dense (MoE blocks: MoEFeedForward)
                self.mlps[i], gate_up = pack_dense_mlp(mlp)
                if gate_up is not None:
                    self._packs.append(gate_up)

    @property
    def use_graphs(self) -> bool:
        return self.graphs.enabled

    @property
    def packed_projections(self) -> str:
        """What runs as one matmul: q/k/v packs and gate/up packs (benchmarks report it)."""
        qkv = sum(p is not None for p in self.qkv)
        return f"qkv {qkv}, gate/up {len(self._packs) - qkv}" if self._packs else "off"

    def free_cache(self) -> None:
        """Release the KV cache and captured graphs; the next generate reallocates them."""
        self.cache.free()

    # ---------------------------------------------------------------- model pieces
    def _attn_qkv(self, li: int, attn, h: torch.Tensor, n: int, t: int):
        packed = self.qkv[li]
        q, k, v = packed(h) if packed is not None else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
        q = q.reshape(n, t, self.n_heads, self.head_dim)
        k = k.reshape(n, t, self.n_kv, self.head_dim)
        v = v.reshape(n, t, self.n_kv, self.head_dim)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(h)).float()

    # ---------------------------------------------------------------- prefill
    def _prefill(self, slots: list[int], seqs: list[list[int]], mode: SamplingMode) -> torch.Tensor:
        """Encode `seqs` into cache rows `slots`; returns [(token, logprob)] of their next token.
        Without SDPA's cuDNN kernel: a prefill's (rows, length) is new almost every time, and
        cuDNN builds a plan per shape (packed_attention.sdpa_without_cudnn)."""
        with sdpa_without_cudnn():
            return self._prefill_rows(slots, seqs, mode)

    def _prefill_rows(self, slots: list[int], seqs: list[list[int]], mode: SamplingMode) -> torch.Tensor:
        n, t = len(seqs), max(len(s) for s in seqs)
        dev = self.device
        ids = torch.zeros(n, t, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        ids = ids.to(dev)
        lens = torch.tensor([len(s) for s in seqs], device=dev)
        slot_idx = torch.tensor(slots, device=dev)
        pos = torch.arange(t, device=dev)[None, :].expand(n, t)
        x = self.model.model.embed_tokens(ids)
        cos, sin = self.model.model.rotary_emb(x, pos)
        cos, sin = cos[:, None], sin[:, None]
        groups = self.n_heads // self.n_kv
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = self._attn_qkv(li, attn, h, n, t)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.cache.k[li][slot_idx, :, :t] = k
            self.cache.v[li][slot_idx, :, :t] = v
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            # right padding: a real token never attends to the pads after it
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(n, t, -1))
            x = x + self.mlps[li](layer.post_attention_layernorm(x))
        last = x[torch.arange(n, device=dev), lens - 1]
        noise = None
        if not mode.greedy:
            noise = torch.empty(n, self.vocab, device=dev).exponential_(generator=self._gen)
        tok, lp = sample(self._logits(last), mode, noise)
        return torch.stack([tok.double(), lp.double()], dim=1)

    # ---------------------------------------------------------------- decode step
    def _decode_body(self, nb: int, kvb: int, mode: SamplingMode) -> None:
        """One token for cache rows [0, nb): reads tok_in/pos_in, writes out. Graph-safe."""
        c = self.cache
        tok, pos = c.tok_in[:nb], c.pos_in[:nb]
        x = self.model.model.embed_tokens(tok)[:, None, :]
        cos, sin = self.model.model.rotary_emb(x, pos[:, None])
        cos, sin = cos[:, None], sin[:, None]
        varlen = self.decode_attention == "varlen"
        mask = None if varlen else self.attention.mask(c.positions, pos, kvb)
        # where the new k/v go: (row, kv head, position) of the whole cache tensor; an index_put_
        # into the cache itself (not into a slice view) is what inductor turns into an in-place
        # store under compile=True, where a scatter into a view made it copy the cache first
        widx = (c.row_ids[:nb, None], c.head_ids[None, :], pos[:, None])
        groups = self.n_heads // self.n_kv
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = self._attn_qkv(li, attn, h, nb, 1)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            c.k[li].index_put_(widx, k[:, :, 0])
            c.v[li].index_put_(widx, v[:, :, 0])
            kc, vc = c.k[li][:nb], c.v[li][:nb]
            # the query heads sharing a kv head ride as `groups` query rows: no K/V repeat
            qg = q.reshape(nb, self.n_kv, groups, self.head_dim)
            if varlen:
                o = self.attention.varlen(qg, c.k[li], c.v[li], pos, nb, kvb)
            else:
                o = self.attention.masked(qg, kc, vc, mask, kvb)
            x = x + attn.o_proj(o.reshape(nb, 1, self.n_heads * self.head_dim))
            x = x + self.mlps[li](layer.post_attention_layernorm(x))
        noise = None if mode.greedy else c.noise[:nb]
        tok_new, lp = sample(self._logits(x[:, 0]), mode, noise)
        c.out[:nb, 0].copy_(tok_new)
        c.out[:nb, 1].copy_(lp)

    def _decode(self, nb: int, kvb: int, mode: SamplingMode) -> None:
        if not mode.greedy:
            self.cache.noise[:nb].exponential_(generator=self._gen)
        key = (nb, kvb, mode)
        step = self.compiled.step_for((*key, self.cache.rows, self.cache.capacity))
        if step is not None:
            try:
                self.graphs.run(key, lambda: step(nb, kvb, mode), on_failure="raise")
                return
            except Exception as e:  # the eager step below rewrites what it wrote: same values
                self.compiled.disable(e)
                self.graphs.clear()
        self.graphs.run(key, lambda: self._decode_body(nb, kvb, mode))

    # ---------------------------------------------------------------- generate
    def _check(self, requests: list[RolloutRequest]) -> None:
        for r in requests:
            ctx = len(r.prompt_ids) + len(r.generated_ids)
            if not r.prompt_ids:
                raise ValueError(f"torch engine: request {r.uid!r} has an empty prompt")
            if ctx + max(r.max_new_tokens, 0) > self.max_len:
                raise ValueError(
                    f"torch engine: request {r.uid!r} needs {len(r.prompt_ids)} prompt + "
                    f"{len(r.generated_ids)} generated + {r.max_new_tokens} new tokens = "
                    f"{ctx + r.max_new_tokens} > max_len {self.max_len}")
            bad = [t for t in (*r.prompt_ids, *r.generated_ids) if not 0 <= t < self.vocab]
            if bad:
                raise ValueError(f"torch engine: request {r.uid!r} has token ids outside the "
                                 f"vocabulary [0, {self.vocab}): {bad[:5]}")

    @torch.inference_mode()
    def generate(self, requests: list[RolloutRequest], sampling: SamplingParams,
                 finished_token_budget: int | None = None) -> list[RolloutUpdate]:
        t0 = time.perf_counter()
        if self._released is not None or self._stale_weights:
            raise RuntimeError("torch engine: generate after sleep(weights=True) needs wake() and then "
                               "update_weights (the weights were released)")
        self._check(requests)
        mode = SamplingMode.of(sampling, self.vocab)
        call_seed = sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self._calls
        self._calls += 1
        self._gen.manual_seed(int(call_seed) & 0x7FFF_FFFF_FFFF_FFFF)
        calls = CallLog(requests, self.eos_token_ids, finished_token_budget)
        routes = RouteLog(self.moe_ffns, len(requests)) if self.cache.route_shape else None
        stats = {"prefill_tokens": 0, "prefill_padded_tokens": 0, "prefills": 0, "prefill_seconds": 0.0,
                 "decode_steps": 0, "decode_row_steps": 0}

        pending: list[int] = []
        for i, r in enumerate(requests):
            if r.max_new_tokens <= 0:
                calls.finish_empty(i)
            else:
                pending.append(i)
        pending.reverse()  # pop() from the end = request order

        c = self.cache
        if pending and not calls.over_budget():
            n_slots = min(self.max_batch, len(pending))
            if self.static_shapes:
                n_slots = min(pow2_at_least(n_slots), self.max_batch)
            c.ensure(n_slots, c.capacity_for(max(
                len(requests[i].prompt_ids) + len(requests[i].generated_ids) + 1 for i in pending)))
        run = ContinuousBatch(requests, mode, calls, stats, pending, min(self.max_batch, c.rows),
                              np.full(c.rows, -1, dtype=np.int64), np.zeros(c.rows, dtype=np.int64), routes)
        while not calls.over_budget():
            run.refill(self)
            if calls.over_budget():
                break
            busy = np.flatnonzero(run.slot_req[:run.n_slots] >= 0)
            if not len(busy):
                if pending:
                    continue
                break
            run.decode(self, busy)

        stats["new_tokens"] = int(calls.count.sum())
        stats["seconds"] = time.perf_counter() - t0
        self.last_stats = stats
        updates = calls.updates(requests)
        if routes:
            routes.end_decode()
            fed = [len(r.prompt_ids) + len(r.generated_ids) + len(u.token_ids) - 1 for r, u in zip(requests, updates)]
            for u, recorded in zip(updates, routes.routes(fed)):
                u.routes = recorded
        return updates


def make_torch_engine(model_dir: str, *, device: str = "cpu", dtype: str = "auto",
                      max_batch: int = 64, max_len: int = 4096, seed: int = 0,
                      **engine_options) -> TorchEngine:
    """engine_options: cuda_graphs (bool, default: on for CUDA), static_shapes (bool, default:
    = cuda_graphs or compile), eos_token_ids (list[int], default: from generation_config / config /
    tokenizer; [] = never stop on EOS), prefill_chunk_tokens (int, default 16384),
    decode_attention ("auto" = varlen on CUDA, sdpa_masked on CPU; "varlen"; "sdpa_masked"),
    refill_min_free (int, default max_batch // 8: free slots that trigger a refill prefill),
    compile (bool, default False: the decode step through torch.compile, compiled_step.py),
    compile_max_shapes (int, default 32: decode shapes compiled at most; later ones run eagerly),
    compile_mode ("default"; "max-autotune-no-cudagraphs": GEMM autotuning, compiled_step.py),
    pack_projections (bool, default True: q/k/v and gate/up as one matmul each, fused_linear.py),
    record_routes (bool, default False: a MoE model's experts per position, RolloutUpdate.routes;
    the RL stages turn it on),
    fp8_scaling ("tensor" | "row": the scales of dtype "fp8", fp8.py), fp8_reference (bool, tests
    only: dtype "fp8" dequantised on the fly, where torch._scaled_mm cannot run)."""
    return TorchEngine(model_dir, device=device, dtype=dtype, max_batch=max_batch,
                       max_len=max_len, seed=seed, **engine_options)

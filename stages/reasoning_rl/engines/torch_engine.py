"""The `torch` rollout engine: a transformers causal LM decoded with our own static KV cache.

What it does, top to bottom:
- Loads the HF directory with `AutoModelForCausalLM` into its *own* copy of the weights
  (eval, no grad; never shares a tensor with the trainer). dtype "auto" = bfloat16 on CUDA,
  float32 on CPU.
- Keeps a static KV cache `[slots, kv_heads, capacity, head_dim]` per layer and runs the
  model's own modules (embeddings, RMSNorms, q/k/v/o projections, rotary embedding, MLP,
  lm_head) around it; only attention and the cache are ours. That covers the Llama
  family the pipeline builds (qwen2, llama; qwen3 too). Other model types are refused with
  a clear message (use the vllm engine for them).
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
  (batch bucket, kv-length bucket, sampling setting) and replayed; buckets are powers of
  two, captured lazily. On CPU (or with `cuda_graphs=False`) the same step runs eagerly
  with exact sizes (`static_shapes=True` keeps the buckets without graphs: the tests use
  it to check the GPU's bookkeeping on CPU).
- Decode attention (`decode_attention`): "varlen" (CUDA default) reads only each row's own
  cached positions: every (row, kv head) is one variable-length sequence of the cache,
  cu_seqlens = row offsets, seqused_k = the row's length, read by the fused varlen kernel
  (flash for bf16/fp16, memory-efficient for fp32; aten's `_flash_attention_forward` /
  `_efficient_attention_forward`), the `groups` query heads of a kv head riding as its
  query rows. Cost follows the actual lengths, not the longest row's, and the shapes stay
  static (graph-safe). "sdpa_masked" (CPU default, and the fallback when the varlen kernel
  is unavailable) runs SDPA over the whole kv-length bucket with a boolean mask: every row
  pays for the longest row.
- Sampling: temperature / top-k / top-p with a `torch.Generator` seeded per call
  (`SamplingParams.seed`, else engine seed + call index), Gumbel-max via exponential noise
  (argmax(p / E), E ~ Exp(1), the noise drawn eagerly outside the graph). temperature <= 0
  means greedy.
- Reported logprob (pi_infer): log_softmax(logits / temperature)[token], computed in fp32,
  *before* top-k/top-p truncation. That is the probability the IcePop ratio compares with
  the trainer's log_softmax(logits / temperature) of the same token; at temperature 1.0
  (the recipe) it is just the model's log-probability. Greedy reports log_softmax(logits).
- `update_weights` copies the trainer's full tensors by name into the engine's parameters
  in place (CUDA graphs stay valid), handles tied embeddings and `module.` prefixes, and
  records `last_sync_seconds`.

Not thread-safe: one `generate` / `update_weights` at a time.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from .base import RolloutRequest, RolloutUpdate, SamplingParams, register_engine

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3")
DECODE_ATTENTION = ("auto", "varlen", "sdpa_masked")  # see the module docstring
_IGNORED_PREFIXES = ("module.", "_orig_mod.")  # DeepSpeed engine / torch.compile wrappers


@dataclass(frozen=True)
class _Mode:
    """A sampling setting, baked into a captured decode graph."""

    greedy: bool
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def of(cls, s: SamplingParams, vocab: int) -> "_Mode":
        if s.top_p <= 0 or s.top_p > 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {s.top_p}")
        if s.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {s.top_k}")
        if s.temperature <= 0:
            return cls(greedy=True)
        top_k = 0 if s.top_k >= vocab else int(s.top_k)
        return cls(greedy=False, temperature=float(s.temperature), top_p=float(s.top_p), top_k=top_k)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(1, n)))))


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"torch engine: unknown dtype {dtype!r}; use auto, {', '.join(table)}")
    return table[dtype]


def eos_token_ids_of(model_dir: str | Path) -> list[int]:
    """EOS ids of an HF model dir: generation_config.json, config.json and the tokenizer's."""
    import json

    path = Path(model_dir)
    ids: list[int] = []

    def add(v):
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if x is not None and int(x) not in ids:
                ids.append(int(x))

    for name in ("generation_config.json", "config.json"):
        if (path / name).exists():
            add(json.loads((path / name).read_text()).get("eos_token_id"))
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        try:
            from transformers import AutoTokenizer
            add(AutoTokenizer.from_pretrained(str(path)).eos_token_id)
        except Exception as e:  # a model dir without a loadable tokenizer still decodes
            log.warning("could not load the tokenizer of %s (%s); EOS ids from the configs "
                        "only: %s", path, e, ids)
    return ids


class TorchEngine:
    """See the module docstring. Construct through `ENGINES["torch"](model_dir, ...)`."""

    name = "torch"

    def __init__(self, model_dir: str, *, device: str = "cpu", dtype: str = "auto",
                 max_batch: int = 64, max_len: int = 4096, seed: int = 0,
                 cuda_graphs: bool | None = None, static_shapes: bool | None = None,
                 eos_token_ids: list[int] | None = None, prefill_chunk_tokens: int = 16384,
                 decode_attention: str = "auto", refill_min_free: int | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM
        import transformers

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
        self.dtype = _resolve_dtype(dtype, self.device)
        self.max_batch, self.max_len, self.seed = int(max_batch), int(max_len), int(seed)
        self.prefill_chunk_tokens = int(prefill_chunk_tokens)
        self.use_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("torch engine: cuda_graphs=True needs a CUDA device")
        # power-of-two batch / kv-length buckets (what graphs need); testable on CPU
        self.static_shapes = self.use_graphs if static_shapes is None else bool(static_shapes)
        if self.use_graphs and not self.static_shapes:
            raise ValueError("torch engine: cuda_graphs=True needs static_shapes=True")

        config = AutoConfig.from_pretrained(str(path))
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"torch engine: model_type {config.model_type!r} of {model_dir} is not "
                             f"supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use the "
                             f"vllm engine for other architectures")
        if getattr(config, "use_sliding_window", False) or any(
                t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
            raise ValueError(f"torch engine: {model_dir} uses sliding-window attention, which "
                             f"this engine does not implement; use the vllm engine")
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(str(path), **{dtype_kw: self.dtype})
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.config = config
        inner = self.model.model
        for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(inner, attr):
                raise ValueError(f"torch engine: {config.model_type} model of this transformers "
                                 f"version has no model.{attr}; cannot run the static-cache path")
        rope_type = getattr(inner.rotary_emb, "rope_type", "default")
        if self.use_graphs and isinstance(rope_type, str) and (
                "dynamic" in rope_type or rope_type == "longrope"):
            # these recompute their frequencies from the positions on the host: not capturable
            log.warning("torch engine: %s RoPE recomputes on the host; decoding without CUDA "
                        "graphs", rope_type)
            self.use_graphs = False
        self.layers = list(inner.layers)
        attn0 = self.layers[0].self_attn
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(attn0, "head_dim", None) or config.hidden_size // self.n_heads)
        self.scaling = float(getattr(attn0, "scaling", self.head_dim ** -0.5))
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = (list(eos_token_ids) if eos_token_ids is not None
                              else eos_token_ids_of(path))

        self.decode_attention = self._pick_decode_attention(decode_attention)
        self.refill_min_free = max(1, self.max_batch // 8) if refill_min_free is None else int(refill_min_free)
        if self.refill_min_free < 1:
            raise ValueError(f"torch engine: refill_min_free must be >= 1, got {refill_min_free}")

        # name -> parameter, tied names included (lm_head.weight is embed_tokens.weight)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))

        self._calls = 0
        self._gen = torch.Generator(device=self.device)
        self._cap_b = self._cap_l = 0
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.last_sync_seconds: float | None = None
        self.sync_seconds_total = 0.0
        self.syncs = 0
        self.last_stats: dict[str, float] = {}

    # ---------------------------------------------------------------- decode attention
    def _varlen_kernel(self) -> str:
        return "flash" if self.dtype in (torch.bfloat16, torch.float16) else "efficient"

    def _pick_decode_attention(self, choice: str) -> str:
        if choice not in DECODE_ATTENTION:
            raise ValueError(f"torch engine: decode_attention must be one of "
                             f"{', '.join(DECODE_ATTENTION)}; got {choice!r}")
        if choice == "sdpa_masked" or (choice == "auto" and self.device.type != "cuda"):
            return "sdpa_masked"
        if self.device.type != "cuda":
            raise ValueError(f"torch engine: decode_attention={choice!r} needs a CUDA device "
                             f"(the fused varlen kernels are CUDA-only); use sdpa_masked or auto")
        try:  # a tiny probe against the masked reference: the private op may be missing
            self._probe_varlen()
        except Exception as e:
            if choice == "varlen":
                raise RuntimeError(f"torch engine: decode_attention='varlen' unusable on this "
                                   f"torch/GPU: {type(e).__name__}: {e}") from e
            log.warning("torch engine: varlen decode attention unavailable (%s: %s); using "
                        "masked SDPA over the kv-length bucket", type(e).__name__, e)
            return "sdpa_masked"
        return "varlen"

    def _probe_varlen(self) -> None:
        g = torch.Generator(device=self.device).manual_seed(0)
        groups, d, rows, cap = self.n_heads // self.n_kv, self.head_dim, 3, 32
        kc = torch.randn(rows, self.n_kv, cap, d, generator=g, device=self.device).to(self.dtype)
        vc = torch.randn(rows, self.n_kv, cap, d, generator=g, device=self.device).to(self.dtype)
        q = torch.randn(rows, self.n_kv, groups, d, generator=g, device=self.device).to(self.dtype)
        pos = torch.tensor([0, 9, cap - 1], device=self.device)
        got = self._attend_varlen(q, kc, vc, pos, rows, cap)
        mask = (torch.arange(cap, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        want = F.scaled_dot_product_attention(q.float(), kc.float(), vc.float(), attn_mask=mask,
                                              scale=self.scaling)
        err = (got.float() - want).abs().max().item()
        if not err < (1e-2 if self.dtype != torch.float32 else 1e-4):
            raise RuntimeError(f"varlen probe disagrees with masked SDPA (max abs error {err:.3g})")

    def _attend_varlen(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                       pos: torch.Tensor, nb: int, kvb: int) -> torch.Tensor:
        """Attention of q [nb, n_kv, groups, d] over each row's positions [0, pos] of the cache
        kc/vc [rows >= nb, n_kv, capacity, d] (contiguous); returns [nb, n_kv, groups, d].

        Each (row, kv head) is one sequence of the flattened cache (offset = its index x
        capacity, length = pos + 1): the kernel reads only the positions a row has. The
        `groups` query heads sharing a kv head are that sequence's query rows (no causal
        mask: they all see the same keys). Static shapes; no host sync (graph-safe).
        """
        groups, d = q.shape[2], q.shape[3]
        cap = kc.shape[2]
        n_seq = nb * self.n_kv
        ar = torch.arange(n_seq + 1, device=q.device, dtype=torch.int32)
        cu_q, cu_k = ar * groups, ar * cap
        used = (pos[:nb] + 1).to(torch.int32)[:, None].expand(nb, self.n_kv).contiguous().view(n_seq)
        kf, vf = kc.view(-1, 1, d), vc.view(-1, 1, d)  # [rows x n_kv x capacity, 1 head, d]
        qf = q.reshape(n_seq * groups, 1, d).contiguous()
        if self._varlen_kernel() == "flash":
            o = torch.ops.aten._flash_attention_forward(
                qf, kf, vf, cu_q, cu_k, groups, kvb, 0.0, False, False,
                scale=self.scaling, seqused_k=used)[0]
        else:
            o = torch.ops.aten._efficient_attention_forward(
                qf[None], kf[None], vf[None], None, cu_q, cu_k, groups, kvb, 0.0, 0,
                scale=self.scaling, seqlen_k=used)[0][0]
        return o.view(nb, self.n_kv, groups, d)

    # ---------------------------------------------------------------- buffers
    # The KV cache holds `slots` rows of `capacity` positions per layer. It starts at the
    # longest context of a call and doubles (keeping its contents) whenever a row reaches
    # its end, up to max_len: memory follows the longest rollout actually decoded, not
    # max_len. It only grows; `free_cache()` gives it back (e.g. while the trainer runs).
    def _cap_for(self, length: int) -> int:
        return min(_pow2_at_least(length, 16), self.max_len)

    def _drop_graphs(self) -> None:
        # The private memory pool dies with its last graph: a handle kept past that point
        # trips the caching allocator's use-count assert at the next capture.
        self._graphs.clear()
        self._pool = None

    def free_cache(self) -> None:
        """Release the KV cache and captured graphs; the next generate reallocates them."""
        self._drop_graphs()
        self._k, self._v = [], []
        self._cap_b = self._cap_l = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _grow(self, length: int) -> None:
        """Make room for `length` positions mid-call, keeping every row's cached keys/values."""
        if length <= self._cap_l:
            return
        cap = min(max(length, 2 * self._cap_l, 16), self.max_len)
        if self.static_shapes:
            cap = max(cap, self._cap_for(length))
        self._drop_graphs()
        shape = (self._cap_b, self.n_kv, cap, self.head_dim)
        for cache in (self._k, self._v):
            for i, old in enumerate(cache):  # one layer at a time: peak = cache + one layer
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                new[:, :, :self._cap_l] = old
                cache[i] = new
                del old
        self._ar_kv = torch.arange(cap, device=self.device)
        self._cap_l = cap

    def _ensure_buffers(self, n_slots: int, length: int) -> None:
        """At the start of a call (nothing cached yet): room for n_slots rows of `length`."""
        if n_slots <= self._cap_b and length <= self._cap_l:
            return
        b = max(n_slots, self._cap_b)
        cap = max(length, self._cap_l)
        self.free_cache()  # captured graphs die with the old buffers
        shape = (b, self.n_kv, cap, self.head_dim)
        self._k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self._v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        dev = self.device
        self._tok_in = torch.zeros(b, dtype=torch.long, device=dev)
        self._pos_in = torch.zeros(b, dtype=torch.long, device=dev)
        self._noise = torch.ones(b, self.vocab, dtype=torch.float32, device=dev)
        self._out = torch.zeros(b, 2, dtype=torch.float64, device=dev)  # (token, logprob)
        self._ar_kv = torch.arange(cap, device=dev)
        self._cap_b, self._cap_l = b, cap

    # ---------------------------------------------------------------- model pieces
    def _attn_qkv(self, attn, h: torch.Tensor, n: int, t: int):
        q = attn.q_proj(h).view(n, t, self.n_heads, self.head_dim)
        k = attn.k_proj(h).view(n, t, self.n_kv, self.head_dim)
        v = attn.v_proj(h).view(n, t, self.n_kv, self.head_dim)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(h)).float()

    @staticmethod
    def _sample(logits: torch.Tensor, mode: _Mode, noise: torch.Tensor | None):
        """(token, logprob) per row. logprob = log_softmax(logits / T)[token] (see module doc)."""
        if mode.greedy:
            lp_all = torch.log_softmax(logits, dim=-1)
            tok = logits.argmax(dim=-1)
        else:
            lp_all = torch.log_softmax(logits / mode.temperature, dim=-1)
            scores = lp_all
            if mode.top_k > 0:
                kth = torch.topk(scores, mode.top_k, dim=-1).values[:, -1:]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            if mode.top_p < 1.0:
                srt, idx = torch.sort(scores, dim=-1, descending=True)
                probs = torch.softmax(srt, dim=-1)
                drop_sorted = (probs.cumsum(dim=-1) - probs) > mode.top_p
                drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
                scores = scores.masked_fill(drop, float("-inf"))
            # Gumbel-max: argmax(log p - log E) with E ~ Exp(1) samples from softmax(scores)
            tok = (scores - noise.clamp_min(1e-30).log()).argmax(dim=-1)
        lp = lp_all.gather(-1, tok[:, None])[:, 0]
        return tok, lp

    # ---------------------------------------------------------------- prefill
    def _prefill(self, slots: list[int], seqs: list[list[int]], mode: _Mode) -> torch.Tensor:
        """Encode `seqs` into cache rows `slots`; returns [(token, logprob)] of their next token."""
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
            q, k, v = self._attn_qkv(attn, h, n, t)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self._k[li][slot_idx, :, :t] = k
            self._v[li][slot_idx, :, :t] = v
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            # right padding: a real token never attends to the pads after it
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(n, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = x[torch.arange(n, device=dev), lens - 1]
        noise = None
        if not mode.greedy:
            noise = torch.empty(n, self.vocab, device=dev).exponential_(generator=self._gen)
        tok, lp = self._sample(self._logits(last), mode, noise)
        return torch.stack([tok.double(), lp.double()], dim=1)

    # ---------------------------------------------------------------- decode step
    def _decode_body(self, nb: int, kvb: int, mode: _Mode) -> None:
        """One token for cache rows [0, nb): reads _tok_in/_pos_in, writes _out. Graph-safe."""
        tok, pos = self._tok_in[:nb], self._pos_in[:nb]
        x = self.model.model.embed_tokens(tok)[:, None, :]
        cos, sin = self.model.model.rotary_emb(x, pos[:, None])
        cos, sin = cos[:, None], sin[:, None]
        varlen = self.decode_attention == "varlen"
        mask = None if varlen else (self._ar_kv[:kvb][None, :] <= pos[:, None])[:, None, None, :]
        widx = pos.view(nb, 1, 1, 1).expand(nb, self.n_kv, 1, self.head_dim)
        groups = self.n_heads // self.n_kv
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = self._attn_qkv(attn, h, nb, 1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = self._k[li][:nb], self._v[li][:nb]
            kc.scatter_(2, widx, k)
            vc.scatter_(2, widx, v)
            # the query heads sharing a kv head ride as `groups` query rows: no K/V repeat
            qg = q.reshape(nb, self.n_kv, groups, self.head_dim)
            if varlen:
                o = self._attend_varlen(qg, self._k[li], self._v[li], pos, nb, kvb)
            else:
                o = F.scaled_dot_product_attention(qg, kc[:, :, :kvb], vc[:, :, :kvb],
                                                   attn_mask=mask, scale=self.scaling)
            x = x + attn.o_proj(o.reshape(nb, 1, self.n_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        noise = None if mode.greedy else self._noise[:nb]
        tok_new, lp = self._sample(self._logits(x[:, 0]), mode, noise)
        self._out[:nb, 0].copy_(tok_new)
        self._out[:nb, 1].copy_(lp)

    def _decode(self, nb: int, kvb: int, mode: _Mode) -> None:
        if not mode.greedy:
            self._noise[:nb].exponential_(generator=self._gen)
        if not self.use_graphs:
            self._decode_body(nb, kvb, mode)
            return
        key = (nb, kvb, mode)
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(nb, kvb, mode)
            except Exception as e:  # keep decoding correctly, just slower
                log.warning("torch engine: CUDA graph capture failed (%s: %s); decoding eagerly",
                            type(e).__name__, e)
                self.use_graphs = False
                self._drop_graphs()
                self._decode_body(nb, kvb, mode)
                return
            self._graphs[key] = graph
        graph.replay()

    def _capture(self, nb: int, kvb: int, mode: _Mode) -> "torch.cuda.CUDAGraph":
        # Warm-up on a side stream (lazy cuBLAS/SDPA init); it computes exactly what the replay
        # will compute (same inputs), so its cache writes and outputs are harmless.
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode_body(nb, kvb, mode)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads (logging, data loading) does not void it
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._decode_body(nb, kvb, mode)
        return graph

    def _bucket_b(self, n: int) -> int:
        return min(_pow2_at_least(n), self._cap_b) if self.static_shapes else n

    def _bucket_kv(self, n: int) -> int:
        return min(_pow2_at_least(n, 16), self._cap_l) if self.static_shapes else n

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
        self._check(requests)
        mode = _Mode.of(sampling, self.vocab)
        call_seed = sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self._calls
        self._calls += 1
        self._gen.manual_seed(int(call_seed) & 0x7FFF_FFFF_FFFF_FFFF)
        eos = np.array(self.eos_token_ids, dtype=np.int64)

        n = len(requests)
        earlier = np.array([len(r.generated_ids) for r in requests], dtype=np.int64)
        limit = np.array([r.max_new_tokens for r in requests], dtype=np.int64)
        count = np.zeros(n, dtype=np.int64)  # new tokens so far, per request
        reason: list[str | None] = [None] * n
        logged: list[tuple[np.ndarray, np.ndarray]] = []  # per step: (requests, [token, logprob])
        done_tokens = 0  # summed response length of the requests finished in this call
        budget = finished_token_budget
        stats = {"prefill_tokens": 0, "prefills": 0, "decode_steps": 0, "decode_row_steps": 0}

        def over_budget() -> bool:
            return budget is not None and done_tokens >= budget

        def record(reqs: np.ndarray, out: np.ndarray) -> np.ndarray:
            """One new (token, logprob) per request in `reqs`; returns which of them finished."""
            nonlocal done_tokens
            logged.append((reqs, out))
            count[reqs] += 1
            is_eos = np.isin(out[:, 0].astype(np.int64), eos)
            fin = is_eos | (count[reqs] >= limit[reqs])
            for j in np.flatnonzero(fin):
                reason[reqs[j]] = "eos" if is_eos[j] else "length"
            done_tokens += int((earlier[reqs[fin]] + count[reqs[fin]]).sum())
            return fin

        pending: list[int] = []
        for i, r in enumerate(requests):
            if r.max_new_tokens <= 0:
                reason[i] = "length"
                done_tokens += int(earlier[i])
            else:
                pending.append(i)
        pending.reverse()  # pop() from the end = request order

        if pending and not over_budget():
            n_slots = min(self.max_batch, len(pending))
            if self.static_shapes:
                n_slots = min(_pow2_at_least(n_slots), self.max_batch)
            self._ensure_buffers(n_slots, self._cap_for(max(
                len(requests[i].prompt_ids) + len(requests[i].generated_ids) + 1 for i in pending)))

        n_slots = min(self.max_batch, self._cap_b)
        slot_req = np.full(self._cap_b, -1, dtype=np.int64)  # request index per cache row
        slot_pos = np.zeros(self._cap_b, dtype=np.int64)     # next cache position of the row
        dev = self.device

        while not over_budget():
            # 1) refill free slots from the pending requests (prefill in chunks)
            # (batched: wait until refill_min_free slots are free, or all the pending fit, or
            # nothing decodes; one eager prefill costs several decode steps of launch overhead)
            free = np.flatnonzero(slot_req[:n_slots] < 0)
            if pending and len(free) and (len(free) == n_slots or len(free) >= min(
                    self.refill_min_free, len(pending))):
                new = [(int(b), pending.pop()) for b in free[:len(pending)]]
                for chunk in self._chunks(new, requests):
                    if over_budget():  # the rest stay unstarted
                        break
                    slots = np.array([b for b, _ in chunk])
                    reqs = np.array([i for _, i in chunk])
                    seqs = [requests[i].prompt_ids + requests[i].generated_ids for i in reqs]
                    self._grow(max(len(q) for q in seqs) + 1)
                    stats["prefill_tokens"] += sum(len(q) for q in seqs)
                    stats["prefills"] += 1
                    out = self._prefill(slots.tolist(), seqs, mode).cpu().numpy()
                    keep = ~record(reqs, out)
                    if keep.any():
                        rows = slots[keep]
                        slot_req[rows] = reqs[keep]
                        slot_pos[rows] = [len(q) for q, k in zip(seqs, keep) if k]
                        idx = torch.from_numpy(rows).to(dev)
                        self._tok_in[idx] = torch.from_numpy(out[keep, 0]).long().to(dev)
                        self._pos_in[idx] = torch.from_numpy(slot_pos[rows]).to(dev)
                if over_budget():
                    break
            busy = np.flatnonzero(slot_req[:n_slots] >= 0)
            if not len(busy):
                if pending:
                    continue
                break
            # 2) compact busy rows to the front once they fit a smaller batch bucket
            hi = int(busy[-1]) + 1
            if not pending and self._bucket_b(len(busy)) < self._bucket_b(hi):
                self._compact(busy, slot_req, slot_pos)
                busy = np.arange(len(busy))
                hi = len(busy)
            # 3) one decode step for rows [0, nb)
            nb = self._bucket_b(hi)
            kv_need = int(slot_pos[busy].max()) + 1
            self._grow(kv_need)
            self._decode(nb, self._bucket_kv(kv_need), mode)
            out = self._out[:hi].cpu().numpy()
            stats["decode_steps"] += 1
            stats["decode_row_steps"] += nb
            fin = record(slot_req[busy], out[busy])
            slot_pos[busy] += 1
            slot_req[busy[fin]], slot_pos[busy[fin]] = -1, 0
            # next inputs: the sampled tokens; positions from the host mirror, where a free
            # row sits at 0 (it rewrites position 0 of its own unused row, never past it)
            self._tok_in[:hi].copy_(self._out[:hi, 0].long())
            self._pos_in[:hi].copy_(torch.from_numpy(slot_pos[:hi]))

        toks: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        if logged:  # regroup the per-step logs by request (a stable sort keeps time order)
            reqs = np.concatenate([r for r, _ in logged])
            outs = np.concatenate([o for _, o in logged])
            order = np.argsort(reqs, kind="stable")
            reqs, outs = reqs[order], outs[order]
            bounds = np.searchsorted(reqs, np.arange(n + 1))
            for i in range(n):
                part = outs[bounds[i]:bounds[i + 1]]
                toks[i] = part[:, 0].astype(np.int64).tolist()
                lps[i] = part[:, 1].tolist()
        stats["new_tokens"] = int(count.sum())
        stats["seconds"] = time.perf_counter() - t0
        self.last_stats = stats
        return [RolloutUpdate(uid=r.uid, token_ids=toks[i], logprobs=lps[i],
                              finished=reason[i] is not None, finish_reason=reason[i])
                for i, r in enumerate(requests)]

    def _chunks(self, new: list[tuple[int, int]], requests: list[RolloutRequest]):
        """Split prefills so that one forward holds at most ~prefill_chunk_tokens padded tokens."""
        chunk: list[tuple[int, int]] = []
        longest = 0
        for b, i in new:
            ln = len(requests[i].prompt_ids) + len(requests[i].generated_ids)
            if chunk and max(longest, ln) * (len(chunk) + 1) > self.prefill_chunk_tokens:
                yield chunk
                chunk, longest = [], 0
            chunk.append((b, i))
            longest = max(longest, ln)
        if chunk:
            yield chunk

    def _compact(self, busy: np.ndarray, slot_req: np.ndarray, slot_pos: np.ndarray) -> None:
        """Move the busy cache rows (ascending) to the front: rows [0, len(busy))."""
        n = len(busy)
        length = int(slot_pos[busy].max())
        src = torch.from_numpy(busy).to(self.device)
        for cache in (*self._k, *self._v):
            cache[:n, :, :length] = cache[src, :, :length]
        self._tok_in[:n] = self._tok_in[src]
        self._pos_in[:n] = self._pos_in[src]
        self._pos_in[n:] = 0
        slot_req[:n], slot_req[n:] = slot_req[busy], -1
        slot_pos[:n], slot_pos[n:] = slot_pos[busy], 0

    # ---------------------------------------------------------------- weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors by name into this engine's parameters, in place.

        Names are the trainer model's `named_parameters()` (a leading `module.` of a
        DeepSpeed engine or `_orig_mod.` of torch.compile is ignored). Every engine
        parameter must be covered (a tied lm_head is covered by the embedding); unknown
        names and shape mismatches raise. Sets `last_sync_seconds`.
        """
        t0 = time.perf_counter()
        seen: set[int] = set()
        unknown: list[str] = []
        for name, tensor in named_tensors:
            key = name
            while key not in self._params and key.startswith(_IGNORED_PREFIXES):
                key = key.split(".", 1)[1]
            param = self._params.get(key)
            if param is None:
                unknown.append(name)
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                hint = (" (an empty tensor: under ZeRO-3 gather the parameters first)"
                        if tensor.numel() == 0 else "")
                raise ValueError(f"torch engine: update_weights: {name} has shape "
                                 f"{tuple(tensor.shape)}, the engine's {key} has "
                                 f"{tuple(param.shape)}{hint}")
            param.copy_(tensor.detach())
            seen.add(id(param))
        if unknown:
            raise ValueError(f"torch engine: update_weights: {len(unknown)} names match no "
                             f"engine parameter, e.g. {unknown[:5]}")
        missing = sorted({k for k, p in self._params.items() if id(p) not in seen})
        if missing:
            raise ValueError(f"torch engine: update_weights: {len(missing)} engine parameters "
                             f"were not sent, e.g. {missing[:5]}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_sync_seconds = time.perf_counter() - t0
        self.sync_seconds_total += self.last_sync_seconds
        self.syncs += 1
        log.info("torch engine: weight sync %d took %.3f s", self.syncs, self.last_sync_seconds)


@register_engine("torch")
def make_torch_engine(model_dir: str, *, device: str = "cpu", dtype: str = "auto",
                      max_batch: int = 64, max_len: int = 4096, seed: int = 0,
                      **engine_options) -> TorchEngine:
    """engine_options: cuda_graphs (bool, default: on for CUDA), static_shapes (bool, default:
    = cuda_graphs), eos_token_ids (list[int], default: from generation_config / config /
    tokenizer; [] = never stop on EOS), prefill_chunk_tokens (int, default 16384),
    decode_attention ("auto" = varlen on CUDA, sdpa_masked on CPU; "varlen"; "sdpa_masked"),
    refill_min_free (int, default max_batch // 8: free slots that trigger a refill prefill)."""
    return TorchEngine(model_dir, device=device, dtype=dtype, max_batch=max_batch,
                       max_len=max_len, seed=seed, **engine_options)

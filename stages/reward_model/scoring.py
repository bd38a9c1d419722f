"""Batched inference with a trained reward model (a `reward_model` stage output).

    scorer = RewardScorer(model_dir, device="cpu", batch_size=16, trust_remote_code=False)
    scores = scorer.score(prompts, responses)   # prompts: str or message lists; one float each

The prompt + response are rendered exactly as in training (stages.reward_model.data:
chat template, thinking stripped when the model was trained so, head kept at the model's
`max_seq_len`). Sequences are sorted by length and batched (right padding; the head reads
the last non-pad token), on the scorer's own device: general RL keeps it off the policy's
GPUs, or on CPU in CI. Imports torch and transformers only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from stages.common.hf_io import load_sequence_classifier, load_tokenizer
from stages.reward_model.data import encode

META = "reward_model.json"  # written by the stage next to the weights


class RewardScorer:
    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu", batch_size: int = 16,
                 max_seq_len: int | None = None, dtype: torch.dtype | None = None, *, trust_remote_code: bool):
        model_dir = Path(model_dir)
        meta_path = model_dir / META
        if not meta_path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a reward_model stage output (no {META}); "
                                    "train one with a `reward_model` stage")
        self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code, what="reward model")
        self.model = load_sequence_classifier(model_dir, dtype, trust_remote_code=trust_remote_code).to(self.device)
        self.model.eval()
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            raise ValueError(f"reward model {model_dir}: config has no pad_token_id (the head could "
                             "not find the last token of padded sequences)")
        self.batch_size = batch_size
        self.strip = bool(self.meta["strip_thinking"])
        self.max_seq_len = min(max_seq_len or self.meta["max_seq_len"], self.meta["max_seq_len"])

    def encode(self, prompt: str | list[dict], response: str) -> list[int]:
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids, _ = encode(self.tokenizer, msgs, [{"role": "assistant", "content": response}], self.strip,
                        self.max_seq_len)
        return ids

    @torch.no_grad()
    def score_ids(self, sequences: Sequence[list[int]]) -> list[float]:
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        out = [0.0] * len(sequences)
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            width = len(sequences[idx[0]])
            ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            att = torch.zeros((len(idx), width), dtype=torch.long)
            for b, i in enumerate(idx):
                ids[b, :len(sequences[i])] = torch.tensor(sequences[i])
                att[b, :len(sequences[i])] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                use_cache=False).logits
            for b, i in enumerate(idx):
                out[i] = float(logits[b, 0].float())
        return out

    def score(self, prompts: Sequence[str | list[dict]], responses: Sequence[str]) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return self.score_ids([self.encode(p, r) for p, r in zip(prompts, responses)])

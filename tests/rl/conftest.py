"""A tiny policy for RL tests: init_model's tokenizer + Qwen2, briefly SFT'd on arithmetic.

The short SFT teaches the chat format and, above all, to end answers with <|im_end|>, so
rollouts finish at different lengths (EOS) as a real policy's do.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

SFT_STEPS = 150


def _response(row: dict) -> str:
    q = row["prompt"].split("?")[0].removeprefix("What is ").strip()
    return f"<think>{q}</think>{row['reference']['answer']}"


def build_tiny_policy(out: Path, seed: int = 0) -> dict[str, Path]:
    import torch

    from stages.init_model.build import build_model, train_tokenizer
    from stages.init_model.config import TinyArchitecture, TokenizerSpec
    from verifiers.math_gen import generate_arithmetic

    out.mkdir(parents=True, exist_ok=True)
    rl_rows = generate_arithmetic(48, seed=1, max_operand=9)
    sft_rows = generate_arithmetic(256, seed=2, max_operand=9)
    (out / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rl_rows))
    corpus = out / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": r["prompt"], "response": _response(r)}) + "\n"
                              for r in sft_rows + rl_rows))
    tok, _ = train_tokenizer([corpus], TokenizerSpec(corpus=[str(corpus)], vocab_size=320), 512)
    arch = TinyArchitecture(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=96, max_position_embeddings=512)
    model = build_model(arch, tok, seed)
    seqs = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]},
                                     {"role": "assistant", "content": _response(r)}], tokenize=True)
            for r in sft_rows]
    seqs = [list(s["input_ids"] if isinstance(s, dict) or hasattr(s, "input_ids") else s) for s in seqs]
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest and does not fight other tests
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pad = tok.pad_token_id
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(SFT_STEPS):
        idx = torch.randint(0, len(seqs), (16,), generator=g).tolist()
        T = max(len(seqs[i]) for i in idx)
        ids = torch.full((16, T), pad)
        for b, i in enumerate(idx):
            ids[b, :len(seqs[i])] = torch.tensor(seqs[i])
        labels = ids.masked_fill(ids == pad, -100)
        loss = model(input_ids=ids, attention_mask=(ids != pad).long(), labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.set_num_threads(threads)
    model.eval()
    policy = out / "policy"
    model.save_pretrained(policy)
    tok.save_pretrained(policy, save_jinja_files=False)
    return {"model": policy, "data": out / "rl.jsonl"}


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> dict[str, Path]:
    return build_tiny_policy(tmp_path_factory.mktemp("rl_tiny"))

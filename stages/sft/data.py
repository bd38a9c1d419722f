"""SFT data: chat rows -> tokens + loss targets -> packed sequences.

Rules (the stage's data contract):
- Input: jsonl/json/parquet files, or a directory of them (recursive, sorted), read by
  stages/common/rows.py. A row needs `messages`: a non-empty list of {role: str, content: str}
  with at least one assistant turn whose content is not empty. Other fields are ignored.
- Malformed rows: `on_bad_row="fail"` (default) stops the stage at the first one, naming
  file, line (jsonl) or row and reason. `"skip"` leaves them out, counts them
  per reason and reports them (log line + stage_summary.json `data.bad_rows`, with the
  first examples' file/row/reason). Nothing is dropped without being counted.
- Tokens: the tokenizer's chat template renders the whole conversation; the loss is on
  assistant turns only (their `<think>` section, the answer and the closing eos token).
  Everything else (system/user turns, role headers, the text after eos) is masked (-100).
- Targets are stored shifted: `targets[t]` is the token that position t must predict
  (`ids[t+1]` if that token is trained, else -100; the last position of every sample is
  -100), so nothing is ever predicted across a sample boundary.
- Longer than `max_seq_len`: truncated to its first `max_seq_len` tokens (the head is
  kept; the cut tail, usually the end of the answer and its eos, is lost), counted as
  `truncated`. A sample left with no trained token after truncation (the prompt alone
  fills the window) cannot teach anything: it is left out and counted as
  `no_target_after_truncation`.
- Packing: samples are shuffled with the seed and packed in that order into sequences of
  at most `max_seq_len` tokens (next-fit). Position ids restart at 0 for every sample;
  transformers turns restarting position ids into a block-diagonal causal mask (when
  `attention_mask` is None and no cache is used), so attention never crosses samples.
  Padding at the end of a batch is one more segment (its own positions, targets -100).
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from stages.common.chat import render_chat
from stages.common.rows import DataError, Row

MAX_EXAMPLES = 20


@dataclass
class Sample:
    input_ids: list[int]
    targets: list[int]  # shifted: what each position predicts, -100 = no loss

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_targets(self) -> int:
        return sum(t != -100 for t in self.targets)


@dataclass
class DataStats:
    rows: int = 0
    samples: int = 0
    truncated: int = 0
    no_target_after_truncation: int = 0
    bad_rows: Counter = field(default_factory=Counter)
    bad_examples: list[str] = field(default_factory=list)
    tokens: int = 0
    target_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "samples": self.samples, "truncated": self.truncated,
                "no_target_after_truncation": self.no_target_after_truncation,
                "bad_rows": dict(self.bad_rows), "bad_row_examples": self.bad_examples,
                "tokens": self.tokens, "target_tokens": self.target_tokens}


def check_messages(row: dict) -> tuple[str, str] | None:
    """None if the row is a usable chat; else (reason key, human-readable reason)."""
    msgs = row.get("messages")
    if msgs is None:
        return "no_messages", "no `messages` field"
    if not isinstance(msgs, list) or not msgs:
        return "bad_messages", "`messages` must be a non-empty list"
    has_answer = False
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            return "bad_message", f"messages[{j}] is not an object"
        if not isinstance(m.get("role"), str) or not m["role"]:
            return "bad_message", f"messages[{j}].role must be a non-empty string"
        if not isinstance(m.get("content"), str):
            return "bad_message", f"messages[{j}].content must be a string"
        if m["role"] == "assistant" and m["content"].strip():
            has_answer = True
    if not has_answer:
        return "no_assistant", "no assistant message with content (nothing to train on)"
    return None


# -- tokenising ------------------------------------------------------------------------------
def trained_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant turns (content
    through the eos token that closes the turn)."""
    full = render_chat(tokenizer, messages, False)
    eos = tokenizer.eos_token
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render_chat(tokenizer, messages[:i], True) if i else render_chat(tokenizer, [], True)
        upto = render_chat(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(head) and full.startswith(upto)):
            raise DataError(
                "the chat template is not prefix-stable (rendering the first k messages is not a "
                "prefix of rendering k+1), so assistant turns cannot be located; use a template "
                "that renders each message independently")
        end = upto.rfind(eos, len(head)) if eos else -1
        spans.append((len(head), end + len(eos) if end >= 0 else len(upto)))
    return full, spans


def tokenize_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, shifted targets) of one conversation, untruncated."""
    text, spans = trained_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    trained = [any(s <= start < e for s, e in spans) for start, _ in offsets]
    targets = [ids[t + 1] if trained[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]
    return ids, targets


def build_samples(rows: Iterator[Row], tokenizer, max_seq_len: int,
                  on_bad_row: str) -> tuple[list[Sample], DataStats]:
    stats = DataStats()
    samples: list[Sample] = []
    for r in rows:
        stats.rows += 1
        row = r.data
        problem = check_messages(row) if isinstance(row, dict) else ("bad_row", "a row must be a JSON object")
        if problem is not None:
            key, reason = problem
            where = f"{r.where}: {reason}"
            if on_bad_row == "fail":
                raise DataError(f"sft data {where} (set on_bad_row: skip to leave such rows out "
                                "and count them)")
            stats.bad_rows[key] += 1
            if len(stats.bad_examples) < MAX_EXAMPLES:
                stats.bad_examples.append(where)
            continue
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        ids, targets = tokenize_chat(tokenizer, messages)
        if len(ids) > max_seq_len:
            stats.truncated += 1
            ids, targets = ids[:max_seq_len], targets[:max_seq_len]
            targets[-1] = -100  # the token it predicted was cut
            if all(t == -100 for t in targets):
                stats.no_target_after_truncation += 1
                continue
        s = Sample(ids, targets)
        samples.append(s)
        stats.samples += 1
        stats.tokens += len(s)
        stats.target_tokens += s.n_targets
    return samples, stats


# -- packing and batching --------------------------------------------------------------------
def pack_samples(lengths: list[int], max_seq_len: int, seed: int, packing: bool = True) -> list[list[int]]:
    """Sample indices per pack: shuffled with `seed`, then next-fit into `max_seq_len`."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    if not packing:
        return [[i] for i in order]
    packs: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        if cur and used + lengths[i] > max_seq_len:
            packs.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        packs.append(cur)
    return packs


def collate(samples: list[Sample], packs: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """A [len(packs), L] batch (L = longest pack): input_ids, targets, position_ids."""
    seqs = []
    for pack in packs:
        ids, tgt, pos = [], [], []
        for i in pack:
            s = samples[i]
            ids += s.input_ids
            tgt += s.targets
            pos += range(len(s))
        seqs.append((ids, tgt, pos))
    width = max(len(ids) for ids, _, _ in seqs)
    out = {k: torch.empty(len(seqs), width, dtype=torch.long) for k in ("input_ids", "targets", "position_ids")}
    for r, (ids, tgt, pos) in enumerate(seqs):
        pad = width - len(ids)
        out["input_ids"][r] = torch.tensor(ids + [pad_id] * pad)
        out["targets"][r] = torch.tensor(tgt + [-100] * pad)
        out["position_ids"][r] = torch.tensor(pos + list(range(pad)))
    return out

"""SFT data: chat rows -> tokens + loss targets -> packed sequences.

Rules (the stage's data contract):
- Input: any data input the stages read (stages/common/rows.py: jsonl/json/parquet/arrow
  files, directories, saved datasets, hub datasets, a `split`). Each row becomes chat
  `messages` by its format (`SFTData.format`, field names in `SFTData.fields`):
  `messages` (a list of {role, content}), `sharegpt` (`conversations` of {from, value},
  `from` mapped to a role by `sharegpt_roles`), `alpaca` (`instruction` + optional `input`
  as the user turn, `output` as the answer, optional `system`), `prompt_completion`
  (`prompt` and `completion`, each a string or a list of messages); `auto` takes the first
  of these whose field the row has. The result needs a non-empty list of {role: str,
  content: str} with at least one assistant turn whose content is not empty. Other fields
  are ignored.
- Malformed rows (unreadable JSON included): `on_bad_row="fail"` (default) stops the stage
  at the first one, naming file, line (jsonl) or row and reason. `"skip"` leaves them out,
  counts them per reason and reports them (log line + stage_summary.json `data.bad_rows`,
  with the first examples' file/row/reason). Nothing is dropped without being counted.
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
from stages.sft.config import SFTData, SFTFields

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


class RowProblem(ValueError):
    """A row that cannot be a training chat: (reason key, human-readable reason)."""

    def __init__(self, key: str, reason: str):
        super().__init__(reason)
        self.key, self.reason = key, reason


def _turns(value: Any, f: SFTFields, field: str) -> list[dict]:
    """A list of messages, {role, content} under the configured names."""
    if not isinstance(value, list):
        raise RowProblem("bad_messages", f"`{field}` must be a list of messages")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowProblem("bad_message", f"{field}[{j}] is not an object")
        out.append({"role": m.get(f.role), "content": m.get(f.content)})
    return out


def _from_messages(row: dict, f: SFTFields) -> list[dict]:
    if row.get(f.messages) is None:
        raise RowProblem("no_messages", f"no `{f.messages}` field")
    return _turns(row[f.messages], f, f.messages)


def _from_sharegpt(row: dict, f: SFTFields) -> list[dict]:
    conv = row.get(f.conversations)
    if conv is None:
        raise RowProblem("no_messages", f"no `{f.conversations}` field")
    if not isinstance(conv, list):
        raise RowProblem("bad_messages", f"`{f.conversations}` must be a list")
    out = []
    for j, m in enumerate(conv):
        if not isinstance(m, dict):
            raise RowProblem("bad_message", f"{f.conversations}[{j}] is not an object")
        who = m.get(f.sharegpt_from)
        if who not in f.sharegpt_roles:
            raise RowProblem("bad_message", f"{f.conversations}[{j}].{f.sharegpt_from} is {who!r}, not one of "
                             f"{sorted(f.sharegpt_roles)} (fields.sharegpt_roles maps them to roles)")
        out.append({"role": f.sharegpt_roles[who], "content": m.get(f.sharegpt_value)})
    return out


def _system(row: dict, f: SFTFields) -> list[dict]:
    system = row.get(f.system)
    if system is None or system == "":
        return []
    if not isinstance(system, str):
        raise RowProblem("bad_message", f"`{f.system}` must be a string")
    return [{"role": "system", "content": system}]


def _text(row: dict, key: str, required: bool = True) -> str:
    v = row.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str):
        raise RowProblem("no_messages" if v is None else "bad_message",
                         f"`{key}` is {'missing' if v is None else type(v).__name__}, expected a string")
    return v


def _from_alpaca(row: dict, f: SFTFields) -> list[dict]:
    instruction, extra = _text(row, f.instruction), _text(row, f.input, required=False)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [*_system(row, f), {"role": "user", "content": user},
            {"role": "assistant", "content": _text(row, f.output)}]


def _from_prompt_completion(row: dict, f: SFTFields) -> list[dict]:
    def part(key: str, role: str) -> list[dict]:
        v = row.get(key)
        if isinstance(v, str):
            return [{"role": role, "content": v}]
        if v is None:
            raise RowProblem("no_messages", f"no `{key}` field")
        return _turns(v, f, key)
    prompt = part(f.prompt, "user")
    return [*(_system(row, f) if isinstance(row.get(f.prompt), str) else []), *prompt,
            *part(f.completion, "assistant")]


# format -> (the field that identifies it, row -> messages); `auto` tries them in this order
FORMATS = {
    "messages": (lambda f: f.messages, _from_messages),
    "sharegpt": (lambda f: f.conversations, _from_sharegpt),
    "alpaca": (lambda f: f.instruction, _from_alpaca),
    "prompt_completion": (lambda f: f.completion, _from_prompt_completion),
}


def row_messages(row: Any, data: SFTData) -> list[dict]:
    """The chat messages of a row in `data`'s format; RowProblem when it has none."""
    if not isinstance(row, dict):
        raise RowProblem("bad_row", "a row must be a JSON object")
    f, fmt = data.fields, data.format
    if fmt == "auto":
        fmt = next((name for name, (key, _) in FORMATS.items() if row.get(key(f)) is not None), None)
        if fmt is None:
            looked = ", ".join(f"`{key(f)}` ({name})" for name, (key, _) in FORMATS.items())
            raise RowProblem("no_messages", f"the row has none of the fields {looked}")
    msgs = FORMATS[fmt][1](row, f)
    problem = check_messages(msgs)
    if problem is not None:
        raise RowProblem(*problem)
    return msgs


def check_messages(msgs: Any) -> tuple[str, str] | None:
    """None if `msgs` is a usable chat; else (reason key, human-readable reason)."""
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


def build_samples(rows: Iterator[Row], tokenizer, max_seq_len: int, on_bad_row: str,
                  data: SFTData) -> tuple[list[Sample], DataStats]:
    """Samples of the rows (`data`: their format); rows read with `keep_bad=True`."""
    stats = DataStats()
    samples: list[Sample] = []
    for r in rows:
        stats.rows += 1
        try:
            if r.error is not None:
                raise RowProblem("unreadable", r.error)
            messages = row_messages(r.data, data)
        except RowProblem as p:
            where = f"{r.where}: {p.reason}"
            if on_bad_row == "fail":
                raise DataError(f"sft data {where} (set on_bad_row: skip to leave such rows out "
                                "and count them)") from None
            stats.bad_rows[p.key] += 1
            if len(stats.bad_examples) < MAX_EXAMPLES:
                stats.bad_examples.append(where)
            continue
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
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

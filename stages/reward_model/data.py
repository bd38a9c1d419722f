"""Preference data: rows -> normalised pairs -> token ids; bad rows are quarantined.

Row formats (one file may mix them; other fields are ignored):

1. Pairwise: `prompt`, `chosen`, `rejected`.
   `prompt` is a string (one user turn) or a list of {role, content} messages. `chosen` /
   `rejected` are a string (the assistant's reply) or a list of messages: the reply's turns
   (first one from the assistant), or the whole conversation (HH-RLHF style), in which case
   `prompt` may be left out and is the messages both conversations share.
2. Arena: a `winner` field, "model_a" | "model_b" | "tie" | "tie (bothbad)" (also "a" /
   "b"), with `conversation_a` / `conversation_b` (whole conversations) or `prompt` +
   `response_a` / `response_b`. The one-hot columns `winner_model_a` / `winner_model_b` /
   `winner_tie` are accepted instead of `winner`; `prompt` / `response_*` given as lists of
   strings (turns, or JSON text of such a list, as in lmsys arena-human-preference-55k) are
   interleaved user / assistant turns.
A field whose value is null counts as absent (files read with `datasets` get every column
on every row).

A pair is (prompt messages, chosen reply turns, rejected reply turns, label): label 1 = the
first reply is preferred; a tie has label 1/2 (kept with `ties: half`, else counted in
`ties_dropped` and left out: a tie is not a bad row).

Quarantine (a row left out, with a reason, written to `quarantine.jsonl`):
unreadable (not valid JSON / UTF-8), missing_field, bad_type, bad_messages, bad_winner (unknown winner value), no_response
(a reply with no assistant text), identical (the two replies are the same after
whitespace normalisation, or after removing the thinking part when `strip_thinking`),
too_long (the prompt alone fills `max_seq_len`), identical_after_truncation (the replies
differ only past `max_seq_len`). A stage whose rows are mostly bad fails (`max_bad_fraction`).

Tokens: the chat template renders prompt + reply; truncated to the first `max_seq_len`
tokens. With `strip_thinking`, the `<think>...</think>` part of every assistant turn is
removed first (text after the last `</think>`; an unclosed `<think>` leaves nothing), so the
model scores answers, not reasoning. `stages.reward_model.scoring` uses the same functions.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from stages.common.chat import encode_text, render_chat
from stages.common.rows import Row

MAX_EXAMPLES = 20
WINNERS = {"model_a": 1.0, "a": 1.0, "model_b": 0.0, "b": 0.0, "tie": 0.5, "tie (bothbad)": 0.5}
_WS = re.compile(r"\s+")


class PairProblem(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class Pair:
    id: str
    where: str                 # "file:LINE" / "file row N", for messages
    prompt: list[dict]         # messages before the replies
    chosen: list[dict]         # reply turns (first one from the assistant)
    rejected: list[dict]
    label: float = 1.0         # P(chosen is preferred): 1, or 1/2 for a tie

    def key(self, seed: int) -> float:
        """A number in [0, 1) from the pair's content: the held-out split."""
        text = json.dumps([self.prompt, sorted([json.dumps(self.chosen), json.dumps(self.rejected)])],
                          sort_keys=True)
        h = hashlib.sha256(f"{seed}/{text}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2 ** 64


@dataclass
class PairStats:
    rows: int = 0
    pairs: int = 0
    ties: int = 0
    ties_dropped: int = 0
    truncated: int = 0
    quarantined: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def quarantine(self, where: str, problem: PairProblem) -> None:
        self.quarantined[problem.reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {problem}")

    def as_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "pairs": self.pairs, "ties": self.ties,
                "ties_dropped": self.ties_dropped, "truncated": self.truncated,
                "quarantined": sum(self.quarantined.values()),
                "quarantine_reasons": dict(self.quarantined), "quarantine_examples": self.examples}


# -- text ------------------------------------------------------------------------------------
def strip_thinking(text: str) -> str:
    """The answer part of a response: after the last </think>; nothing if <think> is unclosed."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1].strip()
    if "<think>" in text:
        return text.split("<think>", 1)[0].strip()
    return text


def _norm(text: str) -> str:
    return _WS.sub(" ", text).strip()


def _messages(value: Any, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise PairProblem("bad_type", f"`{name}` must be a string or a non-empty list of messages")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"] \
                or not isinstance(m.get("content"), str):
            raise PairProblem("bad_messages", f"`{name}[{j}]` must be {{role: str, content: str}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _present(row: dict, name: str) -> Any:
    v = row.get(name)
    if v is None or (isinstance(v, (str, list)) and not v):
        raise PairProblem("missing_field", f"`{name}` is missing or empty")
    return v


def _turns(value: Any, name: str) -> list[str] | None:
    """A list of strings (or JSON text of one) -> the strings; None for anything else."""
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, list) and value and all(isinstance(v, str) or v is None for v in value):
        return ["" if v is None else v for v in value]
    return None


def _prompt(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return _messages(value, "prompt")


def _reply(value: Any, name: str, prompt: list[dict] | None) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    msgs = _messages(value, name)
    if prompt is not None and len(msgs) > len(prompt) and msgs[:len(prompt)] == prompt:
        msgs = msgs[len(prompt):]  # a whole conversation that repeats the prompt
    return msgs


def _split_conversations(a: list[dict], b: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """Shared prefix (up to the first differing assistant turn) and the two replies."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    while n > 0 and a[n - 1]["role"] == "assistant":  # a reply starts at an assistant turn
        n -= 1
    return a[:n], a[n:], b[n:]


def _interleave(prompts: list[str], replies: list[str]) -> tuple[list[dict], list[dict]]:
    """Multi-turn arena rows (lists of turns): the last reply is judged, earlier turns are prompt."""
    if len(prompts) != len(replies):
        raise PairProblem("bad_messages", f"{len(prompts)} prompt turns but {len(replies)} reply turns")
    msgs: list[dict] = []
    for p, r in zip(prompts, replies):
        msgs += [{"role": "user", "content": p}, {"role": "assistant", "content": r}]
    return msgs[:-1], msgs[-1:]


def _winner(row: dict) -> float:
    if "winner" in row and row["winner"] is not None:
        w = str(row["winner"]).strip().lower()
        if w not in WINNERS:
            raise PairProblem("bad_winner", f"`winner` is {row['winner']!r}; expected one of "
                                            "model_a, model_b, tie, tie (bothbad)")
        return WINNERS[w]
    hot = [row.get(k) for k in ("winner_model_a", "winner_model_b", "winner_tie")]
    if any(h is None for h in hot) or sorted(int(bool(h)) for h in hot) != [0, 0, 1]:
        raise PairProblem("bad_winner", "winner_model_a / winner_model_b / winner_tie must be "
                                        f"one-hot, got {hot}")
    return (1.0, 0.0, 0.5)[[bool(h) for h in hot].index(True)]


def _arena(row: dict) -> tuple[list[dict], list[dict], list[dict], float]:
    label = _winner(row)
    if "conversation_a" in row or "conversation_b" in row:
        a = _messages(_present(row, "conversation_a"), "conversation_a")
        b = _messages(_present(row, "conversation_b"), "conversation_b")
        prompt, ra, rb = _split_conversations(a, b)
        return prompt, ra, rb, label
    p, ra, rb = (_present(row, k) for k in ("prompt", "response_a", "response_b"))
    tp, ta, tb = _turns(p, "prompt"), _turns(ra, "response_a"), _turns(rb, "response_b")
    if tp is not None and ta is not None and tb is not None:
        prompt, a = _interleave(tp, ta)
        prompt_b, b = _interleave(tp, tb)
        if prompt_b != prompt:  # earlier replies differ: judge the whole multi-turn answer
            prompt, a, b = _split_conversations(prompt + a, prompt_b + b)
        return prompt, a, b, label
    prompt = _prompt(p)
    return prompt, _reply(ra, "response_a", prompt), _reply(rb, "response_b", prompt), label


def _pairwise(row: dict) -> tuple[list[dict], list[dict], list[dict], float]:
    chosen, rejected = _present(row, "chosen"), _present(row, "rejected")
    if row.get("prompt") in (None, "", []) and isinstance(chosen, list) and isinstance(rejected, list):
        prompt, c, r = _split_conversations(_messages(chosen, "chosen"), _messages(rejected, "rejected"))
        if not prompt:
            raise PairProblem("missing_field", "`prompt` is missing and the two conversations share "
                                               "no prompt turns")
        return prompt, c, r, 1.0
    prompt = _prompt(_present(row, "prompt"))
    return prompt, _reply(chosen, "chosen", prompt), _reply(rejected, "rejected", prompt), 1.0


def _answer_text(reply: list[dict], strip: bool) -> str:
    return "\n".join(_norm(strip_thinking(m["content"]) if strip and m["role"] == "assistant"
                           else m["content"]) for m in reply)


def normalise_row(row: Any, where: str, index: int, strip: bool) -> Pair:
    """One row -> a Pair, or PairProblem(reason, detail)."""
    if not isinstance(row, dict):
        raise PairProblem("bad_type", "a row must be a JSON object")
    row = {k: v for k, v in row.items() if v is not None}  # `datasets` fills absent columns with None
    if any(k in row for k in ("winner", "winner_model_a", "conversation_a", "response_a")):
        prompt, a, b, label = _arena(row)
    elif "chosen" in row or "rejected" in row:
        prompt, a, b, label = _pairwise(row)
    else:
        raise PairProblem("missing_field", "neither `chosen`/`rejected` nor an arena `winner` with "
                                           "two responses")
    for name, reply in (("first", a), ("second", b)):
        if not reply or reply[0]["role"] != "assistant":
            raise PairProblem("no_response", f"the {name} reply does not start with an assistant turn")
        if not any(m["role"] == "assistant" and m["content"].strip() for m in reply):
            raise PairProblem("no_response", f"the {name} reply has no assistant text")
    if _answer_text(a, False) == _answer_text(b, False):
        raise PairProblem("identical", "the two replies are the same text")
    if strip and _answer_text(a, True) == _answer_text(b, True):
        raise PairProblem("identical", "the two replies differ only in their thinking part "
                                       "(strip_thinking is on: the model sees the same answer)")
    rid = row.get("id") if isinstance(row.get("id"), (str, int)) else None
    return Pair(str(rid if rid is not None else index), where, prompt, a, b, label)


# -- tokens ----------------------------------------------------------------------------------
def encode(tokenizer, prompt: list[dict], reply: list[dict], strip: bool, max_len: int) -> tuple[list[int], bool]:
    """(token ids, truncated) of prompt + reply, the first `max_len` tokens kept."""
    msgs = prompt + [{"role": m["role"], "content": strip_thinking(m["content"])
                      if strip and m["role"] == "assistant" else m["content"]} for m in reply]
    ids = encode_text(tokenizer, render_chat(tokenizer, msgs))
    return (ids[:max_len], True) if len(ids) > max_len else (ids, False)


@dataclass
class EncodedPair:
    chosen: list[int]
    rejected: list[int]
    label: float


def encode_pairs(rows: Iterable[Row], tokenizer, *, strip: bool, max_len: int,
                 ties: str, stats: PairStats, quarantine: list[dict]) -> Iterator[tuple[Pair, EncodedPair]]:
    """(pair, tokens) for every good row of `rows`; bad rows go to `quarantine` (file, line or
    row, id, reason, detail, the row itself) and `stats`."""
    for src in rows:
        stats.rows += 1
        row, where = src.data, src.where
        try:
            if src.error is not None:
                raise PairProblem("unreadable", src.error)
            pair = normalise_row(row, where, stats.rows - 1, strip)
            if pair.label == 0.0:  # arena "model_b": the second reply is the preferred one
                pair.chosen, pair.rejected, pair.label = pair.rejected, pair.chosen, 1.0
            if pair.label == 0.5:
                stats.ties += 1
                if ties == "drop":
                    stats.ties_dropped += 1
                    continue
            prompt_len = len(encode(tokenizer, pair.prompt, [], strip, max_len + 1)[0])
            if prompt_len >= max_len:
                raise PairProblem("too_long", f"the prompt alone is {prompt_len}+ tokens, "
                                              f"max_seq_len is {max_len}")
            c, tc = encode(tokenizer, pair.prompt, pair.chosen, strip, max_len)
            r, tr = encode(tokenizer, pair.prompt, pair.rejected, strip, max_len)
            if c == r:
                raise PairProblem("identical_after_truncation",
                                  f"the replies differ only after the first {max_len} tokens")
        except PairProblem as p:
            stats.quarantine(where, p)
            quarantine.append({"file": str(src.file), "row": src.number, "id": row.get("id") if isinstance(row, dict) else None,
                               "reason": p.reason, "detail": p.detail, "data": _clip(row)})
            continue
        stats.truncated += int(tc or tr)
        stats.pairs += 1
        yield pair, EncodedPair(c, r, pair.label)


def _clip(value: Any, limit: int = 2000) -> Any:
    """The row as quarantined: long strings cut, so one huge row does not bloat the file."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + f"... [{len(value) - limit} more chars]"
    if isinstance(value, list):
        return [_clip(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: _clip(v, limit) for k, v in value.items()}
    return value


def split_heldout(pairs: list[tuple[Pair, EncodedPair]], fraction: float, seed: int
                  ) -> tuple[list[EncodedPair], list[EncodedPair]]:
    """(train, held out): a pair is held out when its content hash is below `fraction`, so a
    duplicated pair never sits on both sides; at least one pair is held out when fraction > 0
    and there are two or more pairs."""
    if fraction <= 0:
        return [e for _, e in pairs], []
    keys = [p.key(seed) for p, _ in pairs]
    held = {i for i, k in enumerate(keys) if k < fraction}
    if not held and len(pairs) >= 2:
        held = {min(range(len(keys)), key=keys.__getitem__)}
    if len(held) == len(pairs):  # keep something to train on
        held.discard(max(held, key=keys.__getitem__))
    return ([e for i, (_, e) in enumerate(pairs) if i not in held],
            [e for i, (_, e) in enumerate(pairs) if i in held])

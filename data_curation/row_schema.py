"""Row schemas: where a row's prompt and response text live (config), and checks on them.

Three row shapes are understood, tried in this order:
- chat: `{"id", "messages": [{"role", "content"}, ...], ...}`; the response is the
  concatenation of the turns whose role is in `response_roles` (assistant), the prompt
  is every other turn (system, user, tool);
- pair: `{"prompt": str, "response": str}` (either may be missing, not both);
- text: `{"text": str}`, matched as a response with an empty prompt.
Field names are configurable (`FieldMap`). A row that fits none of them, or whose fields
have the wrong types, is quarantined with the reason. `RowPolicy` says what happens to
rows that parse but are suspect: a chat or pair row with a response and no prompt, and
rows that repeat an earlier row's id.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Literal, NamedTuple

from pydantic import Field

from data_curation._base import Strict


class FieldMap(Strict):
    id: str | None = Field("id", description="row id field (optional in rows)")
    messages: str = "messages"
    role_key: str = "role"
    content_key: str = "content"
    response_roles: list[str] = Field(["assistant"], min_length=1)
    prompt: str = "prompt"
    response: str = "response"
    text: str = "text"
    domain: str = Field("domain", description="field holding a domain label, if rows have one")


class RowPolicy(Strict):
    duplicate_ids: Literal["report", "quarantine_repeats", "quarantine_all"] = Field(
        "report", description="rows whose id an earlier row has: report them (all kept), "
        "quarantine every repeat (the first stays), or quarantine every row of a repeated id")
    response_only: Literal["keep", "quarantine"] = Field(
        "quarantine", description="chat/pair rows with a response but no prompt (always "
        "counted in the report); `text` rows are response-only by design and always kept")


class RowError(ValueError):
    """A row that cannot be used: the message is the quarantine reason."""


class RowText(NamedTuple):
    prompt: str
    response: str
    id: str | None
    shape: Literal["chat", "pair", "text"]

    @property
    def response_only(self) -> bool:
        """A chat/pair row that answers no prompt."""
        return self.shape != "text" and not self.prompt.strip() and bool(self.response.strip())


TURN_SEP = "\n\n"


def extract(row: Any, fm: FieldMap) -> RowText:
    """The matching texts, id and shape of a row, or RowError with the reason."""
    if not isinstance(row, dict):
        raise RowError(f"row is a JSON {type(row).__name__}, not an object")
    rid = row.get(fm.id) if fm.id else None
    if rid is not None and not isinstance(rid, (str, int)):
        raise RowError(f"field {fm.id!r} is {type(rid).__name__}, expected string or integer")
    rid = None if rid is None else str(rid)
    if fm.messages in row and row[fm.messages] is not None:
        msgs = row[fm.messages]
        if not isinstance(msgs, list):
            raise RowError(f"field {fm.messages!r} is {type(msgs).__name__}, expected a list")
        if not msgs:
            raise RowError(f"field {fm.messages!r} is an empty list")
        prompt, response = [], []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise RowError(f"{fm.messages}[{i}] is {type(m).__name__}, expected an object")
            role, content = m.get(fm.role_key), m.get(fm.content_key)
            if not isinstance(role, str):
                raise RowError(f"{fm.messages}[{i}].{fm.role_key} is missing or not a string")
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise RowError(f"{fm.messages}[{i}].{fm.content_key} is {type(content).__name__}, "
                               "expected a string")
            (response if role in fm.response_roles else prompt).append(content)
        return RowText(TURN_SEP.join(prompt), TURN_SEP.join(response), rid, "chat")
    has_p = row.get(fm.prompt) is not None
    has_r = row.get(fm.response) is not None
    if has_p or has_r:
        for key in (fm.prompt, fm.response):
            v = row.get(key)
            if v is not None and not isinstance(v, str):
                raise RowError(f"field {key!r} is {type(v).__name__}, expected a string")
        return RowText(row.get(fm.prompt) or "", row.get(fm.response) or "", rid, "pair")
    if row.get(fm.text) is not None:
        v = row[fm.text]
        if not isinstance(v, str):
            raise RowError(f"field {fm.text!r} is {type(v).__name__}, expected a string")
        return RowText("", v, rid, "text")
    keys = ", ".join(sorted(map(str, row))[:12]) or "none"
    raise RowError(f"row has none of the fields {fm.messages!r}, {fm.prompt!r}/{fm.response!r}, "
                   f"{fm.text!r} (its keys: {keys})")


def map_texts(row: dict, fm: FieldMap, fn: Callable[[str, str], str]) -> bool:
    """Apply `fn(text, part)` (part = "prompt" | "response") to every text of the row in
    place; returns whether anything changed."""
    changed = False
    if fm.messages in row and row[fm.messages] is not None:
        for m in row[fm.messages]:
            content = m.get(fm.content_key)
            if isinstance(content, str):
                new = fn(content, "response" if m.get(fm.role_key) in fm.response_roles else "prompt")
                if new != content:
                    m[fm.content_key] = new
                    changed = True
        return changed
    keys = ((fm.prompt, "prompt"), (fm.response, "response"))
    if row.get(fm.prompt) is None and row.get(fm.response) is None:
        keys = ((fm.text, "response"),)
    for key, part in keys:
        v = row.get(key)
        if isinstance(v, str):
            new = fn(v, part)
            if new != v:
                row[key] = new
                changed = True
    return changed


def dump_row(obj: Any) -> str:
    """A row as one JSON line: UTF-8 text, or \\u escapes where the text holds lone
    surrogates (which UTF-8 cannot carry). NaN and infinities raise ValueError: they are
    not JSON, and a file holding them is not valid JSON lines."""
    s = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(obj, allow_nan=False)
    return s


def field_text(prompt: str, response: str, which: str) -> str:
    if which == "prompt":
        return prompt
    if which == "response":
        return response
    return f"{prompt}\n{response}" if prompt and response else prompt or response

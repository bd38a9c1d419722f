"""Responses as text for the reward functions: `make_decoder(tokenizer, eos_ids)` decodes token
ids (special tokens removed) into `Decoded` strings that also carry the response's token count
and whether generation ended with EOS (length penalties need both)."""
from __future__ import annotations

from typing import Callable, Sequence


class Decoded(str):
    """A decoded response (special tokens removed) that remembers its token count and
    whether generation ended with EOS."""

    n_tokens: int
    ended_by_eos: bool

    def __new__(cls, text: str, n_tokens: int, ended_by_eos: bool) -> "Decoded":
        obj = super().__new__(cls, text)
        obj.n_tokens, obj.ended_by_eos = n_tokens, ended_by_eos
        return obj

    def __reduce__(self):  # pickles (broadcast_object_list) as itself
        return (Decoded, (str(self), self.n_tokens, self.ended_by_eos))


def make_decoder(tokenizer, eos_ids: Sequence[int]) -> Callable[[list[int]], Decoded]:
    eos = set(int(t) for t in eos_ids)

    def decode(ids: list[int]) -> Decoded:
        return Decoded(tokenizer.decode(ids, skip_special_tokens=True), len(ids), bool(ids) and ids[-1] in eos)
    return decode

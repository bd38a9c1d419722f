"""The one way the stages turn chat messages into text and token ids: the tokenizer's chat
template renders, the tokenizer encodes the rendered text without adding special tokens
(the template already holds them). SFT, the reward model and both RL stages go through here,
so a prompt is the same token sequence in every stage."""
from __future__ import annotations

from stages.common.contract import StageError


def require_chat_template(tokenizer, model: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise StageError(f"model {model}: its tokenizer has no chat template (build it with "
                         "init_model, or use a chat model)")


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    """The conversation as the template writes it; with `generation_prompt`, followed by the
    header of the assistant turn that is to be generated."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the messages plus the generation prompt: what a policy continues."""
    return encode_text(tokenizer, render_chat(tokenizer, messages, generation_prompt=True))

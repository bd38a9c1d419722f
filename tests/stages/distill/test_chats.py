"""A kept sample as an SFT chat: the prompt's turns (its system message unless dropped), then
the response exactly as the teacher wrote it."""
from __future__ import annotations

import pytest

from stages.distill.config import DistillConfig
from stages.distill.job import chat_of


@pytest.mark.parametrize("keep", [True, False])
def test_chat_keeps_or_drops_the_system_prompt_and_the_response_verbatim(keep):
    cfg = DistillConfig.model_validate({"teacher": "t", "data": "d", "system_prompt": "Think.",
                                        "keep_system_prompt": keep})
    row = {"messages": [{"role": "system", "content": "Think."}, {"role": "user", "content": "What is 2 + 2?"}]}
    response = "<think>\n2 + 2 = 4  \n</think>\n\nThe answer is \\boxed{4}.\n"
    rec = {"id": "q7", "sample": 3, "domain": "math", "family": "sums", "score": 1.0, "tokens": 21, "response": response}
    chat = chat_of(rec, row, cfg)
    assert chat["id"] == "q7#3" and chat["prompt_id"] == "q7" and chat["response_tokens"] == 21
    roles = [m["role"] for m in chat["messages"]]
    assert roles == (["system", "user", "assistant"] if keep else ["user", "assistant"])
    assert chat["messages"][-1]["content"] == response  # nothing stripped or reformatted
    assert row["messages"][0]["role"] == "system"  # the prompt row is not changed

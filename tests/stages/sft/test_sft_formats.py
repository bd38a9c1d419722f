"""SFT rows in the formats training teams have (stages/sft/data.py `row_messages`): chat
`messages`, ShareGPT `conversations`, Alpaca, prompt/completion, each to the same chat and
the same trained tokens; field names remapped in the recipe; malformed rows of each format
named by file and row, or skipped and counted."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from stages.common.rows import DataError, input_rows
from stages.init_model.config import TokenizerSpec
from stages.init_model.tokenizer import train_tokenizer
from stages.sft.config import SFTConfig, SFTData
from stages.sft.data import RowProblem, build_samples, row_messages

Q, A, SYS = "What is 2 + 3?", "<think>\n2 + 3 = 5\n</think>\n\\boxed{5}", "Be brief."
CHAT = [{"role": "system", "content": SYS}, {"role": "user", "content": Q}, {"role": "assistant", "content": A}]
SAME_CHAT = {
    "messages": {"messages": CHAT},
    "sharegpt": {"conversations": [{"from": "system", "value": SYS}, {"from": "human", "value": Q},
                                   {"from": "gpt", "value": A}]},
    "alpaca": {"instruction": Q, "input": "", "output": A, "system": SYS},
    "prompt_completion": {"prompt": [{"role": "system", "content": SYS}, {"role": "user", "content": Q}],
                          "completion": A},
}


@pytest.fixture(scope="module")
def tok():
    from stages.common.rows import Row

    texts = [{"t": f"{Q} {A} {SYS} user assistant system"}] * 20
    tokenizer, _ = train_tokenizer(lambda: iter(Row("c", i, t) for i, t in enumerate(texts, 1)),
                                   TokenizerSpec(corpus=["-"], vocab_size=300), 512)
    return tokenizer


@pytest.mark.parametrize("fmt", list(SAME_CHAT))
def test_every_format_gives_the_same_chat_explicitly_and_by_detection(fmt):
    for declared in (fmt, "auto"):
        assert row_messages(SAME_CHAT[fmt], SFTData(path="-", format=declared)) == CHAT, (fmt, declared)


def test_alpaca_input_and_prompt_completion_strings_and_renamed_fields():
    alpaca = row_messages({"instruction": "Add:", "input": "2 + 3", "output": "5"}, SFTData(path="-"))
    assert alpaca == [{"role": "user", "content": "Add:\n\n2 + 3"}, {"role": "assistant", "content": "5"}]
    pc = row_messages({"prompt": Q, "completion": A}, SFTData(path="-", format="prompt_completion"))
    assert pc == CHAT[1:]
    renamed = SFTData(path="-", format="sharegpt", fields={
        "conversations": "turns", "sharegpt_from": "speaker", "sharegpt_value": "text",
        "sharegpt_roles": {"Q": "user", "A": "assistant"}})
    assert row_messages({"turns": [{"speaker": "Q", "text": Q}, {"speaker": "A", "text": A}]}, renamed) == CHAT[1:]


@pytest.mark.parametrize("row,fmt,key,reason", [
    ({"text": "plain"}, "auto", "no_messages", "none of the fields `messages`"),
    ([1, 2], "auto", "bad_row", "JSON object"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, "sharegpt", "bad_message", "'robot', not one of"),
    ({"conversations": "hi"}, "sharegpt", "bad_messages", "must be a list"),
    ({"conversations": [{"from": "human", "value": Q}]}, "sharegpt", "no_assistant", "no assistant message"),
    ({"instruction": Q, "output": 5}, "alpaca", "bad_message", "`output` is int"),
    ({"instruction": Q}, "alpaca", "no_messages", "`output` is missing"),
    ({"prompt": Q, "completion": {"x": 1}}, "prompt_completion", "bad_messages", "list of messages"),
    ({"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": None}]}, "messages",
     "bad_message", r"messages\[1\].content must be a string"),
])
def test_malformed_rows_of_each_format_have_a_reason(row, fmt, key, reason):
    with pytest.raises(RowProblem, match=reason) as e:
        row_messages(row, SFTData(path="-", format=fmt))
    assert e.value.key == key


def test_a_file_of_mixed_formats_trains_the_same_tokens_and_bad_rows_are_named(tok, tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in SAME_CHAT.values()) + "{oops\n"
                 + json.dumps({"conversations": []}) + "\n")
    data = SFTData(path=str(f))

    def read():
        return input_rows(Path, data, "sft data", keep_bad=True)

    with pytest.raises(DataError, match=re.escape(f"sft data {f}:5: invalid JSON")):
        build_samples(read(), tok, 256, "fail", data)
    samples, stats = build_samples(read(), tok, 256, "skip", data)
    assert stats.rows == 6 and stats.samples == 4
    assert stats.bad_rows == {"unreadable": 1, "bad_messages": 1}
    assert len({(tuple(s.input_ids), tuple(s.targets)) for s in samples}) == 1  # one chat, four spellings


def test_the_config_takes_a_path_or_a_full_data_input():
    base = {"model": "m"}
    assert SFTConfig.model_validate({**base, "data": "x.jsonl"}).data_input == SFTData(path="x.jsonl")
    full = SFTConfig.model_validate({**base, "data": {"path": "org/set", "split": "train", "format": "alpaca"}})
    assert full.data_input.split == "train" and full.data_input.format == "alpaca"
    for bad, match in (({"path": "x", "format": "csv"}, "format"), ({"path": "x", "fieldz": {}}, "Extra inputs"),
                       ({"path": "x", "fields": {"messagez": "m"}}, "Extra inputs")):
        with pytest.raises(ValidationError, match=match):
            SFTConfig.model_validate({**base, "data": bad})

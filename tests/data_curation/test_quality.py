import json

from data_curation.quality import QualityConfig

from .conftest import chat, table

LONG = "This is a perfectly ordinary answer with enough characters."


def run(rows, ctx, **cfg):
    t = table(rows)
    d = QualityConfig(**cfg).build(ctx).process(t)
    raws = d.columns.get("_raw", t.column("_raw").to_pylist())
    return d, [json.loads(r) for r in raws]


def content(row, i=1):
    return row["messages"][i]["content"]


def test_invisible_characters_are_cleaned_in_the_written_row(ctx):
    rows = [
        chat(0, "What is a pass\u200dword?", "A pass\u200dword is a secret\u200b string."),
        chat(1, "Hello \u202eevil\u202c there, friend", LONG + "\x07\x1b"),
        chat(2, "Private \ue000 use and C1 \x85 control", LONG),
        chat(3, "Family emoji \U0001F468\u200d\U0001F469\u200d\U0001F467 stays", LONG),
    ]
    d, out = run(rows, ctx)
    assert d.keep.all()
    assert out[0]["messages"][0]["content"] == "What is a password?"
    assert content(out[0]) == "A password is a secret string."
    assert out[1]["messages"][0]["content"] == "Hello evil there, friend"
    assert content(out[1]) == LONG
    assert out[2]["messages"][0]["content"] == "Private  use and C1  control"
    assert "\u200d" in out[3]["messages"][0]["content"]          # emoji ZWJ sequence kept
    assert d.stats["cleaned_rows"]["invisible_characters"] == 3
    assert d.columns["_prompt"][0] == "What is a password?"      # matching text follows


def test_mostly_invisible_text_is_removed(ctx):
    d, _ = run([chat(0, "hi" + "\u200b" * 50, LONG)], ctx)
    assert not d.keep[0] and d.reasons[0] == "invisible_characters"


def test_replacement_characters_and_mojibake(ctx):
    rows = [
        chat(0, "Caf\ufffd au lait please", LONG),                  # one U+FFFD: cleaned
        chat(1, "Bad \ufffd\ufffd\ufffd\ufffd\ufffd decoding here", LONG),   # too many: removed
        chat(2, "The cafÃ© serves crÃ¨me brÃ»lÃ©e â€” delicious", LONG),  # mojibake: repaired
    ]
    d, out = run(rows, ctx)
    assert d.keep.tolist() == [True, False, True]
    assert out[0]["messages"][0]["content"] == "Caf au lait please"
    assert d.reasons[1] == "replacement_characters"
    assert out[2]["messages"][0]["content"] == "The café serves crème brûlée — delicious"
    assert d.stats["cleaned_rows"]["mojibake_repaired"] == 1


def test_extraneous_script_short_long_repeated_and_empty(ctx):
    thai = "\u0e01\u0e02\u0e03\u0e04\u0e05" * 8
    rows = [
        chat(0, "Explain this sentence to me please " + thai, LONG),        # English + 40 Thai letters
        chat(1, "\u8bf7\u89e3\u91ca\u4e00\u4e0b Python \u7684 list \u548c tuple \u7684\u533a\u522b",
             "\u5217\u8868\u662f\u53ef\u53d8\u7684, tuple \u662f\u4e0d\u53ef\u53d8\u7684\u3002"),  # zh + en
        chat(2, "hi", "ok"),                                                 # too short
        chat(3, "Write a poem", "\n".join(["la la la"] * 10)),              # repeated lines
        chat(4, "A question without an answer?", ""),                      # empty response
        chat(5, "x" * 500, LONG),
    ]
    d, _ = run(rows, ctx, max_chars=400)
    assert d.reasons[0] == "extraneous_script"
    assert d.details[0]["dominant"] == "Latin" and d.details[0]["ratio"] > 0.3
    assert d.keep[1]
    assert d.reasons[2] == "too_short"
    assert d.reasons[3] == "repeated_lines" and d.details[3]["field"] == "response"
    assert d.reasons[4] == "empty_response"
    assert d.reasons[5] == "too_long"
    assert d.stats["removed"] == {"extraneous_script": 1, "too_short": 1, "repeated_lines": 1,
                                  "empty_response": 1, "too_long": 1}


def test_text_rows_and_pair_rows_are_cleaned_by_field(ctx):
    rows = [{"text": "Plain text row with a zero\u200bwidth space inside."},
            {"prompt": "Pair \u202dprompt\u202c here", "response": LONG}]
    d, out = run(rows, ctx)
    assert d.keep.all()
    assert out[0]["text"] == "Plain text row with a zerowidth space inside."
    assert out[1]["prompt"] == "Pair prompt here"

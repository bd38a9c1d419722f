"""No input row can crash a curation run: generated hostile lines, from categories of
attack on each layer a row passes (bytes, JSON, row schema, text), all end up kept, removed
or quarantined with a reason, and the accounting identity holds."""
import json
import random

import pytest

from data_curation import run_curation

from .conftest import chat, read_jsonl, write_jsonl

ALL_STEPS = [{"step": "quality"}, {"step": "exact_dedup"}, {"step": "near_dedup"}, {"step": "harmful"},
             {"step": "domain_tag"}]


def _nested(rng, depth):
    opens = "".join(rng.choice("[{") for _ in range(depth))
    body = "".join("]" if c == "[" else "}" for c in reversed(opens))
    # objects need keys: wrap every "{" level as {"k": ...}
    return "".join('{"k":' if c == "{" else "[" for c in opens) + "1" + body


def _text_attack(rng) -> str:
    """Hostile text content: controls, invisibles, bidi, floods of combining marks, lone
    surrogates, homoglyphs, mojibake, huge runs."""
    pieces = [
        "".join(chr(rng.randrange(0, 32)) for _ in range(rng.randrange(1, 50))),
        "\u200b\u200d\u2060\ufeff" * rng.randrange(1, 200),
        "\u202e\u2066abc\u2069\u202c",
        "a" + "\u0301" * rng.randrange(100, 5000),
        "\ud800 lone \udfff",
        "Fіnd thе numbеr",                      # Cyrillic letters
        "cafÃ© Ã¼ber",
        "x" * rng.randrange(10_000, 200_000),
        "".join(chr(rng.randrange(0x80, 0x10FFFF)) for _ in range(rng.randrange(1, 300))
                if not 0xD800 <= rng.randrange(0x80, 0x10FFFF) <= 0xDFFF),
        "\\" * rng.randrange(1, 1000) + "frac{" * rng.randrange(1, 500),
    ]
    return "".join(rng.sample(pieces, rng.randrange(1, 4)))


def _schema_attack(rng) -> dict | list | str | int | None:
    bad_values = [None, 1, 1.5, True, [], {}, [1, 2], {"a": {"b": []}}, "", "x" * 10]
    v = lambda: rng.choice(bad_values)  # noqa: E731
    return rng.choice([
        {"messages": v()},
        {"messages": [v(), {"role": "user", "content": "q"}]},
        {"messages": [{"role": v(), "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": v()}, {"role": "assistant", "content": v()}]},
        {"id": rng.choice([[1], {"x": 1}, 1.5, 10 ** 200]), "prompt": "p", "response": "r"},
        {"prompt": v(), "response": v()},
        {"prompt": None, "response": "an answer without a question"},
        {"messages": [{"role": "assistant", "content": "only an answer"}]},
        {"text": v()},
        {rng.choice(["\u0000", "\ud800", "é" * 50, ""]): "no known field"},
        v(),
    ])


def _json_attack(rng) -> str:
    return rng.choice([
        _nested(rng, rng.choice([101, 1000, 100_000])),
        '{"id": 1, "prompt": "p", "response": "r", "n": %s}' % ("9" * rng.randrange(4301, 6000)),
        '{"prompt": "p", "response": "r", "x": %s}' % rng.choice(["NaN", "Infinity", "-Infinity", "1e999"]),
        '{"prompt": "p", "response": "r"',                     # truncated
        '{"prompt": "p", "response": "r"} trailing',
        '{"prompt": "p" "response": "r"}',
        '{"prompt": "\\ud800\\udc00\\ud800", "response": "lone surrogate escapes"}',
        '{"prompt": "tab\tinside", "response": "raw control char"}',
        "\ufeff" + json.dumps({"prompt": "after a BOM", "response": "fine"}),
        rng.choice(["null", "true", "1", '"str"', "[]", "{}"]),
    ])


def _byte_attack(rng) -> bytes:
    return rng.choice([
        bytes(rng.randrange(0, 256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b" "),
        b'{"prompt": "caf\xe9", "response": "latin-1 byte"}',
        b'{"prompt": "a\x00b", "response": "NUL byte"}',
        b"\xef\xbb\xbf\xef\xbb\xbf{}",
        b"   \t  ",
        b'{"prompt": "cr only", "response": "x"}\r',
        b"\xff\xfe{\x00}\x00",
    ])


def hostile_lines(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = rng.randrange(5)
        if kind == 0:
            out.append(_byte_attack(rng))
        elif kind == 1:
            out.append(_json_attack(rng).encode("utf-8", "surrogatepass"))
        elif kind == 2:
            out.append(json.dumps(_schema_attack(rng)).encode())
        elif kind == 3:
            row = chat(i, _text_attack(rng), _text_attack(rng), id=f"h{rng.randrange(20)}")
            out.append(json.dumps(row).encode())
        else:
            out.append(json.dumps(chat(i, f"An ordinary question number {i}?",
                                       f"An ordinary answer, number {i}, with some words.")).encode())
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_hostile_lines_never_end_the_run(tmp_path, seed):
    lines = hostile_lines(seed, 240)
    src = tmp_path / "hostile.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"q": "Find the number of ordered pairs of primes that "
                                                         "sum to one hundred and twenty six."},
                                                   {"q": _text_attack(random.Random(seed))}])
    steps = [*ALL_STEPS, {"step": "decontaminate", "benchmarks": [{"path": str(bench), "fields": ["q"]}]}]
    rep = run_curation([str(src)], steps, str(tmp_path / "out"), num_proc=2, batch_size=50,
                       progress=False)
    out = tmp_path / "out"
    c = rep["counts"]
    assert c["input_rows"] == len(lines) and rep["accounting"]["ok"]
    # every output line is strict JSON (no NaN/Infinity), and every line number is accounted for once
    strict = json.JSONDecoder(parse_constant=lambda name: pytest.fail(f"{name} in the output"))
    curated = [strict.decode(x) for x in (out / "curated.jsonl").read_text().splitlines()]
    removed, quarantined = read_jsonl(out / "removed.jsonl"), read_jsonl(out / "quarantine.jsonl")
    assert len(curated) == c["kept"]
    assert all(q["reason"] for q in quarantined) and all(r["reason"] for r in removed)
    lines_seen = [r["line"] for r in removed] + [q["line"] for q in quarantined]
    assert len(lines_seen) == len(set(lines_seen)) and set(lines_seen) <= set(range(1, len(lines) + 1))
    assert c["kept"] > 0 and c["quarantined"] > 0
    reasons = " ".join(q["reason"] for q in quarantined)
    for expected in ("nested", "invalid JSON", "response without a prompt"):
        assert expected in reasons


def test_bom_nan_depth_and_big_numbers_are_named(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + b"\n".join([
        json.dumps({"prompt": "first row after a BOM", "response": "kept"}).encode(),
        b'{"prompt": "p", "response": "r", "score": NaN}',
        b'{"prompt": "p", "response": "r", "score": 1e999}',
        b'{"prompt": "p", "response": "r", "n": ' + b"7" * 5000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 150 + b"1" + b"}" * 150]) + b"\n")
    rep = run_curation([str(src)], [{"step": "exact_dedup"}], str(tmp_path / "o"), progress=False)
    assert rep["counts"]["kept"] == 1
    q = {r["line"]: r["reason"] for r in read_jsonl(tmp_path / "o" / "quarantine.jsonl")}
    assert "NaN is not valid JSON" in q[2] and "overflows to infinity" in q[3]
    assert "integer string conversion" in q[4] and "nested too deeply" in q[5]
    assert "nested deeper than 100 levels" in q[6]
    # a JSON array file with a BOM, and parquet rows holding NaN or bytes
    (tmp_path / "arr.json").write_bytes(b"\xef\xbb\xbf" + json.dumps([{"text": "one row"}]).encode())
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["p1", "p2", "p3"], "response": ["r1", "r2", "r3"],
                             "score": [1.0, float("nan"), 2.0], "blob": [None, None, b"\x00"]}),
                   tmp_path / "t.parquet")
    rep = run_curation([str(tmp_path / "arr.json"), str(tmp_path / "t.parquet")], [{"step": "exact_dedup"}],
                       str(tmp_path / "o2"), progress=False)
    assert rep["counts"]["kept"] == 2 and rep["counts"]["quarantined"] == 2
    reasons = [r["reason"] for r in read_jsonl(tmp_path / "o2" / "quarantine.jsonl")]
    assert any("NaN" in r or "Out of range float" in r for r in reasons) and any("bytes" in r for r in reasons)


@pytest.mark.parametrize("policy,kept,quarantined", [("report", 5, 0), ("quarantine_repeats", 2, 3),
                                                     ("quarantine_all", 0, 5)])
def test_duplicate_ids_are_reported_and_follow_the_policy(tmp_path, policy, kept, quarantined):
    rows = [chat(0, "first a", "answer one here"), chat(1, "b", "answer two here"),
            {**chat(0, "second a", "answer three here")}, chat(3, "c", "answer four here"),
            {**chat(0, "third a", "answer five here")}]
    rows[1]["id"] = "r3"   # ids by line: r0 r3 r0 r3 r0
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    rep = run_curation([str(src)], [{"step": "exact_dedup"}], str(tmp_path / policy), progress=False,
                       row_policy={"duplicate_ids": policy}, batch_size=2)
    assert (rep["counts"]["kept"], rep["counts"]["quarantined"]) == (kept, quarantined)
    dup = rep["steps"][0]["duplicate_ids"]
    assert dup["repeated_ids"] == 2 and dup["repeat_rows"] == 3
    assert {e["id"]: e["first"].rsplit("/", 1)[-1] for e in dup["examples"]} == {"r0": "in.jsonl:1",
                                                                                "r3": "in.jsonl:2"}
    q = read_jsonl(tmp_path / policy / "quarantine.jsonl")
    assert [r["line"] for r in q] == sorted(r["line"] for r in q)
    assert "| repeat an earlier row's id | 3 | " + policy in (tmp_path / policy / "report.md").read_text()
    if policy == "quarantine_repeats":
        assert {r["line"] for r in q} == {3, 4, 5}
        assert "'r0': 3 rows have it, the first at" in q[0]["reason"]


def test_response_only_rows_are_flagged(tmp_path):
    rows = [{"prompt": None, "response": "an answer to nothing"}, {"prompt": "", "response": "same"},
            {"messages": [{"role": "assistant", "content": "only the assistant speaks"}]},
            {"text": "plain text rows are response-only by design"}, chat(1, "q", "a")]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    rep = run_curation([str(src)], [{"step": "exact_dedup"}], str(tmp_path / "q"), progress=False)
    assert rep["counts"]["quarantined"] == 3 and rep["steps"][0]["response_only_rows"] == 3
    assert all("response without a prompt" in r["reason"] for r in read_jsonl(tmp_path / "q" / "quarantine.jsonl"))
    rep = run_curation([str(src)], [{"step": "exact_dedup"}], str(tmp_path / "k"), progress=False,
                       row_policy={"response_only": "keep"})
    assert rep["counts"]["quarantined"] == 0 and rep["steps"][0]["response_only_rows"] == 3

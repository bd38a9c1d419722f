"""The readable report: the JSON report rendered as Markdown and as a standalone HTML page."""
from __future__ import annotations

import html
from typing import Any

from data_curation.row_reading import ROW_SHIFT

Block = tuple  # ("h", level, text) | ("p", text) | ("table", headers, rows)


def row_ref(row: Any, inputs: list[str]) -> str:
    """`file:line` of a row id (source index << 40 | 1-based line)."""
    if not isinstance(row, int):
        return str(row)
    src, line = row >> ROW_SHIFT, row & ((1 << ROW_SHIFT) - 1)
    name = inputs[src].rsplit("/", 1)[-1] if 0 <= src < len(inputs) else "?"
    return f"{name}:{line}"


def _top(d: dict[str, int], n: int = 4) -> str:
    items = sorted(d.items(), key=lambda kv: -kv[1])
    s = ", ".join(f"{k} {v}" for k, v in items[:n])
    return s + (", ..." if len(items) > n else "")


def _short(s: Any, n: int = 120) -> str:
    s = str(s).replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def blocks(report: dict[str, Any]) -> list[Block]:
    inputs = report.get("inputs", [])
    ref = lambda r: row_ref(r, inputs)  # noqa: E731
    c = report["counts"]
    acc = report["accounting"]
    out: list[Block] = [("h", 1, "Curation report"),
                        ("p", "Inputs: " + ", ".join(inputs)),
                        ("p", f"Output: {report.get('out_url', '')}"),
                        ("table", ["input rows", "kept", "removed", "quarantined", "accounting"],
                         [[c["input_rows"], c["kept"], c["removed"], c["quarantined"],
                           "ok (kept + removed + quarantined = input, row ids match)"
                           if acc["ok"] else "FAILED"]])]
    out.append(("h", 2, "Steps"))
    rows = []
    for s in report["steps"]:
        rows.append([s.get("index", 0), s["step"], "reused" if s.get("reused") else "computed",
                     s["rows_in"], s["kept"], s.get("removed", 0),
                     _top(s.get("reasons") or s.get("quarantine_reasons") or {}), s.get("seconds", "")])
    out.append(("table", ["#", "step", "cache", "in", "kept", "removed", "reasons", "seconds"], rows))
    q = report.get("quarantine", {})
    if q.get("reasons"):
        out.append(("h", 2, "Quarantine (rows that could not be read)"))
        out.append(("table", ["reason", "rows"], sorted(q["reasons"].items(), key=lambda kv: -kv[1])))
        if q.get("examples"):
            out.append(("table", ["source", "reason", "raw"],
                        [[e["source"], e["reason"], _short(e["raw"], 80)] for e in q["examples"]]))
    read = report["steps"][0]
    dup = read.get("duplicate_ids") or {}
    if dup.get("repeated_ids") or read.get("response_only_rows"):
        policy = read.get("row_policy", {})
        out.append(("h", 2, "Row checks"))
        out.append(("table", ["check", "rows", "policy"],
                    [["repeat an earlier row's id", dup.get("repeat_rows", 0), policy.get("duplicate_ids")],
                     ["a response without a prompt", read.get("response_only_rows", 0),
                      policy.get("response_only")]]))
        if dup.get("examples"):
            out.append(("table", ["id", "first row", "repeats"],
                        [[_short(e["id"], 60), e["first"], e["repeats"]] for e in dup["examples"]]))
    for s in report["steps"][1:]:
        out.extend(_step_blocks(s, ref))
    mix = report.get("domain_mix")
    if mix:
        out.append(("h", 2, "Domain mix"))
        doms = sorted(set(mix["before"]) | set(mix["after"]))
        tb, ta = sum(mix["before"].values()) or 1, sum(mix["after"].values()) or 1
        out.append(("table", ["domain", "before", "share", "after", "share"],
                    [[d, mix["before"].get(d, 0), f"{100 * mix['before'].get(d, 0) / tb:.1f}%",
                      mix["after"].get(d, 0), f"{100 * mix['after'].get(d, 0) / ta:.1f}%"] for d in doms]))
    return out


def _step_blocks(s: dict[str, Any], ref) -> list[Block]:
    """A step's section: what its kind reports (its `details`)."""
    out: list[Block] = []
    d = s.get("details") or {}
    kind = s.get("kind")
    out.append(("h", 2, f"{s['step']} ({kind})"))
    if kind == "quality":
        out.append(("table", ["cleaned (rows)", "rows", "characters"],
                    [[k, v, d.get("cleaned_chars", {}).get(k, "")]
                     for k, v in sorted(d.get("cleaned_rows", {}).items())] or [["none", 0, 0]]))
        if d.get("examples_removed"):
            out.append(("table", ["row", "reason", "detail"],
                        [[ref(e["row"]), e["reason"],
                          _short({k: v for k, v in e.items() if k not in ("row", "reason")})]
                         for e in d["examples_removed"]]))
    elif kind == "exact_dedup":
        out.append(("p", f"{d.get('duplicate_groups', 0)} duplicate groups over "
                         f"{d.get('distinct_keys', 0)} distinct keys"))
        if d.get("group_size_histogram"):
            out.append(("table", ["group size", "groups"], list(d["group_size_histogram"].items())))
    elif kind == "near_dedup":
        lsh = d.get("lsh", {})
        out.append(("p", f"MinHash {lsh.get('num_perm')} permutations, LSH {lsh.get('bands')} bands x "
                         f"{lsh.get('rows')} rows, word {lsh.get('ngram')}-grams, Jaccard threshold "
                         f"{lsh.get('threshold')} ({lsh.get('verify')} verification). "
                         f"{d.get('lsh_candidates', 0)} LSH candidates, {d.get('pairs_verified', 0)} "
                         f"pairs verified, {d.get('duplicate_pairs', 0)} duplicate pairs, "
                         f"{d.get('clusters', 0)} clusters."))
        if d.get("cluster_size_histogram"):
            out.append(("table", ["cluster size", "clusters"], list(d["cluster_size_histogram"].items())))
        if d.get("largest_clusters"):
            out.append(("table", ["size", "kept row", "members"],
                        [[cl["size"], ref(cl["kept_row"]), _short(", ".join(ref(r) for r in cl["rows"]))]
                         for cl in d["largest_clusters"]]))
    elif kind == "decontaminate":
        out.extend(_decontamination_blocks(d, ref))
    elif kind == "harmful":
        if d.get("by_category"):
            out.append(("table", ["category", "rows"], sorted(d["by_category"].items())))
        if d.get("examples"):
            out.append(("table", ["row", "category", "field", "evidence"],
                        [[ref(e["row"]), e["category"], e["field"], _short(e["evidence"], 80)]
                         for e in d["examples"]]))
    elif kind == "domain_tag":
        out.append(("table", ["domain", "rows entering the step"], sorted(d.get("input_mix", {}).items())))
    else:
        out.append(("p", _short(d, 400)))
    return out


def _item_ref(x: dict[str, Any]) -> str:
    """`file#row (id)` of a benchmark item: 1-based row, the benchmark's own id if any."""
    name = x["benchmark_file"].rsplit("/", 1)[-1]
    return f"{name}#{x['benchmark_row']}" + (f" (id {x['benchmark_id']})" if x.get("benchmark_id") else "")


def _decontamination_blocks(d: dict[str, Any], ref) -> list[Block]:
    bm = d.get("benchmarks", {})
    out: list[Block] = [("table", ["benchmark", "path", "rows", "items", "training rows flagged",
                                   "benchmark rows found", "by method", "by field",
                                   "rows with new numbers"],
                         [[n, b.get("path"), b.get("rows"), b.get("items"), b.get("rows_flagged", 0),
                           b.get("items_found", 0), _top(b.get("by_method", {})),
                           _top(b.get("by_train_field", {})), b.get("rows_new_numbers", 0)]
                          for n, b in bm.items()])]
    ex = [(n, e) for n, b in bm.items() for e in b.get("examples", [])]
    if ex:
        out.append(("table", ["training row", "field", "benchmark", "benchmark item", "method",
                               "overlap", "matched span"],
                    [[ref(e["row"]), e["train_field"], n, f"{_item_ref(e)} ({e['benchmark_field']})",
                      e["method"], e["overlap"], _short(e["span"], 100)] for n, e in ex]))
    found = d.get("contaminated_items", [])
    if found:
        out.append(("p", f"Benchmark items found in the training data ({len(found)}): "
                         "every item with at least one copy, however many rows hold it."))
        out.append(("table", ["benchmark", "item", "training rows", "methods"],
                    [[x["benchmark"], _item_ref(x), x["training_rows"], _top(x["methods"])] for x in found]))
    changed = d.get("new_numbers_items", [])
    if changed:
        out.append(("p", f"Same template, new numbers ({len(changed)} benchmark items): rows that match "
                         "an item only with other numbers, i.e. new problems (new_numbers: "
                         f"{d.get('methods', {}).get('new_numbers', 'keep')})."))
        out.append(("table", ["benchmark", "item", "training rows"],
                    [[x["benchmark"], _item_ref(x), x["training_rows"]] for x in changed]))
    return out


def _md_cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict[str, Any]) -> str:
    lines: list[str] = []
    for b in blocks(report):
        if b[0] == "h":
            lines += ["#" * b[1] + " " + b[2], ""]
        elif b[0] == "p":
            lines += [b[1], ""]
        else:
            _, headers, rows = b
            lines.append("| " + " | ".join(map(_md_cell, headers)) + " |")
            lines.append("|" + "---|" * len(headers))
            lines += ["| " + " | ".join(map(_md_cell, r)) + " |" for r in rows]
            lines.append("")
    return "\n".join(lines)


def render_html(report: dict[str, Any]) -> str:
    e = lambda v: html.escape(str(v))  # noqa: E731
    body: list[str] = []
    for b in blocks(report):
        if b[0] == "h":
            body.append(f"<h{b[1]}>{e(b[2])}</h{b[1]}>")
        elif b[0] == "p":
            body.append(f"<p>{e(b[1])}</p>")
        else:
            _, headers, rows = b
            body.append("<table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in headers)
                        + "</tr></thead><tbody>"
                        + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
                        + "</tbody></table>")
    style = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}"
             "table{border-collapse:collapse;margin:.5em 0 1.5em}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}"
             "th{background:#f3f3f3}")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>Curation report</title>"
            f"<style>{style}</style></head><body>" + "\n".join(body) + "</body></html>")

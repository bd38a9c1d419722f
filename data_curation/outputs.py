"""The final outputs of a run: curated rows, removed rows, quarantine, reports, and the
accounting identity kept + removed (with reason) + quarantined = input, checked on counts
and on the sum and xor of the row ids (a mismatch raises AccountingError).

    {out}/curated.jsonl (or .parquet) removed.jsonl quarantine.jsonl report.json|md|html

Every row reference is 1-based: `line` is the line of a JSON lines file or the row of a
table, `source` is `file:line`, and `row` is the row id `source index << 40 | line` that
step details (`duplicate_of`, cluster members) use.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from data_curation import io, row_reading, urls
from data_curation.report import render_html, render_markdown
from data_curation.step_api import RunContext
from data_curation.step_cache import StepDir


class AccountingError(RuntimeError):
    """kept + removed + quarantined != input: a row was lost or duplicated (a bug)."""


class _Accounting:
    """Sum and xor of every row id written out: together with the counts they prove that no
    row was lost or duplicated (the read step recorded them for the input)."""

    def __init__(self) -> None:
        self.sum, self.xor = np.uint64(0), np.uint64(0)

    def account(self, ids: np.ndarray) -> None:
        u = ids.astype(np.int64).view(np.uint64)
        self.sum += u.sum(dtype=np.uint64)
        if len(u):
            self.xor ^= np.bitwise_xor.reduce(u)


def write_outputs(sources, step_cfgs, read_loc: StepDir, locs: list[StepDir],
                  step_reports: list[dict[str, Any]], out_url: str, ctx: RunContext,
                  output_format: str, log) -> dict[str, Any]:
    so = ctx.storage_options
    fs, out_path = urls.filesystem(out_url, so)
    if urls.is_local(out_url):
        os.makedirs(out_path, exist_ok=True)
    acc_ids = _Accounting()
    tag_cfg = next((c for c in step_cfgs if c.step == "domain_tag"), None)
    tagger = tag_cfg.build(ctx) if tag_cfg is not None else None
    final = (locs[-1] if locs else read_loc).part_urls()
    outputs, n_kept, mix_after = _write_curated(final, fs, out_path, out_url, ctx, output_format, tagger, acc_ids)
    n_removed, mix_removed = _write_removed(sources, step_cfgs, locs, fs, out_path, so, tagger, acc_ids)
    outputs["removed"] = urls.join(out_url, "removed.jsonl")
    n_quar, examples = _write_quarantine(sources, read_loc, fs, out_path, so, acc_ids)
    outputs["quarantine"] = urls.join(out_url, "quarantine.jsonl")

    # the accounting identity
    n_input = read_loc.done["rows_in"]
    acc = {"input": n_input, "kept": n_kept, "removed": n_removed, "quarantined": n_quar,
           "ids_match": int(acc_ids.sum) == read_loc.done["row_sum"] and int(acc_ids.xor) == read_loc.done["row_xor"]}
    acc["ok"] = n_kept + n_removed + n_quar == n_input and acc["ids_match"]
    if not acc["ok"]:
        raise AccountingError(f"accounting failed: kept {n_kept} + removed {n_removed} + quarantined "
                              f"{n_quar} != input {n_input} (row ids match: {acc['ids_match']})")
    removed_by_step = {r["step"]: r["removed"] for r in step_reports[1:]}
    report: dict[str, Any] = {
        "inputs": [s.label for s in sources], "out_url": out_url,
        "counts": {"input_rows": n_input, "kept": n_kept, "removed": n_removed,
                   "quarantined": n_quar, "removed_by_step": removed_by_step},
        "accounting": acc,
        "quarantine": {"reasons": step_reports[0].get("quarantine_reasons", {}), "examples": examples},
        "steps": step_reports,
        "outputs": {**outputs, "report_json": urls.join(out_url, "report.json"),
                    "report_md": urls.join(out_url, "report.md"),
                    "report_html": urls.join(out_url, "report.html")},
    }
    if tagger:
        before = dict(mix_after)
        for m in mix_removed.values():
            for d, n in m.items():
                before[d] = before.get(d, 0) + n
        report["domain_mix"] = {"before": dict(sorted(before.items())),
                                "after": dict(sorted(mix_after.items())),
                                "removed_by_step": mix_removed,
                                "note": "before = rows read (quarantined rows excluded)"}
    log(f"[curate] done: {n_input} in = {n_kept} kept + {n_removed} removed + {n_quar} quarantined")
    return report


def _write_curated(final, fs, out_path: str, out_url: str, ctx: RunContext, output_format: str, tagger,
                   acc_ids: _Accounting) -> tuple[dict[str, str], int, dict[str, int]]:
    """The kept rows as they were read: (outputs {"curated": url}, their count, domain -> count)."""
    so = ctx.storage_options
    mix_after: dict[str, int] = {}
    n_kept = 0
    curated_name = "curated.jsonl"
    curated_local = ctx.work_dir / "curated.jsonl" if output_format == "parquet" else None
    target = str(curated_local) if curated_local else urls.join(out_path, curated_name)
    opener = open(target, "w", encoding="utf-8") if curated_local else fs.open(target, "w", encoding="utf-8")
    with opener as f:
        for _, u in final:
            t = io.read_table(u, so, columns=None if tagger else ["_row", "_raw"])
            acc_ids.account(t.column("_row").to_numpy())
            raws = t.column("_raw").to_pylist()
            f.write("\n".join(raws))
            if raws:
                f.write("\n")
            n_kept += len(raws)
            if tagger:
                for d in tagger.domains(t):
                    mix_after[d] = mix_after.get(d, 0) + 1
    outputs = {}
    if output_format == "parquet":
        outputs["curated"] = _jsonl_to_parquet(curated_local, urls.join(out_url, "curated.parquet"), ctx)
    else:
        outputs["curated"] = urls.join(out_url, curated_name)
    return outputs, n_kept, mix_after


def _write_removed(sources, step_cfgs, locs: list[StepDir], fs, out_path: str, so, tagger,
                   acc_ids: _Accounting) -> tuple[int, dict[str, dict[str, int]]]:
    """The removed rows, step by step, each with its reason: (their count, step -> domain -> count)."""
    mix_removed: dict[str, dict[str, int]] = {}
    n_removed = 0
    with fs.open(urls.join(out_path, "removed.jsonl"), "w", encoding="utf-8") as f:
        for loc, cfg in zip(locs, step_cfgs):
            for u in loc.removed_urls():
                t = io.read_table(u, so)
                acc_ids.account(t.column("_row").to_numpy())
                cols = {c: t.column(c).to_pylist() for c in
                        ("_row", "_src", "_line", "_id", "_raw", "_reason", "_detail")}
                lines = []
                for row, _src, line, rid, raw, reason, detail in zip(*cols.values()):
                    lines.append('{"row": %d, "source": %s, "line": %d, "id": %s, "step": %s, '
                                 '"reason": %s, "detail": %s, "data": %s}' % (
                                     row, json.dumps(row_reading.row_label(sources, row), ensure_ascii=False), line,
                                     json.dumps(rid, ensure_ascii=False), json.dumps(cfg.label),
                                     json.dumps(reason), detail, raw))
                f.write("\n".join(lines) + "\n")
                n_removed += len(lines)
                if tagger:
                    m = mix_removed.setdefault(cfg.label, {})
                    for d in tagger.domains(t):
                        m[d] = m.get(d, 0) + 1
    return n_removed, mix_removed


def _write_quarantine(sources, read_loc: StepDir, fs, out_path: str, so, acc_ids: _Accounting
                      ) -> tuple[int, list[dict[str, Any]]]:
    """The rows that could not be read, with why: (their count, the first five)."""
    n_quar = 0
    examples = []
    with fs.open(urls.join(out_path, "quarantine.jsonl"), "w", encoding="utf-8") as f:
        for u in read_loc.quarantine_urls():
            t = io.read_table(u, so)
            acc_ids.account(t.column("_row").to_numpy())
            for row, _src, line, reason, raw in zip(*(t.column(c).to_pylist() for c in
                                                     ("_row", "_src", "_line", "_reason", "_rawtext"))):
                rec = {"row": row, "source": row_reading.row_label(sources, row), "line": line,
                       "reason": reason, "raw": raw}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                if len(examples) < 5:
                    examples.append({**rec, "raw": raw[:200]})
                n_quar += 1
    return n_quar, examples


def _jsonl_to_parquet(local_jsonl: Path, url: str, ctx: RunContext) -> str:
    import datasets

    ds = datasets.Dataset.from_json(str(local_jsonl), cache_dir=str(ctx.work_dir / "hf-cache"))
    ds.to_parquet(url if not urls.is_local(url) else urls.local_path(url),
                  storage_options=ctx.storage_options or None)
    return url


def contamination_manifest(report: dict[str, Any]) -> dict[str, Any] | None:
    """What decontamination found, per decontaminate step: for each benchmark its counts,
    and every benchmark item found in the training data (1-based row, the benchmark's own
    id, training rows, methods), plus the "same template, new numbers" items. None when
    the run has no decontaminate step."""
    steps = []
    for s in report["steps"]:
        if s.get("kind") != "decontaminate":
            continue
        d = s.get("details") or {}
        keep = ("path", "rows", "items", "items_found", "rows_flagged", "by_method", "by_train_field",
                "rows_new_numbers", "items_new_numbers")
        steps.append({"step": s["step"], "rows_checked": s["rows_in"], "rows_removed": s["removed"],
                      "benchmarks": {n: {k: b.get(k) for k in keep} for n, b in d.get("benchmarks", {}).items()},
                      "items": d.get("contaminated_items", []),
                      "new_numbers_items": d.get("new_numbers_items", []),
                      "methods": d.get("methods", {})})
    return {"steps": steps} if steps else None


def write_reports(report: dict[str, Any], out_url: str, so: dict) -> None:
    """report.json|md|html, and contamination.json when the run decontaminated."""
    manifest = contamination_manifest(report)
    if manifest is not None:
        report["outputs"]["contamination"] = urls.join(out_url, "contamination.json")
        io.write_text(report["outputs"]["contamination"],
                      json.dumps(manifest, indent=2, ensure_ascii=False, default=str), so)
    io.write_text(urls.join(out_url, "report.json"),
                  json.dumps(report, indent=2, ensure_ascii=False, default=str), so)
    io.write_text(urls.join(out_url, "report.md"), render_markdown(report), so)
    io.write_text(urls.join(out_url, "report.html"), render_html(report), so)

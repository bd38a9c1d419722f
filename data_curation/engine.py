"""Running the steps: step-level cache, parallel parts, final outputs, accounting.

    {cache}/steps/00-read-{hash12}/            rows as parquet parts + quarantine/, _DONE
    {cache}/steps/01-quality-{hash12}/         kept/ + removed/ parts, report.json, _DONE
    {cache}/steps/02-exact_dedup-{hash12}/     ...
    {out}/curated.jsonl removed.jsonl quarantine.jsonl report.json report.md report.html

A step's hash = sha256(step kind, its result-relevant config incl. the content identity
of files it reads (benchmarks), the code of its module and the core modules, the previous
step's hash, the input identity). A step directory with `_DONE` is reused, never
recomputed, so changing only the benchmark list reruns decontamination and the steps
after it. `only=[...]` forbids computing anything before the named steps: they must be
cached (in the cache or a `reuse_from` location), else the run stops and says which.

Rows are processed as parquet parts of `batch_size` rows by `num_proc` worker processes
(forked; each part is read, decided, and written by one worker), so memory is bounded by
a few parts, not the corpus. Every run ends with the accounting identity
kept + removed (with reason) + quarantined = input, checked on counts and on the sum and
xor of the row ids; a mismatch raises.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from data_curation import io
from data_curation._base import CurationError, merge_stats, stable_hash
from data_curation.rows import FieldMap
from data_curation.step import Decision, RunContext, StepConfig, StepRunner, code_version
from data_curation.steps import parse_steps

DONE = "_DONE"


class AccountingError(RuntimeError):
    """kept + removed + quarantined != input: a row was lost or duplicated (a bug)."""


# -- worker side ------------------------------------------------------------------------
_STATE: dict[str, Any] = {}


def _init_worker(state: dict[str, Any]) -> None:
    _STATE.clear()
    _STATE.update(state)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _dispatch(task: tuple[str, tuple]) -> Any:
    name, args = task
    return _TASKS[name](*args)


def _task_read(i: int) -> dict[str, Any]:
    st = _STATE
    task: io.ReadTask = st["read_tasks"][i]
    parts, quarantine_reasons = [], {}
    n_rows = n_bad = 0
    row_sum, row_xor = np.uint64(0), np.uint64(0)
    k = 0
    for b in io.iter_read(task, st["fields"], st["storage_options"], st["batch_size"]):
        ids = np.array(b.rows["_row"] + b.quarantine["_row"], dtype=np.int64).view(np.uint64)
        row_sum += ids.sum(dtype=np.uint64)
        row_xor ^= np.bitwise_xor.reduce(ids) if len(ids) else np.uint64(0)
        name = f"part-{i:05d}-{k:04d}"
        nr, nq = len(b.rows["_row"]), len(b.quarantine["_row"])
        if nr:
            io.write_table(io.batch_table(b.rows), io.join(st["dir"], "kept", name + ".parquet"),
                           st["storage_options"])
        if nq:
            io.write_table(io.batch_table(b.quarantine), io.join(st["dir"], "quarantine", name + ".parquet"),
                           st["storage_options"])
            for r in b.quarantine["_reason"]:
                key = r.split(" at ", 1)[0] if r.startswith(("invalid JSON", "invalid UTF-8")) else r
                key = key if len(key) < 80 else key[:77] + "..."
                quarantine_reasons[key] = quarantine_reasons.get(key, 0) + 1
        if nr or nq:
            parts.append({"name": name, "rows": nr, "quarantined": nq})
            k += 1
        n_rows += nr
        n_bad += nq
    return {"parts": parts, "rows": n_rows, "quarantined": n_bad, "reasons": quarantine_reasons,
            "row_sum": int(row_sum), "row_xor": int(row_xor)}


def _apply(table, d: Decision, name: str) -> dict[str, Any]:
    import pyarrow as pa

    st = _STATE
    n = table.num_rows
    if len(d.keep) != n:
        raise RuntimeError(f"step {st['label']}: decision for {n} rows has {len(d.keep)} entries")
    for col, values in d.columns.items():
        arr = pa.array(values, type=pa.string())
        if col in table.column_names:
            table = table.set_column(table.column_names.index(col), col, arr)
        else:
            table = table.append_column(col, arr)
    keep = np.asarray(d.keep, dtype=bool)
    kept = table.filter(pa.array(keep))
    removed_idx = np.nonzero(~keep)[0]
    reasons: dict[str, int] = {}
    if len(removed_idx):
        removed = table.take(pa.array(removed_idx))
        rs = [(d.reasons[i] if d.reasons else None) or "removed" for i in removed_idx]
        ds = [json.dumps(d.details[i] if d.details else None, ensure_ascii=False, default=str)
              for i in removed_idx]
        removed = removed.append_column("_step", pa.array([st["label"]] * len(rs), pa.string()))
        removed = removed.append_column("_reason", pa.array(rs, pa.string()))
        removed = removed.append_column("_detail", pa.array(ds, pa.string()))
        io.write_table(removed, io.join(st["dir"], "removed", name + ".parquet"), st["storage_options"])
        for r in rs:
            reasons[r] = reasons.get(r, 0) + 1
    if kept.num_rows:
        io.write_table(kept, io.join(st["dir"], "kept", name + ".parquet"), st["storage_options"])
    return {"name": name, "rows_in": n, "rows": kept.num_rows, "removed": len(removed_idx),
            "reasons": reasons, "stats": d.stats}


def _task_rows(name: str, url: str) -> dict[str, Any]:
    table = io.read_table(url, _STATE["storage_options"])
    return _apply(table, _STATE["runner"].process(table), name)


def _task_features(url: str) -> tuple[np.ndarray, Any]:
    table = io.read_table(url, _STATE["storage_options"])
    return table.column("_row").to_numpy(), _STATE["runner"].features(table)


def _task_apply(name: str, url: str, decision: Decision) -> dict[str, Any]:
    return _apply(io.read_table(url, _STATE["storage_options"]), decision, name)


def _task_call(method: str, url: str, args: tuple) -> Any:
    table = io.read_table(url, _STATE["storage_options"])
    return getattr(_STATE["runner"], method)(table, *args)


_TASKS: dict[str, Callable[..., Any]] = {
    "read": _task_read, "rows": _task_rows, "features": _task_features, "apply": _task_apply,
    "call": _task_call}


class _Pool:
    """`num_proc` forked workers sharing `state` (num_proc <= 1: run in this process)."""

    def __init__(self, num_proc: int, state: dict[str, Any]):
        self.pool = None
        self._saved = dict(_STATE)
        if num_proc <= 1:
            _init_worker(state)
        else:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            self.pool = mp.get_context(method).Pool(num_proc, _init_worker, (state,))

    def imap(self, name: str, args: Iterable[tuple]) -> Iterable[Any]:
        tasks = [(name, a) for a in args]
        if self.pool is None:
            return (_dispatch(t) for t in tasks)
        return self.pool.imap(_dispatch, tasks)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
        else:
            _STATE.clear()
            _STATE.update(self._saved)


def _progress(it: Iterable, total: int, desc: str, enabled: bool) -> Iterable:
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, total=total, desc=desc, unit="part", file=sys.stderr, mininterval=2.0,
                dynamic_ncols=True, leave=True)


# -- the run ------------------------------------------------------------------------------
class _Located:
    """A finished step directory (in the cache or a reuse_from location)."""

    def __init__(self, url: str, done: dict[str, Any]):
        self.url = url
        self.done = done

    def part_urls(self) -> list[tuple[str, str]]:
        return [(p["name"], io.join(self.url, "kept", p["name"] + ".parquet"))
                for p in self.done["parts"] if p["rows"]]

    def removed_urls(self) -> list[str]:
        return [io.join(self.url, "removed", p["name"] + ".parquet")
                for p in self.done["parts"] if p.get("removed")]


def _find_done(dirname: str, roots: list[str], so: dict) -> _Located | None:
    for root in roots:
        url = io.join(root, "steps", dirname)
        marker = io.join(url, DONE)
        if io.exists(marker, so):
            return _Located(url, io.read_json(marker, so))
    return None


def run_curation(input_urls: list[str] | str, steps: list[StepConfig | dict], out_url: str, *,
                 storage_options: dict[str, Any] | None = None, num_proc: int = 1,
                 batch_size: int = 10_000, fields: FieldMap | dict | None = None,
                 only: list[str] | None = None, reuse_from: list[str] | str | None = None,
                 cache_url: str | None = None, progress: bool = True,
                 output_format: str = "jsonl", work_dir: str | Path | None = None,
                 input_identity: Any = None, input_names: dict[str, str] | None = None,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the curation steps over the inputs; returns the report (also written to out_url).

    input_urls: files / dirs / globs / dataset dirs (local or fsspec URLs).
    steps: step configs (or dicts with `step:`), applied in order.
    out_url: where curated / removed / quarantine / report files go.
    cache_url: root of the step cache (`{cache_url}/steps/...`; default: out_url).
    reuse_from: other step-cache roots to reuse finished steps from (read only).
    only: compute nothing before these steps (labels); earlier steps must be cached.
    input_identity: what identifies the input content for the step cache (default: the
        sources' URLs with size/mtime/etag); a stage passes its upstream artifact URLs
        here so that local copies of the same artifact hit the same cache.
    input_names: input URL -> name shown in reports (e.g. the artifact URL of a local copy).
    """
    t_start = time.time()
    so = dict(storage_options or {})
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    urls = [input_urls] if isinstance(input_urls, str) else list(input_urls)
    step_cfgs = parse_steps(list(steps))
    fm = fields if isinstance(fields, FieldMap) else FieldMap.model_validate(fields or {})
    if output_format not in ("jsonl", "parquet"):
        raise CurationError(f"output_format must be jsonl or parquet, not {output_format!r}")
    if batch_size < 1 or num_proc < 1:
        raise CurationError("batch_size and num_proc must be >= 1")
    out_url = io.norm_url(out_url)
    cache = io.norm_url(cache_url) if cache_url else out_url
    reuse = [reuse_from] if isinstance(reuse_from, str) else list(reuse_from or [])
    roots = [cache] + [io.norm_url(r) for r in reuse]
    labels = [s.label for s in step_cfgs]
    if only:
        unknown = [o for o in only if o not in labels]
        if unknown:
            raise CurationError(f"--only {unknown}: no such step; the steps are {labels}")
        first_only = min(labels.index(o) for o in only)
    else:
        first_only = None
    own_tmp = work_dir is None
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="curate-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = RunContext(fm, so, work, num_proc, batch_size, progress)

    try:
        sources = io.discover(urls, so)
        if input_names:
            sources = [io.rename_source(s, {io.norm_url(k): v for k, v in input_names.items()})
                       for s in sources]
        input_identity = stable_hash({
            "sources": input_identity if input_identity is not None else [s.as_dict() for s in sources],
            "fields": fm.model_dump(mode="json")})
        # -- step 0: read --------------------------------------------------------------
        read_hash = stable_hash({"step": "read", "input": input_identity,
                                 "code": code_version("data_curation.io")})
        read_dir = f"00-read-{read_hash[:12]}"
        located = _find_done(read_dir, roots, so)
        step_reports: list[dict[str, Any]] = []
        if located is None:
            if first_only is not None:
                raise CurationError(
                    f"--only {only}: the input has not been read into the step cache yet "
                    f"({io.join(cache, 'steps', read_dir)} has no {DONE}); run the full curation "
                    "once before rerunning single steps")
            located = _run_read(sources, io.join(cache, "steps", read_dir), read_hash, ctx, log)
            reused = False
        else:
            log(f"[curate] read: reusing {located.url}")
            reused = True
        read_loc = located
        read_report = io.read_json(io.join(located.url, "report.json"), so)
        step_reports.append({**read_report, "dir": located.url, "reused": reused})
        prev_hash = read_hash
        locs: list[_Located] = []
        for i, cfg in enumerate(step_cfgs, 1):
            h = stable_hash({"step": cfg.step, "identity": cfg.identity(ctx),
                             "code": code_version(cfg.module()), "prev": prev_hash,
                             "input": input_identity})
            dirname = f"{i:02d}-{cfg.label}-{h[:12]}"
            found = _find_done(dirname, roots, so)
            if found is not None:
                log(f"[curate] {cfg.label}: reusing {found.url}")
                reused = True
            else:
                if first_only is not None and i - 1 < first_only:
                    raise CurationError(
                        f"--only {only}: earlier step {i:02d} {cfg.label!r} is not cached "
                        f"(no {DONE} in {io.join(cache, 'steps', dirname)}"
                        + (f" nor under {reuse}" if reuse else "") + "); run the full curation "
                        "once (same inputs and earlier-step config) before rerunning single steps")
                prev = locs[-1] if locs else read_loc
                ctx.total_rows = prev.done["kept"]
                found = _run_step(cfg, i, h, prev.part_urls(), io.join(cache, "steps", dirname), ctx, log)
                reused = False
            locs.append(found)
            rep = io.read_json(io.join(found.url, "report.json"), so)
            step_reports.append({**rep, "dir": found.url, "reused": reused})
            prev_hash = h
        report = _finish(sources, step_cfgs, read_loc, locs, step_reports, out_url, ctx,
                         output_format, log)
        report["seconds"] = round(time.time() - t_start, 3)
        report["cache_url"] = cache
        _write_reports(report, out_url, so)
        return report
    finally:
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)


def _start_dir(url: str, so: dict) -> None:
    io.remove_tree(url, so)   # leftovers of an unfinished run (no _DONE) are not trusted


def _mark_done(url: str, done: dict[str, Any], report: dict[str, Any], so: dict) -> _Located:
    io.write_text(io.join(url, "report.json"), json.dumps(report, indent=2, default=str), so)
    io.write_text(io.join(url, DONE), json.dumps(done, default=str), so)
    return _Located(url, done)


def _run_read(sources: list[io.Source], url: str, h: str, ctx: RunContext,
              log: Callable[[str], None]) -> _Located:
    t0 = time.time()
    _start_dir(url, ctx.storage_options)
    target = max(1 << 20, min(64 << 20, ctx.batch_size * 1024))
    tasks = io.plan_reads(sources, ctx.storage_options, ctx.work_dir, target)
    log(f"[curate] read: {len(sources)} source(s), {len(tasks)} task(s) -> {url}")
    pool = _Pool(ctx.num_proc, {"read_tasks": tasks, "fields": ctx.fields, "dir": url,
                                "storage_options": ctx.storage_options,
                                "batch_size": ctx.batch_size})
    parts, reasons = [], {}
    rows = bad = 0
    row_sum, row_xor = 0, 0
    try:
        for r in _progress(pool.imap("read", [(i,) for i in range(len(tasks))]), len(tasks),
                           "read", ctx.progress):
            parts.extend(r["parts"])
            rows += r["rows"]
            bad += r["quarantined"]
            row_sum = (row_sum + r["row_sum"]) % (1 << 64)
            row_xor ^= r["row_xor"]
            for k, v in r["reasons"].items():
                reasons[k] = reasons.get(k, 0) + v
    finally:
        pool.close()
    secs = round(time.time() - t0, 3)
    done = {"step": "read", "hash": h, "parts": parts, "rows_in": rows + bad, "kept": rows,
            "quarantined": bad, "row_sum": row_sum, "row_xor": row_xor,
            "sources": [s.as_dict() for s in sources]}
    report = {"step": "read", "kind": "read", "hash": h, "rows_in": rows + bad, "kept": rows,
              "removed": 0, "quarantined": bad, "quarantine_reasons": reasons,
              "sources": [s.label for s in sources], "seconds": secs}
    log(f"[curate] read: {rows + bad} rows, {bad} quarantined ({secs}s)")
    return _mark_done(url, done, report, ctx.storage_options)


def _run_step(cfg: StepConfig, index: int, h: str, parts: list[tuple[str, str]], url: str,
              ctx: RunContext, log: Callable[[str], None]) -> _Located:
    t0 = time.time()
    so = ctx.storage_options
    _start_dir(url, so)
    runner: StepRunner = cfg.build(ctx)
    state = {"runner": runner, "dir": url, "storage_options": so, "label": cfg.label}
    log(f"[curate] {cfg.label}: {len(parts)} part(s) -> {url}")
    pool = _Pool(ctx.num_proc, state)
    results: list[dict[str, Any]] = []
    try:
        if runner.mode == "rows":
            results = list(_progress(pool.imap("rows", parts), len(parts), cfg.label, ctx.progress))
        else:
            part_urls = [u for _, u in parts]

            def map_parts(method: str, per_part: dict[int, tuple]) -> list[Any]:
                order = sorted(per_part)
                return list(pool.imap("call", [(method, part_urls[p], per_part[p]) for p in order]))

            ctx.map_parts = map_parts
            feats = pool.imap("features", [(u,) for u in part_urls])
            stream = ((i, rows, f) for i, (rows, f) in
                      enumerate(_progress(feats, len(parts), cfg.label, ctx.progress)))
            decisions = runner.resolve(stream, ctx)
            if len(decisions) != len(parts):
                raise RuntimeError(f"step {cfg.label}: {len(decisions)} decisions for {len(parts)} parts")
            results = list(pool.imap("apply", [(n, u, d) for (n, u), d in zip(parts, decisions)]))
    finally:
        pool.close()
        ctx.map_parts = None
    stats: dict[str, Any] = {}
    reasons: dict[str, int] = {}
    for r in results:
        stats = merge_stats(stats, r.pop("stats") or {})
        for k, v in r["reasons"].items():
            reasons[k] = reasons.get(k, 0) + v
    rows_in = sum(r["rows_in"] for r in results)
    kept = sum(r["rows"] for r in results)
    removed = sum(r["removed"] for r in results)
    secs = round(time.time() - t0, 3)
    done = {"step": cfg.label, "kind": cfg.step, "hash": h, "parts": results,
            "rows_in": rows_in, "kept": kept, "removed": removed}
    report = {"step": cfg.label, "kind": cfg.step, "index": index, "hash": h,
              "config": cfg.model_dump(mode="json"), "rows_in": rows_in, "kept": kept,
              "removed": removed, "reasons": reasons, "details": runner.summarize(stats),
              "seconds": secs}
    log(f"[curate] {cfg.label}: {rows_in} in, {kept} kept, {removed} removed ({secs}s)")
    return _mark_done(url, done, report, so)


# -- final outputs ------------------------------------------------------------------------
def _row_source(sources: list[io.Source], src: int, line: int) -> str:
    return f"{sources[src].label}:{line}" if 0 <= src < len(sources) else f"?:{line}"


def _finish(sources, step_cfgs, read_loc: _Located, locs: list[_Located],
            step_reports: list[dict[str, Any]], out_url: str, ctx: RunContext,
            output_format: str, log) -> dict[str, Any]:
    so = ctx.storage_options
    fs, out_path = io.fs_path(out_url, so)
    if io.is_local(out_url):
        os.makedirs(out_path, exist_ok=True)
    acc_sum, acc_xor = np.uint64(0), np.uint64(0)

    def account(ids: np.ndarray) -> None:
        nonlocal acc_sum, acc_xor
        u = ids.astype(np.int64).view(np.uint64)
        acc_sum += u.sum(dtype=np.uint64)
        if len(u):
            acc_xor ^= np.bitwise_xor.reduce(u)

    tagger = None
    tag_cfg = next((c for c in step_cfgs if c.step == "domain_tag"), None)
    if tag_cfg is not None:
        tagger = tag_cfg.build(ctx)
    mix_after: dict[str, int] = {}
    mix_removed: dict[str, dict[str, int]] = {}

    # curated rows
    final = (locs[-1] if locs else read_loc).part_urls()
    n_kept = 0
    curated_name = "curated.jsonl"
    curated_local = ctx.work_dir / "curated.jsonl" if output_format == "parquet" else None
    target = str(curated_local) if curated_local else io.join(out_path, curated_name)
    opener = open(target, "w", encoding="utf-8") if curated_local else fs.open(target, "w", encoding="utf-8")
    with opener as f:
        for _, u in final:
            t = io.read_table(u, so, columns=None if tagger else ["_row", "_raw"])
            account(t.column("_row").to_numpy())
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
        outputs["curated"] = _jsonl_to_parquet(curated_local, io.join(out_url, "curated.parquet"), ctx)
    else:
        outputs["curated"] = io.join(out_url, curated_name)

    # removed rows, step by step
    n_removed = 0
    with fs.open(io.join(out_path, "removed.jsonl"), "w", encoding="utf-8") as f:
        for loc, cfg in zip(locs, step_cfgs):
            for u in loc.removed_urls():
                t = io.read_table(u, so)
                account(t.column("_row").to_numpy())
                cols = {c: t.column(c).to_pylist() for c in
                        ("_row", "_src", "_line", "_id", "_raw", "_reason", "_detail")}
                lines = []
                for row, src, line, rid, raw, reason, detail in zip(*cols.values()):
                    lines.append('{"row": %d, "source": %s, "id": %s, "step": %s, "reason": %s, '
                                 '"detail": %s, "data": %s}' % (
                                     row, json.dumps(_row_source(sources, src, line), ensure_ascii=False),
                                     json.dumps(rid, ensure_ascii=False), json.dumps(cfg.label),
                                     json.dumps(reason), detail, raw))
                f.write("\n".join(lines) + "\n")
                n_removed += len(lines)
                if tagger:
                    m = mix_removed.setdefault(cfg.label, {})
                    for d in tagger.domains(t):
                        m[d] = m.get(d, 0) + 1
    outputs["removed"] = io.join(out_url, "removed.jsonl")

    # quarantine
    n_quar = 0
    examples = []
    with fs.open(io.join(out_path, "quarantine.jsonl"), "w", encoding="utf-8") as f:
        for p in read_loc.done["parts"]:
            if not p.get("quarantined"):
                continue
            t = io.read_table(io.join(read_loc.url, "quarantine", p["name"] + ".parquet"), so)
            account(t.column("_row").to_numpy())
            for row, src, line, reason, raw in zip(*(t.column(c).to_pylist() for c in
                                                     ("_row", "_src", "_line", "_reason", "_rawtext"))):
                rec = {"row": row, "source": _row_source(sources, src, line), "line": line,
                       "reason": reason, "raw": raw}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                if len(examples) < 5:
                    examples.append({**rec, "raw": raw[:200]})
                n_quar += 1
    outputs["quarantine"] = io.join(out_url, "quarantine.jsonl")

    # the accounting identity
    n_input = read_loc.done["rows_in"]
    acc = {"input": n_input, "kept": n_kept, "removed": n_removed, "quarantined": n_quar,
           "ids_match": int(acc_sum) == read_loc.done["row_sum"] and int(acc_xor) == read_loc.done["row_xor"]}
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
        "outputs": {**outputs, "report_json": io.join(out_url, "report.json"),
                    "report_md": io.join(out_url, "report.md"),
                    "report_html": io.join(out_url, "report.html")},
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


def _jsonl_to_parquet(local_jsonl: Path, url: str, ctx: RunContext) -> str:
    import datasets

    ds = datasets.Dataset.from_json(str(local_jsonl), cache_dir=str(ctx.work_dir / "hf-cache"))
    ds.to_parquet(url if not io.is_local(url) else io.local_path(url),
                  storage_options=ctx.storage_options or None)
    return url


def _write_reports(report: dict[str, Any], out_url: str, so: dict) -> None:
    from data_curation.report import render_html, render_markdown

    io.write_text(io.join(out_url, "report.json"),
                  json.dumps(report, indent=2, ensure_ascii=False, default=str), so)
    io.write_text(io.join(out_url, "report.md"), render_markdown(report), so)
    io.write_text(io.join(out_url, "report.html"), render_html(report), so)

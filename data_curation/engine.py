"""Running the steps: the read step, then each configured step, against the step cache.

A step's hash = sha256(step kind, its result-relevant config incl. the content identity
of files it reads (benchmarks), the code of its module and the core modules, the previous
step's hash, the input identity). A finished step directory (step_cache.py) is reused,
never recomputed, so changing only the benchmark list reruns decontamination and the
steps after it. `only=[...]` forbids computing anything before the named steps: they must
be cached (in the cache or a `reuse_from` location), else the run stops and says which.

Rows are processed as parquet parts of `batch_size` rows by `num_proc` worker processes
(worker_pool.py: forked; each part is read, decided, and written by one worker), so memory
is bounded by a few parts, not the corpus. outputs.py writes the final files and checks
the accounting identity.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from data_curation import discovery, urls
from data_curation._base import CurationError, merge_stats, stable_hash
from data_curation.outputs import AccountingError, write_outputs, write_reports
from data_curation.read_step import run_read
from data_curation.row_schema import FieldMap, RowPolicy
from data_curation.step_api import RunContext, StepConfig, StepRunner, code_version
from data_curation.step_cache import DONE, StepDir, find_done, mark_done, start_dir
from data_curation.step_kinds import parse_steps
from data_curation.worker_pool import WorkerPool, progress

__all__ = ["run_curation", "AccountingError"]


def run_curation(input_urls: list[str] | str, steps: list[StepConfig | dict], out_url: str, *,
                 storage_options: dict[str, Any] | None = None, num_proc: int = 1,
                 batch_size: int = 10_000, fields: FieldMap | dict | None = None,
                 row_policy: RowPolicy | dict | None = None,
                 only: list[str] | None = None, reuse_from: list[str] | str | None = None,
                 cache_url: str | None = None, progress: bool = True,
                 output_format: str = "jsonl", work_dir: str | Path | None = None,
                 input_identity: Any = None, input_names: dict[str, str] | None = None,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the curation steps over the inputs; returns the report (also written to out_url).

    input_urls: files / dirs / globs / dataset dirs (local or fsspec URLs).
    steps: step configs (or dicts with `step:`), applied in order.
    fields: where rows keep their texts (row_schema.FieldMap); row_policy: what happens to
        response-only rows and repeated ids (row_schema.RowPolicy).
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
    inputs = [input_urls] if isinstance(input_urls, str) else list(input_urls)
    step_cfgs = parse_steps(list(steps))
    fm = fields if isinstance(fields, FieldMap) else FieldMap.model_validate(fields or {})
    policy = row_policy if isinstance(row_policy, RowPolicy) else RowPolicy.model_validate(row_policy or {})
    if output_format not in ("jsonl", "parquet"):
        raise CurationError(f"output_format must be jsonl or parquet, not {output_format!r}")
    if batch_size < 1 or num_proc < 1:
        raise CurationError("batch_size and num_proc must be >= 1")
    out_url = urls.normalise_url(out_url)
    cache = urls.normalise_url(cache_url) if cache_url else out_url
    reuse = [reuse_from] if isinstance(reuse_from, str) else list(reuse_from or [])
    roots = [cache] + [urls.normalise_url(r) for r in reuse]
    first_only = _first_only(only, [s.label for s in step_cfgs])
    own_tmp = work_dir is None
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="curate-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = RunContext(fm, so, work, num_proc, batch_size, progress)

    try:
        sources = discovery.discover(inputs, so)
        if input_names:
            sources = [discovery.rename_source(s, {urls.normalise_url(k): v for k, v in input_names.items()})
                       for s in sources]
        input_identity = stable_hash({
            "sources": input_identity if input_identity is not None else [s.as_dict() for s in sources],
            "fields": fm.model_dump(mode="json")})
        cached = _StepCache(cache, roots, reuse, only, first_only)
        read_hash, read_loc, step_reports = _read(cached, sources, input_identity, policy, ctx, log)
        locs = _run_steps(cached, step_cfgs, read_hash, read_loc, input_identity, ctx, log, step_reports)
        report = write_outputs(sources, step_cfgs, read_loc, locs, step_reports, out_url, ctx,
                         output_format, log)
        report["seconds"] = round(time.time() - t_start, 3)
        report["cache_url"] = cache
        write_reports(report, out_url, so)
        return report
    finally:
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)



def _first_only(only: list[str] | None, labels: list[str]) -> int | None:
    """The index of the first step `--only` names (None: compute every step)."""
    if not only:
        return None
    unknown = [o for o in only if o not in labels]
    if unknown:
        raise CurationError(f"--only {unknown}: no such step; the steps are {labels}")
    return min(labels.index(o) for o in only)


@dataclass(frozen=True)
class _StepCache:
    """Where finished steps are found (`roots`: the cache, then `reuse`) and where new ones go."""

    cache: str
    roots: list[str]
    reuse: list[str]
    only: list[str] | None
    first_only: int | None


def _read(cached: _StepCache, sources, input_identity: str, policy: RowPolicy, ctx: RunContext,
          log: Callable[[str], None]) -> tuple[str, StepDir, list[dict[str, Any]]]:
    """Step 0, reading the sources (or its cached result): (its hash, its dir, [its report])."""
    so = ctx.storage_options
    read_hash = stable_hash({"step": "read", "input": input_identity,
                             "policy": policy.model_dump(mode="json"),
                             "code": code_version("data_curation.read_step",
                                                  "data_curation.worker_pool")})
    read_dir = f"00-read-{read_hash[:12]}"
    located = find_done(read_dir, cached.roots, so)
    if located is None:
        if cached.first_only is not None:
            raise CurationError(
                f"--only {cached.only}: the input has not been read into the step cache yet "
                f"({urls.join(cached.cache, 'steps', read_dir)} has no {DONE}); run the full curation "
                "once before rerunning single steps")
        located = run_read(sources, urls.join(cached.cache, "steps", read_dir), read_hash, ctx, policy, log)
        reused = False
    else:
        log(f"[curate] read: reusing {located.url}")
        reused = True
    return read_hash, located, [{**located.report(so), "dir": located.url, "reused": reused}]


def _run_steps(cached: _StepCache, step_cfgs: list[StepConfig], read_hash: str, read_loc: StepDir,
               input_identity: str, ctx: RunContext, log: Callable[[str], None],
               step_reports: list[dict[str, Any]]) -> list[StepDir]:
    """Each step in order, from the step cache where it is there; appends each one's report."""
    so = ctx.storage_options
    prev_hash = read_hash
    locs: list[StepDir] = []
    for i, cfg in enumerate(step_cfgs, 1):
        h = stable_hash({"step": cfg.step, "identity": cfg.identity(ctx),
                         "code": code_version(*cfg.modules()), "prev": prev_hash,
                         "input": input_identity})
        dirname = f"{i:02d}-{cfg.label}-{h[:12]}"
        found = find_done(dirname, cached.roots, so)
        if found is not None:
            log(f"[curate] {cfg.label}: reusing {found.url}")
            reused = True
        else:
            if cached.first_only is not None and i - 1 < cached.first_only:
                raise CurationError(
                    f"--only {cached.only}: earlier step {i:02d} {cfg.label!r} is not cached "
                    f"(no {DONE} in {urls.join(cached.cache, 'steps', dirname)}"
                    + (f" nor under {cached.reuse}" if cached.reuse else "") + "); run the full curation "
                    "once (same inputs and earlier-step config) before rerunning single steps")
            prev = locs[-1] if locs else read_loc
            ctx.total_rows = prev.done["kept"]
            found = _run_step(cfg, i, h, prev.part_urls(), urls.join(cached.cache, "steps", dirname), ctx, log)
            reused = False
        locs.append(found)
        step_reports.append({**found.report(so), "dir": found.url, "reused": reused})
        prev_hash = h
    return locs


def _run_step(cfg: StepConfig, index: int, h: str, parts: list[tuple[str, str]], url: str,
              ctx: RunContext, log: Callable[[str], None]) -> StepDir:
    t0 = time.time()
    so = ctx.storage_options
    start_dir(url, so)
    runner: StepRunner = cfg.build(ctx)
    state = {"runner": runner, "dir": url, "storage_options": so, "label": cfg.label}
    log(f"[curate] {cfg.label}: {len(parts)} part(s) -> {url}")
    pool = WorkerPool(ctx.num_proc, state)
    results: list[dict[str, Any]] = []
    try:
        if runner.mode == "rows":
            results = list(progress(pool.imap("rows", parts), len(parts), cfg.label, ctx.progress))
        else:
            part_urls = [u for _, u in parts]

            def map_parts(method: str, per_part: dict[int, tuple]) -> list[Any]:
                order = sorted(per_part)
                return list(pool.imap("call", [(method, part_urls[p], per_part[p]) for p in order]))

            ctx.map_parts = map_parts
            feats = pool.imap("features", [(u,) for u in part_urls])
            stream = ((i, rows, f) for i, (rows, f) in
                      enumerate(progress(feats, len(parts), cfg.label, ctx.progress)))
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
    return mark_done(url, done, report, so)


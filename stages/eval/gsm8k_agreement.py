"""Does our GSM8K scoring agree with lm-eval's? The same generations scored both ways.

Ours: the gold is the N after "#### " of the GSM8K solution (`benchmarks.gsm8k_gold`), and the
`math` verifier scores the response (what the eval stage does for a GSM8K benchmark set).
lm-eval's: the `gsm8k` task's two filters, strict-match ("#### N") and flexible-extract (the
last number-like string), then exact_match with the task's regexes_to_ignore
(`harness.gsm8k_scorer`). Every row where a filter's score differs from ours is listed with
both extractions, so each disagreement can be explained.

    python -m stages.eval.gsm8k_agreement EVAL_STAGE_DIR --set gsm8k --gold "$RING_BENCHMARKS_DIR/gsm8k.jsonl"
        [--model rl] [--decoding greedy] [--out report.json] [--show 20]
    python -m stages.eval.gsm8k_agreement GENERATIONS.jsonl [--gold ...] [--id-field idx] [--extraction JSON]

EVAL_STAGE_DIR: a published eval stage (its responses.jsonl and manifest.json). Our scoring then
uses the extraction options the stage's set used (its recipe's `extraction`, the verifier's
defaults where it set none), so "ours" is the score the eval reported. GENERATIONS.jsonl: one JSON
object per line with `response` and either `answer` (the GSM8K solution or the number) or an `id`
found in `--gold` under `--id-field`; our extraction is `--extraction` (default: a GSM8K set's
`GSM8K_EXTRACTION`). An agreement rate is one model's generations under one decoding: rows of
several (an eval of two models, or greedy and sampled) are refused until `--model` /
`--decoding` pick one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from stages.common.artifact_inputs import ArtifactError, read_manifest
from stages.common.rows import DataError, input_rows
from stages.eval.benchmarks import GSM8K_EXTRACTION, gsm8k_gold
from stages.eval.harness import gsm8k_scorer
from verifiers import verify_batch


def agreement(rows: list[dict[str, Any]], num_workers: int = 0,
              extraction: dict[str, Any] | None = None) -> dict[str, Any]:
    """rows: {"id", "response", "answer"}. Returns accuracies, agreement rates per lm-eval
    filter, and the disagreements. `extraction`: our verifier's extraction options (default:
    a GSM8K benchmark set's, `GSM8K_EXTRACTION`)."""
    score, _ = gsm8k_scorer()
    golds = [gsm8k_gold(r["answer"]) or str(r["answer"]).strip() for r in rows]
    options = GSM8K_EXTRACTION if extraction is None else extraction
    task_rows = [{"domain": "math", "prompt": "", "reference": {"answer": g}, "id": r.get("id"), "extraction": options}
                 for r, g in zip(rows, golds)]
    ours = verify_batch(task_rows, [r["response"] for r in rows], num_workers=num_workers)
    theirs = score([r["response"] for r in rows], [str(r["answer"]) for r in rows])
    n = len(rows)
    report: dict[str, Any] = {"rows": n, "ours_accuracy": sum(o.score for o in ours) / max(n, 1),
                              "lm_eval_accuracy": {}, "agreement": {}, "disagreements": {}}
    for name, scored in theirs.items():
        differ = [i for i, (o, (_, s)) in enumerate(zip(ours, scored)) if float(o.score == 1.0) != s]
        report["lm_eval_accuracy"][name] = sum(s for _, s in scored) / max(n, 1)
        report["agreement"][name] = 1 - len(differ) / max(n, 1)
        report["disagreements"][name] = [
            {"id": rows[i].get("id"), "gold": golds[i], "ours": ours[i].score, "ours_extracted": ours[i].extracted,
             "ours_reason": ours[i].reason, "lm_eval": scored[i][1], "lm_eval_extracted": scored[i][0],
             "response": rows[i]["response"]} for i in differ]
    return report


def read_generations(path: Path, gold: Path | None, id_field: str, set_name: str | None,
                     model: str | None = None, decoding: str | None = None) -> list[dict[str, Any]]:
    """The generations (of `set_name`, `model`, `decoding` where given) with their gold answers;
    DataError naming file:line for a bad line, or the groups when the rows are of several models
    or decodings (one agreement figure over both would describe neither)."""
    def rows_of(p: Path, what: str):
        return input_rows(Path, str(p), what)

    answers: dict[str, Any] = {}
    for row in rows_of(gold, "GSM8K gold rows") if gold is not None else ():
        if not isinstance(row.data, dict) or id_field not in row.data or "answer" not in row.data:
            raise DataError(f"GSM8K gold rows {row.where}: needs fields {id_field!r} and 'answer'")
        answers[str(row.data[id_field])] = row.data["answer"]
    rows, groups = [], set()
    for row in rows_of(path, "generations"):
        data = row.data if isinstance(row.data, dict) else {}
        if ((set_name is not None and data.get("set") != set_name) or (model is not None and data.get("model") != model)
                or (decoding is not None and data.get("decoding") != decoding)):
            continue
        groups.add((str(data.get("model", "")), str(data.get("decoding", ""))))
        if not isinstance(data.get("response"), str):
            raise DataError(f"generations {row.where}: field 'response' must be a string")
        answer = data.get("answer", answers.get(str(data.get("id"))))
        if answer is None:
            raise DataError(f"generations {row.where}: no 'answer' field and id {data.get('id')!r} is not in "
                            f"{gold or '--gold (not given)'}")
        rows.append({"id": data.get("id", row.where), "response": data["response"], "answer": answer})
    if not rows:
        picked = ", ".join(f"{k} {v!r}" for k, v in (("set", set_name), ("model", model), ("decoding", decoding)) if v)
        raise DataError(f"generations {path}: no rows" + (f" of {picked}" if picked else ""))
    if len(groups) > 1:
        raise DataError(f"generations {path}: rows of {len(groups)} (model, decoding) pairs {sorted(groups)}; "
                        "an agreement rate is one model's generations under one decoding: pick one with "
                        "--model and --decoding")
    return rows


def eval_stage_extraction(stage_dir: Path, set_name: str | None) -> dict[str, Any]:
    """The extraction options eval set `set_name` of a published eval stage was scored with, read
    from its manifest's config: the verifier's defaults ({}) where the set named none."""
    if set_name is None:
        raise DataError(f"{stage_dir}: an eval stage directory needs --set (the eval set to read)")
    try:
        config = read_manifest(str(stage_dir)).get("config") or {}
    except ArtifactError as e:
        raise DataError(f"{stage_dir}: not a published eval stage ({e})") from None
    sets = config.get("sets") or {}
    if set_name not in sets:
        raise DataError(f"{stage_dir}: the eval stage has no set {set_name!r} (its sets: {sorted(sets)})")
    spec = sets[set_name]
    return dict(spec.get("extraction") or {}) if isinstance(spec, dict) else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("generations", type=Path, help="an eval stage's directory, or a JSONL file of generations")
    p.add_argument("--gold", type=Path, help="GSM8K rows (their answer field) to look generation ids up in")
    p.add_argument("--id-field", default="idx", help="the id field of --gold rows")
    p.add_argument("--set", dest="set_name", help="only generations whose `set` is this (eval responses.jsonl)")
    p.add_argument("--model", help="only generations of this model (an eval stage's model name)")
    p.add_argument("--decoding", help="only generations under this decoding (an eval stage's decoding name)")
    p.add_argument("--out", type=Path, help="write the full report (JSON) here")
    p.add_argument("--show", type=int, default=20, help="disagreements printed per filter")
    p.add_argument("--extraction", type=json.loads, help="our verifier's extraction options as JSON "
                   "(default: an eval stage's, read from its manifest; for a file, the GSM8K benchmark set's)")
    args = p.parse_args(argv)
    extraction, generations = args.extraction, args.generations
    try:
        if generations.is_dir():
            if extraction is None:
                extraction = eval_stage_extraction(generations, args.set_name)
            generations = generations / "responses.jsonl"
        rows = read_generations(generations, args.gold, args.id_field, args.set_name, args.model, args.decoding)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = agreement(rows, num_workers=2, extraction=extraction)
    report["extraction"] = GSM8K_EXTRACTION if extraction is None else extraction
    print(f"{report['rows']} rows; ours accuracy {report['ours_accuracy']:.4f} (extraction {report['extraction']})")
    for name, rate in report["agreement"].items():
        dis = report["disagreements"][name]
        print(f"lm-eval {name}: accuracy {report['lm_eval_accuracy'][name]:.4f}, agreement with ours {rate:.4f} "
              f"({len(dis)} rows differ)")
        for d in dis[:args.show]:
            print(f"  id {d['id']}: gold {d['gold']!r} ours {d['ours']:.0f} ({d['ours_extracted']!r}: {d['ours_reason']})"
                  f" lm-eval {d['lm_eval']:.0f} ({d['lm_eval_extracted']!r}) response {d['response'][-120:]!r}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

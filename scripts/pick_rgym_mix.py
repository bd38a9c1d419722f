"""Pick a reasoning-RL mix of reasoning-gym families from what the base model gets partly right.

GRPO learns only from prompts whose rollouts are partly right (some samples score 1, some 0):
an all-wrong or all-right group has zero advantage. An `eval` stage with several samples per
prompt reports that share per family (`partly_right`, eval's `reasoning_gym/<family>` records).
This script reads such a summary, keeps the families with enough partly-right prompts and room
to improve, and writes a recipe whose reasoning-gym files use them:

    python3 scripts/pick_rgym_mix.py --summary .ring/artifacts/smollm2-reasoning/eval_probe-*/stage_summary.json \\
        --recipe recipes/smollm2-reasoning.yaml --out recipes/smollm2-picked.yaml

The rule (flags): a family is eligible when partly_right >= --min-partly and its sampled
accuracy <= --max-accuracy; the --families most partly-right eligible ones are taken (ties: the
lower accuracy first). Each keeps the config it had in the probe (`--probe-stage`, `--probe-file`);
the files of `--data-stage` named by `--files` get the mix (same weight each). Fewer eligible
families than --min-families is an error: the probe says the model cannot learn from this set.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

PREFIX = "reasoning_gym/"


@dataclass(frozen=True)
class FamilyScore:
    family: str
    accuracy: float      # mean sampled score (pass@1)
    partly_right: float  # share of prompts with some but not all samples right
    rows: int


def family_scores(summary: dict, model: str | None = None, set_name: str | None = None) -> list[FamilyScore]:
    """The per-family records of a sampled decoding in an eval stage's summary."""
    out = []
    for r in summary["results"]:
        if not r["domain"].startswith(PREFIX) or "partly_right" not in r:
            continue
        if (model and r["model"] != model) or (set_name and r["set"] != set_name):
            continue
        out.append(FamilyScore(r["domain"][len(PREFIX):], r["accuracy"], r["partly_right"], int(r["rows"])))
    if not out:
        raise SystemExit("no per-family sampled records (reasoning_gym/<family> with partly_right) in the "
                         "summary: the probe needs a decoding with samples > 1 on reasoning-gym rows")
    return out


def pick(scores: list[FamilyScore], *, k: int, min_partly: float, max_accuracy: float,
         min_families: int) -> list[FamilyScore]:
    eligible = [s for s in scores if s.partly_right >= min_partly and s.accuracy <= max_accuracy]
    if len(eligible) < min_families:
        raise SystemExit(f"only {len(eligible)} families have partly_right >= {min_partly} and accuracy <= "
                         f"{max_accuracy} (need {min_families}): {[s.family for s in eligible]}")
    return sorted(eligible, key=lambda s: (-s.partly_right, s.accuracy, s.family))[:k]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summary", required=True, help="the probe eval stage's stage_summary.json")
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="the model name in the summary (default: any)")
    ap.add_argument("--families", type=int, default=6)
    ap.add_argument("--min-families", type=int, default=3)
    ap.add_argument("--min-partly", type=float, default=0.15)
    ap.add_argument("--max-accuracy", type=float, default=0.75)
    ap.add_argument("--probe-stage", default="probe_data")
    ap.add_argument("--probe-file", default="probe.jsonl")
    ap.add_argument("--data-stage", default="data")
    ap.add_argument("--files", nargs="+", default=["distill_prompts.jsonl", "rl.jsonl", "heldout.jsonl"])
    args = ap.parse_args(argv)

    scores = family_scores(json.loads(Path(args.summary).read_text()), args.model)
    chosen = pick(scores, k=args.families, min_partly=args.min_partly, max_accuracy=args.max_accuracy,
                  min_families=args.min_families)
    names = {s.family for s in chosen}
    print(f"{'family':26} {'accuracy':>8} {'partly':>7}  rows")
    for s in sorted(scores, key=lambda s: -s.partly_right):
        print(f"{s.family:26} {s.accuracy:8.3f} {s.partly_right:7.3f}  {s.rows:4}  {'<- picked' if s.family in names else ''}")

    recipe = yaml.safe_load(Path(args.recipe).read_text())
    stages = recipe["stages"]
    probe_tasks = stages[args.probe_stage]["files"][args.probe_file]["params"]["tasks"]
    mix = {s.family: {"config": dict((probe_tasks.get(s.family) or {}).get("config", {}))} for s in chosen}
    for name in args.files:
        stages[args.data_stage]["files"][name]["params"]["tasks"] = mix
    Path(args.out).write_text(f"# written by scripts/pick_rgym_mix.py from {args.summary} and {args.recipe}\n"
                              + yaml.safe_dump(recipe, sort_keys=False, width=120))
    print(f"mix of {len(chosen)} families -> {args.out}: {', '.join(s.family for s in chosen)}")


if __name__ == "__main__":
    sys.exit(main())

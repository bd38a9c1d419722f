"""The `curate` stage: SFT data cleaning (data_curation) between data and `sft`.

Run: `python -m stages.curate.job --job job.json` (one process, `num_proc` workers).
Outputs: curated.jsonl (or .parquet; rows unchanged except cleaning/tagging, `messages`
kept), removed.jsonl (every removed row with step, reason, detail), quarantine.jsonl
(unreadable rows with the reason), report.json/.md/.html, contamination.json (benchmark
items found, when the steps decontaminate), stage_summary.json. Step
outputs live in a step cache next to the stage dirs, `{store}/{recipe}/_curate_cache/
{stage}/steps/`, so a new stage hash (say, a new benchmark list) reuses the steps before
decontamination.
"""

"""The `synthetic_data` stage: writes each configured jsonl file from its generator.

Run: `python -m stages.synthetic_data.job --job job.json` (one process). Outputs:
the files named in the config (one JSON object per line) and `stage_summary.json` with
the row count of each file.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from stages.common.contract import StageError, StageJob
from stages.common.entry import run_job
from stages.common.stage_log import StageLogger, info
from stages.synthetic_data.config import SyntheticDataConfig
from stages.synthetic_data.generators import get_generator


def main(job: StageJob, cfg: SyntheticDataConfig) -> dict[str, Any]:
    log = StageLogger.for_job(job)
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"files": {}}
    for name, spec in cfg.files.items():
        try:
            rows = get_generator(spec.generator)(spec.n, spec.seed, **spec.params)
        except ValueError as e:  # what the parameters cannot give (e.g. too few distinct questions)
            raise StageError(f"synthetic_data: files.{name} ({spec.generator}): {e}") from None
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        summary["files"][name] = {"rows": len(rows), "generator": spec.generator}
        info(f"synthetic_data: {name}: {len(rows)} rows from {spec.generator}")
    log.params({f"rows.{k}": v["rows"] for k, v in summary["files"].items()})
    (out / "stage_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    sys.exit(run_job(main, SyntheticDataConfig))

"""`python -m tests.stages.run_stage_process '<json>'`: pipeline.execute.run_stage in a process of its
own, so that a test can kill it (and the stage job under it) with SIGKILL. The JSON holds
run_stage's arguments plus "kind", "config" and "resources" (a Resources dict)."""
from __future__ import annotations

import json
import sys

from pipeline.execute import run_stage
from stages.common.contract import Resources

if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    kind, config = args.pop("kind"), args.pop("config")
    run_stage(kind, config, resources=Resources(**args.pop("resources")), **args)

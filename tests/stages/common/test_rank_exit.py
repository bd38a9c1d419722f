"""How a rank whose job succeeded ends its process (stages.common.entry.end_succeeded_process):
without the interpreter's finalization, where a native thread of the process group that needs
the GIL aborted ranks now and then (SIGABRT, "terminate called without an active exception":
4 of 150 runs of tests/stages/rl/ds_zero3_ranks.py), yet with everything Python's own exit
would have finished: threads, exit handlers, buffered output. The abort itself is a race that
no test here provokes on demand (an allreduce left to finish during finalization did not:
torch skips the GIL once the interpreter is no longer initialized)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stages.common.contract import StageJob

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
WORLD_OF_ONE = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}  # its store binds any port


def _run_rank(tmp_path: Path, body: str, prologue: str = "") -> subprocess.CompletedProcess:
    """A stage rank as launchers start one (`python -m ...`: run_job is the process's entry),
    joined to a gloo world of one, whose job is `def main(job, cfg)` as written in `body`."""
    StageJob(recipe="t", stage="ends", kind="probe", hash="0" * 16, config={"kind": "probe"},
             stage_url=f"file://{tmp_path}/store", output_dir=str(tmp_path / "out"),
             work_dir=str(tmp_path / "work")).write(tmp_path / "job.json")
    script = (f"{prologue}"
              "import sys\n"
              "from stages.common.contract import StageConfig\n"
              "from stages.common.distributed import init_distributed\n"
              "from stages.common.entry import run_job\n"
              f"{body}"
              f"sys.argv[1:] = ['--job', {str(tmp_path / 'job.json')!r}]\n"
              "sys.exit(run_job(main, StageConfig))\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, **WORLD_OF_ONE, "PYTHONPATH": str(REPO)})


def test_a_succeeded_rank_ends_with_its_last_lines_and_files_complete(tmp_path):
    """What a rank's Python exit finished before still is: the output it had not flushed, its
    logging records, the files that a non-daemon thread, a thread pool and an exit handler
    were still writing when the job returned. The job's status stays 0."""
    out_dir = tmp_path / "out"
    body = ("import atexit, concurrent.futures, logging, threading, time\n"
            "from pathlib import Path\n"
            "from stages.common.stage_log import StageLogger\n"
            "def write_late(name, lines, after_s):\n"
            "    time.sleep(after_s)  # still writing when main has returned\n"
            "    Path(name).write_text(''.join(f'{i}\\n' for i in range(lines)))\n"
            "def main(job, cfg):\n"
            "    init_distributed()\n"
            "    out = Path(job.output_dir)\n"
            "    out.mkdir(parents=True)\n"
            "    logging.basicConfig(filename=out / 'job.log', level=logging.INFO)\n"
            "    threading.Thread(target=write_late, args=(out / 'thread.txt', 50_000, 2.0)).start()\n"
            "    pool = concurrent.futures.ThreadPoolExecutor(1)  # never shut down by the job\n"
            "    pool.submit(write_late, out / 'pool.txt', 50_000, 2.0)\n"
            "    atexit.register(write_late, out / 'atexit.txt', 50_000, 0.2)\n"
            "    # the threads outlast the exit handler: only joining them first keeps their files\n"
            "    StageLogger.for_job(job).metrics(7, {'loss': 0.5})\n"
            "    for i in range(20_000):  # stdout is a pipe: block-buffered, not flushed by the job\n"
            "        print(f'line {i}')\n"
            "    logging.info('last record')\n"
            "    print('the last words', file=sys.stderr)\n")
    out = _run_rank(tmp_path, body)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "line 19999" and len([x for x in lines if x.startswith("line ")]) == 20_000
    assert json.loads(next(x for x in lines if x.startswith("[metrics] ")).removeprefix("[metrics] ")) == \
        {"step": 7, "loss": 0.5}
    assert out.stderr.rstrip().endswith("the last words")
    assert (out_dir / "job.log").read_text().rstrip().endswith("last record")
    for name in ("thread.txt", "pool.txt", "atexit.txt"):
        assert (out_dir / name).read_text().splitlines()[-1] == "49999", name

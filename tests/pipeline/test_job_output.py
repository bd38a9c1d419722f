"""What a stage job prints, read the way `ring-pipeline run` reads it (real subprocesses through
`pipeline.launch.launch_job`): progress and metrics for the console, the user error or the crash
that explains a failure, and nothing of the job's chatter on a normal console."""
from __future__ import annotations

import io
import sys
import textwrap

import pytest

from pipeline import console
from pipeline.console import RunConsole, Verbosity
from pipeline.launch import launch_job
from stages.common.contract import Resources, StageFailed

DEEPSPEED_CHATTER = ("[2026-11-26 10:36:50,103] [INFO] [launch.py:152:main] WORLD INFO DICT: {'localhost': [0, 1]}\n"
                     "[2026-11-26 10:36:33,419] [WARNING] [real_accelerator.py:213:get_accelerator] Setting "
                     "accelerator to CPU.\n"
                     "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n"
                     "/venv/torch/distributed/c10d_logger.py:83: FutureWarning: `all_gather_into_tensor` is "
                     "deprecated.\n"
                     "  return func(*args, **kwargs)\n"
                     "Loading weights: 100%|##########| 26/26 [00:00<00:00, 12453.11it/s]\n")


def _run(tmp_path, body: str, stage: str = "demo", kind: str | None = "sft",
         verbosity: Verbosity = Verbosity.NORMAL):
    """Run a Python job with `body` as its program; (result or StageFailed, console text)."""
    out = io.StringIO()
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    with console.installed(RunConsole(verbosity, live=False, out=out, err=out)):
        try:
            result = launch_job([sys.executable, str(script)], stage, tmp_path / "stage.log", Resources(), kind=kind)
        except StageFailed as e:
            result = e
    return result, out.getvalue()


def test_progress_and_metrics_reach_the_console_not_the_json(tmp_path):
    result, shown = _run(tmp_path, f"""
        import json
        print({DEEPSPEED_CHATTER!r}, end="")
        print('[progress] {{"done": 0, "total": 8, "unit": "step"}}')
        for step in range(1, 9):
            print("sft step", step)
            print("[metrics] " + json.dumps({{"step": step, "loss": 10.0 - step, "lr": 0.1}}), flush=True)
        print("sft: warning: warmup_steps >= total steps")
    """)
    p = result.output.progress
    assert (p.done, p.total, p.unit) == (8, 8, "step")
    assert result.output.first["loss"] == 9.0 and result.output.last["loss"] == 2.0
    lines = shown.splitlines()
    # a plain console: a line at each quarter (2/8, 4/8, 6/8) with the kind's headline number,
    # and the stage's warning; no metric JSON, no step lines, no launcher chatter
    assert [ln.split()[1] for ln in lines if "steps (" in ln] == ["2/8", "4/8", "6/8"], shown
    assert "loss 6" in lines[1] and "step/s" in lines[1] and "ETA" in lines[1]
    assert lines[-1].startswith("demo") and lines[-1].endswith("sft: warning: warmup_steps >= total steps")
    assert len(lines) == 4
    log = (tmp_path / "stage.log").read_text()
    assert "[metrics]" in log and "WORLD INFO DICT" in log  # everything stays in the stage's log


def test_quiet_and_verbose(tmp_path):
    body = """
        print('[progress] {"total": 4}')
        for step in range(1, 5):
            print('[metrics] {"step": %d, "loss": 1.0}' % step)
        print("")
        print("[demo] a line that names its stage itself")
        print("demo: warning: careful")
    """
    _, quiet = _run(tmp_path, body, verbosity=Verbosity.QUIET)
    assert quiet == ""
    _, verbose = _run(tmp_path, body, verbosity=Verbosity.VERBOSE)
    assert '[demo] [metrics] {"step": 4, "loss": 1.0}' in verbose  # every line, prefixed once
    assert "[demo] a line that names its stage itself\n" in verbose and "[demo] [demo]" not in verbose
    assert "[demo] \n" not in verbose  # blank lines (tqdm's carriage returns) dropped


@pytest.mark.parametrize("peer", ["nothing", "a peer rank's traceback", "the launcher's report"])
def test_a_user_error_is_its_message_whatever_follows(tmp_path, peer):
    after = {"nothing": "",
             "a peer rank's traceback": "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                                        "RuntimeError: Connection closed by peer\n",
             "the launcher's report": "[2026-11-26 10:38:55,832] [ERROR] [launch.py:325:sigkill_handler] "
                                      "['python', '-m', 'stages.sft.job'] exits with return code = 2\n"}[peer]
    result, shown = _run(tmp_path, f"""
        import sys
        print({DEEPSPEED_CHATTER!r}, end="")
        print('[metrics] {{"step": 1, "loss": 2.0}}')
        print("demo (sft) failed: data.jsonl:3: not valid JSON\\ndata.jsonl:7: no messages", file=sys.stderr,
              flush=True)
        print({after!r}, end="", flush=True)
        sys.exit(2)
    """)
    assert isinstance(result, StageFailed) and result.user_error and result.exit_code == 2
    assert result.reason == "data.jsonl:3: not valid JSON\ndata.jsonl:7: no messages"
    assert result.excerpt == []
    assert str(result) == "stage 'demo' failed: data.jsonl:3: not valid JSON / data.jsonl:7: no messages"
    assert shown == ""  # launch_job reports nothing itself: execute reports the failure once


def test_a_crash_is_its_exception_and_the_lines_before_it(tmp_path):
    result, _ = _run(tmp_path, f"""
        print({DEEPSPEED_CHATTER!r}, end="")
        for i in range(30):
            print("sft step", i)
        def load(row):
            raise KeyError(row)
        def train():
            load("messages")
        train()
    """)
    assert isinstance(result, StageFailed) and not result.user_error and result.exit_code == 1
    assert result.reason == "KeyError: 'messages' (exit code 1)"
    assert result.excerpt[0].startswith("Traceback") or result.excerpt[0].startswith("  File")
    assert any("in load" in ln for ln in result.excerpt) and 'raise KeyError(row)' in result.excerpt[-1]
    assert not any("INFO" in ln or "sft step" in ln for ln in result.excerpt)


@pytest.mark.parametrize("line", [
    "[metrics] not json", "[metrics] [1, 2]", '[progress] {"done": "many"}', '[progress] {"total": null}',
    "[metrics] " + "{" * 5000, '[metrics] {"step": -3, "loss": "high"}',
])
def test_malformed_protocol_lines_are_text(tmp_path, line):
    result, shown = _run(tmp_path, f"""
        print({line!r})
        print('[metrics] {{"step": 2, "loss": 1.5}}')
    """)
    assert result.output.progress.done == 2 and result.output.last == {"loss": 1.5}
    assert "Traceback" not in shown


def test_the_first_crash_of_several_ranks_is_the_reason():
    """Rank 1 crashes; rank 0 then dies of it (its collective broke) and the launcher reports
    its child failed: the operator reads rank 1's error, not the echoes that came after it."""
    from pipeline.job_output import JobOutput

    out = JobOutput("rl", "reasoning_rl")
    for line in ["step 3 done", "Traceback (most recent call last):", '  File "learner.py", line 9, in train',
                 "ValueError: rank 1: NaN in the advantages of group g7",
                 "Traceback (most recent call last):", '  File "distributed_c10d.py", line 2, in all_reduce',
                 "torch.distributed.DistBackendError: Connection reset by peer",
                 "Traceback (most recent call last):", '  File "run.py", line 1, in <module>',
                 "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]:
        out.feed(line)
    failure = out.failure(1)
    assert failure.reason == "ValueError: rank 1: NaN in the advantages of group g7 (exit code 1)"
    assert not failure.user_error
    # only echoes, no traceback of the cause: the last lines are shown, not an echo as the reason
    echoes = JobOutput("rl", "reasoning_rl")
    for line in ["node 1 fails on purpose", "Traceback (most recent call last):", '  File "run.py", line 1',
                 "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]:
        echoes.feed(line)
    assert echoes.failure(1).reason == "its job exited with code 1"
    assert "node 1 fails on purpose" in echoes.failure(1).excerpt


def test_a_user_error_of_another_rank_is_the_reason_when_rank_0_says_nothing(tmp_path):
    """Ranks 1-3 refuse their input (exit 2) while rank 0 waits in a collective they never
    reach; the launcher stops rank 0 and exits 1 with its long report. The operator reads the
    ranks' message, named by rank, not the launcher's summary (round 7's 4-GPU resume)."""
    launcher = ("W1127 00:58:11.062000 2127 torch/distributed/elastic/multiprocessing/api.py:1012] Sending "
                "process 2209 closing signal SIGTERM\nTraceback (most recent call last):\n  File \"run.py\", "
                "line 1\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                + "\n".join(f"  rank      : {r} (local_rank: {r})\n  exitcode  : 2" for r in range(4)) + "\n")
    result, _ = _run(tmp_path, f"""
        import sys
        print({DEEPSPEED_CHATTER!r}, end="")
        for r in (2, 1, 3):
            print(f"[rank {{r}}] demo (sft) failed: checkpoint step-1: rollouts_rank{{r}}.json.gz cannot be read",
                  file=sys.stderr, flush=True)
        print("[rank 0] a line of rank 0 that is not an error")
        print({launcher!r}, end="", flush=True)
        sys.exit(1)
    """)
    assert isinstance(result, StageFailed) and result.user_error and result.exit_code == 1
    assert result.reason == "[rank 2] checkpoint step-1: rollouts_rank2.json.gz cannot be read"


def test_rank_0s_user_error_wins_over_a_peer_rank_that_spoke_first():
    from pipeline.job_output import JobOutput

    out = JobOutput("demo", "sft")
    for line in ["[rank 1] demo (sft) failed: rank 1 lost its input", "demo (sft) failed: data.jsonl:3: bad row",
                 "data.jsonl:9: another bad row", "[rank 3] demo (sft) failed: rank 3 lost its input"]:
        out.feed(line)
    failure = out.failure(2)
    assert failure.user_error and failure.reason == "data.jsonl:3: bad row\ndata.jsonl:9: another bad row"

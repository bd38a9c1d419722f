"""Verifiers that misbehave on purpose, registered for the pool tests (imported in workers)."""
import os
import time

from verifiers import Reward, register_verifier


@register_verifier("_test_sleep")
def _sleep(row, text):
    time.sleep(float(row.reference["sleep"]))
    return Reward.one("slept")


@register_verifier("_test_busy_c")
def _busy(row, text):
    # a hang that the in-process SIGALRM timeout cannot interrupt (like a long C call):
    # only the pool's kill stops it
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(30)
    return Reward.one("finished")


@register_verifier("_test_crash")
def _crash(row, text):
    os._exit(3)


@register_verifier("_test_raise")
def _raise(row, text):
    raise RuntimeError("boom")

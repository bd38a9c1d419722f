"""The vLLM engine's event-loop thread (stages/rl/engines/vllm_loop.py): closing it ends the tasks
still on it, as vLLM's output handler is at an engine's close, instead of leaving them pending."""
from __future__ import annotations

import asyncio
import gc
import warnings

from stages.rl.engines.vllm_loop import LoopThread


def test_close_ends_the_tasks_left_on_the_loop_and_runs_their_cleanup():
    loop = LoopThread()
    cleaned = []

    async def handler():  # vLLM's output handler: waits on its engine's output queue for ever
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(True)

    async def start():
        return asyncio.ensure_future(handler())

    task = loop.run(start())
    assert loop.run(asyncio.sleep(0, result=1)) == 1 and not task.done()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pending task destroyed with the loop would say so here
        loop.close()
        assert task.cancelled() and cleaned == [True]
        assert not loop._thread.is_alive()
        del task
        gc.collect()

"""An asyncio event loop on a thread of its own: vLLM's AsyncLLM is built and driven there
(its output handler is a task of that loop), while the stage's thread, which is not async,
submits coroutines and waits for their results."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine

CANCEL_TIMEOUT_S = 10.0  # for the loop's tasks to end once cancelled, at close


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class LoopThread:
    def __init__(self, name: str = "vllm-engine-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """`coro` on the loop; its result here (its exception raised here)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"vllm engine: no result after {timeout} s") from None

    def close(self) -> None:
        """Cancel the loop's tasks and let them end, then stop it. vLLM's shutdown only asks for its
        output handler's cancellation (call_soon_threadsafe); a loop stopped right after never ran
        it: "Task was destroyed but it is pending!" and "Event loop is closed" from the handler at
        every engine's close (the engine contract's tests on vLLM)."""
        if self.loop.is_running() and threading.current_thread() is not self._thread:
            try:
                self.run(_cancel_other_tasks(), timeout=CANCEL_TIMEOUT_S)
            except TimeoutError:  # a task that ignores its cancellation: stop the loop anyway
                pass
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:  # (a finaliser may run on the loop itself)
            self._thread.join(timeout=10)

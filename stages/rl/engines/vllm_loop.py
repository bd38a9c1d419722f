"""An asyncio event loop on a thread of its own: vLLM's AsyncLLM is built and driven there
(its output handler is a task of that loop), while the stage's thread, which is not async,
submits coroutines and waits for their results."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine


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
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self._thread:  # (a finaliser may run on the loop itself)
            self._thread.join(timeout=10)

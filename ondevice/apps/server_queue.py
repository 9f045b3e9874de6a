"""One generation at a time: the model slot with its bounded line of waiting requests (429
beyond it), and the run that pumps one generation's chunks out of `Generator.astream` in a task
of its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ondevice.apps.openai_schema import APIError
from ondevice.apps.server_metrics import Metrics

if TYPE_CHECKING:
    from ondevice.api import Chunk, Generator


_END = object()


class ModelSlot:
    """The model, handed to one generation at a time, with a bounded line of waiting requests."""

    def __init__(self, gen: Generator, max_queue: int, metrics: Metrics) -> None:
        self.gen = gen
        self.max_queue = max_queue
        self.metrics = metrics
        self.waiting = 0
        self.busy = False
        self._lock = asyncio.Lock()  # FIFO: waiters are served in arrival order

    def check_room(self) -> None:
        """APIError 429 if a new request would find the line full."""
        if (self.busy or self._lock.locked()) and self.waiting >= self.max_queue:
            raise APIError(
                429,
                f"The server is busy: {self.waiting} request(s) already wait for the model "
                f"(--max-queue {self.max_queue}). Retry later.",
                type="rate_limit_error",
                code="queue_full",
            )

    def start(self, prompt: Any, options: dict[str, Any]) -> Run:
        """Queue a generation (429 if the line is full) and return its handle at once."""
        self.check_room()
        self.waiting += 1
        return Run(self, prompt, options)


class Run:
    """One generation: a task that waits for the model and pumps chunks into a queue.

    The pump runs in its own task, outside the request's cancel scope, so that cancelling it
    is delivered once and `astream` can wait for its worker thread to stop before the model
    is released to the next request.
    """

    def __init__(self, slot: ModelSlot, prompt: Any, options: dict[str, Any]) -> None:
        self.slot = slot
        self.queued = True  # counted in slot.waiting (ModelSlot.start counted it)
        self.chunks: asyncio.Queue[Any] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._pump(prompt, options))

    def _leave_queue(self) -> None:
        if self.queued:
            self.queued = False
            self.slot.waiting -= 1

    async def _pump(self, prompt: Any, options: dict[str, Any]) -> None:
        slot = self.slot
        try:
            try:
                await slot._lock.acquire()
            finally:
                self._leave_queue()
            try:
                slot.busy = True
                async for chunk in slot.gen.astream(prompt, **options):
                    self.chunks.put_nowait(chunk)
                    if chunk.stats is not None:
                        slot.metrics.count_generation(chunk.stats)
            finally:
                slot.busy = False
                slot._lock.release()
        except asyncio.CancelledError:
            pass  # the consumer left; nobody reads the queue any more
        except BaseException as e:  # handed to the consumer, who turns it into an error reply
            self.chunks.put_nowait(e)
        finally:
            self.chunks.put_nowait(_END)

    async def batches(self) -> AsyncIterator[list[Chunk]]:
        """Chunks as they arrive, grouped: all that are waiting when the consumer looks.

        A speculative round yields several tokens at once; sending them as one write instead
        of one each saves event-loop turns and system calls per token.
        """
        while True:
            items = [await self.chunks.get()]
            while not self.chunks.empty():
                items.append(self.chunks.get_nowait())
            done = items[-1] is _END
            chunks = items[:-1] if done else items
            for item in chunks:
                if isinstance(item, BaseException):
                    raise item
            if chunks:
                yield chunks
            if done:
                return

    def cancel(self) -> None:
        # A task cancelled before its first step never runs its body, so leave the queue here.
        self._leave_queue()
        self.task.cancel()  # no effect once the generation has finished

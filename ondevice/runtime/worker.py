"""The model's generation thread: a daemon thread that runs submitted work in order, and the
bridges that hand the items a job yields on it to a caller's thread or event loop."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, TypeVar

from ondevice.runtime import threads

T = TypeVar("T")


class Worker:
    """A daemon thread that runs submitted functions one after another."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threads.start(self._loop, name)
        # MLX aborts the process at exit if a thread that used it is still alive then.
        atexit.register(self.stop)

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn() on this thread (run at once when already on it); its result or exception."""
        return fn() if self.is_current() else self.submit(fn).result()

    def stop(self) -> None:
        """End the thread after the work already submitted, and wait for it, native part
        included (see `runtime.threads`: MLX aborts the process otherwise)."""
        if not self._thread.is_alive():
            return
        self._jobs.put(None)
        threads.wait_native_exit(self._thread, timeout=None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue  # its caller left while it waited in line
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def iterate(self, job: Callable[[], Iterable[T]], cancel: threading.Event) -> Iterator[T]:
        """Run the items of `job()` on this thread and yield them here. Closing this iterator
        sets `cancel` (the job stops after its current step) and waits for the job's end."""
        if self.is_current():
            yield from job()
            return
        items: queue.SimpleQueue = queue.SimpleQueue()
        done = object()

        def work() -> None:
            try:
                for item in job():
                    items.put(item)
            except BaseException as e:  # delivered to the consumer
                items.put(e)
            finally:
                items.put(done)

        finished = self.submit(work)
        try:
            while (item := items.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()
            if not finished.cancel():  # still in line: dropped, nothing to wait for
                finished.result()  # the job is over when this returns

    async def aiterate(
        self, job: Callable[[], Iterable[T]], cancel: threading.Event
    ) -> AsyncIterator[T]:
        """Like `iterate`, for an event loop, which it never blocks. Closing the iterator (or
        cancelling its task) sets `cancel` and waits for the job's end."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        done = object()

        def work() -> None:
            try:
                for item in job():
                    loop.call_soon_threadsafe(items.put_nowait, item)
                    if cancel.is_set():
                        break
            except BaseException as e:  # delivered to the consumer
                loop.call_soon_threadsafe(items.put_nowait, e)
            finally:
                loop.call_soon_threadsafe(items.put_nowait, done)

        finished = self.submit(work)
        try:
            while True:
                item = await items.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()
            finished.cancel()  # a job still in line is dropped (then `joined` is done at once)
            # Wait for the job to finish its step even if this task is cancelled again
            # meanwhile (servers cancel disconnected requests): the thread must be free on return.
            joined = asyncio.wrap_future(finished)
            cancelled = False
            while not joined.done():
                try:
                    await asyncio.shield(joined)
                except asyncio.CancelledError:
                    cancelled = True
            if cancelled:
                raise asyncio.CancelledError

"""Threads that run MLX work, and an interpreter exit that waits for them.

MLX keeps a per-thread compile cache (`mx.compile`, used by `nn.silu` among others) that holds
Python objects. The cache is freed by the native thread's exit handlers, which run *after*
`Thread.join()` has returned. If the interpreter has begun to shut down by then, freeing those
objects aborts the whole process ("terminate called without an active exception", exit code
134): a program that generated in a thread and exited right afterwards died at random.

So every thread that may run MLX is started (or registered) here, and at exit the interpreter
waits until each such thread that has finished is also gone natively. Threads still running at
exit cannot be waited for; their owners stop them first (see `worker.Worker.stop`).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from typing import Any

_TASKS = "/proc/self/task"
_registered: dict[int, threading.Thread] = {}  # native thread id -> thread
_lock = threading.Lock()


def register_current() -> None:
    """Register the calling thread (usable as a ThreadPoolExecutor initializer)."""
    thread = threading.current_thread()
    with _lock:
        for tid in [t for t, th in _registered.items() if not th.is_alive() and _gone(t)]:
            del _registered[tid]
        if thread.native_id is not None:
            _registered[thread.native_id] = thread


def start(target: Callable[..., Any], name: str, args: tuple = ()) -> threading.Thread:
    """Start a daemon thread running `target(*args)`, registered for a clean exit."""

    def run() -> None:
        register_current()
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def wait_native_exit(thread: threading.Thread, timeout: float | None = 2.0) -> None:
    """Join `thread` (up to `timeout`), then wait until its native thread has exited as well
    (up to 2 s: a thread id reused by a new thread must not hang the caller)."""
    if thread is threading.current_thread():
        return
    thread.join(timeout)
    if thread.native_id is None or thread.is_alive():
        return
    if not os.path.isdir(_TASKS):
        time.sleep(0.05)  # no /proc (macOS): a short grace period for the exit handlers
        return
    deadline = time.monotonic() + 2.0
    while not _gone(thread.native_id) and time.monotonic() < deadline:
        time.sleep(0.005)  # lets the exiting thread take the GIL for its exit handlers


def _gone(tid: int) -> bool:
    return not os.path.exists(f"{_TASKS}/{tid}")


@atexit.register  # registered on import, so it runs after the atexit hooks of later modules
def _wait_for_finished_threads() -> None:
    with _lock:
        threads = list(_registered.values())
    for thread in threads:
        if not thread.is_alive():
            wait_native_exit(thread)

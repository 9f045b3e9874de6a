"""Greedy answers do not depend on who else is calling (the issue-29 soak's differing answers).

A loaded model has exactly one generation thread, however many threads ask for it at once: two
would run two generations on the same KV caches at the same time (mixed answers, a cache
holding more than the prompt, or a segfault in MLX).
"""

from __future__ import annotations

import threading
import time

import ondevice
import ondevice.api


def _generation_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ondevice-generate"]


def test_first_callers_on_many_threads_share_one_generation_thread(pair, monkeypatch):
    class SlowWorker(ondevice.api.Worker):
        """Starting a thread takes a moment: callers arriving together all see none yet."""

        def __init__(self, name: str) -> None:
            time.sleep(0.05)
            super().__init__(name)

    monkeypatch.setattr(ondevice.api, "Worker", SlowWorker)
    before = set(_generation_threads())
    gen = ondevice.load(*pair)
    n = 6
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def first_call() -> None:
        try:
            barrier.wait()
            gen.clear_prompt_cache()  # runs on the model's generation thread
        except BaseException as e:  # collected: an error here is the bug
            errors.append(e)

    threads = [threading.Thread(target=first_call) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not errors, errors
        started = [t for t in _generation_threads() if t not in before]
        assert len(started) == 1, f"{len(started)} generation threads for one model"
    finally:
        gen.close()
        for t in _generation_threads():  # any extra ones the bug started
            if t not in before:
                t.join(timeout=0)

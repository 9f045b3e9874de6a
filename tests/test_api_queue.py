"""Several threads calling one loaded model queue for it (issue 28, item 8): a second caller
waits its turn instead of getting an error, turns are first come first served, and every
answer is the one the same call gives alone."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

PROMPTS = ["hello there", "count: 1 2 3", "abc abc abc", "why?", "the end", "more text"]


def _options(i: int) -> dict:
    return {"max_tokens": 24, "temperature": 0.8 if i % 2 else 0.0, "seed": i}


def test_threads_queue_and_get_the_sequential_answers(gen):
    expected = [gen.generate(p, **_options(i)).tokens for i, p in enumerate(PROMPTS)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(PROMPTS))

    def call(i: int) -> None:
        try:
            barrier.wait()
            results[i] = gen.generate(PROMPTS[i], **_options(i)).tokens
        except BaseException as e:  # collected: an error here is the bug
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [results[i] for i in range(len(PROMPTS))] == expected


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """A model that never ends an answer: a long generation keeps the line waiting."""
    import tiny

    import ondevice

    path = tmp_path_factory.mktemp("endless") / "m"
    return ondevice.load(tiny.write_endless_model(path, context=8192))


def _queued(gen) -> int:
    return gen._worker._jobs.qsize()  # generations waiting behind the running one


def test_turns_are_first_come_first_served(endless, monkeypatch):
    order: list[int] = []  # the seeds of the generations in the order the model's thread runs them
    decoder = endless._decoder

    def recording(params, seed, *rest):
        order.append(seed)
        return decoder(params, seed, *rest)

    monkeypatch.setattr(endless, "_decoder", recording)
    gate = threading.Event()
    busy = endless._thread().submit(gate.wait)  # the model is busy until the gate opens

    def call(i: int) -> None:
        endless.generate(PROMPTS[i], max_tokens=4, seed=i)

    threads = []
    for i in range(1, 4):
        threads.append(threading.Thread(target=call, args=(i,)))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while _queued(endless) < i:  # its generation is in line before the next thread starts
            assert time.monotonic() < deadline
            time.sleep(0.001)
    gate.set()
    busy.result(timeout=10)
    for t in threads:
        t.join(timeout=60)
    assert order == [1, 2, 3]


def test_a_second_generation_while_reading_the_first_does_not_deadlock(gen):
    alone = gen.generate("abc abc abc", max_tokens=8).tokens
    outer = gen.stream("hello there", max_tokens=8)
    next(outer)
    inner = gen.generate("abc abc abc", max_tokens=8).tokens  # waits for `outer` to finish
    assert inner == alone
    assert list(outer)[-1].stats is not None


def test_astream_queues_behind_a_thread(gen):
    expected = gen.generate("why?", max_tokens=12).tokens
    first = gen.stream("hello there", max_tokens=16)
    next(first)

    async def collect() -> list[int]:
        return [t async for c in gen.astream("why?", max_tokens=12) for t in c.tokens]

    assert asyncio.run(collect()) == expected
    assert list(first)[-1].stats is not None


def test_a_task_that_leaves_the_line_does_not_wait_for_the_model(endless):
    expected = endless.generate("abc", max_tokens=8).tokens
    first = endless.stream("hello there", max_tokens=4000)  # seconds of work
    next(first)
    misses = endless.prompt_cache_stats()["misses"]

    async def leave() -> float:
        async def read() -> None:
            async for _ in endless.astream("why?", max_tokens=4000):
                pass

        task = asyncio.create_task(read())
        while _queued(endless) < 1:  # queued behind the first generation
            await asyncio.sleep(0.001)
        t0 = time.perf_counter()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return time.perf_counter() - t0

    left = asyncio.run(leave())
    rest = list(first)
    assert rest[-1].stats["generation_tokens"] == 4000  # the first ran to its end
    assert left < 0.5, f"a cancelled queued astream waited {left:.2f} s for the model"
    assert endless.prompt_cache_stats()["misses"] == misses  # the second never ran
    assert endless.generate("abc", max_tokens=8).tokens == expected

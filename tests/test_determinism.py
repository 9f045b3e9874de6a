"""Greedy answers do not depend on who else is calling or on the machine's load (the issue-29
soak's differing answers; docs/reliability.md).

A loaded model has exactly one generation thread, however many threads ask for it at once: two
would run two generations on the same KV caches at the same time (mixed answers, a cache
holding more than the prompt, or a segfault in MLX). And the pipelined decoder chooses greedy
block lengths by the clock only for a verifier whose rows do not depend on the pass's size.
"""

from __future__ import annotations

import threading
import time

import pytest
import tiny
from test_pipeline import Slow

import ondevice
import ondevice.api
from ondevice.decoders.chain import ChainDecoder
from ondevice.decoders.pipelined import PipelinedDecoder
from ondevice.models import load_model
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime.engines import MLXEngine


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


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("det")
    v = tiny.write_model(tmp / "v", scale=2.0)
    d = tiny.perturbed_copy(v, tmp / "d", 0.05)
    return MLXEngine(load_model(v).model), MLXEngine(load_model(d).model)


def test_greedy_pipelined_block_lengths_do_not_depend_on_the_clock(engines):
    """The verifier's rows are not bitwise independent of how many tokens share a pass (MKL),
    so under greedy decoding a block length chosen from timings would make the answer depend
    on the machine's load. The same request under two different timings takes the same blocks
    as the sequential decoder, and gives its tokens."""
    v, d = engines
    prompt = [5, 17, 33, 8, 61, 12]
    seq = ChainDecoder(v, d, SamplingParams(0.0), eos_token_ids=[tiny.EOS_ID])
    expected = [t for r in seq.run(prompt, 40) for t in r.tokens]
    blocks = []
    for verify_delay, draft_delay in ((0.02, 0.0), (0.0, 0.01)):  # verifier or draft slow
        pipe = PipelinedDecoder(
            Slow(v, verify_delay), Slow(d, draft_delay), SamplingParams(0.0),
            eos_token_ids=[tiny.EOS_ID],
        )  # fmt: skip
        assert [t for r in pipe.run(prompt, 40) for t in r.tokens] == expected
        blocks.append(pipe._k_used)
    assert blocks[0] == blocks[1]


def test_the_clock_chooses_block_lengths_only_for_a_batch_invariant_verifier(engines):
    v, d = engines
    greedy, sample = SamplingParams(0.0), SamplingParams(1.0)
    invariant = Slow(v, 0.0)
    invariant.batch_invariant = True  # what an engine with batch-invariant passes would say
    assert not PipelinedDecoder(Slow(v, 0.0), d, greedy).timed
    assert PipelinedDecoder(invariant, d, greedy).timed
    assert not PipelinedDecoder(invariant, d, sample).timed

"""Plain greedy decoding with the verifier alone, pipelined the way MLX likes it.

The next step's graph is built and submitted with `mx.async_eval` before the current token is
read back, so Python overhead overlaps computation. A `Decoder` whose rounds hold one token each,
so the API treats it like the speculative ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import mlx.core as mx

from ondevice.decoders.base import DecoderBase, Round, Step
from ondevice.rules.engine import prefill
from ondevice.runtime.engines import MLXEngine


class PlainGreedyDecoder(DecoderBase):
    verifier: MLXEngine

    def __init__(self, verifier: MLXEngine, eos_token_ids: Sequence[int] = ()) -> None:
        super().__init__(verifier, eos_token_ids)
        self._y: mx.array | None = None  # the next token, submitted
        self._pending: list[mx.array] = []
        self._t0: float | None = None  # while the first token is on its way: when prefill began

    def run(self, prompt: Sequence[int], max_tokens: int, resume: bool = False) -> Iterator[Round]:
        """resume: the verifier's cache already holds a prefix of `prompt` (at most all but its
        last token), so only the rest is fed."""
        v = self.verifier
        self.check_prompt(prompt)
        self._t0 = time.perf_counter()
        if v.length >= len(prompt) and resume:
            raise ValueError("the cache must leave at least the prompt's last token to feed")
        # as every decoder: the prompt but its last token as a prompt, the last token as the
        # first decoding pass (a kernel may compute the two apart, runtime/kernel.py)
        prefill(v, prompt[:-1], resume)
        self._y = mx.argmax(v.forward(prompt[-1:], last_only=True)[-1])
        mx.async_eval(self._y)
        self._pending = [self._y]
        try:
            yield from self.rounds(list(prompt), max_tokens)
        finally:
            mx.eval(self._pending)  # leave no submitted work behind when the consumer stops early

    def step(self, seq: list[int], room: int) -> Step:
        v, y = self.verifier, self._y
        assert y is not None
        t = time.perf_counter()
        if room > 1:  # submit the next step before reading this one
            self._y = mx.argmax(v.model(y.reshape(1, 1), v.cache)[0, -1])
            mx.async_eval(self._y)
            self._pending = [self._y]
        tok = y.item()
        now = time.perf_counter()
        if self._t0 is not None:
            self.time_prefill = now - self._t0
            self._t0 = None
        else:
            self.time_verify += now - t
        return Step([tok], 0, 0)

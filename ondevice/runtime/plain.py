"""Plain greedy decoding with the verifier alone, pipelined the way MLX likes it.

The next step's graph is built and submitted with `mx.async_eval` before the current token is
read back, so Python overhead overlaps computation. Yields the same `Round`s as the speculative
decoder (one token each), so the API treats both alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import mlx.core as mx

from ondevice.errors import ContextLengthError
from ondevice.runtime.engines import MLXEngine
from ondevice.speculative.decoder import DecodeStats, Round


class PlainGreedyDecoder:
    def __init__(self, verifier: MLXEngine, eos_token_ids: Sequence[int] = ()) -> None:
        self.verifier = verifier
        self.eos = frozenset(eos_token_ids)
        self.stats = DecodeStats()
        self.time_draft = 0.0
        self.time_verify = 0.0
        self.time_prefill = 0.0

    def draft_prefix_length(self) -> int:
        return 0  # no draft

    def run(
        self, prompt: Sequence[int], max_tokens: int, resume: bool = False
    ) -> Iterator[Round]:
        """resume: the verifier's cache already holds a prefix of `prompt` (at most all but its
        last token), so only the rest is fed."""
        v = self.verifier
        limit = v.context_length
        if len(prompt) >= limit:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but the model's context is {limit} tokens; "
                "shorten the prompt."
            )
        room = min(max_tokens, limit - len(prompt))
        t0 = time.perf_counter()
        if not resume:
            v.reset()
        if v.length >= len(prompt):
            raise ValueError("the cache must leave at least the prompt's last token to feed")
        y = mx.argmax(v.forward(prompt[v.length :], last_only=True)[-1])
        mx.async_eval(y)
        pending = [y]
        try:
            produced = 0
            first = True
            while produced < room:
                t = time.perf_counter()
                nxt = None
                if produced + 1 < room:
                    nxt = mx.argmax(v.model(y.reshape(1, 1), v.cache)[0, -1])
                    mx.async_eval(nxt)
                    pending = [nxt]
                tok = y.item()
                now = time.perf_counter()
                if first:
                    self.time_prefill = now - t0
                    first = False
                else:
                    self.time_verify += now - t
                self.stats.rounds += 1
                if tok in self.eos:
                    yield Round([], [], 0, 0, "stop")
                    return
                produced += 1
                yield Round([tok], [False], 0, 0, "length" if produced >= room else None)
                if nxt is None:
                    return
                y = nxt
        finally:
            mx.eval(pending)  # leave no submitted work behind when the consumer stops early

"""From a decoder's rounds to the chunks a caller sees: detokenize token by token, cut the text
at the first stop string (never emitting it), and end with the finish reason and statistics."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import mlx.core as mx

from ondevice.decoders.chain import Round
from ondevice.results import Chunk, generation_stats


class StopMatcher:
    """Cuts text at the first stop string, holding back what could still become one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Text that is safe to emit now, and whether a stop string was found."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def decode_chunks(
    dec: Any,
    ids: list[int],
    max_tokens: int,
    stops: Sequence[str],
    cancel: threading.Event | None,
    detok: Any,
    draft_backend: str | None,
    stop_ids: Collection[int] = (),
) -> Iterator[Chunk]:
    """Run `dec` on the prompt `ids` (resuming from the KV its engines hold) and yield a chunk
    per token; the last chunk carries the finish reason and `generation_stats`. A token in
    `stop_ids` stops like a stop string (for a hidden token whose text is one)."""
    matcher = StopMatcher(stops)
    tokens: list[int] = []
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    finish = "length"
    rounds: Iterator[Round] = dec.run(ids, max_tokens, resume=True) if max_tokens > 0 else iter(())
    try:
        for rnd in rounds:
            stopped = False
            lps = rnd.logprobs or [None] * len(rnd.tokens)
            for tok, flag, lp in zip(rnd.tokens, rnd.from_draft, lps):
                tokens.append(tok)
                text, stopped = matcher.feed(detok.add([tok]))
                if tok in stop_ids:  # its text is a stop string, hidden from the text
                    text, stopped = text + matcher.flush(), True
                # a stop string's text is never emitted
                yield Chunk(text, [tok], flag, logprobs=None if lp is None else [lp])
                if stopped:
                    break
            if stopped:
                finish = "stop"
                break
            if rnd.finish_reason:
                finish = rnd.finish_reason
                break
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
    finally:
        # stop the decoder now (a pipelined one waits for its pass in flight), not at GC
        close = getattr(rounds, "close", None)
        if close is not None:
            close()
    elapsed = time.perf_counter() - t0
    if finish != "stop" or not stops:
        tail, _ = matcher.feed(detok.flush())
        tail += matcher.flush()
    else:
        tail = ""
    stats = generation_stats(dec, len(ids), len(tokens), elapsed, draft_backend)
    yield Chunk(tail, [], False, finish_reason=finish, stats=stats)

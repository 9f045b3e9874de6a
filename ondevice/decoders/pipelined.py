"""The pipelined speculative decoder: the drafter works while the verifier checks a block.

While the verifier scores block r, the drafter keeps going as if block r will be fully accepted:
it drafts its own guess of the bonus token and then block r + 1 after it (PEARL's post-verify,
AMUSD's continuous drafting). When the result arrives and the whole block was accepted with the
bonus token equal to the guess, block r + 1 is already drafted; otherwise the pre-drafted tokens
are discarded, the draft's cache is rolled back to the verified prefix and drafting continues
from the verifier's token.

How the two engines run at once, with a single Python thread driving both:

- The verifier (MLX) pass is built on the thread's default stream and submitted with
  `mx.async_eval`; MLX runs it on that stream's own worker thread. A small helper thread waits
  for it (`mx.eval` releases the GIL) and flags when it is done, because MLX has no way to ask
  "is this array ready?" without blocking.
- The drafter runs on the calling thread: an MLX draft on a second stream (each MLX stream has
  its own worker, so on the CPU backend the two passes run on two cores at once), the reference
  executor in numpy, or Core ML (whose `predict` holds the GIL but not the GPU).
- A verifier that is not MLX runs its passes in one worker thread instead.

Exactness: the decisions come from the same `TokenChooser` as the sequential decoder (greedy,
or sampling with noise keyed by (seed, position)), the draft catches up as there (`catch_up`),
and block lengths follow the same token-only `DraftLength` schedule whenever they can change
the output. So with a seed the tokens equal the sequential decoder's, however the two engines'
timings interleave. The clock may choose block lengths only where they cannot change the
output: under greedy decoding with a verifier whose logits for a position are bitwise the same
whatever else shares its pass (an engine with `batch_invariant = True`). The block length then
maximises the expected tokens per second of the cost model, and a block may be cut short when
the verifier is ready for it. MLX's CPU products through MKL are not batch-invariant (a row of a
pass over 4 tokens differs in its last bits from the same row in a pass over 2), so there a
clock-chosen length can make the same greedy request answer differently from run to run where
two logits nearly tie (docs/reliability.md, "Greedy answers that differed").

Cancellation: closing the generator waits for the verifier pass in flight and stops the helper
thread, so nothing keeps running after `close()`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ondevice.decoders.base import Round, Step
from ondevice.decoders.chain import ChainDecoderBase, block_length, catch_up
from ondevice.rules.engine import Engine, batch_invariant, prefill
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime import threads
from ondevice.runtime.costmodel import CostModel
from ondevice.runtime.engines import innermost

# -- running the verifier in the background ---------------------------------------------------


class _Pending:
    """One verifier pass in flight."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.t_submit = time.perf_counter()
        self.t_done = 0.0
        self.event = threading.Event()
        self.error: BaseException | None = None
        self._value = None

    def done(self) -> bool:
        return self.event.is_set()

    def result(self) -> np.ndarray:
        self.event.wait()
        if self.error is not None:
            raise self.error
        return np.asarray(self._value)


class _MLXVerifier:
    """Submits MLX verifier passes asynchronously; a helper thread waits for each to finish."""

    def __init__(self, engine) -> None:
        import mlx.core as mx

        self._mx = mx
        self.engine = engine
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threads.start(self._wait_loop, "ondevice-verify-wait")

    def submit(self, tokens: Sequence[int]) -> _Pending:
        mx = self._mx
        pending = _Pending(len(tokens))
        # the same operations as MLXEngine.feed, so the logits are bitwise the same
        logits = self.engine.forward(tokens).astype(mx.float32)
        mx.async_eval(logits)
        pending._value = logits
        self._queue.put(pending)
        return pending

    def _wait_loop(self) -> None:
        while (pending := self._queue.get()) is not None:
            try:
                self._mx.eval(pending._value)
            except BaseException as e:  # handed to the scheduler by result()
                pending.error = e
            pending.t_done = time.perf_counter()
            pending.event.set()

    def close(self) -> None:
        """Wait for work in flight and stop the helper thread."""
        self._queue.put(None)
        self._thread.join()


class _ThreadVerifier:
    """Any other engine: its passes run in one worker thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="ondevice-verify", initializer=threads.register_current
        )

    def submit(self, tokens: Sequence[int]) -> _Pending:
        pending = _Pending(len(tokens))
        toks = list(tokens)

        def run() -> None:
            try:
                pending._value = self.engine.feed(toks)
            except BaseException as e:
                pending.error = e
            pending.t_done = time.perf_counter()
            pending.event.set()

        self._pool.submit(run)
        return pending

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _EagerVerifier(_ThreadVerifier):
    """An MLX verifier served by the CPU kernel computes its pass while the pass is built (each
    product evaluates its input), so it cannot be submitted lazily. Its passes run in one worker
    thread kept with the engine for its lifetime: MLX keeps native state for every thread that
    used it, so a thread per request would leave threads behind."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        owner = engine
        while hasattr(owner, "engine"):  # wrappers come and go; the model's engine stays
            owner = owner.engine
        pool = getattr(owner, "verify_pool", None)
        if pool is None:
            pool = owner.verify_pool = ThreadPoolExecutor(
                1, thread_name_prefix="ondevice-verify", initializer=threads.register_current
            )
        self._pool = pool

    def close(self) -> None:
        self._pool.submit(lambda: None).result()  # the pass in flight is done; the thread stays


def _is_mlx(engine) -> bool:
    return hasattr(engine, "forward") and hasattr(engine, "cache")


_draft_stream = None
_draft_stream_lock = threading.Lock()


def _mlx_draft_stream():
    """A stream for MLX drafts, one per thread (MLX streams belong to the thread that made
    them), on the default device, so draft and verifier passes run side by side."""
    global _draft_stream
    import mlx.core as mx

    with _draft_stream_lock:
        if _draft_stream is None:
            _draft_stream = mx.new_thread_local_stream(mx.default_device())
    return mx.stream(_draft_stream)


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


# -- busy-time bookkeeping ----------------------------------------------------------------------


def _busy(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two sorted lists of disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo = max(xs[i][0], ys[j][0])
        hi = min(xs[i][1], ys[j][1])
        if hi > lo:
            total += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


# -- the decoder ------------------------------------------------------------------------------


class PipelinedDecoder(ChainDecoderBase):
    """A `Decoder` with the tokens of `ChainDecoder` (same seed, same tokens); the options
    are `ChainDecoderBase`'s."""

    draft: Engine

    def __init__(
        self, verifier: Engine, draft: Engine, params: SamplingParams, **options: Any
    ) -> None:
        if draft is None:
            raise ValueError("the pipelined decoder needs a draft engine")
        super().__init__(verifier, draft, params, **options)
        # the clock may choose block lengths only where they cannot change the output (see
        # the module docstring): a verifier served by the CPU kernel declares it
        self.timed = params.greedy and self.k.fixed is None and batch_invariant(verifier)
        self.k_max = self.k.high
        self.cost = CostModel()
        self.explore_every = 16  # rounds
        # rounds since a pass with / without drafting beside it; the second round measures a
        # pass alone, so the contention is known early
        self._since = {True: 0, False: self.explore_every - 1}
        self.wasted_drafts = 0
        self.prefetch_hits = 0  # blocks that were fully drafted before the verifier asked
        self.in_flight: _Pending | None = None  # the verifier pass now running, if any
        self._draft_busy: list[tuple[float, float]] = []
        self._verify_busy: list[tuple[float, float]] = []
        self._k_used: list[int] = []
        self._seq: list[int] = []  # the committed sequence of the current run
        # per-call measurements, for benchmarks that check the cost model
        self.calls: dict[str, list] = {"verify": [], "draft": [], "host": []}

    # -- setup ----------------------------------------------------------------------------------

    def prefill_rest(self, prompt: Sequence[int], resume: bool) -> None:
        with self._stream():
            prefill(self.draft, prompt[:-1], resume)
        self.chooser.start(prompt)

    # -- drafting -------------------------------------------------------------------------------

    def _draft_step(self, ahead: bool = False) -> None:
        """Draft one more token at the end of the chain (after catching up on what the draft's
        cache lacks, `catch_up`). `ahead`: while the verifier works (its cost is hidden, and
        may be inflated by sharing the machine with it)."""
        seq, chain = self._seq, self._chain
        pos = len(seq) + len(chain)
        t0 = time.perf_counter()
        draft = self.draft
        assert draft.length < pos, "the draft's cache ran ahead of the sequence"
        with self._stream():
            start = draft.length
            logits = catch_up(draft, seq[start:] + chain[max(0, start - len(seq)) :])
        x, q = self.chooser.draft(logits, pos, seq, chain)
        conf = self.chooser.confidence(logits, q, seq, chain) if self.k.adaptive else 1.0
        chain.append(x)
        self._chain_q.append(q)
        self._chain_conf.append(conf)
        t1 = time.perf_counter()
        self._draft_busy.append((t0, t1))
        self.time_draft += t1 - t0
        if not ahead or not self.cost.draft.n:
            self.cost.observe_draft(t1 - t0)  # what drafting costs when the verifier waits
        self.calls["draft"].append((t1 - t0, ahead))

    def _block_len(self, offset: int, k: int) -> int | None:
        """Length of the block that starts at chain[offset] (None: needs more drafts)."""
        return block_length(self._chain[offset:], self._chain_conf[offset:], k, self.k, self.eos)

    def _prefetch(self, k: int, k_next: int) -> bool:
        """Draft ahead during this pass? Yes while the cost model says it pays; and now and
        then each way regardless, to keep measuring what contention costs."""
        if self._since[True] >= self.explore_every:
            return True
        if self._since[False] >= self.explore_every:
            return False
        return self.cost.prefetch_pays(k, k_next)

    def _target_k(self, room: int) -> int:
        if self.timed:
            return self.cost.best_k(True, min(self.k_max, room), self.k.k)
        return min(self.k.k, room)

    def _next_target_k(self, room: int) -> int:
        """k of the block after a fully accepted one (what the drafter prepares meanwhile)."""
        if self.timed:
            return self.cost.best_k(True, min(self.k_max, room), self.k.k)
        return min(self.k.after_full_accept(), room)

    # -- the loop -------------------------------------------------------------------------------

    def run(self, prompt: Sequence[int], max_tokens: int, resume: bool = False) -> Iterator[Round]:
        """As `ChainDecoder.run` (resume: the caches already hold a prefix of `prompt`)."""
        draft = innermost(self.draft)  # a draft window over MLX drafts on MLX
        self._stream = _mlx_draft_stream if _is_mlx(draft) else _NoStream
        seq = list(prompt)
        self.prefill(seq, resume)
        self._submitter: _MLXVerifier | _ThreadVerifier
        if getattr(self.verifier, "eager", False):
            self._submitter = _EagerVerifier(self.verifier)
        elif _is_mlx(self.verifier):
            self._submitter = _MLXVerifier(self.verifier)
        else:
            self._submitter = _ThreadVerifier(self.verifier)
        self._seq = seq
        self._chain: list[int] = []
        self._chain_q: list[np.ndarray | None] = []
        self._chain_conf: list[float] = []
        self._t_start = self._t_end = time.perf_counter()
        self._fresh = True  # no pre-drafted block is waiting
        try:
            yield from self.rounds(seq, max_tokens)
        finally:
            self._submitter.close()  # waits for any pass in flight: nothing runs after this
            if self.in_flight is not None and self.in_flight.done():
                self.in_flight = None
            self.wasted_drafts += len(self._chain)
            self._chain = []

    def step(self, seq: list[int], room: int) -> Step:
        kmax = 0 if self.no_room(room) else max(0, min(room - 1, self.draft_room(seq)))
        block, q = self._block(kmax)  # 1. pre-drafted, or drafted now
        K = len(block)
        logits = self._verify(seq, block, kmax, room)  # 2-3. drafting on meanwhile
        # 4. decide, exactly as the sequential decoder does
        t_host = time.perf_counter()
        n, tok = self.chooser.decide(block, q, logits, len(seq), seq)
        self.verifier.trim(K - n)
        hit = n == K and len(self._chain) > K and self._chain[K] == tok
        if hit:
            self.prefetch_hits += 1
            del self._chain[: K + 1], self._chain_q[: K + 1], self._chain_conf[: K + 1]
        else:
            self.wasted_drafts += max(0, len(self._chain) - K)
            self._chain, self._chain_q, self._chain_conf = [], [], []
            keep = len(seq) + n  # the draft's cache stays valid up to the accepted drafts
            self.draft.trim(max(0, self.draft.length - keep))
        self._fresh = not hit
        self.k.update(K, n)
        self.cost.observe_block(K, n)
        self._k_used.append(K)
        self._logits = logits
        host = time.perf_counter() - t_host
        self.cost.observe_host(host)
        self.calls["host"].append(host)
        self._t_end = time.perf_counter()
        return Step([*block[:n], tok], n, K)

    def _block(self, kmax: int) -> tuple[list[int], np.ndarray | None]:
        """The block to verify (pre-drafted tokens at the front of the chain, or drafted now)
        and the distributions its tokens were sampled from."""
        k = self._target_k(kmax)
        if self.timed and not self._fresh:
            # the verifier is ready: take what is drafted (at least one token)
            k = min(k, max(1, len(self._chain)))
        K = self._block_len(0, k)
        while K is None:
            self._draft_step()
            K = self._block_len(0, k)
        q = None if self.params.greedy or not K else np.stack(self._chain_q[:K])
        return self._chain[:K], q

    def _verify(self, seq: list[int], block: list[int], kmax: int, room: int) -> np.ndarray:
        """The verifier's logits for seq[-1] + block; while its pass runs, draft the guess of
        the bonus token and the next block."""
        K = len(block)
        # The pass's whole cost counts as the verifier's (its time starts before the graph is
        # built); with MLX on the CPU, `async_eval` itself runs most of the pass before
        # returning (docs/benchmarks.md, "Why `overlap` is only ~0.1 on Linux"), so counting
        # submit as host work too charged the pass twice.
        pending = self.in_flight = self._submitter.submit([seq[-1], *block])
        k_next = self._next_target_k(max(0, kmax - K - 1))
        limit_chain = min(room, self.draft.context_length - 1 - len(seq))
        steps = 0
        while self._prefetch(K, k_next) and not pending.done():
            if len(self._chain) >= limit_chain:
                break
            if len(self._chain) > K and self._block_len(K + 1, k_next) is not None:
                break  # the next block is complete
            self._draft_step(ahead=True)
            steps += 1
        logits = pending.result()
        self._since[steps > 0] = 0
        self._since[steps == 0] += 1
        seconds = pending.t_done - pending.t_submit
        self.cost.observe_contention(pending.length, seconds, busy=steps > 0)
        self.in_flight = None
        self._verify_busy.append((pending.t_submit, pending.t_done))
        self.timed_pass(pending.length, seconds, self.cost.contention if steps else 1.0)
        self.cost.observe_verify(pending.length, seconds)
        self.calls["verify"].append((pending.length, seconds))
        return logits

    # -- stats ----------------------------------------------------------------------------------

    def draft_prefix_length(self) -> int:
        """How many leading entries of the draft's cache hold the sequence committed so far
        (at a round's end its cache holds that sequence, then perhaps pre-drafted tokens)."""
        return min(self.draft.length, len(self._seq))

    def extra_stats(self) -> dict:
        """overlap: fraction of the decoding wall time with both engines busy; *_idle_s: wall
        time each engine was not working; wasted_drafts: pre-drafted tokens thrown away
        unverified; predicted_tokens_per_second: the cost model's rate for the mean block."""
        wall = max(self._t_end - self._t_start, 1e-12)
        both = _intersection(self._draft_busy, self._verify_busy)
        k_mean = float(np.mean(self._k_used)) if self._k_used else 0.0
        return {
            "pipelined": True,
            "sampling_rule": self.chooser.rule_name,
            "overlap": both / wall,
            "draft_idle_s": max(wall - _busy(self._draft_busy), 0.0),
            "verify_idle_s": max(wall - _busy(self._verify_busy), 0.0),
            "wasted_drafts": self.wasted_drafts,
            "prefetch_hits": self.prefetch_hits,
            "mean_draft_length": k_mean,
        }

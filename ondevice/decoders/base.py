"""What every decoder is: the `Decoder` protocol, and `DecoderBase`, the part they share.

A decoder drives a verifier engine (and perhaps a draft or another proposer) over one prompt:
`run(prompt, max_tokens, resume)` yields `Round`s, one per verifier pass, already cut at EOS and
at the token limit. It keeps `stats` (rounds, drafted, accepted) and the seconds spent
prefilling, drafting and verifying; `extra_stats()` adds what is particular to it, and
`draft_prefix_length()` says how much of its draft's cache holds the committed sequence (the
prompt cache keeps that much). The API, the server and the benchmarks use nothing else.

Seeds mean the same for every decoder: randomness is keyed by (seed, position, purpose)
(`noise.py`), never drawn from one sequential stream, so the random numbers that decide a
position do not depend on how the rounds fell before it, and the same seed gives the same
tokens whichever decoder object runs it, and however often it runs. `seed=None` draws a fresh
seed when the decoder is made.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ondevice.errors import ContextLengthError
from ondevice.rules.engine import Engine, prefill
from ondevice.rules.sampling import TokenLogprob
from ondevice.runtime.pass_costs import CostWatch


@dataclass
class Round:
    """What one verifier pass produced (already cut at EOS and max_tokens)."""

    tokens: list[int]
    from_draft: list[bool]
    drafted: int
    accepted: int
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_tokens or context)
    logprobs: list[TokenLogprob] | None = None  # per token, when the params ask for them


@dataclass
class DecodeStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds whose draft was cut short: alpha = accepted / (accepted + rejected)
    extra: dict = field(default_factory=dict)


class Decoder(Protocol):
    """The decoder interface (see the module docstring)."""

    stats: DecodeStats
    skip_reason: str | None  # why rounds drafted nothing (see `DecoderBase`)
    time_prefill: float
    time_draft: float
    time_verify: float

    def run(
        self, prompt: Sequence[int], max_tokens: int, resume: bool = False
    ) -> Iterator[Round]: ...

    def extra_stats(self) -> dict: ...

    def draft_prefix_length(self) -> int: ...


@dataclass
class Step:
    """What a decoder's round proposes to emit: `accepted` drafted tokens, then the verifier's."""

    tokens: list[int]
    accepted: int
    drafted: int


class DecoderBase:
    """The shared skeleton: the prompt check, prefill, the round loop with its cut at EOS and
    the token limit, and the stats. A subclass implements `step` (one verifier pass) and, when it
    has more engines to fill, `prefill_rest`; `round_logprobs` when it reports log-probs.

    cost_watch: told how long each verifier pass took (`timed_pass`; `runtime/pass_costs.py`'s
    `CostWatch` marks a profile the live passes disagree with stale).

    hidden: whether a proposer reads the verifier's hidden states; the prefill then keeps the
    one at the prompt's last prefilled token (`prompt_state`, None where the prompt cache held
    every token), which the first round drafts from."""

    hidden = False

    def __init__(
        self,
        verifier: Engine,
        eos_token_ids: Sequence[int] = (),
        cost_watch: CostWatch | None = None,
    ) -> None:
        self.verifier = verifier
        self.cost_watch = cost_watch
        self.eos = frozenset(eos_token_ids)
        self.stats = DecodeStats()
        self.time_prefill = 0.0
        self.time_draft = 0.0
        self.time_verify = 0.0
        # why the latest round drafted nothing (reported when no round drafted anything)
        self.skip_reason: str | None = None
        self.prompt_state: np.ndarray | None = None

    def check_prompt(self, prompt: Sequence[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        limit = self.verifier.context_length
        if len(prompt) >= limit:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but the model's context is {limit} tokens; "
                "shorten the prompt."
            )

    def prefill(self, prompt: Sequence[int], resume: bool = False) -> None:
        """Fill the caches with prompt[:-1]; `resume`: they already hold a prefix of it."""
        self.check_prompt(prompt)
        t = time.perf_counter()
        self.prompt_state = prefill(self.verifier, prompt[:-1], resume, hidden=self.hidden)
        self.prefill_rest(prompt, resume)
        self.time_prefill += time.perf_counter() - t

    def prefill_rest(self, prompt: Sequence[int], resume: bool) -> None:
        """The other engines' and the sampling state's part of `prefill`."""

    def run(self, prompt: Sequence[int], max_tokens: int, resume: bool = False) -> Iterator[Round]:
        """Rounds of tokens after `prompt`. resume: the engines' caches already hold a prefix
        of the prompt (see `prefill`)."""
        seq = list(prompt)
        self.prefill(seq, resume)
        yield from self.rounds(seq, max_tokens)

    def rounds(self, seq: list[int], max_tokens: int) -> Iterator[Round]:
        """The round loop over the committed sequence `seq` (extended in place)."""
        produced = 0
        limit = self.verifier.context_length
        while produced < max_tokens:
            room = min(max_tokens - produced, limit - len(seq))
            if room <= 0:
                yield Round([], [], 0, 0, "length")
                return
            step = self.step(seq, room)
            self.stats.rounds += 1
            self.stats.drafted += step.drafted
            self.stats.accepted += step.accepted
            self.stats.rejected += step.accepted < step.drafted
            out = step.tokens
            flags = [True] * step.accepted + [False] * (len(out) - step.accepted)
            finish = None
            for i, x in enumerate(out):
                if x in self.eos:
                    out, flags, finish = out[:i], flags[:i], "stop"
                    break
            if finish is None and len(out) >= room:
                out, flags = out[:room], flags[:room]
                finish = "length"
            seq.extend(out)
            produced += len(out)
            yield Round(out, flags, step.drafted, step.accepted, finish, self.round_logprobs(out))
            if finish:
                return

    def step(self, seq: list[int], room: int) -> Step:
        """One verifier pass after `seq`, emitting at most `room` tokens."""
        raise NotImplementedError

    def timed_pass(self, n: int, seconds: float, contention: float = 1.0) -> None:
        """A verifier pass over n tokens took `seconds`, `contention` times what it would have
        taken with the machine to itself (a draft working beside it): counted as verifying,
        and told to the cost watch as the pass alone."""
        self.time_verify += seconds
        if self.cost_watch is not None:
            self.cost_watch.observe(n, seconds / contention)

    def round_logprobs(self, tokens: list[int]) -> list[TokenLogprob] | None:
        return None

    def no_room(self, room: int) -> bool:
        """True, noting why, when this round can emit only one token (nothing to draft)."""
        if room > 1:
            return False
        # a reason found earlier says more than the last round's lack of room
        self.skip_reason = self.skip_reason or (
            "no room for drafts: max_tokens or the verifier's context ends here"
        )
        return True

    def extra_stats(self) -> dict:
        return {}

    def draft_prefix_length(self) -> int:
        return 0

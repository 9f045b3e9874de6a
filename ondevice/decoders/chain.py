"""The sequential speculative decoder: the semantic reference every faster path must match.

Each round the draft proposes k tokens after the current sequence, the verifier scores the last
committed token plus the k drafts in one pass (k + 1 distributions), and the acceptance rule keeps
a prefix of the drafts and adds one token of the verifier's. Both caches are then rolled back to
the committed sequence. With no draft (or k = 0) a round is one plain decoding step.

Invariants at the start of a round, for the committed sequence `seq` (prompt + emitted tokens):
the verifier's cache holds seq[:-1] (its last token is fed together with the drafts), and the
draft's cache holds a prefix of seq (it catches up on the rest before proposing).

Reproducibility: random numbers are keyed by (seed, position) (`noise.py`), the draft's
distribution at a position is bitwise the same whichever decoder built its cache (`catch_up`:
one call per round where the draft is batch-invariant, else one token at a time after the
prompt), and the block lengths depend only on tokens. The pipelined
decoder (`decoders/pipelined.py`) shares `TokenChooser` and `DraftLength` with this one and so
produces exactly its tokens for the same seed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ondevice.decoders.base import DecoderBase, DecodeStats, Round, Step
from ondevice.proposers.base import LONGEST_DRAFT
from ondevice.rules.chooser import CustomRule, TokenChooser
from ondevice.rules.engine import Engine, batch_invariant, prefill
from ondevice.rules.sampling import SamplingParams, TokenLogprob
from ondevice.runtime.pass_costs import CostWatch

__all__ = [
    "CustomRule",
    "DecodeStats",
    "DraftLength",
    "Round",
    "ChainDecoder",
    "TokenChooser",
]


class DraftLength:
    """How many tokens a block holds. Fixed when the user sets it. Otherwise a schedule that
    depends only on tokens, never on timing, so a seed always gives the same tokens: k grows
    after a fully accepted block and shrinks after a rejection, and a block also ends early
    where the draft's confidence (its largest probability) falls below `threshold` or after a
    drafted EOS."""

    def __init__(
        self,
        fixed: int | None,
        start: int = 4,
        low: int = 2,
        high: int = LONGEST_DRAFT,
        threshold: float = 0.3,
    ):
        self.fixed = fixed
        self.k = fixed if fixed is not None else start
        self.low, self.high = low, high
        self.threshold = threshold

    @property
    def adaptive(self) -> bool:
        return self.fixed is None

    def update(self, drafted: int, accepted: int) -> None:
        # depends on `drafted` only through accepted == drafted, which is decided by positions
        # up to the committed prefix; so later blocks never depend on noise of later positions
        if self.fixed is not None or drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k + 1, self.high)
        else:
            self.k = max(self.k - 1, self.low)

    def after_full_accept(self) -> int:
        """k of the next block if the current one is fully accepted."""
        return self.k if self.fixed is not None else min(self.k + 1, self.high)

    def ends_before(self, i: int, confidence: float) -> bool:
        """Whether a block with i drafts so far ends before drafting at a position whose draft
        distribution has this confidence (never before the first draft)."""
        return self.adaptive and i > 0 and confidence < self.threshold

    def ends_after(self, token: int, eos: frozenset[int]) -> bool:
        return self.adaptive and token in eos


def catch_up(draft: Engine, tokens: Sequence[int]) -> np.ndarray:
    """Feed `tokens` (at least one) to the draft and return its logits after the last.

    In one call where the draft is batch-invariant (its numbers do not depend on how tokens are
    grouped into passes), so a round costs one draft call for the accepted and bonus tokens;
    otherwise one token at a time, the only grouping every decoder can reproduce exactly."""
    if batch_invariant(draft):
        return draft.feed(list(tokens), last_only=True)
    for tok in tokens:
        logits = draft.feed([tok], last_only=True)
    return logits


def block_length(
    tokens: Sequence[int], confidence: Sequence[float], k: int, policy: DraftLength, eos
) -> int | None:
    """Length of the block drafted as `tokens` (with their distributions' confidences) under
    `policy` with target k, or None when more drafts are needed to know it."""
    for i in range(k):
        if i >= len(tokens):
            return None
        if policy.ends_before(i, confidence[i]):
            return i
        if policy.ends_after(tokens[i], eos):
            return i + 1
    return k


class ChainDecoderBase(DecoderBase):
    """What the chain decoders (this one and `decoders/pipelined.py`'s) share: a draft engine, the
    `TokenChooser` and the `DraftLength` schedule.

    rule: "leviathan" (default: Leviathan/Chen speculative sampling with position-keyed noise),
    "coupled" (Gumbel coupling: the same tokens as plain sampling with the same seed), or a
    custom callable `rule(drafts, q, p, at)` (see `CustomRule`). cost_watch: see `DecoderBase`.
    """

    def __init__(
        self,
        verifier: Engine,
        draft: Engine | None,
        params: SamplingParams,
        *,
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        num_draft_tokens: int | None = None,
        rule: str | CustomRule | None = None,
        k_max: int = LONGEST_DRAFT,
        cost_watch: CostWatch | None = None,
    ) -> None:
        if num_draft_tokens is not None and num_draft_tokens < 0:
            raise ValueError("num_draft_tokens must be >= 0")
        super().__init__(verifier, eos_token_ids, cost_watch)
        self.draft = draft
        self.params = params
        self.chooser = TokenChooser(params, verifier.vocab_size, seed, rule)
        self.k = DraftLength(num_draft_tokens, high=k_max)
        self._logits: np.ndarray | None = None  # the last verifier pass (for logprobs)
        self._t_start = self._t_end = 0.0

    def round_logprobs(self, tokens: list[int]) -> list[TokenLogprob] | None:
        return self.chooser.logprobs(self._logits, tokens)

    def draft_room(self, seq: Sequence[int]) -> int:
        """Drafts the draft's context leaves room for after `seq` (a `DraftWindow` never runs
        out; a bare engine of fixed context does), noting why when none."""
        assert self.draft is not None
        room = self.draft.context_length - len(seq) - 1
        if room <= 0:
            self.skip_reason = (
                f"the sequence is longer than the draft's {self.draft.context_length}-token "
                "context (a draft without a window)"
            )
        return room


class ChainDecoder(ChainDecoderBase):
    """Drives a verifier engine and an optional draft engine over one prompt, one block after
    another (see the module docstring and `ChainDecoderBase` for the options)."""

    _draft_valid = 0  # leading draft cache entries that hold the committed sequence

    def prefill_rest(self, prompt: Sequence[int], resume: bool) -> None:
        if self.draft is not None:
            prefill(self.draft, prompt[:-1], resume)
        self.chooser.start(prompt)
        self._draft_valid = len(prompt) - 1  # draft cache entries that match the sequence
        self._t_start = time.perf_counter()

    def propose(self, seq: list[int], k: int) -> tuple[list[int], np.ndarray | None]:
        """Up to k draft tokens after `seq` and the distributions they were drawn from."""
        draft = self.draft
        assert draft is not None
        t = time.perf_counter()
        valid = min(self._draft_valid, draft.length)
        draft.trim(draft.length - valid)
        logits = catch_up(draft, seq[valid:])
        drafts: list[int] = []
        qs = []
        for i in range(k):
            x, q = self.chooser.draft(logits, len(seq) + i, seq, drafts)
            if self.k.adaptive and self.k.ends_before(
                i, self.chooser.confidence(logits, q, seq, drafts)
            ):
                break
            drafts.append(x)
            qs.append(q)
            if i == k - 1 or self.k.ends_after(x, self.eos):
                break
            logits = draft.feed([x], last_only=True)
        self.time_draft += time.perf_counter() - t
        return drafts, (None if self.params.greedy else np.stack(qs))

    def verify(self, seq: list[int], drafts: list[int], q: np.ndarray | None) -> tuple[int, int]:
        """Score seq[-1] + drafts in one pass; return (accepted count, next token)."""
        t = time.perf_counter()
        logits = self.verifier.feed([seq[-1], *drafts])
        n, tok = self.chooser.decide(drafts, q, logits, len(seq), seq)
        self._logits = logits
        self.verifier.trim(len(drafts) - n)
        self.timed_pass(len(drafts) + 1, time.perf_counter() - t)
        return n, tok

    def step(self, seq: list[int], room: int) -> Step:
        k = 0
        if self.draft is not None and not self.no_room(room):
            k = max(0, min(self.k.k, room - 1, self.draft_room(seq)))
        drafts, q = self.propose(seq, k) if k else ([], None)
        n, tok = self.verify(seq, drafts, q)
        if drafts:  # the draft saw seq and drafts[:-1]; the accepted part stays valid
            self._draft_valid = len(seq) + min(n, len(drafts) - 1)
        self.k.update(len(drafts), n)
        self._t_end = time.perf_counter()
        return Step([*drafts[:n], tok], n, len(drafts))

    def draft_prefix_length(self) -> int:
        """How many leading entries of the draft's cache hold the sequence committed so far."""
        return min(self._draft_valid, self.draft.length) if self.draft is not None else 0

    def extra_stats(self) -> dict:
        """Scheduling stats in the pipelined decoder's terms (nothing overlaps here)."""
        wall = max(self._t_end - self._t_start, 0.0)
        return {
            "pipelined": False,
            "sampling_rule": self.chooser.rule_name,
            "overlap": 0.0,
            "draft_idle_s": max(wall - self.time_draft, 0.0),
            "verify_idle_s": max(wall - self.time_verify, 0.0),
            "wasted_drafts": 0,
        }

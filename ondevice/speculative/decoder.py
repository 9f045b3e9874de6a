"""The sequential speculative decoder: the semantic reference every faster path must match.

Each round the draft proposes k tokens after the current sequence, the verifier scores the last
committed token plus the k drafts in one pass (k + 1 distributions), and the acceptance rule keeps
a prefix of the drafts and adds one token of the verifier's. Both caches are then rolled back to
the committed sequence. With no draft (or k = 0) a round is one plain decoding step.

Invariants at the start of a round, for the committed sequence `seq` (prompt + emitted tokens):
the verifier's cache holds seq[:-1] (its last token is fed together with the drafts), and the
draft's cache holds a prefix of seq (it catches up on the rest before proposing).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ondevice.errors import ContextLengthError
from ondevice.speculative import accept
from ondevice.speculative.engine import Engine
from ondevice.speculative.sampling import SamplingParams, probabilities, sample


@dataclass
class Round:
    """What one verifier pass produced (already cut at EOS and max_tokens)."""

    tokens: list[int]
    from_draft: list[bool]
    drafted: int
    accepted: int
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_tokens or context)


class DraftLength:
    """Chooses k per round. Fixed when the user sets it; otherwise a schedule that depends only
    on accepted counts (never on timing), so a seed always gives the same tokens."""

    def __init__(self, fixed: int | None, start: int = 4, low: int = 2, high: int = 12):
        self.fixed = fixed
        self.k = fixed if fixed is not None else start
        self.low, self.high = low, high

    def update(self, drafted: int, accepted: int) -> None:
        if self.fixed is not None or drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k + 1, self.high)
        else:
            self.k = max(self.k - 1, self.low)


@dataclass
class DecodeStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    extra: dict = field(default_factory=dict)


class SpeculativeDecoder:
    """Drives a verifier engine and an optional draft engine over one prompt."""

    def __init__(
        self,
        verifier: Engine,
        draft: Engine | None,
        params: SamplingParams,
        *,
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        num_draft_tokens: int | None = None,
        rule=None,
    ) -> None:
        if num_draft_tokens is not None and num_draft_tokens < 0:
            raise ValueError("num_draft_tokens must be >= 0")
        self.verifier = verifier
        self.draft = draft
        self.params = params
        self.eos = frozenset(eos_token_ids)
        self.rng = np.random.default_rng(seed)
        self.k = DraftLength(num_draft_tokens)
        self.stats = DecodeStats()
        # the acceptance rule for sampling; replaceable so tests can show a wrong rule is caught
        self.rule = rule or accept.speculative
        self.time_draft = 0.0
        self.time_verify = 0.0
        self.time_prefill = 0.0
        self._draft_valid = 0

    @property
    def vocab(self) -> int:
        return self.verifier.vocab_size

    def _probs(self, logits: np.ndarray) -> np.ndarray:
        V = self.vocab
        if logits.shape[-1] != V:  # draft vocabulary truncated (FR-Spec) or padded
            if logits.shape[-1] > V:
                logits = logits[..., :V]
            else:
                pad = np.full((*logits.shape[:-1], V - logits.shape[-1]), -np.inf, logits.dtype)
                logits = np.concatenate([logits, pad], -1)
        return probabilities(logits, self.params)

    def prefill(self, prompt: Sequence[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        limit = self.verifier.context_length
        if len(prompt) >= limit:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but the model's context is {limit} tokens; "
                "shorten the prompt."
            )
        t = time.perf_counter()
        self.verifier.reset()
        if len(prompt) > 1:
            self.verifier.feed(prompt[:-1], last_only=True)
        if self.draft is not None:
            self.draft.reset()
            if len(prompt) > 1:
                self.draft.feed(prompt[:-1], last_only=True)
        self.time_prefill += time.perf_counter() - t
        self._draft_valid = len(prompt) - 1  # draft cache entries that match the sequence

    def propose(self, seq: list[int], k: int) -> tuple[list[int], np.ndarray | None]:
        """k draft tokens after `seq` and the distributions they were drawn from (sampling)."""
        draft = self.draft
        assert draft is not None
        t = time.perf_counter()
        valid = min(self._draft_valid, draft.length)
        draft.trim(draft.length - valid)
        logits = draft.feed(seq[valid:], last_only=True)
        drafts: list[int] = []
        qs = []
        for i in range(k):
            if self.params.greedy:
                x = int(np.argmax(logits[: self.vocab]))
            else:
                q = self._probs(logits)
                x = sample(q, self.rng)
                qs.append(q)
            drafts.append(x)
            if i < k - 1:
                logits = draft.feed([x], last_only=True)
        self.time_draft += time.perf_counter() - t
        return drafts, (np.stack(qs) if qs else None)

    def verify(self, seq: list[int], drafts: list[int], q: np.ndarray | None) -> tuple[int, int]:
        """Score seq[-1] + drafts in one pass; return (accepted count, next token)."""
        t = time.perf_counter()
        logits = self.verifier.feed([seq[-1], *drafts])
        if self.params.greedy:
            n, tok = accept.greedy(drafts, np.argmax(logits, -1))
        else:
            p = self._probs(logits)
            if drafts:
                n, tok = self.rule(drafts, q, p, self.rng)
            else:
                n, tok = 0, sample(p[0], self.rng)
        self.verifier.trim(len(drafts) - n)
        self.time_verify += time.perf_counter() - t
        return n, tok

    def run(self, prompt: Sequence[int], max_tokens: int) -> Iterator[Round]:
        seq = list(prompt)
        self.prefill(seq)
        produced = 0
        limit = self.verifier.context_length
        while produced < max_tokens:
            room = min(max_tokens - produced, limit - len(seq))
            if room <= 0:
                yield Round([], [], 0, 0, "length")
                return
            k = 0
            if self.draft is not None:
                draft_room = self.draft.context_length - len(seq) - 1
                k = max(0, min(self.k.k, room - 1, draft_room))
            drafts, q = self.propose(seq, k) if k else ([], None)
            n, tok = self.verify(seq, drafts, q)
            if drafts:  # the draft saw seq and drafts[:-1]; the accepted part stays valid
                self._draft_valid = len(seq) + min(n, len(drafts) - 1)
            self.stats.rounds += 1
            self.stats.drafted += len(drafts)
            self.stats.accepted += n
            self.k.update(len(drafts), n)
            out = [*drafts[:n], tok]
            flags = [True] * n + [False]
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
            yield Round(out, flags, len(drafts), n, finish)
            if finish:
                return

"""Prompt lookup: no model; the last n tokens are looked up earlier in the context and what
followed them is proposed (several matches form a tree)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ondevice.proposers.base import BudgetFn, Verification, cost_budget, fixed_budget
from ondevice.rules.noise import PositionNoise
from ondevice.rules.token_tree import TokenTree

if TYPE_CHECKING:
    from ondevice.proposers.resources import Resources, Speculation


class NgramIndex:
    """Where each n-gram (n in [min_n, max_n]) of a growing sequence ends, most recent last."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        self.min_n, self.max_n = min_n, max_n
        self.seq: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, seq: Sequence[int]) -> None:
        """Index `seq`, which must extend (or equal) what was indexed before."""
        if len(seq) < len(self.seq) or list(seq[: len(self.seq)]) != self.seq:
            self.seq, self.ends = [], {}
        start = len(self.seq)
        self.seq.extend(int(t) for t in seq[start:])
        for end in range(max(start, 1), len(self.seq) + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends.setdefault(tuple(self.seq[end - n : end]), []).append(end)

    def continuations(self, k: int, branches: int) -> list[list[int]]:
        """Up to `branches` distinct continuations (<= k tokens) of earlier occurrences of the
        longest suffix that occurred before; most recent occurrences first."""
        return self.match(k, branches)[0]

    def match(self, k: int, branches: int) -> tuple[list[list[int]], int]:
        """`continuations`, and the length of the suffix they continue (0: none found)."""
        s = self.seq
        for n in range(min(self.max_n, len(s) - 1), self.min_n - 1, -1):
            ends = self.ends.get(tuple(s[len(s) - n :]), [])
            out: list[list[int]] = []
            for e in reversed(ends):
                if e >= len(s):
                    continue  # the suffix itself
                cont = s[e : e + k]
                if cont and not any(c[: len(cont)] == cont for c in out):
                    out.append(cont)
                    if len(out) >= branches:
                        break
            if out:
                return out, n
        return [], 0


class AcceptanceModel:
    """Per-token acceptance rate of a proposer, as the MLE of a geometric model: accepted
    tokens over (accepted tokens + rounds that ended in a rejection). Used to size proposals."""

    def __init__(self, prior_accept: float = 1.0, prior_reject: float = 1.0):
        self.acc, self.rej = prior_accept, prior_reject

    def update(self, proposed_depth: int, accepted: int) -> None:
        self.acc += accepted
        if accepted < proposed_depth:
            self.rej += 1

    @property
    def rate(self) -> float:
        return self.acc / (self.acc + self.rej)

    def values(self, n: int) -> np.ndarray:
        """Probability that each of n chained proposals is accepted: rate ** depth."""
        return self.rate ** np.arange(1, n + 1)


class PromptLookup:
    """Prompt lookup decoding: propose what followed earlier occurrences of the context's tail.

    How far the verifier follows a copy depends on how long a tail matched (a repeated 3-gram
    of code says more than one repeated token), so acceptance is learnt per match length, and
    with a cost budget a round whose match is not worth verifying proposes nothing (`abstains`:
    `auto` then gives the round to another candidate, and scores prompt lookup only on the
    rounds it spoke)."""

    abstains = True

    def __init__(
        self,
        *,
        min_ngram: int = 1,
        max_ngram: int = 3,
        budget: BudgetFn | int | None = None,  # nodes per proposal (None: max_tokens per branch)
        max_tokens: int = 10,
        branches: int = 3,
        name: str = "pld",
    ):
        self.name = name
        self.index = NgramIndex(min_ngram, max_ngram)
        self.max_tokens = max_tokens
        self.branches = branches
        self.budget = fixed_budget(budget) if isinstance(budget, int) else budget
        self.models: dict[int, AcceptanceModel] = {}  # per matched suffix length
        self._depth = 0
        self.last_match = 0  # the length of the tail the last proposal continued

    def reset(self, prompt: Sequence[int]) -> None:
        self.index = NgramIndex(self.index.min_n, self.index.max_n)
        self.models = {}

    def guesses(self, seq: Sequence[int], k: int) -> list[list[int]]:
        self.index.extend(seq)
        return self.index.continuations(k, self.branches)

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        k = min(self.max_tokens, max_depth)
        tree = TokenTree.root(seq[-1])
        self.index.extend(seq)
        found, self.last_match = self.index.match(k, self.branches)
        nodes = k * self.branches
        if found and self.budget is not None:
            model = self.models.setdefault(self.last_match, AcceptanceModel())
            # 0 where this length of match has not paid (the prior, 1/2, always tries it)
            nodes = int(self.budget(model.values(nodes)))
            k = min(k, nodes)
        for cont in found:
            room = nodes - tree.size
            if room <= 0:
                break
            tree.add_path(cont[:room])
        self._depth = tree.max_depth
        return tree

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        if tree.size:
            self.learn(self._depth, len(verdict.path))

    def learn(self, proposed: int, accepted: int) -> None:
        """The last proposal's outcome (`proposed` tokens deep, `accepted` followed), learnt for
        the length of the tail it continued."""
        self.models.setdefault(self.last_match, AcceptanceModel()).update(proposed, accepted)


def build(res: Resources, spec: Speculation) -> PromptLookup:
    """The "pld" method: a fixed num_draft_tokens proposes up to that many tokens per branch;
    otherwise up to 10, sized by the verifier's pass costs."""
    k = spec.num_draft_tokens
    return PromptLookup(max_tokens=k or 10, budget=None if k else cost_budget(res.verify_cost))

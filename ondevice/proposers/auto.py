"""`auto`: the proposer that picks, each round, among other proposers by measured acceptance and
the estimated cost of their rounds (cost profiles, `runtime/pass_costs.py`)."""

from __future__ import annotations

from collections.abc import Sequence

from ondevice.proposers import cascade, lookahead, lookup
from ondevice.proposers.base import NoProposal, Proposer, Verification, wants_hidden
from ondevice.proposers.draft_tree import DraftState, build_greedy_path, build_tree
from ondevice.proposers.resources import Resources, Speculation
from ondevice.rules.noise import PositionNoise
from ondevice.rules.token_tree import TokenTree
from ondevice.runtime.pass_costs import CostProfile


class AutoProposer:
    """Picks a proposer per round by measured acceptance and estimated cost.

    Each candidate is tried `explore` rounds; afterwards the one with the best tokens per second
    (tokens per round over seconds per round, each an exponential average over rounds, so a
    score last updated long ago counts for little against a fresh try) proposes. A losing
    candidate gets one round again after `period` rounds of the others (at most one such
    re-check per `period` rounds, the least recently tried first), so a change in the text (a
    passage to copy, say) is noticed; each re-check it loses doubles its wait, up to
    `period * max_backoff`, and one it wins resets it. Where the verifier keeps disagreeing with
    the draft, every re-check of a draft method is a round slower than a plain step, and on
    long answers those rounds added up.

    Seconds are estimated from the cost profiles (the verifier's pass over the tree's size plus
    the draft work the proposer reports), not from the clock, so the choice depends only on
    accepted counts and a seed gives the same tokens. A draft's catch-up on tokens other
    proposers committed is left out of a round's seconds: it is what switching costs once, not
    what the proposer costs per round, and counting it kept a strong draft from ever winning
    back the rounds plain steps had taken.
    """

    name = "auto"

    def __init__(
        self,
        proposers: Sequence[Proposer],
        verify_cost: CostProfile,
        drafts: Sequence[DraftState] = (),
        *,
        explore: int = 2,
        period: int = 16,
        max_backoff: int = 8,
        decay: float = 0.8,
    ):
        if not proposers:
            raise ValueError("auto needs at least one proposer")
        self.proposers = list(proposers)
        self.verify_cost = verify_cost
        self.drafts = list(drafts)
        self.explore, self.period, self.decay = explore, period, decay
        self.max_backoff = max_backoff
        self.wants_hidden = any(wants_hidden(p) for p in self.proposers)
        self._reset_scores()

    def _reset_scores(self) -> None:
        n = len(self.proposers)
        self.tried = [0] * n
        self.last_tried = [-1] * n
        self.tokens = [0.0] * n
        self.seconds = [0.0] * n
        self.round = 0
        self.wait = [self.period] * n  # rounds before a losing candidate is re-checked
        self._best = 0
        self._last_check = 0  # the round of the last re-check (exploration counts as one)
        self._current = 0
        self._work = 0.0
        self.last_name = self.proposers[0].name

    def reset(self, prompt: Sequence[int]) -> None:
        self._reset_scores()
        for p in self.proposers:
            p.reset(prompt)

    def score(self, i: int) -> float:
        return self.tokens[i] / self.seconds[i] if self.seconds[i] > 0 else float("inf")

    def _choose(self) -> int:
        n = len(self.proposers)
        for i in range(n):
            if self.tried[i] < self.explore:
                return i
        self._best = best = max(range(n), key=self.score)
        if self.round - self._last_check < self.period:  # at most one re-check per period
            return best
        due = [i for i in range(n) if i != best and self.round - self.last_tried[i] >= self.wait[i]]
        if not due:
            return best
        self._last_check = self.round
        return min(due, key=lambda i: self.last_tried[i])

    def _draft_work(self) -> float:
        """Seconds of draft work so far, switching costs excluded (see the class docstring)."""
        return sum(d.work - d.switch_work for d in self.drafts)

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        self._current = i = self._choose()
        self.last_name = self.proposers[i].name
        self._work = self._draft_work()
        return self.proposers[i].propose(seq, max_depth, noise)

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        i = self._current
        self.proposers[i].observe(seq, tree, verdict)
        path = verdict.path
        secs = float(self.verify_cost(len(tree))) + self._draft_work() - self._work
        # an average over rounds, not over tries: what a re-check finds outweighs a score last
        # updated many rounds ago (the text may have changed since)
        a = self.decay ** (self.round + 1 - self.last_tried[i]) if self.tried[i] else 0.0
        self.tokens[i] = a * self.tokens[i] + (1 - a) * (len(path) + 1)
        self.seconds[i] = a * self.seconds[i] + (1 - a) * secs
        if self.tried[i] >= self.explore and i != self._best:  # a re-check: did it win?
            won = self.score(i) > self.score(self._best)
            self.wait[i] = (
                self.period if won else min(2 * self.wait[i], self.period * self.max_backoff)
            )
        self.tried[i] += 1
        self.round += 1
        self.last_tried[i] = self.round


def build(res: Resources, spec: Speculation) -> AutoProposer:
    """The "auto" method: plain steps, prompt lookup and, with a draft, its greedy path, its tree and
    the cascade (without one, lookahead); num_draft_tokens fixes each candidate's size."""
    cands: list[Proposer] = [NoProposal(), lookup.build(res, spec)]
    if res.draft is not None:
        cands += [build_greedy_path(res, spec), build_tree(res, spec), cascade.build(res, spec)]
    else:
        cands += [lookahead.build(res, spec)]
    # unprofiled: every pass costs the same
    vcost = res.verify_cost if res.verify_cost is not None else CostProfile([1], [1.0])
    return AutoProposer(cands, vcost, [res.draft] if res.draft is not None else [])

"""`auto`: the proposer that picks, each round, among other proposers by measured acceptance and
the estimated cost of their rounds (cost profiles, `runtime/pass_costs.py`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ondevice.proposers.base import (
    NoProposal,
    Proposer,
    Unavailable,
    Verification,
    start_from,
    wants_hidden,
)
from ondevice.proposers.draft_tree import DraftState, build_tree
from ondevice.proposers.resources import Resources, Speculation
from ondevice.rules.noise import PositionNoise
from ondevice.rules.token_tree import TokenTree
from ondevice.runtime.pass_costs import CostProfile, pass_cost

EXPLORE_SHARE = 0.02  # of a generation's time at the best known rate that tries may lose
TIE = 1e-9  # relative: scores this close count as equal (rounding in the averages)
# the least weight of a round in what later answers start from (`memory`): the mean of a
# candidate's first 32 rounds, then about its last 32, most of an answer or two, not the last
# few rounds of the last answer
LONG_RUN = 1 / 32
# the weight of a candidate's own expectation against its first round's tokens (one round each)
FIRST_ROUND_PRIOR = 0.5
# the least weight of what a losing candidate did before (its long-run record where remembered)
# against the one round a re-check gives it
RECHECK_PRIOR = 0.5
# how far (in standard errors of its score) another candidate must score above the one auto is
# on before it takes over (see the class)
NOISE_MARGIN = 1.0


class AutoProposer:
    """Picks a proposer per round by measured acceptance and estimated cost.

    Plain steps' tokens per second is known from the cost profile (one token per one-token
    pass), so they are never tried to find it out, and a candidate that scores as much (one
    whose rounds found nothing: each was a plain step) is preferred to them on the tie. A
    candidate that `abstains` (prompt lookup: it proposes only where its match is worth a
    verification) and proposes nothing leaves the round to the next choice, so it is scored on
    the rounds it speaks and asked first whenever that score is the best: a lookup that copies
    well when it finds a passage is not averaged down by the rounds it finds none (one-model
    `auto` lost to prompt lookup alone that way: docs/benchmarks.md, "Issue 30, session 9").
    Each other candidate is tried up to `explore` rounds (first tries of all before second
    ones); afterwards the one with the best tokens per second (tokens per round over seconds per round, each an exponential average over rounds, so
    a score last updated long ago counts for little against a fresh try) proposes. A losing
    candidate gets one round again after `period` rounds of the others (at most one such
    re-check per `period` rounds, the least recently tried first), so a change in the text (a
    passage to copy, say) is noticed; each re-check it loses doubles its wait, up to
    `period * max_backoff`, and one it wins resets it.

    Tries are budgeted: a try (a round of anything but the best, exploration or re-check) loses
    its seconds less the time its tokens would have taken at the best known rate (nothing
    when it gains). A try is made only while the losses so far plus the try's expected loss
    (its own rounds' so far; untried, a round that finds nothing) stay within `explore_share`
    of the time the whole generation would take at that rate (the tokens so far plus the room
    left). On a short answer, where tries cannot pay for themselves, auto so stays within
    about that share of its best candidate (exploring every candidate twice lost more: each
    try of a losing method is a round slower than a plain step, and against a fast best, prompt
    lookup copying a passage, even a plain step is a loss); a long answer affords tries in
    proportion.

    A generation starts from what the pair's earlier generations learnt of each candidate
    (`memory`, kept in the pair's `Calibrations` where that cannot change tokens): their scores
    count as a recent round each, so one unlucky first round does not hand the answer to plain
    steps. Memory is a long-run average over the candidate's rounds (their mean, then an
    exponential one, `LONG_RUN`), not the fast one a generation decides by: the last rounds of
    an answer are the rounds auto was leaving a candidate on (where the text stopped suiting
    it), the least like the next answer's; remembering them kept Medusa's heads out of four
    Spec-Bench answers in a row after one answer's weak ending (one-model auto 1.19x where the
    heads alone made 2.29x: docs/benchmarks.md, "Issue 30, session 10"). A memory of fewer
    rounds than `explore` leaves the rest of the tries to be made. Without memory a draft's
    tree that found nothing in its first round had lost more than the tries' budget, and plain
    steps took the other 95 rounds of a 96-token answer (0.77x plain, where the tree alone made
    1.03x: Spec-Bench humanities 156, docs/benchmarks.md, "Issue 26, session 9").

    With nothing remembered, a candidate's first round is weighed against what the candidate
    expected of it, where it says (`expected`: a draft's tree sums its nodes' calibrated
    acceptance estimates), the two counting as one round each (`FIRST_ROUND_PRIOR`): in a
    fresh process the tree's first round found nothing and, judged by that round alone,
    never came back (the demo at 1.24x plain: docs/benchmarks.md, "Issue 26, session 15").
    An expectation that is wrong fades as the candidate's rounds come (by `decay`).

    A re-check is one round, and it counts as one of two beside what the candidate did before
    (`RECHECK_PRIOR`: its long-run record where earlier answers left one, else its score when
    it lost), not in its place. Judged by that round alone, one lucky round of Medusa's heads
    (5 tokens where they expected 2.1) outscored the tree, and the heads took the next seven
    rounds at 9.5 tokens a second where the tree had averaged 13 (Spec-Bench math 116, 10%
    below the tree alone: docs/benchmarks.md, "Issue 26, session 17"). A candidate whose text
    has truly changed (a passage to copy) wins its re-check by far more than noise and is
    taken up at once.

    A candidate auto is on keeps the rounds against another speculating candidate unless that
    one scores higher by more than `NOISE_MARGIN` standard errors of its own score (`noise`:
    the spread of its rounds' tokens, over the weights the average gives its rounds): what
    moves by chance is the average of the one in use, round after round; the other's score,
    however few its rounds, is the best guess of it, and taking it up is how to learn more. A
    draft's tree gives 1 to 9 tokens a round, so its average over about five rounds moves by a
    third on chance alone: two one-token rounds put it just below Medusa's heads' older score,
    the heads took over, and the tree's one re-check six rounds later found nothing and kept it
    out (Spec-Bench stem 144 modelled: 10.5% below the tree alone; docs/benchmarks.md, "Issue 26,
    session 19"). A longer average instead held a lucky stretch of the heads as long (the
    demo's prompt: 2.09x against 2.46x), and a margin over both scores' errors kept the heads
    on the demo's prompt after the tree's second try scored 50% above them (1.55x). With this
    margin: stem 144 1.5% below the tree, the demo's prompt and the held-out prompts as before
    (docs/benchmarks.md, "Issue 26, session 20"). Plain steps' score is exact: against them no
    margin.

    Re-checks go to the most promising due candidate first (the least expected loss, see
    `_expected_loss`; then the least recently tried): the tries' budget is spent where a win is
    likeliest, not in the candidates' order (which re-checked prompt lookup and lookahead, and
    left the heads, whose tries cost a sixth of a plain step, waiting: docs/benchmarks.md,
    "Issue 30, session 11").

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
        explore_share: float = EXPLORE_SHARE,
        left_out: dict[str, str] | None = None,
        memory: dict[str, tuple[float, float, int]] | None = None,
    ):
        if not proposers:
            raise ValueError("auto needs at least one proposer")
        self.proposers = list(proposers)
        self.verify_cost = verify_cost
        self.drafts = list(drafts)
        self.explore, self.period, self.decay = explore, period, decay
        self.max_backoff = max_backoff
        self.explore_share = explore_share
        # plain steps: a known score, never tried or re-checked
        self.known = [isinstance(p, NoProposal) for p in self.proposers]
        self.left_out = dict(left_out or {})  # candidates `build` left out, and why
        # per candidate name, (tokens, seconds) per round as earlier generations left them
        self.memory = memory
        self.wants_hidden = any(wants_hidden(p) for p in self.proposers)
        self._reset_scores()

    def _reset_scores(self) -> None:
        n = len(self.proposers)
        one = float(self.verify_cost(1))
        self.tried = [self.explore if k else 0 for k in self.known]
        self.last_tried = [-1] * n
        self.tokens = [1.0 if k else 0.0 for k in self.known]
        self.seconds = [one if k else 0.0 for k in self.known]
        # per candidate, the same average of its rounds' tokens squared, and the sum of the
        # squared weights of the rounds in it (1: one round; a long-run average of many rounds,
        # little): how far the average still moves by chance (`noise`)
        self.square = [0.0] * n
        self.spread = [0.0] * n
        self.round = 0
        self.wait = [self.period] * n  # rounds before a losing candidate is re-checked
        self._best = 0
        self._last_check = 0  # the round of the last re-check (exploration counts as one)
        self._current = 0
        self._work = 0.0
        self._ref = 0.0  # the best known tokens per second when this round is a try, else 0
        self.lost = 0.0  # seconds the tries lost against the best known rate (see the class)
        self.committed = 0  # tokens so far
        self.last_name = self.proposers[0].name

    def reset(self, prompt: Sequence[int]) -> None:
        self._reset_scores()
        for i, p in enumerate(self.proposers):
            p.reset(prompt)
            # a draft whose work a round costs (a draft model's, Medusa's sequential heads', the
            # layer-skipped view `self` builds at its first reset)
            state = getattr(p, "state", None)
            if hasattr(state, "switch_work") and all(state is not d for d in self.drafts):
                self.drafts.append(state)
            if self.memory and p.name in self.memory and not self.known[i]:
                rounds = self._remembered(i, self.memory[p.name])
                # as if tried just now, as often as the memory holds rounds
                self.tried[i], self.last_tried[i] = min(self.explore, rounds), 0

    def start_from(self, state: np.ndarray) -> None:
        for p in self.proposers:
            start_from(p, state)

    def score(self, i: int) -> float:
        return self.tokens[i] / self.seconds[i] if self.seconds[i] > 0 else float("inf")

    def noise(self, i: int) -> float:
        """The standard error of candidate i's score: the variance of its rounds' tokens (as
        measured, or at least a geometric law's, m (m - 1) for a mean of m: a draft's guesses
        each accepted with a like chance; a few rounds say little of their spread) over the
        weights its average gives them (`spread`). Plain steps' score is known exactly."""
        if self.known[i] or self.seconds[i] <= 0:
            return 0.0
        m = self.tokens[i]
        var = max(self.square[i] - m * m, _geometric_variance(m))
        return math.sqrt(var * self.spread[i]) / self.seconds[i]

    def _remembered(self, i: int, record: tuple[float, float, int]) -> int:
        """Start candidate i's averages from its long-run record (`memory`); its rounds."""
        self.tokens[i], self.seconds[i], rounds = record
        m = self.tokens[i]
        self.square[i] = m * m + _geometric_variance(m)  # no spread remembered: see `noise`
        self.spread[i] = 1.0 / min(max(rounds, 1), 2 / LONG_RUN - 1)  # a long run's (below)
        return rounds

    def _choose(self, room: int, skip: frozenset[int] = frozenset()) -> int:
        n = len(self.proposers)
        self._ref = 0.0
        live = [i for i in range(n) if i not in skip]
        scored = [i for i in live if self.seconds[i] > 0]
        if not scored:  # nothing known yet: every first try is needed
            return min(live, key=lambda i: self.tried[i])
        # a tie goes to the candidate that speculates: one whose rounds found nothing scored
        # exactly a plain step's (prompt lookup without a match is one), so it is no worse,
        # and choosing it keeps its score fresh for when it finds something
        best = max(
            scored,
            key=lambda i: (
                (self.score(i) * (1 + TIE), -i) if not self.known[i] else (self.score(i), -i)
            ),
        )
        # a candidate auto is on keeps it against another that speculates unless beaten by
        # more than chance (see the class); against plain steps, whose score is exact, not
        held = self._best
        if (
            held != best
            and held in scored
            and not self.known[held]
            and not self.known[best]
            and self.tried[held] >= self.explore
            and self.score(best) - self.score(held) <= NOISE_MARGIN * self.noise(held)
        ):
            best = held
        self._best = best
        rate = self.score(best)
        budget = self.explore_share * (self.committed + room) / rate - self.lost
        explore = [i for i in live if self.tried[i] < self.explore]
        if explore:
            i = min(explore, key=lambda i: self.tried[i])
        elif self.round - self._last_check < self.period:  # at most one re-check per period
            return best
        else:
            due = [
                i
                for i in live
                if i != best
                and not self.known[i]
                and self.round - self.last_tried[i] >= self.wait[i]
            ]
            if not due:
                return best
            self._last_check = self.round
            i = min(due, key=lambda i: (self._expected_loss(i, rate), self.last_tried[i]))
        if self._expected_loss(i, rate) > budget:
            return best  # the tries have spent their share
        self._ref = rate
        return i

    def _expected_loss(self, i: int, rate: float) -> float:
        """What a try of candidate i is expected to lose against `rate`: what its rounds did so
        far, or, untried, what a round that finds nothing loses (one token for a one-token
        pass)."""
        if self.seconds[i] > 0:
            return self.seconds[i] - self.tokens[i] / rate
        return float(self.verify_cost(1)) - 1.0 / rate

    def _draft_work(self) -> float:
        """Seconds of draft work so far, switching costs excluded (see the class docstring)."""
        return sum(d.work - d.switch_work for d in self.drafts)

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        skip: set[int] = set()
        while True:
            self._current = i = self._choose(max_depth + 1, frozenset(skip))
            self.last_name = self.proposers[i].name
            self._work = self._draft_work()
            tree = self.proposers[i].propose(seq, max_depth, noise)
            # a candidate that abstains (proposes nothing where its guess is not worth a
            # verification: prompt lookup without a match that pays) leaves the round to the
            # others; it is scored on the rounds it speaks
            if tree.size or not getattr(self.proposers[i], "abstains", False):
                return tree
            skip.add(i)
            if len(skip) == len(self.proposers):
                return tree  # every candidate abstained: a plain step, the last one's

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        i = self._current
        self.proposers[i].observe(seq, tree, verdict)
        for j, p in enumerate(self.proposers):  # a reader of the verifier's hidden states
            if j != i and wants_hidden(p):  # drafts from the latest, whoever proposed
                p.observe(seq, tree, verdict)
        path = verdict.path
        recheck = self.tried[i] >= self.explore and i != self._best  # a loser's one round
        secs = float(pass_cost(self.verify_cost, tree)) + self._draft_work() - self._work
        self.committed += len(path) + 1
        if self._ref > 0:  # a try: what it lost against the best known rate (a gain does not
            # fund more tries: against a fast best, every try of another is a loss)
            self.lost += max(secs - (len(path) + 1) / self._ref, 0.0)
        if not self.known[i]:
            # an average over rounds, not over tries (a score last updated many rounds ago
            # fades: the text may have changed since), but a re-check's one round counts no
            # more than the candidate's record (below)
            a = self.decay ** (self.round + 1 - self.last_tried[i]) if self.tried[i] else 0.0
            expected = getattr(self.proposers[i], "expected", None)
            name = self.proposers[i].name
            if not self.tried[i] and expected is not None:
                # a first round, with nothing remembered, counts as much as what the candidate
                # expected of it (see the class): one round's luck does not decide alone
                self.tokens[i], self.seconds[i], a = expected, secs, FIRST_ROUND_PRIOR
                self.square[i], self.spread[i] = expected**2, 1.0  # the expectation, as a round
            elif recheck:
                # a re-check: its one round weighed against the candidate's record, not in its
                # place (see the class)
                if self.memory and name in self.memory:
                    self._remembered(i, self.memory[name])
                a = max(a, RECHECK_PRIOR)
            x = len(path) + 1
            self.tokens[i] = a * self.tokens[i] + (1 - a) * x
            self.seconds[i] = a * self.seconds[i] + (1 - a) * secs
            self.square[i] = a * self.square[i] + (1 - a) * x * x
            self.spread[i] = a * a * self.spread[i] + (1 - a) ** 2
            if self.memory is not None:
                toks, took, rounds = self.memory.get(name, (0.0, 0.0, 0))
                b = max(1 / (rounds + 1), LONG_RUN)
                self.memory[name] = (
                    (1 - b) * toks + b * (len(path) + 1),
                    (1 - b) * took + b * secs,
                    rounds + 1,
                )
        if recheck:  # did it win?
            won = self.score(i) > self.score(self._best)
            self.wait[i] = (
                self.period if won else min(2 * self.wait[i], self.period * self.max_backoff)
            )
        self.tried[i] += 1
        self.round += 1
        self.last_tried[i] = self.round


def _geometric_variance(m: float) -> float:
    """The variance of a round's tokens with mean m where each guess is accepted with a like
    chance (a geometric law on 1, 2, ...): m (m - 1)."""
    return max(m * (m - 1.0), 0.0)


def build(res: Resources, spec: Speculation) -> AutoProposer:
    """The "auto" method: plain steps, every registered method that declares itself a candidate
    (`Method.in_auto`: pld, lookahead, self, ...) whose builder finds what it needs, and, with a
    draft, the draft's tree; num_draft_tokens fixes each candidate's size. A candidate whose
    builder raises `Unavailable` is left out, with its reason in `left_out` (the decoder's stats
    show it as "auto_left_out")."""
    from ondevice.proposers.registry import METHODS

    # the order tries are made in, the likeliest to pay first (tries are budgeted). The draft
    # gives one candidate, its tree: its levels are sized by cost (one node a level where only
    # the best pays), so the greedy path and the cascade's chain are readings of the same
    # guesses that auto told apart by a round or two each, which chance decided
    # (docs/benchmarks.md, "Issue 26, session 16")
    cands: list[Proposer] = [NoProposal()]
    if res.draft is not None:
        cands.append(build_tree(res, spec))
    left_out: dict[str, str] = {}
    as_candidate = replace(spec, method="auto")  # builders: use only what is cached
    for m in METHODS.values():
        if not m.in_auto or m.name == "auto" or (m.needs_draft and res.draft is None):
            continue
        try:
            cands.append(m.build_proposer(res, as_candidate))
        except Unavailable as e:
            left_out[m.name] = str(e)
    # unprofiled: every pass costs the same
    vcost = res.verify_cost if res.verify_cost is not None else CostProfile([1], [1.0])
    return AutoProposer(cands, vcost, left_out=left_out, memory=res.calibrations.rates)

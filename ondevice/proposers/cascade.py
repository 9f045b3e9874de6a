"""The cascade: a draft chain whose own drafting is sped up by prompt lookup (the draft checks
the lookup's guesses in one draft pass with the same acceptance rule, `accept.choose`), so the
chain is still an exact sample of the draft."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ondevice.proposers.base import BudgetFn, Verification, cost_budget, fixed_budget
from ondevice.proposers.draft_tree import DraftState
from ondevice.proposers.lookup import AcceptanceModel, PromptLookup
from ondevice.rules import accept
from ondevice.rules.chooser import as_chooser
from ondevice.rules.engine import Engine
from ondevice.rules.noise import PositionNoise
from ondevice.rules.sampling import SamplingParams
from ondevice.rules.token_tree import TokenTree

if TYPE_CHECKING:
    from ondevice.proposers.resources import Resources, Speculation


class CascadeProposer:
    """A draft chain whose drafting is itself speculative: prompt lookup guesses, the draft
    checks the guesses in one draft pass, and accepted guesses save draft passes.

    The draft's chain is still an exact sample of the draft (greedy: its argmax chain): each
    guess g is accepted with the draft's probability q(g) (deterministic-proposal rule), and on
    rejection the draft's token is sampled from q without g. So the verifier applies the usual
    multi-draft rule with the draft's q, and the output is exactly the verifier's.
    """

    def __init__(
        self,
        draft: Engine | DraftState,
        vocab: int,
        params: SamplingParams,
        *,
        lookup: PromptLookup | None = None,
        budget: BudgetFn | int = 6,
        name: str = "cascade",
    ):
        self.name = name
        self.state = draft if isinstance(draft, DraftState) else DraftState(draft, vocab)
        self.chooser = as_chooser(params, vocab)
        self.params = self.chooser.params
        self.lookup = lookup or PromptLookup(branches=1)
        self.budget = fixed_budget(budget) if isinstance(budget, int) else budget
        self.model = AcceptanceModel()
        self.draft_passes = 0
        self._k = 0

    def reset(self, prompt: Sequence[int]) -> None:
        self.state.reset(prompt)
        self.lookup.reset(prompt)
        self.chooser.start(prompt)
        self.model = AcceptanceModel()

    def _feed(self, tokens: list[int]) -> np.ndarray:
        self.draft_passes += 1
        return self.state.feed(tokens)

    def _step(self, q: np.ndarray, guess: int | None, rand: accept.Randomness) -> tuple[int, bool]:
        """The draft's next token (and whether it equals the guess): the acceptance rule with
        the draft as the target and the guess as a deterministic draw, so it samples q exactly."""
        if self.params.greedy:
            x = int(np.argmax(q))
            return x, x == guess
        taken, x = accept.choose(q, [] if guess is None else [(guess, None)], rand)
        return x, taken is not None

    @staticmethod
    def _draws(noise: PositionNoise, pos: int) -> accept.Randomness:
        return accept.Stream(noise.draws(pos))

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        k = max(1, min(int(self.budget(self.model.values(max_depth))), max_depth))
        # Invariant at the top of the loop: the draft's cache holds seq + drafts and `logits`
        # is its output after the last of them.
        logits = self.state.sync(seq)
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        while len(drafts) < k:
            q = self.chooser.probs(logits, seq, [drafts])
            found = self.lookup.guesses([*seq, *drafts], k - len(drafts))
            if not found:
                x, _ = self._step(q, None, self._draws(noise, len(seq) + len(drafts)))
                drafts.append(x)
                qs.append(q)
                if len(drafts) < k:
                    logits = self._feed([x])[-1]
                continue
            guess = found[0]
            base = len(self.state.tokens)
            rows = self._feed(guess)  # row i: the draft after guess[i], in one pass
            for i, g in enumerate(guess):
                x, hit = self._step(q, g, self._draws(noise, len(seq) + len(drafts)))
                drafts.append(x)
                qs.append(q)
                if not hit:  # guess[i:] are wrong: drop them, feed the draft's own token
                    self.state.truncate(base + i)
                    if len(drafts) < k:
                        logits = self._feed([x])[-1]
                    break
                if len(drafts) >= k:
                    self.state.truncate(base + i + 1)
                    break
                q, logits = self.chooser.probs(rows[i], seq, [drafts]), rows[i]
        tree = TokenTree.root(seq[-1])
        node = 0
        for x, q in zip(drafts, qs):
            node = tree.add(node, x, None if self.params.greedy else q)
        self._k = len(drafts)
        return tree

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        if self._k:
            self.model.update(self._k, len(verdict.path))


def build(res: Resources, spec: Speculation) -> CascadeProposer:
    """The "cascade" method: num_draft_tokens fixes the draft chain's length; otherwise the
    verifier's pass costs size it (at most 12)."""
    k = spec.num_draft_tokens
    budget = k if k else cost_budget(res.verify_cost, per_node=res.draft_pass(1), cap=12)
    return CascadeProposer(res.draft, res.vocab, res.chooser, budget=budget)

"""Proposers: where the tokens a verifier checks come from.

Every proposer builds a `TokenTree` rooted at the last committed token; the tree decoder scores
it in one verifier pass and keeps the accepted path. Losslessness never depends on the proposer,
only on each draw being recorded with the distribution it was drawn from (or as deterministic):

- `DraftTreeProposer`: a draft model grows a static tree (a list of rank paths), a chain, or a
  dynamic tree (EAGLE-2: expand the most probable nodes by cumulative draft probability and keep
  the best N). Children are the draft's top-k (deterministic) or, for sampled static trees,
  i.i.d. samples from the draft (SpecInfer).
- `PromptLookup`: no model; the last n tokens are looked up earlier in the context and what
  followed them is proposed (several matches form a tree).
- `Lookahead`: no model; a Jacobi window of guesses rides along in the verifier pass, its outputs
  feed an n-gram pool, and pool n-grams starting with the last token are verified.
- `CascadeProposer`: a draft chain whose own drafting is sped up by prompt lookup (the draft
  checks the lookup's guesses in one draft pass with the same rejection rule), so the chain is
  still an exact sample of the draft.

Each has its module: `draft_tree.py` (the draft's cache and its trees), `lookup.py` (prompt
lookup and its n-gram index), `lookahead.py`, `cascade.py`; this one holds what they share (the
`Proposer` protocol, budgets) and `NoProposal`. Sampled draws come from the position-keyed noise
(`noise.py`) the decoder passes to `propose`.

Proposers talk to engines through the `Engine` protocol; a draft engine that also has
`feed_masked(tokens, positions, visible)` and `keep(n_recent, indices)` grows trees in one pass
per level, any other engine grows them path by path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ondevice.errors import OndeviceError
from ondevice.rules.noise import PositionNoise
from ondevice.rules.token_tree import TokenTree
from ondevice.runtime.pass_costs import CostProfile, best_rate, best_size

if TYPE_CHECKING:
    from ondevice.proposers.resources import Resources, Speculation

# the most tokens a draft model guesses ahead in one round: the chain's longest block and a
# dynamic tree's deepest level (both stop sooner where the costs say it does not pay)
LONGEST_DRAFT = 12


class Unavailable(OndeviceError):
    """Raised by a proposer's builder when what the proposer needs is missing (no trained heads,
    no skip set, no MLX verifier): the message says what and how to get it. `auto` builds its
    candidates with `Speculation.method == "auto"`; a builder whose resources are costly to
    get (a search, training) uses only what is cached then and raises this otherwise, and
    `auto` leaves the method out and records why (`stats["auto_left_out"]`)."""


def not_beside_a_draft(res: Resources, spec: Speculation) -> None:
    """Raise `Unavailable` where `auto` builds a one-model candidate whose guesses a loaded draft
    model makes better and cheaper (lookahead's Jacobi window, the verifier's own layers, Medusa's
    heads): the draft's tree takes its place. A try of one there is a round lost (a held-out stem
    answer 1.37x plain where the tree alone made 1.59x, when `self`'s draft still caught up over
    the whole prompt: docs/benchmarks.md, "Issue 30, session 19"). The heads cost little a round,
    but on every Spec-Bench prompt where they won a re-check beside the draft and kept rounds (8
    to 24 of an answer's), auto fell 5-15% below the tree alone, and nowhere did their rounds
    gain beyond the clock's noise (docs/benchmarks.md, "Issues 26 and 30, session 25")."""
    if spec.method == "auto" and res.draft is not None:
        raise Unavailable("a draft model is loaded: auto drafts with it instead")


@dataclass
class Verification:
    """What one verification pass hands back to the proposer that built the tree.

    path: the accepted nodes (ids in the tree, root excluded), in order.
    token: the verifier's token after the path (the round's last token).
    target: (len(tree),) the verifier's greedy token after every node (after the sampling
        transform; lookahead reads its Jacobi guesses' outcomes here).
    hidden: (len(tree), hidden_size) float32: the verifier's last hidden states (after the final
        norm) at every node, when the proposer asked for them (`wants_hidden`), else None: what
        a verifier-side proposer (a Medusa or EAGLE head) drafts the next round from.
    """

    path: list[int]
    token: int
    target: np.ndarray
    hidden: np.ndarray | None = None


class Proposer(Protocol):
    """Builds each round's token tree. `wants_hidden` (an optional attribute, False when
    missing): the verifier's hidden states are wanted in each `Verification`; such a proposer
    may also have `start_from(state)`, called after `reset` with the verifier's hidden state at
    the prompt's last prefilled token (prompt[-2]) where the prefill computed one, so that the
    first round drafts from it as later rounds draft from a verification's."""

    name: str

    def reset(self, prompt: Sequence[int]) -> None:
        """A new generation starts with `prompt` (the verifier holds prompt[:-1])."""

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        """A tree rooted at seq[-1], no deeper than `max_depth` (>= 1); sampled draws for
        position m come from `noise.draws(m)`."""

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        """After verification of `tree` (built after `seq`, the sequence before this round's
        tokens): what the verifier decided (see `Verification`)."""


def wants_hidden(proposer: Proposer) -> bool:
    """Whether `proposer` reads the verifier's hidden states."""
    return bool(getattr(proposer, "wants_hidden", False))


def start_from(proposer: Proposer, state: np.ndarray) -> None:
    """Hand `proposer` the prompt's last hidden state, where it takes one (`Proposer`)."""
    take = getattr(proposer, "start_from", None)
    if take is not None:
        take(state)


BudgetFn = Callable[[np.ndarray], int]
# (acceptance estimates of the candidate nodes, seconds of drafting spent) -> the best tokens per
# second a verifier pass over some of them can give (see `runtime/pass_costs.best_rate`)
RateFn = Callable[[np.ndarray, float], float]


def fixed_budget(n: int) -> BudgetFn:
    return lambda values: n


def cost_budget(
    verify: CostProfile | None, fixed: float = 0.0, per_node: float = 0.0, cap: int = 64
) -> BudgetFn:
    """A budget function from the verifier's cost profile (None: a fixed default of 8)."""
    if verify is None:
        return lambda values: min(len(values), 8)
    return lambda values: best_size(np.asarray(values)[:cap], verify, fixed, per_node)


def cost_rate(verify: CostProfile | None, fixed: float = 0.0, cap: int = 64) -> RateFn | None:
    """The best tokens per second over candidate values after `spent` seconds of drafting
    beyond `fixed` (None without a profile: trees then grow to their full depth)."""
    if verify is None:
        return None
    return lambda values, spent: best_rate(np.asarray(values)[:cap], verify, fixed + spent)[1]


# (a grown tree of candidates, their values by node - 1, the nodes best first) -> the nodes to
# verify, best first (parents before children)
PickFn = Callable[[TokenTree, np.ndarray, np.ndarray], np.ndarray]


def cost_pick(verify: CostProfile, fixed: float = 0.0, cap: int = 64) -> PickFn:
    """Which of a grown tree's candidates to verify: the best n of them, their pass priced as
    a tree whose rows branch (`CostProfile.branched`), or the best prefix of its greedy path
    (each node its parent's most valuable child), priced as a causal pass, whichever gives
    more tokens per second. A branched pass costs more than a causal one of its size (more so
    after a long prompt): priced alike, trees bought side nodes that did not pay for it and
    lost to the chain of the same draft (docs/benchmarks.md, "session 31")."""

    def pick(tree: TokenTree, values: np.ndarray, order: np.ndarray) -> np.ndarray:
        order = order[:cap]
        n, tree_rate = best_rate(values[order - 1], verify, fixed, branched=True)
        best_child: dict[int, int] = {}
        for node in range(1, len(tree)):
            parent = tree.parents[node]
            if parent not in best_child or values[node - 1] > values[best_child[parent] - 1]:
                best_child[parent] = node
        path, node = [], 0
        while node in best_child and len(path) < cap:
            node = best_child[node]
            path.append(node)
        m, path_rate = best_rate(values[np.asarray(path, int) - 1], verify, fixed)
        return np.asarray(path[:m], int) if path_rate >= tree_rate else order[:n]

    return pick


class NoProposal:
    """Proposes nothing: each round is one plain decoding step (a candidate for `auto`, which
    should fall back to plain decoding where no proposer pays for itself)."""

    name = "plain"

    def reset(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        return TokenTree.root(seq[-1])

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        pass

"""Tree decoding: one verifier pass scores a whole token tree, the accepted path is kept.

`TreeDecoder` is a `Decoder` (`decoders/base.py`) with the invariants of the sequential
`ChainDecoder`: at the start of a round the verifier's cache holds seq[:-1]; the round feeds
seq[-1] (the root) with every proposed node, at positions root + depth under a tree mask, and
afterwards keeps only the root and the accepted path (`KVCache.keep`), so the cache again holds
the committed sequence minus its last token. The acceptance rule is `accept.multi_draft` (greedy:
`accept.greedy_tree`), with the position-keyed noise of `noise.py`. `proposers/registry.py` builds
it for each method.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ondevice.decoders.base import DecoderBase, Step
from ondevice.errors import OndeviceError
from ondevice.proposers.base import Proposer, Verification, start_from, wants_hidden
from ondevice.proposers.draft_tree import DraftState
from ondevice.rules import accept
from ondevice.rules.chooser import TokenChooser, TreeRule
from ondevice.rules.engine import Engine
from ondevice.rules.sampling import SamplingParams, TokenLogprob, token_logprobs
from ondevice.rules.token_tree import TokenTree
from ondevice.runtime.engines import tree_engine
from ondevice.runtime.pass_costs import CostProfile, CostWatch

# rule(tree, p, at) -> (accepted nodes, next token); `accept.multi_draft` unless a test swaps it
Rule = TreeRule


class TreeDecoder(DecoderBase):
    """Drives a tree-capable verifier with any proposer over one prompt."""

    def __init__(
        self,
        verifier: Engine,
        proposer: Proposer,
        params: SamplingParams,
        *,
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        rule: Rule | None = None,
        draft_state: DraftState | None = None,
        chooser: TokenChooser | None = None,
        cost_watch: CostWatch | None = None,
        costs: Sequence[CostProfile] = (),
    ) -> None:
        """verifier: a tree-capable engine (`runtime.engines.tree_engine` wraps MLX ones).
        proposer: where each round's tree comes from. params: the sampling parameters.
        seed: the position-keyed noise's seed. rule: the tree acceptance rule (tests swap it).
        draft_state: the proposers' draft, if they have one (its cache follows the prompt
        cache). chooser: the generation's token chooser, shared with the proposer (default:
        a new one from params and seed). cost_watch: see `DecoderBase`. costs: the pass-cost
        profiles the proposer prices its rounds by, priced each round at the committed
        sequence's length (`CostProfile.at`: what more tokens cost grows with the context)."""
        verifier = tree_engine(verifier)
        if not hasattr(verifier, "feed_masked"):
            raise OndeviceError(
                f"the {verifier.name!r} verifier cannot score token trees; use method='chain'."
            )
        super().__init__(verifier, eos_token_ids, cost_watch)
        self.proposer = proposer
        self.hidden = wants_hidden(proposer)
        if self.hidden and not getattr(verifier, "returns_hidden", False):
            raise OndeviceError(
                f"the {proposer.name!r} proposer reads the verifier's hidden states, which the "
                f"{verifier.name!r} verifier engine does not return; use an MLX verifier."
            )
        self.draft_state = draft_state  # the proposers' draft, if they have one
        self.params = params
        self.chooser = chooser or TokenChooser(params, verifier.vocab_size, seed)
        # the sampling rule; replaceable so tests can show that a wrong rule is caught
        self.rule = rule or accept.multi_draft
        self._per_method = self.stats.extra.setdefault("rounds_by_method", {})
        self.costs = list(costs)

    def extra_stats(self) -> dict:
        """Which proposer made how many rounds (auto's choices; one entry for other methods), and
        the candidates auto left out, with why ("auto_left_out")."""
        out: dict = {"rounds_by_method": dict(self._per_method)}
        left_out = getattr(self.proposer, "left_out", None)
        if left_out:
            out["auto_left_out"] = dict(left_out)
        return out

    def prefill_rest(self, prompt: Sequence[int], resume: bool) -> None:
        if resume and self.draft_state is not None:
            engine = self.draft_state.engine
            self.draft_state.resume(prompt[: min(engine.length, len(prompt) - 1)])
        self.chooser.start(prompt)
        self.proposer.reset(prompt)
        if self.prompt_state is not None:
            start_from(self.proposer, self.prompt_state)

    def verify(self, seq: list[int], tree: TokenTree) -> Verification:
        """Score the tree in one pass and decide the round. seq: the committed sequence (the
        tree's root is seq[-1]). The verifier's hidden states ride along when the proposer
        reads them."""
        args = (tree.tokens, tree.positions(len(seq) - 1), tree.ancestors())
        hidden = None
        if self.hidden:
            logits, hidden = self.verifier.feed_masked(*args, hidden=True)  # type: ignore[attr-defined]
        else:
            logits = self.verifier.feed_masked(*args)  # type: ignore[attr-defined]
        path, tok, target = self.chooser.decide_tree(tree, logits, seq, self.rule)
        self.verifier.keep(len(tree), [0, *path])  # type: ignore[attr-defined]
        self._logits, self._nodes = logits, [0, *path]
        return Verification(path, tok, target, hidden)

    def draft_prefix_length(self) -> int:
        """How many leading entries of the draft's cache hold the sequence committed so far."""
        state = self.draft_state
        return len(state.tokens) if state is not None and state.tokens is not None else 0

    def step(self, seq: list[int], room: int) -> Step:
        t = time.perf_counter()
        proposed = not self.no_room(room)
        for cost in self.costs:
            cost.at = len(seq)
        if proposed:
            tree = self.proposer.propose(seq, room - 1, self.chooser.noise)
        else:
            tree = TokenTree.root(seq[-1])
        t2 = time.perf_counter()
        verdict = self.verify(seq, tree)
        path, tok = verdict.path, verdict.token
        t3 = time.perf_counter()
        if proposed:
            self.proposer.observe(seq, tree, verdict)
        self.time_draft += (t2 - t) + (time.perf_counter() - t3)
        self.timed_pass(len(tree), t3 - t2)
        name = getattr(self.proposer, "last_name", self.proposer.name)
        self._per_method[name] = self._per_method.get(name, 0) + 1
        if proposed and tree.size == 0:
            self.skip_reason = (
                f"the {name!r} proposer proposed nothing (no match, or nothing the cost model "
                "found worth verifying)"
            )
        return Step([*(tree.tokens[n] for n in path), tok], len(path), tree.size)

    def round_logprobs(self, tokens: list[int]) -> list[TokenLogprob] | None:
        if self.params.logprobs is None:
            return None
        return token_logprobs(self._logits[self._nodes], tokens, self.params.logprobs)

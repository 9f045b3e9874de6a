"""The one token chooser of a generation: logits in, tokens and accepted prefixes out.

Every decoder (chain, pipelined, tree) and every proposer turns logits into tokens through one
`TokenChooser`, which owns the sampling transform (`sampling.py`) and the position-keyed noise
(`noise.py`), and applies the acceptance rule (`accept.py`). So the draft and the verifier see
the same transformed distributions, and a seed means the same draws, whoever asks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ondevice.rules import accept
from ondevice.rules.noise import PositionNoise
from ondevice.rules.sampling import (
    SamplingParams,
    TokenLogprob,
    Transform,
    align,
    chain_paths,
    probabilities,
    softmax,
    token_logprobs,
)
from ondevice.rules.token_tree import TokenTree

# A chain acceptance rule: rule(drafts, q, p, at) -> (accepted, token), where at(i) is the random
# source of the i-th position of the block (as `accept.speculative`, the default).
CustomRule = Callable[[Sequence[int], "np.ndarray | None", np.ndarray, accept.At], tuple[int, int]]
# A tree acceptance rule: rule(tree, p, at) -> (accepted nodes, next token), p(node) the
# verifier's distribution after a node (as `accept.multi_draft`, the default).
TreeRule = Callable[..., tuple[list[int], int]]


def as_chooser(chooser: TokenChooser | SamplingParams, vocab: int) -> TokenChooser:
    """The chooser a proposer shares with its decoder, or (given only sampling parameters, as
    a proposer used on its own) one of its own, unseeded."""
    return chooser if isinstance(chooser, TokenChooser) else TokenChooser(chooser, vocab, None)


class TokenChooser:
    """Turns logits into draft tokens and verification results, identically for every decoder
    and every proposer: one per generation, owning the generation's sampling transform (so one
    grammar state) and its position-keyed noise.

    Logits are (V,) for one position or (R, V) for R positions; `seq` is the committed sequence
    (prompt first) and a path the drafted tokens between it and a position.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab: int,
        seed: int | None,
        rule: str | CustomRule | None = None,
    ):
        self.params = params
        self.vocab = vocab
        self.transform = Transform(params, vocab)
        self.noise = PositionNoise(seed)
        self._prompt: tuple[int, ...] | None = None
        rule = rule or "leviathan"
        if isinstance(rule, str):
            if rule not in accept.RULES:
                raise ValueError(
                    f"unknown sampling rule {rule!r}; choose one of {', '.join(accept.RULES)}"
                )
            self.rule_name, self.rule = rule, accept.RULES[rule]
        else:  # a custom rule (tests show a wrong one is caught)
            self.rule_name, self.rule = "custom", rule

    def start(self, prompt: Sequence[int]) -> None:
        """A new generation (penalties and grammars read the tokens after the prompt). The
        decoder and each proposer sharing the chooser call it; only the first call for a
        prompt starts the transform (one grammar state per generation)."""
        key = tuple(int(t) for t in prompt)
        if key != self._prompt:
            self._prompt = key
            self.transform.start(prompt)

    def probs(
        self, logits: np.ndarray, seq: Sequence[int] = (), paths: Sequence[Sequence[int]] = ((),)
    ) -> np.ndarray:
        """Transformed distribution(s) (R, V) float64 at the position(s) after seq + paths[i],
        from logits (R, V) (or (V,) with one path: then (V,))."""
        logits = align(logits, self.vocab)
        if not self.transform.active:
            return probabilities(logits, self.params)
        return self.transform.probs(logits, seq, paths)

    def ranking(
        self, logits: np.ndarray, seq: Sequence[int] = (), path: Sequence[int] = ()
    ) -> np.ndarray:
        """The draft's distribution (V,) after seq + path for ranking children and valuing
        nodes: the transformed one, or under greedy decoding the temperature-1 softmax of the
        processed logits (a point mass says nothing about confidence)."""
        if self.transform.active:
            logits = self.transform.logits(align(logits, self.vocab), seq, [path])
        if self.params.greedy:
            return softmax(logits)
        return probabilities(logits, self.params)

    def targets(
        self, logits: np.ndarray, seq: Sequence[int], paths: Sequence[Sequence[int]] | None
    ) -> np.ndarray:
        """The verifier's greedy token per row of `logits` (R, V), row i after seq + paths[i]
        (paths None: the transform is inactive and reads no context)."""
        if self.transform.active:
            return self.transform.argmax(logits, seq, paths)
        return np.argmax(logits, -1)

    def draft(
        self, logits: np.ndarray, pos: int, seq: Sequence[int] = (), path: Sequence[int] = ()
    ) -> tuple[int, np.ndarray | None]:
        """The draft's token at position `pos` (after seq + path) from its logits (V,), and the
        distribution (V,) it was sampled from (None under greedy decoding)."""
        if self.params.greedy:
            if self.transform.active:
                return int(self.transform.argmax(align(logits, self.vocab), seq, [path])), None
            return int(np.argmax(logits[: self.vocab])), None
        q = self.probs(logits, seq, [path])
        return self.noise.race_sample(q, pos), q

    def confidence(
        self,
        logits: np.ndarray,
        q: np.ndarray | None,
        seq: Sequence[int] = (),
        path: Sequence[int] = (),
    ) -> float:
        """The largest probability of the draft's distribution (greedy: softmax at T=1)."""
        if q is not None:
            return float(q.max())
        if self.transform.active:
            z = self.transform.logits(align(logits, self.vocab), seq, [path])
        else:
            z = np.asarray(logits[: self.vocab], np.float32)
        return float(1.0 / np.exp(z - z.max()).sum())

    def decide(
        self,
        drafts: Sequence[int],
        q: np.ndarray | None,
        logits: np.ndarray,
        start: int,
        seq: Sequence[int] = (),
    ) -> tuple[int, int]:
        """(accepted count, next token) for `drafts` (K ids) at positions start.. given `q`
        (K, V), the distributions they were drawn from (None when greedy), and the verifier's
        `logits` (K+1, V) for the last committed token plus the drafts; `seq` is the committed
        sequence."""
        paths = chain_paths(drafts) if self.transform.active else [()] * (len(drafts) + 1)
        if self.params.greedy:
            return accept.greedy(drafts, self.transform.argmax(logits, seq, paths))
        p = self.probs(logits, seq, paths)
        return self.rule(drafts, q, p, self.noise.offsets(start))

    def decide_tree(
        self, tree: TokenTree, logits: np.ndarray, seq: Sequence[int], rule: TreeRule
    ) -> tuple[list[int], int, np.ndarray]:
        """(accepted nodes, next token, the verifier's greedy token per node) for `tree` scored
        by the verifier's `logits` (len(tree), V), row i after node i; `rule(tree, p, at)` is
        the sampling rule (`accept.multi_draft` unless a test swaps it)."""
        # node i's context: the committed sequence and the tokens on the path to i
        paths = [tree.path_tokens(n) for n in range(len(tree))] if self.transform.active else None
        target = self.targets(logits, seq, paths)
        if self.params.greedy:
            path, tok = accept.greedy_tree(tree, target)
            return path, tok, target
        rows: dict[int, np.ndarray] = {}

        def p(node: int) -> np.ndarray:  # only the visited nodes' distributions
            if node not in rows:
                ctx = [paths[node]] if paths is not None else [()]
                rows[node] = self.transform.probs(logits[node], seq, ctx)
            return rows[node]

        # the node at depth d decides position len(seq) + d
        path, tok = rule(tree, p, self.noise.offsets(len(seq)))
        return path, tok, target

    def logprobs(self, logits: np.ndarray, tokens: Sequence[int]) -> list[TokenLogprob] | None:
        """Log-probabilities of the emitted tokens (row i scores tokens[i]), when asked for."""
        if self.params.logprobs is None:
            return None
        return token_logprobs(logits, tokens, self.params.logprobs)

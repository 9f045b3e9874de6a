"""A proposer that reads the verifier's hidden states: a Medusa-style head, for tests.

It shows the seam a verifier-side proposer plugs into (one file and one registry entry): it
sets `wants_hidden`, the tree decoder then hands it the verifier's last hidden states in every
`Verification`, and from the state at the last accepted node its head proposes the next
round's tokens. The head here is the verifier's own output layer (Medusa initialises its heads
so), which makes it a weak drafter but lets a test check that the states are the verifier's:
the head applied to them gives the verifier's greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ondevice.proposers.base import Verification
from ondevice.proposers.resources import Resources, Speculation
from ondevice.rules.noise import PositionNoise
from ondevice.rules.token_tree import TokenTree


class HiddenHeadProposer:
    """Proposes the head's `width` best tokens (as children of the root) from the verifier's
    hidden state (hidden_size,) at the last accepted node; `head` is (hidden_size, vocab)."""

    name = "hidden-head"
    wants_hidden = True

    def __init__(self, head: np.ndarray, width: int = 2) -> None:
        self.head = head  # (hidden_size, vocab)
        self.width = width
        self.state: np.ndarray | None = None  # (hidden_size,) at the last accepted node
        self.agreed = self.checked = 0  # head(hidden) == the verifier's greedy token, per node
        self.shapes: list[tuple[int, ...]] = []

    def reset(self, prompt: Sequence[int]) -> None:
        self.state = None

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        tree = TokenTree.root(seq[-1])
        if self.state is not None:
            for tok in np.argsort(-(self.state @ self.head))[: self.width]:
                tree.add(0, int(tok))
        return tree

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        hidden = verdict.hidden
        assert hidden is not None, "the decoder did not hand over the hidden states"
        self.shapes.append(hidden.shape)
        self.agreed += int((np.argmax(hidden @ self.head, -1) == verdict.target).sum())
        self.checked += len(tree)
        self.state = hidden[verdict.path[-1] if verdict.path else 0]


def build(res: Resources, spec: Speculation) -> HiddenHeadProposer:
    """The registry's builder: the head from the verifier's output layer (tied or not)."""
    model = res.verifier.model  # type: ignore[attr-defined]
    layer = getattr(model, "lm_head", None) or model.model.embed_tokens
    # the CPU kernel's head may be blocked (a flat buffer): `dense()` reads it back as (vocab, d)
    weight = layer.dense() if hasattr(layer, "dense") else layer.weight
    return HiddenHeadProposer(np.array(weight.astype(mx.float32)).T)

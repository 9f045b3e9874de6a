"""Token trees: structure, attention mask and positions (the acceptance rule is `accept.py`).

A tree is rooted at the last committed token (node 0, which the verifier has not seen yet: it is
fed together with the proposals, as in the chain decoder). Every other node is a proposed token
after its parent. Nodes are stored in insertion order and a parent always precedes its children,
so the list of nodes is a valid order for one verifier pass: node i attends to the committed
prefix and to its own ancestors, at position `root_position + depth(i)`. The verifier's output at
node i is then its distribution for the token after the path root..i.

Each node keeps the *draws* that proposed its children, in the order the acceptance rule tries
them: `(token, q)` where `q` is the distribution the token was sampled from, or None for a
deterministic proposal (top-k children, prompt lookup, n-gram pools). Several draws may name the
same child (i.i.d. samples repeat); the tree stores that child once, the rule still sees every
draw, which is what keeps multi-draft rejection sampling exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ondevice.rules.accept import Draw


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])
    draws: list[list[Draw]] = field(default_factory=lambda: [[]])

    @classmethod
    def root(cls, token: int) -> TokenTree:
        return cls([int(token)])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, q: np.ndarray | None = None) -> int:
        """Record a draw of `token` after `parent` (from distribution `q`, or deterministic when
        None) and return the child's node index (an existing one if the token is already there).

        A deterministic draw repeating an earlier deterministic draw of the same token is dropped:
        the rule would always reject it (the residual has no mass left on that token) and leave
        the residual unchanged, so it carries no information.
        """
        token = int(token)
        kids = self.children[parent]
        node = kids.get(token)
        if node is None:
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.children.append({})
            self.draws.append([])
            kids[token] = node
        if q is not None or not any(t == token and d is None for t, d in self.draws[parent]):
            self.draws[parent].append((token, q))
        return node

    def add_path(self, tokens: Sequence[int], parent: int = 0) -> list[int]:
        """Add a deterministic chain of tokens below `parent`; returns its node indices."""
        nodes = []
        for t in tokens:
            parent = self.add(parent, t)
            nodes.append(parent)
        return nodes

    @property
    def size(self) -> int:
        """Proposed tokens (nodes other than the root)."""
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def ancestors(self) -> np.ndarray:
        """Boolean (N, N): [i, j] is True when j is i or an ancestor of i."""
        return ancestry(self.parents)

    def positions(self, root_position: int) -> np.ndarray:
        return root_position + np.asarray(self.depths, dtype=np.int32)

    def subtree(self, keep: Sequence[int]) -> tuple[TokenTree, list[int]]:
        """The tree restricted to `keep` (must contain every kept node's ancestors; the root is
        always kept), with draws of dropped children removed. Returns the tree and, for each new
        node, its index in this tree."""
        kept = sorted(set(keep) | {0})
        new_index = {old: new for new, old in enumerate(kept)}
        out = TokenTree.root(self.tokens[0])
        for old in kept[1:]:
            parent = new_index.get(self.parents[old])
            if parent is None:
                raise ValueError(f"subtree: node {old} is kept but its parent is not")
            out.tokens.append(self.tokens[old])
            out.parents.append(parent)
            out.depths.append(out.depths[parent] + 1)
            out.children.append({})
            out.draws.append([])
            out.children[parent][self.tokens[old]] = len(out.tokens) - 1
        for old in kept:
            node = new_index[old]
            out.draws[node] = [(t, q) for t, q in self.draws[old] if t in out.children[node]]
        return out, kept


def ancestry(parents: Sequence[int]) -> np.ndarray:
    """Boolean (N, N) of nodes given by their parents (-1: a root; parents before children):
    [i, j] is True when j is i or an ancestor of i."""
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


# -- static tree shapes ----------------------------------------------------------------------

# Rank paths: (0,) is the draft's best child of the root, (0, 1) the second-best child of that,
# and so on (for sampled trees: the i-th draw). A shape must list every prefix of its paths.
CHAIN_4 = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))


def check_shape(paths: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Validate a static tree shape (every prefix present, ranks >= 0); return it sorted by
    depth then rank, the order in which it is filled."""
    shape = {tuple(int(r) for r in p) for p in paths}
    for p in shape:
        if not p or min(p) < 0:
            raise ValueError(f"tree shape: bad path {p!r} (ranks are integers >= 0)")
        if len(p) > 1 and p[:-1] not in shape:
            raise ValueError(f"tree shape: path {p!r} is listed but its prefix {p[:-1]!r} is not")
        if p[-1] > 0 and (*p[:-1], p[-1] - 1) not in shape:
            raise ValueError(f"tree shape: path {p!r} is listed but rank {p[-1] - 1} is not")
    return sorted(shape, key=lambda p: (len(p), p))

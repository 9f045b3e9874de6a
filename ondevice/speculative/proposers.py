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

Proposers talk to engines through the `Engine` protocol; a draft engine that also has
`feed_masked(tokens, positions, visible)` and `keep(n_recent, indices)` grows trees in one pass
per level, any other engine grows them path by path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ondevice.speculative.engine import Engine
from ondevice.speculative.sampling import SamplingParams, Transform, probabilities, sample
from ondevice.speculative.tree import CHAIN_4, TokenTree, check_shape


class Proposer(Protocol):
    name: str

    def reset(self, prompt: Sequence[int]) -> None:
        """A new generation starts with `prompt` (the verifier holds prompt[:-1])."""

    def propose(self, seq: list[int], max_depth: int, rng: np.random.Generator) -> TokenTree:
        """A tree rooted at seq[-1], no deeper than `max_depth` (>= 1)."""

    def observe(
        self, seq: list[int], tree: TokenTree, path: list[int], token: int, target: np.ndarray
    ) -> None:
        """After verification: `path` (nodes) was accepted and `token` follows; `target` is the
        verifier's argmax after every node. `seq` is the sequence before this round's tokens."""


BudgetFn = Callable[[np.ndarray], int]
# (acceptance estimates of the candidate nodes, seconds of drafting spent) -> the best tokens per
# second a verifier pass over some of them can give (see `runtime/treecost.best_rate`)
RateFn = Callable[[np.ndarray, float], float]


def fixed_budget(n: int) -> BudgetFn:
    return lambda values: n


def align(logits: np.ndarray, vocab: int) -> np.ndarray:
    """Draft logits over the verifier's vocabulary (cut, or padded with -inf)."""
    v = logits.shape[-1]
    if v == vocab:
        return logits
    if v > vocab:
        return logits[..., :vocab]
    pad = np.full((*logits.shape[:-1], vocab - v), -np.inf, logits.dtype)
    return np.concatenate([logits, pad], -1)


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


# -- the draft model's cache ----------------------------------------------------------------------


class DraftState:
    """A draft engine whose cache is kept in step with the committed sequence.

    `tokens` is what the cache holds as a plain sequence; tree nodes fed for one round sit after
    it (`slots`, node ids of the current tree in cache order) until `commit` keeps the accepted
    ones. The cache never has to be rebuilt: `sync` trims to the longest common prefix with the
    committed sequence and feeds the rest.
    """

    def __init__(self, engine: Engine, vocab: int, pass_cost: Callable[[int], float] | None = None):
        self.engine = engine
        self.vocab = vocab
        self.tokens: list[int] | None = None  # None: the cache's content is unknown
        self.last: np.ndarray | None = None  # logits after tokens[-1]
        self.slots: list[int] = []
        self.tree_pass = hasattr(engine, "feed_masked") and hasattr(engine, "keep")
        # estimated seconds of draft work (from a cost profile, so it is reproducible)
        self.pass_cost = pass_cost
        self.work = 0.0

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a generation: the cache catches up on prompt[:-1] (several proposers may share
        this state; only the first reset does any work)."""
        if self.tokens is None:
            self.engine.reset()
            self.tokens, self.slots, self.last = [], [], None
        if len(prompt) > 1:
            self.sync(prompt[:-1])

    def resume(self, prefix: Sequence[int]) -> None:
        """The engine's cache already holds `prefix` (restored by the prompt cache)."""
        self.tokens, self.slots, self.last = [int(t) for t in prefix], [], None

    def _count(self, n: int) -> None:
        if self.pass_cost is not None:
            self.work += self.pass_cost(n)

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; logits (len, V) after each."""
        assert self.tokens is not None, "reset() first"
        rows = align(np.atleast_2d(self.engine.feed(list(tokens))), self.vocab)
        self._count(len(tokens))
        self.tokens.extend(int(t) for t in tokens)
        self.last = rows[-1]
        return rows

    def truncate(self, n: int) -> None:
        self._drop_slots()
        if n < len(self.tokens):
            self.engine.trim(len(self.tokens) - n)
            self.tokens = self.tokens[:n]
            self.last = None

    def sync(self, seq: Sequence[int]) -> np.ndarray:
        """Make the cache hold exactly `seq`; return the logits after seq[-1]."""
        assert self.tokens is not None, "reset() first"
        self._drop_slots()
        n = 0
        m = min(len(self.tokens), len(seq))
        while n < m and self.tokens[n] == seq[n]:
            n += 1
        if n == len(seq) == len(self.tokens) and self.last is not None:
            return self.last
        self.truncate(min(n, len(seq) - 1))
        return self.feed(seq[len(self.tokens) :])[-1]

    def _drop_slots(self) -> None:
        if self.slots:
            self.engine.trim(len(self.slots))
            self.slots = []

    def expand(self, tree: TokenTree, nodes: Sequence[int]) -> np.ndarray:
        """Logits (len(nodes), V) after each node's path. The cache must hold the tree's prefix
        (after `sync`) and every proper ancestor of `nodes` already expanded; `nodes` are fed as
        new slots (with a tree pass when the engine has one)."""
        nodes = list(nodes)
        if not self.tree_pass:
            return self._expand_by_paths(tree, nodes)
        base = len(self.tokens)  # the root, seq[-1], is the last of these
        slot_of = {node: base + i for i, node in enumerate(self.slots)}
        for i, node in enumerate(nodes):
            slot_of[node] = base + len(self.slots) + i
        total = base + len(self.slots) + len(nodes)
        visible = np.zeros((len(nodes), total), dtype=bool)
        visible[:, :base] = True
        for i, node in enumerate(nodes):
            for a in tree.path(node):
                visible[i, slot_of[a]] = True  # KeyError: an ancestor was never expanded
        positions = np.array([base - 1 + tree.depths[n] for n in nodes], dtype=np.int32)
        logits = self.engine.feed_masked([tree.tokens[n] for n in nodes], positions, visible)
        self._count(len(nodes))
        self.slots.extend(nodes)
        return align(np.atleast_2d(logits), self.vocab)

    def _expand_by_paths(self, tree: TokenTree, nodes: list[int]) -> np.ndarray:
        # An engine without tree passes (e.g. Core ML): feed each node's path, read the last
        # row, roll back. Costs depth passes per node, but any engine can grow a tree this way.
        base = len(self.tokens)
        rows = []
        for node in nodes:
            toks = tree.path_tokens(node)
            rows.append(align(self.engine.feed(toks, last_only=True), self.vocab))
            self._count(len(toks))
            self.engine.trim(self.engine.length - base)
        return np.stack(rows)

    def commit(self, tree: TokenTree, path: Sequence[int]) -> None:
        """Keep, of this round's fed slots, the ones on the accepted `path` (a prefix of it)."""
        if not self.slots:
            return
        where = {node: i for i, node in enumerate(self.slots)}
        keep = []
        for node in path:
            if node not in where:
                break
            keep.append(where[node])
        self.engine.keep(len(self.slots), keep)
        self.tokens.extend(tree.tokens[self.slots[i]] for i in keep)
        self.slots = []
        self.last = None


# -- draft-model trees -----------------------------------------------------------------------------


def top_tokens(d: np.ndarray, k: int) -> np.ndarray:
    """The k most probable tokens, best first (ties: lower id first), without sorting all."""
    if k >= len(d):
        return np.argsort(-d, kind="stable")
    part = np.argpartition(-d, k - 1)[:k]
    return part[np.lexsort((part, -d[part]))]


class DraftTreeProposer:
    """A draft model proposes a chain, a static tree, or a dynamic (EAGLE-2) tree.

    mode "dynamic": up to `depth` levels; at each level the `topk` most valuable frontier nodes
        are fed to the draft in one pass and each gets its `topk` best children. A node's value
        estimates the probability that the verifier accepts it: the product of draft
        probabilities along its path, calibrated per depth by the acceptance actually observed
        (a weak draft is overconfident). The verifier then sees the best `budget(values)` nodes
        (a node never scores above its parent, so the best N form a tree). Growth stops early
        when even an optimistic next level (each frontier node's best child as likely to be
        accepted as the node itself) would not raise the round's tokens per second, `rate`
        (values, seconds of drafting so far) -> best tokens per second over the values, after
        a draft pass of `expand_cost` seconds. Without `rate` every level is grown.
    mode "static": the tree `shape` (rank paths, see tree.py) filled with the draft's ranked
        children, or with i.i.d. draft samples when `sampled` (SpecInfer).
    mode "chain": a static shape of one path of length `budget`.

    Values (and top-k ranks) use the draft's distribution after the sampling transform, or its
    temperature-1 softmax under greedy decoding (a point mass says nothing about confidence).
    """

    def __init__(
        self,
        draft: Engine | DraftState,
        vocab: int,
        params: SamplingParams,
        *,
        mode: str = "dynamic",
        depth: int = 5,
        topk: int = 4,
        budget: BudgetFn | int = 16,
        shape: Sequence[Sequence[int]] = CHAIN_4,
        sampled: bool = False,
        expand_cost: float = 0.0,
        rate: RateFn | None = None,
        name: str = "tree",
    ):
        if mode not in ("dynamic", "static", "chain"):
            raise ValueError(f"unknown tree mode {mode!r}")
        self.name = name
        self.state = draft if isinstance(draft, DraftState) else DraftState(draft, vocab)
        self.vocab = vocab
        self.params = params
        self.transform = Transform(params, vocab)
        self._seq: list[int] = []
        self.mode = mode
        self.depth = depth
        self.topk = topk
        self.budget = fixed_budget(budget) if isinstance(budget, int) else budget
        self.shape = check_shape(shape)
        self.sampled = sampled and not params.greedy
        self.expand_cost, self.rate = expand_cost, rate
        # per depth: summed predicted acceptance of the verified nodes, and rounds that accepted
        # that deep (prior: one round of perfect calibration)
        self.predicted = np.ones(depth + 2)
        self.realised = np.ones(depth + 2)
        self._cand: TokenTree | None = None
        self._kept: list[int] = []
        self._depth_pred: np.ndarray | None = None

    def reset(self, prompt: Sequence[int]) -> None:
        self.state.reset(prompt)
        self.transform.start(prompt)

    def _dist(self, logits: np.ndarray, tree: TokenTree, node: int) -> np.ndarray:
        """The draft's distribution after `node` (its context: the sequence and node's path)."""
        tf = self.transform
        if tf.active:
            logits = tf.logits(logits, self._seq, [tree.path_tokens(node)])
        if self.params.greedy:
            return softmax(logits)
        return probabilities(logits, self.params)

    def calibration(self, depth: int) -> float:
        d = min(depth, len(self.predicted) - 1)
        return float(min(1.0, self.realised[d] / self.predicted[d]))

    def propose(self, seq: list[int], max_depth: int, rng: np.random.Generator) -> TokenTree:
        root_logits = self.state.sync(seq)
        self._seq = seq
        self._depth_pred = None
        if self.mode == "dynamic":
            cand, kept, tree = self._dynamic(seq[-1], root_logits, max_depth)
        else:
            shape = self.shape
            if self.mode == "chain":
                n = min(self.budget(np.ones(max_depth)), max_depth)
                shape = [(0,) * d for d in range(1, n + 1)]
            tree = self._static(seq[-1], root_logits, shape, max_depth, rng)
            cand, kept = tree, list(range(len(tree)))
        self._cand, self._kept = cand, kept
        return tree

    def _dynamic(
        self, root: int, root_logits: np.ndarray, max_depth: int
    ) -> tuple[TokenTree, list[int], TokenTree]:
        cand = TokenTree.root(root)
        raw = [1.0]  # product of draft probabilities along the path
        value = [1.0]  # calibrated, and never above the parent's
        dists = {0: self._dist(root_logits, cand, 0)}
        frontier = [0]
        depth = min(self.depth, max_depth)
        drafting = 0.0  # seconds of draft passes this round beyond the catch-up
        for level in range(1, depth + 1):
            grown = []
            c = self.calibration(level)
            for node in frontier:
                d = dists[node]
                for tok in top_tokens(d, self.topk):
                    if d[tok] <= 0:
                        break
                    child = cand.add(node, int(tok))
                    raw.append(raw[node] * float(d[tok]))
                    value.append(min(value[node], raw[-1] * c))
                    grown.append(child)
            if level == depth or not grown:
                break
            frontier = sorted(grown, key=lambda n: -value[n])[: self.topk]
            if self.rate is not None:
                # a child is never more likely than its parent (up to the depth's calibration)
                ratio = min(1.0, self.calibration(level + 1) / max(c, 1e-9))
                now = np.array(value[1:])
                later = np.concatenate([now, [value[n] * ratio for n in frontier]])
                if self.rate(later, drafting + self.expand_cost) <= self.rate(now, drafting):
                    break
            drafting += self.expand_cost
            for node, row in zip(frontier, self.state.expand(cand, frontier)):
                dists[node] = self._dist(row, cand, node)
        vals = np.array(value[1:])
        order = np.argsort(-vals, kind="stable") + 1  # parents precede children on ties
        # may be 0: where even the best node does not pay for its verification, this round is
        # a plain step (confident rounds still speculate, so the calibration keeps learning)
        n = max(0, min(int(self.budget(vals[order - 1])), len(order)))
        tree, kept = cand.subtree(order[:n].tolist())
        pred = np.zeros(len(self.predicted))
        for node in kept[1:]:
            pred[min(cand.depths[node], len(pred) - 1)] += raw[node]
        self._depth_pred = pred
        return cand, kept, tree

    def _static(
        self,
        root: int,
        root_logits: np.ndarray,
        shape: Sequence[tuple[int, ...]],
        max_depth: int,
        rng: np.random.Generator,
    ) -> TokenTree:
        tree = TokenTree.root(root)
        node_of: dict[tuple[int, ...], int] = {(): 0}
        dists = {0: self._dist(root_logits, tree, 0)}
        by_depth: dict[int, list[tuple[int, ...]]] = {}
        for p in shape:
            if len(p) <= max_depth:
                by_depth.setdefault(len(p), []).append(p)
        for level in sorted(by_depth):
            paths = by_depth[level]
            parents = sorted({node_of[p[:-1]] for p in paths if p[:-1] in node_of})
            missing = [n for n in parents if n not in dists]
            if missing:
                for node, row in zip(missing, self.state.expand(tree, missing)):
                    dists[node] = self._dist(row, tree, node)
            children: dict[int, list[int]] = {}  # parent node -> child node per rank
            for p in paths:
                parent = node_of.get(p[:-1])
                if parent is None:
                    continue
                kids = children.setdefault(parent, [])
                if p[-1] < len(kids):  # merged duplicates already drew this rank
                    node_of[p] = kids[p[-1]]
                    continue
                d = dists[parent]
                if self.sampled:
                    tok = sample(d, rng)
                    node = tree.add(parent, tok, d)
                else:
                    tok = int(top_tokens(d, p[-1] + 1)[p[-1]])
                    if d[tok] <= 0:
                        continue
                    node = tree.add(parent, tok)
                kids.append(node)
                node_of[p] = node
        return tree

    def observe(self, seq, tree, path, token, target) -> None:
        assert self._cand is not None
        self.state.commit(self._cand, [self._kept[n] for n in path])
        if self._depth_pred is not None:
            depths = np.arange(len(self.predicted))
            tried = self._depth_pred > 0
            self.predicted += self._depth_pred
            self.realised += tried & (depths >= 1) & (depths <= len(path))


class NoProposal:
    """Proposes nothing: each round is one plain decoding step (a candidate for `auto`, which
    should fall back to plain decoding where no proposer pays for itself)."""

    name = "plain"

    def reset(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, seq: list[int], max_depth: int, rng: np.random.Generator) -> TokenTree:
        return TokenTree.root(seq[-1])

    def observe(self, seq, tree, path, token, target) -> None:
        pass


# -- prompt lookup -------------------------------------------------------------------------------


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
                return out
        return []


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
    """Prompt lookup decoding: propose what followed earlier occurrences of the context's tail."""

    def __init__(
        self,
        *,
        min_ngram: int = 1,
        max_ngram: int = 3,
        max_tokens: int = 10,
        branches: int = 3,
        budget: BudgetFn | int | None = None,
        name: str = "pld",
    ):
        self.name = name
        self.index = NgramIndex(min_ngram, max_ngram)
        self.max_tokens = max_tokens
        self.branches = branches
        self.budget = fixed_budget(budget) if isinstance(budget, int) else budget
        self.model = AcceptanceModel()
        self._depth = 0

    def reset(self, prompt: Sequence[int]) -> None:
        self.index = NgramIndex(self.index.min_n, self.index.max_n)
        self.model = AcceptanceModel()

    def guesses(self, seq: Sequence[int], k: int) -> list[list[int]]:
        self.index.extend(seq)
        return self.index.continuations(k, self.branches)

    def propose(self, seq: list[int], max_depth: int, rng: np.random.Generator) -> TokenTree:
        k = min(self.max_tokens, max_depth)
        tree = TokenTree.root(seq[-1])
        nodes = k * self.branches
        if self.budget is not None:
            # at least one token: a budget of 0 would never learn that lookups pay off
            nodes = max(1, int(self.budget(self.model.values(nodes))))
            k = min(k, nodes)
        for cont in self.guesses(seq, k):
            room = nodes - tree.size
            if room <= 0:
                break
            tree.add_path(cont[:room])
        self._depth = tree.max_depth
        return tree

    def observe(self, seq, tree, path, token, target) -> None:
        if tree.size:
            self.model.update(self._depth, len(path))


# -- lookahead decoding ----------------------------------------------------------------------------


class Lookahead:
    """Lookahead decoding: a 2-D Jacobi window plus an n-gram pool, verified in the same pass.

    The window has `ngram - 1` rows of `window` guesses. Row 0 is a chain after the root (guesses
    for the next `window` positions); column j hangs below row-0 cell j a chain of rows 1.., so
    cell (r, j) sits at depth j + r + 1 and its verifier output predicts the position after it.
    Each column with that output is an n-gram; n-grams go into the pool keyed by their first
    token, as do the n-grams of the committed text. Pool entries starting with the last committed
    token are verified as tree branches. Then the window moves: rows shift up (and left by the
    extra tokens accepted), and the outputs of the last row become the new last row.
    """

    def __init__(
        self,
        *,
        window: int = 4,
        ngram: int = 4,
        candidates: int = 4,
        pool_size: int = 8,
        seed: int = 0,
        name: str = "lookahead",
    ):
        if window < 1 or ngram < 2:
            raise ValueError("lookahead needs window >= 1 and ngram >= 2")
        self.name = name
        self.W, self.N, self.G = window, ngram, candidates
        self.pool_size = pool_size
        self.seed = seed
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.grid: list[list[int]] = []
        self._indexed = 0
        self._cells: dict[tuple[int, int], int] = {}

    def reset(self, prompt: Sequence[int]) -> None:
        self.pool, self._indexed = {}, 0
        # Initial guesses: tokens of the prompt, chosen with a fixed seed (the paper's choice;
        # any guesses are lossless, these at least belong to the text's vocabulary).
        g = np.random.default_rng(self.seed)
        self._fill = lambda: int(prompt[int(g.integers(len(prompt)))])
        self.grid = [[self._fill() for _ in range(self.W)] for _ in range(self.N - 1)]

    def _add(self, gram: Sequence[int]) -> None:
        key, cont = int(gram[0]), tuple(int(t) for t in gram[1:])
        lst = self.pool.setdefault(key, [])
        if cont in lst:
            lst.remove(cont)
        lst.insert(0, cont)
        del lst[self.pool_size :]

    def _index(self, seq: Sequence[int]) -> None:
        for end in range(max(self._indexed, self.N), len(seq) + 1):
            self._add(seq[end - self.N : end])
        self._indexed = max(self._indexed, len(seq))

    def propose(self, seq: list[int], max_depth: int, rng: np.random.Generator) -> TokenTree:
        self._index(seq)
        tree = TokenTree.root(seq[-1])
        for cont in self.pool.get(int(seq[-1]), [])[: self.G]:
            tree.add_path(cont[:max_depth])
        self._cells = {}
        parent = 0
        for j in range(self.W):
            if j + 1 > max_depth:
                break
            parent = self._cells[0, j] = tree.add(parent, self.grid[0][j])
            below = parent
            for r in range(1, self.N - 1):
                if j + r + 1 > max_depth:
                    break
                below = self._cells[r, j] = tree.add(below, self.grid[r][j])
        return tree

    def observe(self, seq, tree, path, token, target) -> None:
        last = self.N - 2
        for j in range(self.W):
            cell = self._cells.get((last, j))
            if cell is not None:
                self._add([self.grid[r][j] for r in range(self.N - 1)] + [int(target[cell])])
        shift = len(path)  # extra tokens committed beyond one: the window slides further
        new_last = [
            int(target[self._cells[last, j]]) if (last, j) in self._cells else self._fill()
            for j in range(self.W)
        ]
        rows = self.grid[1:] + [new_last]
        self.grid = [
            row[shift:] + [self._fill() for _ in range(min(shift, self.W))] for row in rows
        ]
        self._index([*seq, *(tree.tokens[n] for n in path), token])


# -- cascade -------------------------------------------------------------------------------------


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
        self.params = params
        self.transform = Transform(params, vocab)
        self.lookup = lookup or PromptLookup(branches=1)
        self.budget = fixed_budget(budget) if isinstance(budget, int) else budget
        self.model = AcceptanceModel()
        self.draft_passes = 0
        self._k = 0

    def reset(self, prompt: Sequence[int]) -> None:
        self.state.reset(prompt)
        self.lookup.reset(prompt)
        self.transform.start(prompt)
        self.model = AcceptanceModel()

    def _feed(self, tokens: list[int]) -> np.ndarray:
        self.draft_passes += 1
        return self.state.feed(tokens)

    def _step(self, q: np.ndarray, guess: int | None, rng: np.random.Generator) -> tuple[int, bool]:
        """The draft's next token (and whether it equals the guess)."""
        if self.params.greedy:
            x = int(np.argmax(q))
            return x, x == guess
        if guess is not None:
            if rng.random() < q[guess]:
                return guess, True
            r = q.copy()
            r[guess] = 0.0
            s = r.sum()
            return sample(r / s if s > 0 else q, rng), False
        return sample(q, rng), False

    def propose(self, seq: list[int], max_depth: int, rng: np.random.Generator) -> TokenTree:
        k = max(1, min(int(self.budget(self.model.values(max_depth))), max_depth))
        # Invariant at the top of the loop: the draft's cache holds seq + drafts and `logits`
        # is its output after the last of them.
        logits = self.state.sync(seq)
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        while len(drafts) < k:
            q = self.transform.probs(logits, seq, [drafts])
            found = self.lookup.guesses([*seq, *drafts], k - len(drafts))
            if not found:
                x, _ = self._step(q, None, rng)
                drafts.append(x)
                qs.append(q)
                if len(drafts) < k:
                    logits = self._feed([x])[-1]
                continue
            guess = found[0]
            base = len(self.state.tokens)
            rows = self._feed(guess)  # row i: the draft after guess[i], in one pass
            for i, g in enumerate(guess):
                x, hit = self._step(q, g, rng)
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
                q, logits = self.transform.probs(rows[i], seq, [drafts]), rows[i]
        tree = TokenTree.root(seq[-1])
        node = 0
        for x, q in zip(drafts, qs):
            node = tree.add(node, x, None if self.params.greedy else q)
        self._k = len(drafts)
        return tree

    def observe(self, seq, tree, path, token, target) -> None:
        if self._k:
            self.model.update(self._k, len(path))

"""Draft-model trees: the draft's cache kept in step with the committed sequence (`DraftState`)
and the trees it grows (`DraftTreeProposer`: a path, a static tree, or a dynamic EAGLE-2 tree;
children are the draft's top-k, or i.i.d. samples for sampled static trees, SpecInfer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ondevice.proposers.base import (
    LONGEST_DRAFT,
    BudgetFn,
    PickFn,
    RateFn,
    Verification,
    cost_budget,
    cost_pick,
    cost_rate,
    fixed_budget,
)
from ondevice.proposers.resources import Calibrations
from ondevice.rules.chooser import TokenChooser, as_chooser
from ondevice.rules.engine import Engine
from ondevice.rules.noise import PositionNoise
from ondevice.rules.sampling import SamplingParams, align, sample
from ondevice.rules.token_tree import CHAIN_4, TokenTree, check_shape

if TYPE_CHECKING:
    from ondevice.proposers.resources import Resources, Speculation
    from ondevice.runtime.pass_costs import CostProfile


# -- the draft model's cache ----------------------------------------------------------------------


# Tokens a draft used every round catches up on at the next: the verifier's bonus token, and
# the last accepted draft when it was never fed (the deepest level is drafted, not expanded).
STEADY_CATCH_UP = 2


class DraftState:
    """A draft engine whose cache is kept in step with the committed sequence.

    `tokens` is what the cache holds as a plain sequence; tree nodes fed for one round sit after
    it (`slots`, node ids of the current tree in cache order) until `commit` keeps the accepted
    ones. The cache never has to be rebuilt: `sync` trims to the longest common prefix with the
    committed sequence and feeds the rest.
    """

    def __init__(
        self,
        engine: Engine,
        vocab: int,
        pass_cost: CostProfile | None = None,
        calibrations: Calibrations | None = None,
    ):
        self.engine = engine
        self.vocab = vocab
        self.tokens: list[int] | None = None  # None: the cache's content is unknown
        self.last: np.ndarray | None = None  # logits after tokens[-1]
        self.slots: list[int] = []
        self.tree_pass = hasattr(engine, "feed_masked") and hasattr(engine, "keep")
        # estimated seconds of draft work (from a cost profile, so it is reproducible), and the
        # part of it spent catching up on tokens committed while no proposer used the draft:
        # the price of switching to it, which a proposer drafting every round never pays
        self.pass_cost = pass_cost
        self.work = 0.0
        self.switch_work = 0.0
        self.calibrations = calibrations  # the pair's, from earlier generations (None: none)
        self._calibration: tuple[np.ndarray, np.ndarray] | None = None

    def calibration(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Per depth, the summed predicted acceptance of verified nodes and the rounds that
        accepted that deep (`Calibrations`: what earlier generations of the pair learned, or
        the prior). One pair of arrays for every proposer growing trees from this draft,
        updated in place: they all measure how far the verifier follows this draft, so auto's
        candidates learn from each other's rounds instead of each paying for its own
        optimistic first guesses. Depths beyond the arrays' length share the last entry."""
        if self._calibration is None:
            store = self.calibrations or Calibrations()
            self._calibration = store.get("draft", max(size, 18))
        return self._calibration

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

    def _count(self, n: int, branched: bool = False) -> None:
        if self.pass_cost is not None:
            self.work += self.pass_cost.branched(n) if branched else self.pass_cost(n)

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
        behind = len(seq) - len(self.tokens)
        if behind > STEADY_CATCH_UP and self.pass_cost is not None:
            self.switch_work += self.pass_cost(behind) - self.pass_cost(STEADY_CATCH_UP)
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
        self._count(len(nodes), branched=len(nodes) > 1)  # several nodes: each its own path
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
    """A draft model proposes a path, a static tree, or a dynamic (EAGLE-2) tree.

    mode "dynamic": up to `depth` levels; at each level the `topk` most valuable frontier nodes
        are fed to the draft in one pass and each gets its `topk` best children. A node's value
        estimates the probability that the verifier accepts it: the product of draft
        probabilities along its path, calibrated per depth by the acceptance actually observed
        (a weak draft is overconfident). The verifier then sees the best `budget(values)` nodes
        (a node never scores above its parent, so the best N form a tree). Growth stops early
        when no optimistic guess of the next levels (`_frontier_size`) would raise the round's
        tokens per second, `rate`(values, seconds of drafting so far) -> best tokens per second
        over the values, each level costing a draft pass of `expand_cost` seconds. Without
        `rate` every level is grown. Where `expand_cost` is a function of the number of nodes
        a pass expands (a draft model's pass over 4 tokens costs more than over 1 on a CPU),
        each level expands only as many of the frontier's best nodes as pay: where the draft
        is sure, one, and the tree grows as deep as a chain.
    mode "static": the tree `shape` (rank paths, see tree.py) filled with the draft's ranked
        children, or with i.i.d. draft samples when `sampled` (SpecInfer).
    mode "path": a static shape of one path of length `budget`.

    Values (and top-k ranks) use the draft's distribution after the sampling transform, or its
    temperature-1 softmax under greedy decoding (a point mass says nothing about confidence).
    """

    def __init__(
        self,
        draft: Engine | DraftState,
        vocab: int,
        params: SamplingParams | TokenChooser,
        *,
        mode: str = "dynamic",
        depth: int = 5,
        topk: int = 4,
        budget: BudgetFn | int = 16,
        shape: Sequence[Sequence[int]] = CHAIN_4,
        sampled: bool = False,
        expand_cost: float | Callable[[int], float] = 0.0,
        rate: RateFn | None = None,
        pick: PickFn | None = None,
        name: str = "tree",
    ):
        if mode not in ("dynamic", "static", "path"):
            raise ValueError(f"unknown tree mode {mode!r}")
        self.name = name
        # a DraftState, or another draft with its interface (sync, expand, commit: Medusa's
        # sequential heads); a bare engine gets a DraftState
        self.state = draft if hasattr(draft, "expand") else DraftState(draft, vocab)
        self.vocab = vocab
        self.chooser = as_chooser(params, vocab)
        self.params = self.chooser.params
        self._seq: list[int] = []
        self.mode = mode
        self.depth = depth
        self.topk = topk
        self.budget = fixed_budget(budget) if isinstance(budget, int) else budget
        self.shape = check_shape(shape)
        self.sampled = sampled and not self.params.greedy
        # seconds of a draft pass expanding n nodes; a constant: every frontier node is expanded
        self.expand_cost = expand_cost if callable(expand_cost) else (lambda n: expand_cost)
        self._sized = callable(expand_cost)  # whether fewer nodes may cost less
        self.rate = rate
        self.pick = pick  # dynamic mode: chooses the nodes to verify in `budget`'s place
        # how well the draft's probabilities predict acceptance, per depth (shared: see there)
        self.predicted, self.realised = self.state.calibration(depth + 2)
        self._cand: TokenTree | None = None
        self._kept: list[int] = []
        self._depth_pred: np.ndarray | None = None
        # the tokens the last proposed round is expected to give by the calibrated values (one
        # plus the summed acceptance estimates of the tree's nodes); None: no estimate (static
        # and path modes)
        self.expected: float | None = None

    def reset(self, prompt: Sequence[int]) -> None:
        self.state.reset(prompt)
        self.chooser.start(prompt)

    def _dist(self, logits: np.ndarray, tree: TokenTree, node: int) -> np.ndarray:
        """The draft's distribution after `node` (its context: the sequence and node's path)."""
        return self.chooser.ranking(logits, self._seq, tree.path_tokens(node))

    def calibration(self, depth: int) -> float:
        """How far the verifier follows the draft's probabilities at `depth`: above 1 where it
        takes more than they promise (an unsure draft, the verifier with a layer skipped; a
        node's value still never exceeds its parent's, so it stays at most 1)."""
        d = min(depth, len(self.predicted) - 1)
        return float(self.realised[d] / self.predicted[d])

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        root_logits = self.state.sync(seq)
        self._seq = seq
        self._depth_pred, self.expected = None, None
        if self.mode == "dynamic":
            cand, kept, tree = self._dynamic(seq[-1], root_logits, max_depth)
        else:
            shape = self.shape
            if self.mode == "path":
                n = min(self.budget(np.ones(max_depth)), max_depth)
                shape = [(0,) * d for d in range(1, n + 1)]
            tree = self._static(seq[-1], root_logits, shape, max_depth, noise)
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
                size = self._frontier_size(cand, raw, value, frontier, depth - level, drafting)
                if not size:
                    break
                frontier = frontier[:size]
            drafting += self.expand_cost(len(frontier))
            for node, row in zip(frontier, self.state.expand(cand, frontier)):
                dists[node] = self._dist(row, cand, node)
        vals = np.array(value[1:])
        order = np.argsort(-vals, kind="stable") + 1  # parents precede children on ties
        # may be none: where even the best node does not pay for its verification, this round
        # is a plain step (confident rounds still speculate, so the calibration keeps learning)
        if self.pick is not None:
            chosen = self.pick(cand, vals, order)
        else:
            chosen = order[: max(0, min(int(self.budget(vals[order - 1])), len(order)))]
        tree, kept = cand.subtree(chosen.tolist())
        self.expected = 1.0 + float(vals[chosen - 1].sum())
        pred = np.zeros(len(self.predicted))
        for node in kept[1:]:
            pred[min(cand.depths[node], len(pred) - 1)] += raw[node]
        self._depth_pred = pred
        return cand, kept, tree

    def _frontier_size(
        self,
        cand: TokenTree,
        raw: list[float],
        value: list[float],
        frontier: list[int],
        levels_left: int,
        drafting: float,
    ) -> int:
        """How many of the frontier's best nodes the next level expands: the number whose guess
        of the next levels raises the round's tokens per second most, 0 where none raises it
        (the tree stops growing).

        It looks up to `levels_left` levels ahead, not one: on a CPU a verifier pass can cost
        much more at 3 tokens than at 2 and hardly more up to 8, so one more level may not pay
        where several do. The guess is optimistic: below each expanded node a chain whose
        acceptance falls per level as it fell from the node's parent to the node. Where a
        pass's cost depends on how many nodes it expands, the sizes are weighed against each
        other: a confident draft's runner-up nodes are worth less than the larger pass costs
        (the chain's depth then), an unsure draft's are worth it. Otherwise every frontier
        node is expanded where any growth pays."""
        assert self.rate is not None
        now = np.array(value[1:])
        best, size = self.rate(now, drafting), 0
        decay = [min(1.0, raw[n] / max(raw[cand.parents[n]], 1e-12)) for n in frontier]
        for k in range(1, len(frontier) + 1) if self._sized else [len(frontier)]:
            cost, guess = self.expand_cost(k), []
            for j in range(1, levels_left + 1):
                guess += [value[n] * q**j for n, q in zip(frontier[:k], decay[:k])]
                rate = self.rate(np.concatenate([now, guess]), drafting + j * cost)
                if rate > best:
                    best, size = rate, k
                    if not self._sized:
                        return size
        return size

    def _static(
        self,
        root: int,
        root_logits: np.ndarray,
        shape: Sequence[tuple[int, ...]],
        max_depth: int,
        noise: PositionNoise,
    ) -> TokenTree:
        tree = TokenTree.root(root)
        draws: dict[int, np.random.Generator] = {}  # per parent: its children's position's draws
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
                    if parent not in draws:
                        draws[parent] = noise.draws(len(self._seq) + tree.depths[parent])
                    tok = sample(d, draws[parent])
                    node = tree.add(parent, tok, d)
                else:
                    tok = int(top_tokens(d, p[-1] + 1)[p[-1]])
                    if d[tok] <= 0:
                        continue
                    node = tree.add(parent, tok)
                kids.append(node)
                node_of[p] = node
        return tree

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        path = verdict.path
        assert self._cand is not None
        self.state.commit(self._cand, [self._kept[n] for n in path])
        if self._depth_pred is not None:
            depths = np.arange(len(self.predicted))
            tried = self._depth_pred > 0
            self.predicted += self._depth_pred
            self.realised += tried & (depths >= 1) & (depths <= len(path))


# -- builders: the tuning of each use, kept with the proposer -------------------------------------


def build_tree(res: Resources, spec: Speculation) -> DraftTreeProposer:
    """The "tree" method: a dynamic tree of the draft's top-4 expansions, num_draft_tokens deep
    (default `LONGEST_DRAFT`: the costs stop it sooner), sized by the verifier's pass costs,
    each level expanding as many nodes as pay for the draft's pass over them; or, with
    tree_mode "sampled", a static tree of i.i.d. draft samples (a chain num_draft_tokens deep,
    default 6, plus four side branches)."""
    topk = 4
    if spec.tree_mode == "sampled":
        depth = spec.num_draft_tokens or 6
        shape = [(0,) * d for d in range(1, depth + 1)] + [(1,), (2,), (0, 1), (1, 0)]
        return DraftTreeProposer(
            res.draft, res.vocab, res.chooser, mode="static", shape=shape, sampled=True
        )
    fixed = res.draft_pass(1)  # the draft catching up: once per round
    return DraftTreeProposer(
        res.draft, res.vocab, res.chooser, mode="dynamic",
        depth=spec.num_draft_tokens or LONGEST_DRAFT, topk=topk,
        budget=cost_budget(res.verify_cost, fixed), expand_cost=res.draft_expand,
        rate=cost_rate(res.verify_cost, fixed),
        pick=cost_pick(res.verify_cost, fixed) if res.verify_cost is not None else None,
    )  # fmt: skip

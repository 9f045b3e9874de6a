"""Proposers and cost profiles: prompt lookup, lookahead's window and pool, the draft cache
bookkeeping, the cascade's draft chain, auto selection, and the per-device cost profile."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from support.engines import TableEngine, TreeTableEngine
from support.enumeration import law

from ondevice.proposers import auto as auto_mod
from ondevice.proposers.auto import AutoProposer
from ondevice.proposers.base import NoProposal, Verification, cost_budget
from ondevice.proposers.cascade import CascadeProposer
from ondevice.proposers.draft_tree import DraftState, DraftTreeProposer
from ondevice.proposers.lookahead import Lookahead
from ondevice.proposers.lookup import AcceptanceModel, NgramIndex, PromptLookup
from ondevice.rules.noise import PositionNoise
from ondevice.rules.sampling import SamplingParams
from ondevice.rules.token_tree import TokenTree
from ondevice.runtime.pass_costs import CostProfile, best_size, engine_key, load_profile

V = 12


# -- prompt lookup --------------------------------------------------------------------------------


def test_ngram_index_prefers_longest_and_most_recent_matches():
    idx = NgramIndex(1, 3)
    idx.extend([1, 2, 3, 9, 1, 2, 3, 8, 4, 2, 3])
    # suffix (2, 3) ... longest earlier match is the 3-gram (4, 2, 3)? no: only (2, 3) recurs
    assert idx.continuations(2, 5) == [[8, 4], [9, 1]]
    idx.extend([1, 2, 3, 9, 1, 2, 3, 8, 4, 2, 3, 8])  # (3, 8) occurred once before
    assert idx.continuations(3, 5) == [[4, 2, 3]]
    assert idx.continuations(3, 1) == [[4, 2, 3]]
    idx.extend([7, 7])  # not an extension: re-indexed from scratch
    assert idx.seq == [7, 7] and idx.continuations(3, 5) == [[7]]
    idx.extend([7, 7, 6])
    assert idx.continuations(3, 5) == []


def test_prompt_lookup_builds_a_tree_of_continuations_within_budget():
    pld = PromptLookup(max_tokens=4, branches=3)
    pld.reset([])
    seq = [1, 2, 3, 9, 1, 2, 3, 8, 4, 2, 3]
    tree = pld.propose(seq, 10, PositionNoise(0))
    assert tree.tokens[0] == 3
    paths = sorted(tree.path_tokens(n) for n in range(len(tree)) if not tree.children[n])
    assert paths == [[8, 4, 2, 3], [9, 1, 2, 3]]
    assert all(q is None for d in tree.draws for _, q in d)  # deterministic proposals
    assert pld.propose(seq, 2, PositionNoise(0)).max_depth == 2
    capped = PromptLookup(max_tokens=4, branches=3, budget=3)
    capped.reset([])
    assert capped.propose(seq, 10, PositionNoise(0)).size == 3
    assert pld.propose([1, 2, 5], 10, PositionNoise(0)).size == 0  # nothing to copy


def test_acceptance_model():
    m = AcceptanceModel()
    assert m.rate == 0.5
    m.update(4, 4)  # all accepted: no rejection observed
    m.update(4, 1)
    assert m.rate == pytest.approx((1 + 5) / (1 + 5 + 1 + 1))
    np.testing.assert_allclose(m.values(3), m.rate ** np.arange(1, 4))


# -- lookahead ----------------------------------------------------------------------------------


def test_lookahead_window_layout_pool_and_update():
    la = Lookahead(window=3, ngram=3, candidates=2, seed=0)
    prompt = [4, 5, 6, 4, 5, 7]
    la.reset(prompt)
    la.grid = [[1, 2, 3], [10, 11, 9]]
    seq = [*prompt, 4]
    tree = la.propose(seq, 10, PositionNoise(0))
    # candidates from the pool: 3-grams of the text starting with 4 -> (5, 7), (5, 6)
    assert tree.path_tokens(tree.children[0][5]) == [5]
    assert sorted(tree.children[tree.children[0][5]]) == [6, 7]
    # window: row 0 is a chain after the root, column j hangs below cell (0, j)
    cells = la._cells
    assert [tree.tokens[cells[0, j]] for j in range(3)] == [1, 2, 3]
    assert tree.path_tokens(cells[1, 2]) == [1, 2, 3, 9]
    assert all(tree.depths[cells[r, j]] == j + r + 1 for r, j in cells)
    target = np.zeros(len(tree), int)
    for (r, j), node in cells.items():
        target[node] = 20 + 10 * r + j  # the verifier's argmax after each cell
    # accept nothing; the verifier's token after the root is 5
    la.observe(seq, tree, Verification([], 5, target))
    assert (1, 10, 30) in [(k, *v) for k, vs in la.pool.items() for v in vs]  # column 0 n-gram
    assert la.grid[0] == [10, 11, 9] and la.grid[1] == [30, 31, 32]
    # accepting two tokens shifts the window left by one more
    la.grid = [[1, 2, 3], [10, 11, 9]]
    tree = la.propose(seq, 10, PositionNoise(0))
    a = la._cells[0, 0]
    target = np.zeros(len(tree), int)
    for (r, j), node in la._cells.items():
        target[node] = 20 + 10 * r + j
    la.observe(seq, tree, Verification([a], 5, target))
    assert la.grid[0][:2] == [11, 9] and la.grid[1][:2] == [31, 32]
    # depth limit: nothing deeper than max_depth
    assert la.propose([*seq, 1, 5], 2, PositionNoise(0)).max_depth <= 2


# -- the draft cache --------------------------------------------------------------------------------


def test_draft_state_reuses_the_common_prefix():
    eng = TableEngine.cycle()
    st = DraftState(eng, V)
    st.reset([1, 2, 3, 4])
    assert eng.tokens == [1, 2, 3] and eng.fed == 3
    st.sync([1, 2, 3, 4])
    assert eng.tokens == [1, 2, 3, 4] and eng.fed == 4
    before = eng.fed
    np.testing.assert_array_equal(st.sync([1, 2, 3, 4]), eng.row([4]))  # cached, no pass
    assert eng.fed == before
    st.sync([1, 2, 9, 9, 9])  # diverges after two tokens: trims and feeds only the rest
    assert eng.tokens == [1, 2, 9, 9, 9] and eng.fed == before + 3
    st.sync([1, 2, 9])  # a prefix: re-feeds the last token for its logits
    assert eng.tokens == [1, 2, 9] and eng.fed == before + 4
    st.reset([1, 2, 9, 7])  # a second reset (another proposer sharing it) costs nothing new
    assert eng.tokens == [1, 2, 9]


def test_static_and_chain_trees_from_the_draft():
    eng = TableEngine.cycle()
    prop = DraftTreeProposer(
        eng, V, SamplingParams(), mode="static", shape=[(0,), (1,), (0, 0), (0, 0, 0)]
    )
    prop.reset([5, 6])
    tree = prop.propose([5, 6], 5, PositionNoise(0))
    # after 6 the draft ranks 7 first and 9 second; then 8, then 5
    assert tree.path_tokens(len(tree) - 1) == [7, 8, 5] and 9 in tree.children[0]
    chain = DraftTreeProposer(eng, V, SamplingParams(), mode="path", budget=3)
    chain.reset([5, 6])
    assert chain.propose([5, 6], 5, PositionNoise(0)).path_tokens(3) == [7, 8, 5]
    assert chain.propose([5, 6], 2, PositionNoise(0)).size == 2  # depth cap


def test_dynamic_tree_keeps_the_most_probable_nodes():
    eng = TreeTableEngine.cycle()
    prop = DraftTreeProposer(eng, V, SamplingParams(), mode="dynamic", depth=3, topk=2, budget=4)
    prop.reset([5, 6])
    tree = prop.propose([5, 6], 5, PositionNoise(0))
    assert tree.size == 4
    # the greedy chain of the draft is the most probable path, so it is kept whole
    assert tree.path_tokens(tree.children[tree.children[tree.children[0][7]][8]][5]) == [7, 8, 5]
    # every kept node's ancestors are kept (subtree), and the draft cache commits the path
    assert tree.path_tokens(3) == [7, 8]
    prop.observe([5, 6], tree, Verification(tree.path(3), 0, np.zeros(len(tree), int)))
    assert prop.state.tokens == eng.tokens == [5, 6, 7, 8]  # only the accepted path stays cached


def test_dynamic_tree_grows_only_as_deep_as_the_costs_pay():
    """A confident chain: where every token adds to the verifier pass (a steep CPU profile) the
    draft is not asked for levels the pass could not afford to check; where a pass over 3 to 8
    tokens costs about the same but far more than over 2 (MKL on 2 cores), one more level does
    not pay but several do, so it grows deep; on a flat, GPU-like profile too."""
    from ondevice.proposers.base import cost_rate as _rate

    steep = CostProfile([1, 2, 3, 4], [0.26, 0.28, 0.39, 0.49])
    step = CostProfile([1, 2, 3, 8], [0.198, 0.272, 0.46, 0.516])  # the 1.5B verifier, MKL
    flat = CostProfile([1, 64], [0.26, 0.27])
    grown = {}
    for name, prof in (("steep", steep), ("step", step), ("flat", flat)):
        eng = TreeTableEngine.cycle(sharp=12.0)  # the draft is sure of the cycle
        prop = DraftTreeProposer(
            eng, V, SamplingParams(), mode="dynamic", depth=6, topk=1,
            budget=lambda v, p=prof: best_size(v, p, 0.084), expand_cost=0.084,
            rate=_rate(prof, 0.084),
        )  # fmt: skip
        prop.reset([5, 6])
        passes = eng.passes
        tree = prop.propose([5, 6], 8, PositionNoise(0))
        grown[name] = (eng.passes - passes, tree.size)
    # (draft passes, drafts verified): steep: the catch-up pass only and one draft; step and
    # flat: the catch-up and five expansions, six drafts
    assert grown == {"steep": (1, 1), "step": (6, 6), "flat": (6, 6)}


class _PassSizes(TreeTableEngine):
    """Records how many tokens each tree pass feeds (a dynamic tree's expansions)."""

    def feed_masked(self, tokens, *args, **kwargs):
        self.sizes.append(len(tokens))
        return super().feed_masked(tokens, *args, **kwargs)


def test_a_dynamic_tree_expands_only_the_nodes_worth_a_larger_draft_pass():
    """On a CPU a draft's pass over 4 tokens costs more than over 1 (the 0.5B int8 draft: 30 /
    38 ms). Where the draft is sure, its runner-up nodes are not worth the larger pass: each
    level expands one node and the tree grows as deep as a chain, where expanding all four at
    the four-token price stopped it at depth 5 (held-out coding: the tree made 3.56 tokens a
    pass to the chain's 4.92, docs/benchmarks.md, "session 14"). Where the draft is torn
    between two tokens, both are expanded, and not the two nodes it has no hope for. A cost
    that does not depend on the number of nodes (Medusa's heads) expands them all, as before."""
    from ondevice.proposers.base import cost_rate

    verify = CostProfile([1, 8, 16, 64], [0.172, 0.192, 0.26, 1.29])  # 1.5B, oneDNN bf16
    draft = CostProfile([1, 2, 4], [0.030, 0.034, 0.038])

    def grow(eng, expand):
        prop = DraftTreeProposer(
            eng, V, SamplingParams(), mode="dynamic", depth=12, topk=4,
            budget=cost_budget(verify, 0.030), expand_cost=expand, rate=cost_rate(verify, 0.030),
        )  # fmt: skip
        prop.reset([5, 6])
        eng.sizes = []
        tree = prop.propose([5, 6], 20, PositionNoise(0))
        return eng.sizes, max(tree.depths)

    def torn():  # after any token t, t+1 and t+5 equally likely
        rows = np.zeros((V, V), np.float32)
        rows[np.arange(V), (np.arange(V) + 1) % V] = rows[np.arange(V), (np.arange(V) + 5) % V] = 8
        return _PassSizes(table=np.broadcast_to(rows, (V, V, V)))

    sized = lambda n: float(draft(n))  # noqa: E731
    assert grow(_PassSizes.cycle(sharp=12.0), sized) == ([1] * 11, 12)
    assert grow(_PassSizes.cycle(sharp=12.0), float(draft(4))) == ([4] * 4, 5)
    assert grow(torn(), sized) == ([2], 2)
    assert grow(torn(), float(draft(4))) == ([4], 2)


# -- cascade -----------------------------------------------------------------------------------------


def _draft_greedy(prompt, n):
    eng = TableEngine.cycle()
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(eng.feed(seq[-1:], last_only=True))))
    return seq[len(prompt) :]


def test_cascade_greedy_chain_is_the_drafts_own_and_lookup_saves_passes():
    eng = TableEngine.cycle()
    prompt = [5, 6, 7, 8, 5, 6]  # the text already shows the cycle: lookups are right
    casc = CascadeProposer(eng, V, SamplingParams(), budget=6)
    casc.reset(prompt)
    passes = eng.passes
    tree = casc.propose(prompt, 6, PositionNoise(0))
    assert tree.path_tokens(len(tree) - 1) == _draft_greedy(prompt, 6)
    assert eng.passes - passes == 3  # sync + two guessed blocks, instead of sync + 5 steps
    # lookup guesses that are wrong cost passes but do not change the chain
    wrong = [5, 6, 9, 2, 5, 6]
    casc.reset(wrong)
    assert casc.propose(wrong, 5, PositionNoise(0)).path_tokens(5) == _draft_greedy(wrong, 5)


def test_cascade_draft_step_samples_exactly_the_draft():
    """The draft-side rule (accept the lookup's guess g with q(g), else sample q without g)
    emits exactly q, for every guess."""
    q = np.array([0.1, 0.5, 0.15, 0.25])
    casc = CascadeProposer(TableEngine.cycle(), 4, SamplingParams(1.0))
    for g in (None, 0, 1, 3):
        emitted = Counter()
        for (x, _), pr in law(lambda r, g=g: casc._step(q, g, r)).items():
            emitted[x] += pr
        np.testing.assert_allclose([emitted[i] for i in range(4)], q, atol=1e-12)


# -- auto ---------------------------------------------------------------------------------------------


class _Fixed:
    """A proposer that proposes a chain of n tokens of which the first `good` are right."""

    def __init__(self, name, n, good):
        self.name, self.n, self.good = name, n, good
        self.calls = 0

    def reset(self, prompt):
        pass

    def propose(self, seq, max_depth, noise):
        self.calls += 1
        t = TokenTree.root(seq[-1])
        t.add_path(range(self.n))
        return t

    def observe(self, seq, tree, verdict):
        pass


def _drive(auto, rounds):
    seq = [1]
    for _ in range(rounds):
        tree = auto.propose(seq, 10, PositionNoise(0))
        current = next(p for p in auto.proposers if p.name == auto.last_name)
        good = getattr(current, "good", 0)
        path = tree.path(good) if good else []
        auto.observe(seq, tree, Verification(path, 0, np.zeros(len(tree), int)))


def test_auto_settles_on_the_best_tokens_per_second():
    cost = CostProfile([1, 8, 64], [1.0, 2.0, 16.0])
    cheap_good = _Fixed("pld", 4, 3)  # 4 tokens per pass at cost(5) = 1.57
    big_bad = _Fixed("tree", 30, 1)  # 2 tokens per pass at cost(31) ~ 6
    auto = AutoProposer([big_bad, cheap_good], cost, explore=2, period=10)
    auto.reset([1])
    _drive(auto, 60)
    # tried, then re-checked as far as the tries' budget allows (a try of it loses a lot)
    assert cheap_good.calls > 50 and 1 <= big_bad.calls <= 8
    assert auto.score(1) > auto.score(0)


class _Branched(_Fixed):
    """`_Fixed`'s chain, its last node moved to a second branch below the first."""

    def propose(self, seq, max_depth, noise):
        t = super().propose(seq, max_depth, noise)
        branched = TokenTree.root(seq[-1])
        branched.add_path(range(self.n - 1))
        branched.add(1, self.n)
        assert len(branched) == len(t)
        return branched


def test_auto_prices_a_branched_tree_above_a_chain_of_its_size():
    """A tree pass whose rows branch costs more than a causal pass over as many tokens (the
    profile measures both, `CostProfile.branched`); priced alike, auto kept trees where a chain
    of the same size and yield was faster by the clock (docs/benchmarks.md, "Session 31")."""
    cost = CostProfile([1, 4, 8], [1.0, 1.2, 1.4], tree_sizes=[4, 8], tree_seconds=[1.5, 1.9])
    assert cost.branched(1) == cost(1) and cost.branched(8) == pytest.approx(1.9)
    assert cost(7) < cost.branched(7) < cost.branched(8)
    chain, tree = _Fixed("chain", 6, 3), _Branched("tree", 6, 3)  # 4 tokens a round each
    auto = AutoProposer([tree, chain], cost, explore=2, period=10)
    auto.reset([1])
    _drive(auto, 60)
    assert chain.calls > 2 * tree.calls  # the tree: explored, then only re-checked
    assert auto.seconds[0] == pytest.approx(cost.branched(7))
    assert auto.seconds[1] == pytest.approx(cost(7))
    # where the profile measured no excess, the two tie and the first tried keeps its rounds
    flat = CostProfile([1, 4, 8], [1.0, 1.2, 1.4], tree_sizes=[4, 8], tree_seconds=[1.2, 1.4])
    chain, tree = _Fixed("chain", 6, 3), _Branched("tree", 6, 3)
    auto = AutoProposer([tree, chain], flat, explore=2, period=10)
    auto.reset([1])
    _drive(auto, 60)
    assert tree.calls > 2 * chain.calls


def _grown(path_values, side_values):
    """A grown tree: a path of nodes with `path_values`, and below its first node a side node
    per `side_values` (values by node - 1, nodes best first, as a dynamic tree orders them)."""
    tree = TokenTree.root(0)
    nodes = tree.add_path(range(1, len(path_values) + 1))
    for k, _ in enumerate(side_values):
        tree.add(nodes[0] if k % 2 else 0, 50 + k)
    values = np.array([*path_values, *side_values])
    order = np.argsort(-values, kind="stable") + 1
    return tree, values, order


def test_a_tree_keeps_side_nodes_only_where_they_pay_for_a_branched_pass():
    """`cost_pick`: the best nodes priced as a branched pass, or the greedy path priced as a
    causal one, whichever gives more tokens per second."""
    from ondevice.proposers.base import cost_pick

    tree, values, order = _grown([0.9, 0.8, 0.7, 0.6], [0.3, 0.3])
    flat = CostProfile([1, 4, 8], [1.0, 1.02, 1.05], tree_sizes=[4, 8], tree_seconds=[1.02, 1.05])
    dear = CostProfile([1, 4, 8], [1.0, 1.02, 1.05], tree_sizes=[4, 8], tree_seconds=[1.3, 1.4])
    chosen = cost_pick(flat)(tree, values, order).tolist()
    assert sorted(chosen) == [1, 2, 3, 4, 5, 6]  # the side nodes pay where branching is free
    assert cost_pick(dear)(tree, values, order).tolist() == [1, 2, 3, 4]  # the path alone
    # a side node worth more than the branched pass's excess is kept even so
    tree, values, order = _grown([0.9, 0.5, 0.2], [0.85])
    assert sorted(cost_pick(dear)(tree, values, order).tolist()) == [1, 2, 3, 4]
    # nothing pays: a plain step
    steep = CostProfile([1, 2], [1.0, 2.0], tree_sizes=[4], tree_seconds=[5.0])
    assert cost_pick(steep)(*_grown([0.1, 0.05], [0.05])).tolist() == []


def test_auto_falls_back_to_plain_steps_when_nothing_pays():
    steep = CostProfile([1, 2], [1.0, 2.0])  # every verified token costs a full pass
    weak = _Fixed("tree", 6, 1)  # 2 tokens per pass at cost 7
    auto = AutoProposer([NoProposal(), weak], steep, explore=2, period=10)
    auto.reset([1])
    _drive(auto, 40)
    assert auto.score(0) == pytest.approx(1.0) and auto.score(1) < 0.5
    assert weak.calls <= 6  # explored twice, re-checked every 10 rounds


def test_auto_rechecks_a_loser_less_often_each_time_it_loses_again():
    """A candidate that keeps losing is re-checked after 10, 20, 40, 80, 80... rounds of the
    others, not after every 10: over 400 rounds that is 7 re-checks instead of 38 (with the
    tries' budget out of the way: `explore_share`)."""
    steep = CostProfile([1, 2], [1.0, 2.0])
    weak = _Fixed("tree", 6, 1)
    auto = AutoProposer(
        [NoProposal(), weak], steep, explore=2, period=10, max_backoff=8, explore_share=np.inf
    )
    auto.reset([1])
    picks = []
    for _ in range(400):
        _drive(auto, 1)
        picks.append(auto.last_name)
    rechecks = [r for r, name in enumerate(picks) if name == "tree"][2:]
    assert len(rechecks) == 7
    gaps = np.diff(rechecks) - 1  # rounds of the others in between
    assert list(gaps[:3]) == [20, 40, 80] and set(gaps[3:]) == {80}  # doubling, capped


def test_auto_takes_up_a_loser_again_as_soon_as_a_recheck_wins():
    """The text changes (say, a passage to copy appears): the re-check that finds the candidate
    winning makes it the choice, and its wait is back to `period`."""
    steep = CostProfile([1, 2, 8], [1.0, 2.0, 2.5])
    later = _Fixed("pld", 6, 0)  # useless at first
    auto = AutoProposer(
        [NoProposal(), later], steep, explore=1, period=10, max_backoff=8, explore_share=np.inf
    )
    auto.reset([1])
    _drive(auto, 200)
    calls = later.calls
    assert calls <= 8 and auto.wait[1] == 80
    later.good = 6  # now it copies whole passages: 7 tokens for 2.5 s against 1 for 1 s
    _drive(auto, 100)
    assert later.calls - calls >= 100 - 80 - 1  # found within one wait, then kept
    assert auto.wait[1] == 10 and auto.score(1) > auto.score(0)


def _short_answer(auto, cost, total=48):
    """Tokens per second (by the cost profile) of a generation of `total` tokens, each round's
    accepted count scripted by the chosen candidate (`_Fixed.good`)."""
    done, secs, seq = 0, 0.0, [1]
    auto.reset(seq)
    while done < total:
        tree = auto.propose(seq, total - done - 1, PositionNoise(0))
        good = min(getattr(auto.proposers[auto._current], "good", 0), len(tree) - 1)
        path = tree.path(good) if good else []
        auto.observe(seq, tree, Verification(path, 0, np.zeros(len(tree), int)))
        done, secs = done + len(path) + 1, secs + float(cost(len(tree)))
    return min(done, total) / secs


@pytest.mark.parametrize(
    "cost",
    [
        CostProfile([1, 2, 3, 8], [0.198, 0.272, 0.46, 0.516]),  # steep: MKL's products
        CostProfile([1, 8, 16], [1.0, 1.15, 1.35]),  # flat: the oneDNN kernel's
    ],
)
@pytest.mark.parametrize("copy", [False, True])
def test_auto_loses_at_most_3_percent_to_the_best_candidate_on_a_short_answer(cost, copy):
    """Issue 26 item 4: a 48-token answer where plain steps are best (prompt lookup finds
    nothing, lookahead's and a self-draft's guesses are always wrong), or where prompt lookup
    copies 6 tokens a round. Exploring every candidate twice and re-checking losers lost 12%
    and 33% there (steep costs): each try was a round slower than the best's."""

    def candidates():
        pld = _Fixed("pld", 6, 6) if copy else _Fixed("pld", 0, 0)
        return [NoProposal(), pld, _Fixed("lookahead", 2, 0), _Fixed("self", 2, 0)]

    best = max(_short_answer(AutoProposer([p], cost), cost) for p in candidates())
    assert _short_answer(AutoProposer(candidates(), cost), cost) >= 0.97 * best
    # a long answer affords tries: the 256-token answer loses less than 3% too
    best = max(_short_answer(AutoProposer([p], cost), cost, 256) for p in candidates())
    assert _short_answer(AutoProposer(candidates(), cost), cost, 256) >= 0.97 * best


class _Sometimes(_Fixed):
    """Prompt lookup on text with a few passages to copy: every 4th round it proposes n tokens
    and all are right; otherwise it finds no match and proposes nothing (a plain step)."""

    def propose(self, seq, max_depth, noise):
        self.good = self.n if (self.calls + 1) % 4 == 0 else 0
        tree = super().propose(seq, max_depth, noise)
        return tree if self.good else TokenTree.root(seq[-1])


def test_auto_keeps_a_candidate_that_finds_nothing_at_times_over_plain_steps():
    """Rounds where prompt lookup finds no match cost a plain step's pass and score exactly as
    much: the tie goes to prompt lookup, which copies when a passage comes (the old rule took
    plain steps on the tie and re-checked prompt lookup every 16 rounds: 0.69x of it)."""
    cost = CostProfile([1, 2, 3, 8], [0.198, 0.272, 0.46, 0.516])
    alone = _short_answer(AutoProposer([_Sometimes("pld", 3, 0)], cost), cost)
    both = _short_answer(AutoProposer([NoProposal(), _Sometimes("pld", 3, 0)], cost), cost)
    assert both == pytest.approx(alone)


class _Unlucky(_Fixed):
    """A draft's tree on a text it suits, whose first round of each answer finds nothing."""

    def reset(self, prompt):
        self.first = True

    def propose(self, seq, max_depth, noise):
        self.good, self.first = (0 if self.first else 3), False
        return super().propose(seq, max_depth, noise)


def test_auto_starts_an_answer_from_what_earlier_answers_learnt():
    """Alone, the first unlucky round spends the tries' budget and plain steps take the rest of
    the answer (Spec-Bench humanities 156: 95 plain rounds of 96). With the pair's memory the
    tree's earlier score outweighs one round, and the answer runs at the tree's pace. (Costs
    as there: a round of the tree, with its draft's steps, costs about two plain steps.)"""
    cost = CostProfile([1, 8], [1.0, 2.2])
    alone = _short_answer(AutoProposer([_Unlucky("tree", 6, 3)], cost), cost, 96)
    forgetful = _short_answer(AutoProposer([NoProposal(), _Unlucky("tree", 6, 3)], cost), cost, 96)
    assert forgetful < 0.8 * alone  # what happened without it
    memory: dict = {}
    first = _short_answer(
        AutoProposer([NoProposal(), _Unlucky("tree", 6, 3)], cost, memory=memory), cost, 96
    )
    assert first == pytest.approx(forgetful) and "tree" in memory  # nothing known yet
    memory["tree"] = (4.0, 2.0, 20)  # earlier answers where the tree paid
    second = _short_answer(
        AutoProposer([NoProposal(), _Unlucky("tree", 6, 3)], cost, memory=memory), cost, 96
    )
    assert second >= 0.97 * alone
    assert memory["tree"][0] / memory["tree"][1] > 1.0  # and it remembers this answer too


class _Expecting(_Unlucky):
    """The same tree, which says what it expects of each round (a draft's tree does, from its
    calibrated acceptance estimates): `expected` tokens."""

    def __init__(self, name, n, good, expected):
        super().__init__(name, n, good)
        self.expected = expected


def test_auto_weighs_a_first_round_against_what_the_candidate_expected_of_it():
    """A fresh process, nothing remembered: the tree's first round finds nothing. Judged by
    that round alone, the try spent the tries' budget and plain steps took the answer (the
    demo with the tree as the draft's only candidate: 1.24x plain where the tree's rounds
    made 2.3x; docs/benchmarks.md, "Issue 26, session 15"). Weighed against what the tree
    expected of it (4 tokens), the round counts as one of two, and the answer runs at the
    tree's pace. A candidate whose expectation is wrong is left within a few rounds."""
    cost = CostProfile([1, 8], [1.0, 2.2])
    alone = _short_answer(AutoProposer([_Unlucky("tree", 6, 3)], cost), cost, 96)
    blind = _short_answer(AutoProposer([NoProposal(), _Unlucky("tree", 6, 3)], cost), cost, 96)
    seeing = _short_answer(
        AutoProposer([NoProposal(), _Expecting("tree", 6, 3, 4.0)], cost), cost, 96
    )
    assert blind < 0.8 * alone and seeing >= 0.97 * alone
    # a tree sure of 6 tokens a round that never finds one: plain steps take over
    wrong = _Fixed("tree", 6, 0)
    wrong.expected = 7.0
    fooled = _short_answer(AutoProposer([NoProposal(), wrong], cost), cost, 96)
    assert wrong.calls <= 8 and fooled >= 0.9  # plain steps: 1 token a second


class _FadingOut(_Fixed):
    """Heads on an answer whose last part stops suiting them: 3 of 6 right for `until` calls,
    then nothing."""

    def __init__(self, name, until):
        super().__init__(name, 6, 3)
        self.until = until

    def propose(self, seq, max_depth, noise):
        self.good = 3 if self.calls < self.until else 0
        return super().propose(seq, max_depth, noise)


def test_auto_remembers_a_candidate_by_its_long_run_not_by_an_answers_last_rounds():
    """One answer's weak ending (the rounds auto was leaving the heads on) must not keep them
    out of the next answers (Spec-Bench dev, session 10: after humanities ended badly for the
    heads, four answers ran on plain steps and prompt lookup; math_reasoning 1.19x where the
    heads alone made 2.29x). Remembering the last rounds made the next answer start on plain
    steps; a long-run average starts it on the heads."""
    cost = CostProfile([1, 8], [1.0, 2.2])
    memory: dict = {}
    fading = _FadingOut("medusa", 40)
    _short_answer(AutoProposer([NoProposal(), fading], cost, memory=memory), cost, 200)
    assert fading.calls > 40  # the heads' weak ending was tried, then left
    toks, secs, rounds = memory["medusa"]
    assert toks / secs > 1.0 and rounds == fading.calls  # still better than a plain step's
    again = _Fixed("medusa", 6, 3)
    _short_answer(AutoProposer([NoProposal(), again], cost, memory=memory), cost, 8)
    assert again.calls >= 2  # the next answer starts on the heads


def test_auto_does_not_let_a_candidates_first_rounds_outweigh_its_later_ones():
    """The heads' two tries on the first answer ever found nothing (a writing prompt), and
    their next answer went well: what later answers start from is the mean of all those
    rounds, not two rounds weighted as a long history (which left the heads out of the next
    six Spec-Bench answers: one-model auto 1.17x where they alone made 1.34x)."""
    cost = CostProfile([1, 8], [1.0, 2.2])
    memory: dict = {}
    unlucky = _Fixed("medusa", 6, 0)
    _short_answer(AutoProposer([NoProposal(), unlucky], cost, memory=memory), cost, 48)
    assert memory["medusa"][2] == unlucky.calls <= 3
    good = _Fixed("medusa", 6, 3)
    _short_answer(AutoProposer([good], cost, memory=memory), cost, 96)
    toks, secs, rounds = memory["medusa"]
    assert rounds == unlucky.calls + good.calls and toks / secs > 1.5  # 4 tokens per 2.2 s


class _LuckyOnce(_Fixed):
    """Heads that give 2 tokens a round (1 of 6 right), except on their `lucky`-th call, where
    all 6 are right."""

    def __init__(self, name, lucky):
        super().__init__(name, 6, 1)
        self.lucky = lucky

    def propose(self, seq, max_depth, noise):
        self.good = 6 if self.calls + 1 == self.lucky else 1
        return super().propose(seq, max_depth, noise)


def test_auto_weighs_a_re_check_against_the_candidates_record():
    """A losing candidate's re-check is one round: it counts as one of two beside what the
    candidate did before, not in its place. Judged by it alone, one lucky round of the heads
    (7 tokens where they give 2) outscored the tree, and the heads took the next rounds at
    half the tree's rate until their average fell back (Spec-Bench math 116: eight rounds of the
    heads, 10% below the tree alone; docs/benchmarks.md, "Issue 26, session 17")."""
    cost = CostProfile([1, 8, 16], [1.0, 1.1, 1.3])  # flat: 4 tokens a round of the tree
    tree = _Fixed("tree", 6, 3)
    heads = _LuckyOnce("medusa", 3)  # two explorations, then the lucky re-check
    auto = AutoProposer([tree, heads], cost, explore=2, period=10, explore_share=np.inf)
    auto.reset([1])
    picks = []
    for _ in range(60):
        _drive(auto, 1)
        picks.append(auto.last_name)
    lucky = [r for r, name in enumerate(picks) if name == "medusa"][2]
    after = picks[lucky + 1 : lucky + 10]
    assert after.count("medusa") <= 1  # judged alone, the lucky round bought four more
    # where earlier answers left a record, the re-check is weighed against that record
    memory = {"medusa": (2.0, float(cost(7)), 30)}
    heads = _LuckyOnce("medusa", 1)
    auto = AutoProposer([tree, heads], cost, explore=2, period=10, memory=memory)
    auto.reset([1])
    auto.tried[1], auto.last_tried[1], auto.round = 2, 0, 40  # a loser, long due
    auto._current, auto._best = 1, 0
    t = heads.propose([1], 10, PositionNoise(0))
    auto.observe([1], t, Verification(t.path(6), 0, np.zeros(len(t), int)))
    assert auto.tokens[1] == pytest.approx((2.0 + 7.0) / 2)


def test_auto_re_checks_the_most_promising_candidate_first():
    """Two losers as earlier answers left them (both due for a re-check at once), one whose
    rounds cost little more than a plain step (heads with a small tree) and one that costs
    twice as much (lookahead): the re-check goes to the cheap one, so the tries' budget is
    spent where a win is likeliest (the candidates' order re-checked lookahead first); the
    text has changed and it wins, so it is kept."""
    cost = CostProfile([1, 3, 9], [1.0, 1.1, 2.0])
    dear, cheap = _Fixed("lookahead", 8, 0), _Fixed("medusa", 2, 2)
    memory = {"lookahead": (1.0, 2.0, 8), "medusa": (1.0, 1.1, 8)}  # both lost before
    auto = AutoProposer([NoProposal(), dear, cheap], cost, period=10, memory=memory,
                        explore_share=np.inf)  # fmt: skip
    auto.reset([1])
    picks = []
    for _ in range(16):
        _drive(auto, 1)
        picks.append(auto.last_name)
    assert picks[:10] == ["plain"] * 10 and dear.calls == 0
    assert picks[10:] == ["medusa"] * 6  # 3 tokens for 1.1 s


def test_auto_knows_plain_steps_without_trying_them():
    cost = CostProfile([1, 8], [1.0, 1.5])
    good = _Fixed("pld", 3, 3)
    auto = AutoProposer([NoProposal(), good], cost)
    auto.reset([1])
    _drive(auto, 5)
    assert good.calls == 5 and auto.score(0) == pytest.approx(1.0)


def test_proposers_of_one_draft_share_what_they_learn_about_its_acceptance():
    """A chain's rejected rounds make the tree from the same draft less sure too, so auto's
    tree candidate does not grow deep on the draft's raw confidence in its first rounds."""
    state = DraftState(TreeTableEngine.cycle(sharp=12.0), V)
    chain, tree = (
        DraftTreeProposer(state, V, SamplingParams(), mode="dynamic", depth=d, topk=k, budget=8)
        for d, k in ((8, 1), (6, 4))
    )
    seq = [5, 6, 7, 8, 5]
    chain.reset(seq)
    assert tree.calibration(1) == chain.calibration(1) == 1.0  # the prior
    for _ in range(4):  # the verifier never follows the draft
        t = chain.propose(seq, 8, PositionNoise(0))
        chain.observe(seq, t, Verification([], 0, np.zeros(len(t), int)))
        seq.append(0)
    assert tree.calibration(1) == chain.calibration(1) < 0.25
    lone = DraftTreeProposer(DraftState(TreeTableEngine.cycle(), V), V, SamplingParams())
    assert lone.calibration(1) == 1.0  # another draft state learns on its own


def test_auto_charges_a_draft_round_its_own_work_not_the_catch_up_on_others_tokens():
    """The draft's catch-up on tokens that plain steps committed is a switching cost, not the
    chain's cost per round: counted as the latter, a chain re-tried after 16 plain steps would
    look 16 tokens expensive, and plain would keep rounds the chain pays for."""
    verify = CostProfile([1, 2, 8], [1.0, 1.1, 1.4])
    pc = CostProfile([1, 64], [0.15, 63.15])  # the draft: 1 s per fed token
    state = DraftState(TreeTableEngine.cycle(sharp=12.0), V, pc)
    chain = DraftTreeProposer(state, V, SamplingParams(), mode="dynamic", depth=1, topk=1,
                              budget=1, name="chain")  # fmt: skip
    # (a stand-in for plain steps that is explored like any candidate)
    auto = AutoProposer(
        [chain, _Fixed("plain", 0, 0)], verify, [state], explore=1, period=100,
        explore_share=np.inf,
    )  # fmt: skip
    seq = [5, 6, 7, 8, 5]
    auto.reset(seq)  # the draft holds seq[:-1]
    switching = state.switch_work  # (its prefill happened outside any round)

    def round_(expected: str, accepted: list[int]) -> None:
        tree = auto.propose(seq, 8, PositionNoise(0))
        assert auto.last_name == expected
        auto.observe(seq, tree, Verification(accepted, 0, np.zeros(len(tree), int)))

    round_("chain", [1])  # explored first: the draft was one token behind (steady)
    assert state.switch_work == switching and auto.seconds[0] == pytest.approx(pc(1) + verify(2))
    seq += [6, 7]
    round_("plain", [])  # explored second
    seq += [8, 5, 6, 7, 8, 5, 6]  # plain steps commit tokens the draft never sees
    work = state.work
    round_("chain", [1])  # the best so far: 9 tokens behind
    assert state.work - work == pytest.approx(pc(9))  # what the catch-up cost
    assert state.switch_work - switching == pytest.approx(pc(9) - pc(2))  # of which switching
    # the round is charged a steady catch-up (2 tokens), not the 9 (the average is over rounds:
    # the first try is two rounds old)
    a = auto.decay**2
    assert auto.seconds[0] == pytest.approx(a * (pc(1) + verify(2)) + (1 - a) * (pc(2) + verify(2)))


def test_auto_charges_the_work_of_a_draft_a_candidate_builds_at_its_first_reset():
    """`self` builds its layer-skipped draft at its first reset, after auto is made: that
    draft's work counts in its rounds as a draft model's does (it was left out, and `self`
    scored as if its drafting were free)."""
    verify = CostProfile([1, 8], [1.0, 1.4])
    pc = CostProfile([1, 64], [0.5, 32.0])

    class Late:
        name = "self"

        def __init__(self):
            self.inner = None

        @property
        def state(self):
            return self.inner.state if self.inner is not None else None

        def reset(self, prompt):
            if self.inner is None:
                state = DraftState(TreeTableEngine.cycle(sharp=12.0), V, pc)
                self.inner = DraftTreeProposer(state, V, SamplingParams(), mode="dynamic",
                                               depth=1, topk=1, budget=1)  # fmt: skip
            self.inner.reset(prompt)

        def propose(self, seq, max_depth, noise):
            return self.inner.propose(seq, max_depth, noise)

        def observe(self, seq, tree, verdict):
            self.inner.observe(seq, tree, verdict)

    auto = AutoProposer([Late()], verify)
    seq = [5, 6, 7, 8, 5]
    auto.reset(seq)
    tree = auto.propose(seq, 8, PositionNoise(0))
    auto.observe(seq, tree, Verification([1], 0, np.zeros(len(tree), int)))
    assert auto.seconds[0] == pytest.approx(pc(1) + verify(2))


def test_a_dynamic_tree_says_how_many_tokens_it_expects_by_its_calibration():
    """`expected`: one plus the calibrated acceptance estimates of the proposed nodes. A sure
    draft's first chain promises its whole length; once the verifier has refused it, the
    calibration and so the promise fall."""
    state = DraftState(TreeTableEngine.cycle(sharp=12.0), V)
    chain = DraftTreeProposer(state, V, SamplingParams(), mode="dynamic", depth=4, topk=1,
                              budget=4)  # fmt: skip
    seq = [5, 6, 7, 8, 5]
    chain.reset(seq)
    tree = chain.propose(seq, 4, PositionNoise(0))
    assert len(tree) == 5 and chain.expected == pytest.approx(5.0, abs=0.05)
    for _ in range(4):  # the verifier never follows the draft
        chain.observe(seq, tree, Verification([], 0, np.zeros(len(tree), int)))
        seq = [*seq, 0]
        tree = chain.propose(seq, 4, PositionNoise(0))
    assert 1.0 < chain.expected < 2.0
    static = DraftTreeProposer(state, V, SamplingParams(), mode="static")
    static.propose(seq, 4, PositionNoise(0))
    assert static.expected is None  # no estimates: nothing promised


def test_an_unsure_drafts_estimates_rise_when_the_verifier_follows_it():
    """Calibration goes both ways: a draft whose probabilities are low but whose guesses the
    verifier keeps taking (the verifier itself with a layer or two skipped, method `self`) is
    trusted more than its raw confidence, so its chains grow; capped at its raw confidence,
    such a draft kept proposing one token a round at 0.95 acceptance."""
    state = DraftState(TreeTableEngine.cycle(sharp=1.0), V)  # top-1 probability about 0.2
    chain = DraftTreeProposer(state, V, SamplingParams(), mode="dynamic", depth=4, topk=1,
                              budget=4)  # fmt: skip
    seq = [5, 6, 7, 8, 5]
    chain.reset(seq)
    tree = chain.propose(seq, 4, PositionNoise(0))
    first = chain.expected
    assert first is not None and first < 2.0
    for _ in range(4):  # the verifier takes every guess
        path = list(range(1, len(tree)))
        chain.observe(seq, tree, Verification(path, 0, np.zeros(len(tree), int)))
        seq = [*seq, *(tree.tokens[n] for n in path), 0]
        tree = chain.propose(seq, 4, PositionNoise(0))
    assert chain.calibration(1) > 1.5 and chain.expected > first + 0.4


# -- cost profiles ----------------------------------------------------------------------------------


def test_cost_profile_interpolates_and_extrapolates():
    c = CostProfile([1, 2, 4], [1.0, 1.5, 2.5])
    assert c(1) == 1.0 and c(3) == 2.0 and c(6) == pytest.approx(3.5)
    np.testing.assert_allclose(c(np.array([2, 8])), [1.5, 4.5])
    with pytest.raises(ValueError):
        CostProfile.from_json({"format": 1, "sizes": [2, 1], "seconds": [1, 2]})


def test_best_size_trades_acceptance_for_cost():
    flat = CostProfile([1, 64], [1.0, 1.0])  # a pass costs the same whatever its size
    steep = CostProfile([1, 2], [1.0, 1.5])  # every token adds half a pass
    vals = np.array([0.9, 0.8, 0.5, 0.1, 0.01])
    assert best_size(vals, flat) == 5
    assert best_size(vals, steep) == 2  # 2.7 / 2.0 beats 1.9 / 1.5 and 3.2 / 2.5
    assert best_size(np.array([0.2]), steep) == 0
    assert best_size(vals, flat, per_node=0.3) < 5


def test_profile_is_measured_once_and_cached_per_device_and_model(tmp_path, monkeypatch):
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    eng = TableEngine.cycle()
    p1 = load_profile(eng, sizes=(1, 2, 4))
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["sizes"] == [1, 2, 4]
    assert p1.seconds == sorted(p1.seconds) and p1.model == engine_key(eng)
    fed = eng.fed
    p2 = load_profile(eng, sizes=(1, 2, 4))
    assert eng.fed == fed and p2 == p1  # read from the cache, not measured
    files[0].write_text("{broken")
    load_profile(eng, sizes=(1, 2, 4))
    assert eng.fed > fed  # unreadable: measured again (and rewritten atomically)
    assert CostProfile.from_json(json.loads(files[0].read_text())).sizes == [1, 2, 4]
    assert load_profile(TableEngine.cycle(), measure_if_missing=False) is not None
    other = TableEngine.cycle()
    other.vocab_size = 99
    assert engine_key(other) != engine_key(eng)


def test_auto_gives_the_rounds_prompt_lookup_abstains_from_to_the_next_best():
    """Prompt lookup copies a whole passage every 4th round and finds nothing in the others; a
    draft-free tree makes 2 tokens a round. Scored on every round, lookup's average (empty
    rounds count as plain steps) beat the tree's and took every round, empty ones included;
    abstaining, it speaks where it copies and the tree takes the rest: the two candidates'
    best per round."""
    cost = CostProfile([1, 8], [1.0, 1.15])

    class Abstaining(_Sometimes):
        abstains = True

    def per_round_best(total=96):
        """Each round: lookup where it copies, else the tree (what a perfect chooser does)."""
        done, secs, r = 0, 0.0, 0
        while done < total:
            r += 1
            copy = r % 4 == 0
            done += 7 if copy else 2
            secs += float(cost(7 if copy else 3))
        return min(done, total) / secs

    old = _short_answer(AutoProposer([NoProposal(), _Sometimes("pld", 6, 0),
                                      _Fixed("medusa", 2, 1)], cost), cost, 96)  # fmt: skip
    new = _short_answer(AutoProposer([NoProposal(), Abstaining("pld", 6, 0),
                                      _Fixed("medusa", 2, 1)], cost), cost, 96)  # fmt: skip
    assert new >= 0.95 * per_round_best() and new > 1.15 * old


def test_prompt_lookup_learns_per_match_length_and_abstains_where_it_does_not_pay():
    """Single repeated tokens are poor guesses in this text, repeated 3-grams good ones: after
    the 1-token matches fail, lookup proposes nothing for them (auto gives those rounds to
    another candidate) and still copies after 3-gram matches. (Costs where a second token
    costs 30% more: on flat passes even a 1-in-14 guess pays, and lookup keeps guessing.)"""
    cost = CostProfile([1, 2, 8], [1.0, 1.3, 1.6])
    pld = PromptLookup(max_tokens=4, branches=1, budget=cost_budget(cost))
    pld.reset([])
    one = [5, 9, 7, 5]  # the tail (5) occurred once: a 1-token match
    for _ in range(12):
        tree = pld.propose(one, 4, PositionNoise(0))
        if not tree.size:
            break
        pld.observe(one, tree, Verification([], 0, np.zeros(len(tree), int)))
    assert pld.propose(one, 4, PositionNoise(0)).size == 0  # abstains on 1-token matches
    three = [1, 2, 3, 4, 6, 1, 2, 3]  # a 3-gram match, never tried: the prior tries it
    tree = pld.propose(three, 4, PositionNoise(0))
    assert tree.size >= 1 and tree.path_tokens(len(tree) - 1)[:2] == [4, 6]
    assert set(pld.models) == {1, 3} and pld.models[1].rate <= 0.25


class _Scripted(_Fixed):
    """A proposer whose rounds find `script[k]` right tokens of n, in turn, round after round
    (a draft's tree on real text: mostly several, now and then none)."""

    def __init__(self, name, n, script):
        super().__init__(name, n, script[0])
        self.script = script

    def propose(self, seq, max_depth, noise):
        self.good = self.script[self.calls % len(self.script)]
        return super().propose(seq, max_depth, noise)


def test_auto_stays_on_a_candidate_through_a_run_of_bad_luck(monkeypatch):
    """A draft's tree that averages 4.4 tokens a round, in rounds of 1 to 9, against heads
    that give 4 every round: two one-token rounds in a row put the tree's recent average below
    the heads', the heads take over, and the tree's re-check meets another such round
    (Spec-Bench stem 144, session 19): 8% below the tree alone. A margin of the tree's score's
    noise keeps it on the tree."""
    cost = CostProfile([1, 16], [1.0, 1.0])

    def candidates():
        tree = _Scripted("tree", 9, [7, 0, 0, 6, 3, 5, 0, 0, 8, 5])
        return [NoProposal(), tree, _Fixed("medusa", 4, 3)]

    alone = _short_answer(AutoProposer([candidates()[1]], cost), cost, 192)
    kept = _short_answer(AutoProposer(candidates(), cost), cost, 192)
    monkeypatch.setattr(auto_mod, "NOISE_MARGIN", 0.0)
    swayed = _short_answer(AutoProposer(candidates(), cost), cost, 192)
    assert kept >= 0.97 * alone and swayed < 0.95 * alone

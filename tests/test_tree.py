"""Token trees: structure, masks and positions against sequential passes, keep-subset, the
multi-draft acceptance rules by exact enumeration, and end-to-end losslessness of every method
(greedy identity; the joint law of the first two sampled tokens by a chi-square test)."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest
import tiny
from support.engines import MemoEngine
from support.enumeration import assert_emits_the_verifier_law, law, random_dist
from support.medusa_heads import write_heads
from support.stats import chi_square_p, exact_joint

from ondevice.decoders.factory import make_decoder
from ondevice.models import load_model
from ondevice.proposers.draft_tree import DraftState
from ondevice.proposers.registry import METHODS
from ondevice.proposers.resources import CALIBRATION_MEMORY, Calibrations, Speculation
from ondevice.rules import accept
from ondevice.rules.sampling import SamplingParams
from ondevice.rules.token_tree import TokenTree, check_shape
from ondevice.runtime.engines import MLXEngine, MLXTreeEngine
from ondevice.runtime.pass_costs import SIZES, CostProfile, device_name, engine_key, profile_path

# -- structure -------------------------------------------------------------------------------------


def _random_tree(rng: np.random.Generator, root: int, n: int, vocab: int) -> TokenTree:
    tree = TokenTree.root(root)
    while tree.size < n:
        parent = int(rng.integers(len(tree)))
        if tree.depths[parent] < 4:
            tree.add(parent, int(rng.integers(5, vocab)))
    return tree


def test_tree_structure_mask_positions_and_subtree():
    t = TokenTree.root(7)
    a = t.add(0, 3)
    b = t.add(0, 4)
    assert b == 2 and t.children[0] == {3: a, 4: b}
    c = t.add(a, 5)
    assert t.add(0, 3) == a  # same token under the same parent: same node
    assert t.draws[0] == [(3, None), (4, None)]  # a repeated deterministic draw is dropped
    q = np.full(8, 1 / 8)
    assert t.add(0, 3, q) == a and len(t.draws[0]) == 3  # a sampled draw is kept
    assert t.path(c) == [a, c] and t.path_tokens(c) == [3, 5] and t.path(0) == []
    assert t.depths == [0, 1, 1, 2] and t.max_depth == 2 and t.size == 3
    np.testing.assert_array_equal(t.positions(10), [10, 11, 11, 12])
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    np.testing.assert_array_equal(t.ancestors(), expected)
    sub, kept = t.subtree([a, c])
    assert kept == [0, a, c] and sub.tokens == [7, 3, 5] and sub.parents == [-1, 0, 1]
    assert [tok for tok, _ in sub.draws[0]] == [3, 3]  # draws of the dropped child 4 are gone
    with pytest.raises(ValueError, match="parent"):
        t.subtree([c])


def test_check_shape():
    assert check_shape([(0, 0), (0,), (1,)]) == [(0,), (1,), (0, 0)]
    with pytest.raises(ValueError, match="prefix"):
        check_shape([(0,), (0, 0, 0)])
    with pytest.raises(ValueError, match="rank 0"):
        check_shape([(1,)])


def test_accept_greedy_takes_the_longest_matching_path():
    t = TokenTree.root(1)
    a = t.add(0, 3)
    t.add(0, 4)
    c = t.add(a, 5)
    t.add(c, 6)
    # target[i]: the verifier's argmax after node i
    assert accept.greedy_tree(t, [3, 5, 0, 9, 0]) == ([a, c], 9)
    assert accept.greedy_tree(t, [4, 0, 8, 0, 0]) == ([2], 8)
    assert accept.greedy_tree(t, [9, 0, 0, 0, 0]) == ([], 9)


# -- the acceptance rule by exact enumeration ------------------------------------------------------
# `accept.multi_draft` is the rule the tree decoder runs (with position-keyed noise for `at`);
# here its random source is `support.enumeration`'s, which walks every outcome.


def _first_token_law(p, qs, det, rule, V):
    """Exact law of the token emitted first at a node whose draws are i.i.d. samples from each q
    in `qs` (in order, enumerated over all outcomes) followed by deterministic tokens `det`."""
    out = np.zeros(V)
    for sampled in itertools.product(range(V), repeat=len(qs)):
        w = np.prod([q[x] for q, x in zip(qs, sampled)])
        if w == 0:
            continue
        tree = TokenTree.root(0)
        for x, q in zip(sampled, qs):
            tree.add(0, x, q)
        for x in det:
            tree.add(0, x)
        rows = np.stack([p] + [np.full(V, 1 / V)] * tree.size)

        def fn(r, tree=tree, rows=rows):
            path, tok = rule(tree, rows, r)
            return tree.tokens[path[0]] if path else tok

        for tok, pr in law(fn).items():
            out[tok] += w * pr
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "draws",
    ["one sampled", "three iid", "two q's", "top-2 deterministic", "mixed"],
)
def test_multi_draft_rule_emits_exactly_p(seed, draws):
    """SpecInfer/SpecTr recursive rejection over i.i.d. sampled children, EAGLE's rule over
    deterministic children, and a mix of both: the first token's law is exactly p."""
    rng = np.random.default_rng(seed)
    V = 4
    p, q, q2 = random_dist(rng, V, zeros=seed % 2), random_dist(rng, V, 1), random_dist(rng, V)
    qs, det = {
        "one sampled": ([q], []),
        "three iid": ([q, q, q], []),
        "two q's": ([q, q2], []),
        "top-2 deterministic": ([], list(np.argsort(-q)[:2])),
        "mixed": ([q2], [int(np.argmax(q)), 1]),
    }[draws]
    law = _first_token_law(p, qs, det, accept.multi_draft, V)
    np.testing.assert_allclose(law, p, atol=1e-12)


def test_two_level_tree_emits_the_verifier_joint_law():
    """Root with two i.i.d. draws, each child with two i.i.d. draws (context-dependent p and q):
    the first token follows p1, and the second, given the first was an accepted draft, follows
    p2[first] exactly."""
    rng = np.random.default_rng(7)
    V = 3
    p1, q1 = random_dist(rng, V), random_dist(rng, V)
    p2 = {x: random_dist(rng, V) for x in range(V)}
    q2 = {x: random_dist(rng, V, zeros=x % 2) for x in range(V)}
    joint: Counter = Counter()
    for a, b in itertools.product(range(V), repeat=2):
        for c, d, e, f in itertools.product(range(V), repeat=4):
            w = q1[a] * q1[b] * q2[a][c] * q2[a][d] * q2[b][e] * q2[b][f]
            if w == 0:
                continue
            tree = TokenTree.root(0)
            na, nb = tree.add(0, a, q1), tree.add(0, b, q1)
            for node, tok, x in ((na, c, a), (na, d, a), (nb, e, b), (nb, f, b)):
                tree.add(node, tok, q2[x])
            rows = {0: p1}
            for node in range(1, len(tree)):
                d1 = tree.depths[node] == 1
                rows[node] = p2[tree.tokens[node]] if d1 else np.full(V, 1 / V)

            def fn(r, tree=tree, rows=rows):
                path, tok = accept.multi_draft(tree, rows.__getitem__, r)
                toks = [tree.tokens[n] for n in path] + [tok, None]
                return toks[0], toks[1], len(path)

            for (x1, x2, n), pr in law(fn).items():
                joint[x1, x2, n] += w * pr
    assert_emits_the_verifier_law(joint, p1, p2)


def _without_the_residual_update(monkeypatch):
    """Deliberately wrong: each draw is tested against the verifier's p itself instead of the
    residual left by the draws rejected before it."""
    monkeypatch.setattr(accept, "residual", lambda r, token, q: r)


def test_enumeration_catches_a_rule_without_the_residual_update(monkeypatch):
    _without_the_residual_update(monkeypatch)
    rng = np.random.default_rng(1)
    V = 4
    p, q = random_dist(rng, V), random_dist(rng, V)
    law = _first_token_law(p, [q, q, q], [], accept.multi_draft, V)
    assert np.abs(law - p).max() > 0.02
    law = _first_token_law(p, [], [0, 1], accept.multi_draft, V)
    assert np.abs(law - p).max() > 0.02


def test_rejection_helpers():
    r = np.array([0.5, 0.3, 0.2])
    assert accept.acceptance_probability(r, 1, None) == pytest.approx(0.3)
    assert accept.acceptance_probability(r, 0, np.array([0.25, 0.5, 0.25])) == 1.0
    assert accept.acceptance_probability(r, 1, np.array([0.0, 0.6, 0.4])) == pytest.approx(0.5)
    np.testing.assert_allclose(accept.residual(r, 0, None), [0, 0.6, 0.4])
    np.testing.assert_allclose(accept.residual(r, 1, np.array([0.1, 0.6, 0.3])), [1, 0, 0])
    # rejection impossible (r == q): the residual is defined as r itself
    np.testing.assert_allclose(accept.residual(r, 0, r), r)


# -- tree passes on the MLX model --------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tree")
    v = tiny.write_model(d / "v", seed=0, layers=2, scale=1.0)
    dr = tiny.perturbed_copy(v, d / "d", noise=0.05)
    return load_model(v).model, load_model(dr).model


def _last_row(model, tokens) -> np.ndarray:
    e = MLXEngine(model)
    return e.feed(tokens, last_only=True)


@pytest.mark.parametrize("seed", range(3))
def test_tree_pass_equals_sequential_passes_per_path(models, seed):
    model, _ = models
    rng = np.random.default_rng(seed)
    prefix = rng.integers(5, 96, 9).tolist()
    tree = _random_tree(rng, prefix[-1], 14, 96)
    eng = MLXTreeEngine(MLXEngine(model))
    eng.feed(prefix[:-1])
    logits = eng.feed_masked(tree.tokens, tree.positions(len(prefix) - 1), tree.ancestors())
    assert logits.shape == (len(tree), 96) and eng.length == len(prefix) - 1 + len(tree)
    for node in range(len(tree)):
        ref = _last_row(model, prefix + tree.path_tokens(node))
        np.testing.assert_allclose(logits[node], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_keep_subset_leaves_the_cache_as_if_only_the_path_was_appended(models, seed):
    model, _ = models
    rng = np.random.default_rng(10 + seed)
    prefix = rng.integers(5, 96, 7).tolist()
    tree = _random_tree(rng, prefix[-1], 12, 96)
    leaf = max(range(len(tree)), key=lambda n: (tree.depths[n], n))
    path = tree.path(leaf)
    eng = MLXTreeEngine(MLXEngine(model))
    eng.feed(prefix[:-1])
    eng.feed_masked(tree.tokens, tree.positions(len(prefix) - 1), tree.ancestors())
    eng.keep(len(tree), [0, *path])
    seq = prefix + tree.path_tokens(leaf)
    assert eng.length == len(seq)
    fresh = MLXEngine(model)
    fresh.feed(seq)
    for mine, ref in zip(eng.engine.cache.layers, fresh.cache.layers):
        n = len(seq)
        np.testing.assert_allclose(
            np.array(mine.keys[..., :n, :]), np.array(ref.keys[..., :n, :]), atol=1e-5
        )
        np.testing.assert_allclose(
            np.array(mine.values[..., :n, :]), np.array(ref.values[..., :n, :]), atol=1e-5
        )
    nxt = [11, 12]
    np.testing.assert_allclose(eng.feed(nxt), fresh.feed(nxt), atol=1e-4, rtol=1e-4)


def test_draft_tree_expansion_level_by_level_equals_sequential(models):
    """The draft grows a tree over several passes (mask over the whole cache, ancestors fed in
    earlier passes) and commits the accepted path; both agree with plain sequential passes, for a
    tree-capable engine and for one that can only feed chains."""
    _, draft = models
    rng = np.random.default_rng(3)
    seq = rng.integers(5, 96, 8).tolist()
    tree = _random_tree(rng, seq[-1], 10, 96)
    for engine in (MLXTreeEngine(MLXEngine(draft)), MLXEngine(draft)):
        st = DraftState(engine, 96)
        st.reset(seq)
        np.testing.assert_allclose(st.sync(seq), _last_row(draft, seq), atol=1e-4, rtol=1e-4)
        inner = [n for n in range(1, len(tree)) if tree.children[n]]
        for depth in range(1, tree.max_depth + 1):
            level = [n for n in inner if tree.depths[n] == depth]
            if not level:
                break
            rows = st.expand(tree, level)
            for n, row in zip(level, rows):
                ref = _last_row(draft, seq + tree.path_tokens(n))
                np.testing.assert_allclose(row, ref, atol=1e-4, rtol=1e-4)
        deepest = max(inner, key=lambda n: tree.depths[n])
        st.commit(tree, tree.path(deepest))
        full = seq + tree.path_tokens(deepest)
        np.testing.assert_allclose(st.sync(full + [9]), _last_row(draft, full + [9]), atol=1e-4)


# -- greedy: every method is token-identical to the verifier alone ---------------------------------


def _plain_greedy(model, prompt, n, eos=()):
    e = MLXEngine(model)
    out = []
    logits = e.feed(prompt, last_only=True)
    for _ in range(n):
        t = int(np.argmax(logits))
        if t in eos:
            break
        out.append(t)
        logits = e.feed([t], last_only=True)
    return out


def _prompts(model):
    rng = np.random.default_rng(0)
    out = []
    for i in range(6):
        p = rng.integers(5, 96, 5).tolist()
        out.append(p * 4 if i % 2 else p)  # repetitive prompts give the lookups something
    # the verifier's own continuation repeated: prompt lookup has whole blocks to copy
    base = rng.integers(5, 96, 4).tolist()
    out.append(base + _plain_greedy(model, base, 24) + base)
    return out


@pytest.fixture(scope="module")
def home(tmp_path_factory, models):
    """A cache with fixed cost profiles for the two tiny models, so that what `profile=True`
    decides does not depend on how loaded the machine is while the tests run: a verifier pass
    costs little more for more tokens, a draft step a twentieth of a pass (a typical pair)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ONDEVICE_HOME", str(tmp_path_factory.mktemp("home")))
    for model, base, per_token in ((models[0], 1.0, 0.02), (models[1], 0.05, 0.001)):
        engine = MLXEngine(model)
        path = profile_path(device_name(), engine_key(engine))
        path.parent.mkdir(parents=True, exist_ok=True)
        prof = CostProfile(list(SIZES), [base + per_token * n for n in SIZES])
        path.write_text(json.dumps(prof.to_json()))
    write_heads(models[0])  # method "medusa" finds them in the cache
    yield
    mp.undo()


@pytest.mark.parametrize("method", [m for m in METHODS])
@pytest.mark.parametrize("k", [None, 2, 5])
def test_greedy_output_is_the_verifiers_for_every_method(models, home, method, k):
    ver, dra = models
    accepted = 0
    for prompt in _prompts(ver):
        ref = _plain_greedy(ver, prompt, 40)
        spec = Speculation(method=method, num_draft_tokens=k)
        dec = make_decoder(MLXEngine(ver), MLXEngine(dra), SamplingParams(), spec, seed=0)
        got = [t for r in dec.run(prompt, 40) for t in r.tokens]
        assert got == ref, (method, k, prompt)
        accepted += dec.stats.accepted
    # the method did speculate (and was right) along the way; the test's Medusa heads are
    # untrained (identity: "the next token repeats"), so right less often
    assert accepted > (10 if method != "medusa" else 3)


@pytest.mark.parametrize("method", ["pld", "lookahead"])
def test_draft_free_methods_run_without_a_draft(models, home, method):
    ver, _ = models
    prompt = _prompts(ver)[-1]
    spec = Speculation(method=method, num_draft_tokens=6)
    dec = make_decoder(MLXEngine(ver), None, SamplingParams(), spec)
    got = [t for r in dec.run(prompt, 30) for t in r.tokens]
    assert got == _plain_greedy(ver, prompt, 30)
    assert dec.stats.accepted > 0


def test_static_and_sampled_tree_modes_are_greedy_exact(models, home):
    ver, dra = models
    for prompt in _prompts(ver)[:3]:
        spec = Speculation(method="tree", tree_mode="sampled")
        dec = make_decoder(MLXEngine(ver), MLXEngine(dra), SamplingParams(), spec)
        assert [t for r in dec.run(prompt, 30) for t in r.tokens] == _plain_greedy(ver, prompt, 30)


@pytest.mark.parametrize("method", [m.name for m in METHODS.values() if m.proposer])
def test_eos_inside_an_accepted_block_ends_generation(models, home, method):
    ver, dra = models
    prompt = _prompts(ver)[-1]
    ref = _plain_greedy(ver, prompt, 40)
    eos = ref[12]  # a token the verifier emits mid-answer
    dec = make_decoder(
        MLXEngine(ver), MLXEngine(dra), SamplingParams(), Speculation(method=method),
        eos_token_ids=[eos],
    )  # fmt: skip
    rounds = list(dec.run(prompt, 40))
    got = [t for r in rounds for t in r.tokens]
    assert got == ref[: ref.index(eos)] and rounds[-1].finish_reason == "stop"


def test_max_tokens_and_context_limits(models, home):
    ver, dra = models
    prompt = _prompts(ver)[1]
    for method in ("tree", "pld", "lookahead", "cascade"):
        rounds = list(
            make_decoder(
                MLXEngine(ver), MLXEngine(dra), SamplingParams(), Speculation(method=method)
            ).run(prompt, 7)
        )
        assert sum(len(r.tokens) for r in rounds) == 7 and rounds[-1].finish_reason == "length"
        short = MLXEngine(ver, context_length=len(prompt) + 5)
        dec = make_decoder(short, MLXEngine(dra), SamplingParams(), Speculation(method=method))
        rounds = list(dec.run(prompt, 50))
        assert sum(len(r.tokens) for r in rounds) == 5 and rounds[-1].finish_reason == "length"


@pytest.mark.parametrize("method", ["tree", "medusa"])
def test_a_pairs_calibration_carries_over_its_generations(models, home, method):
    """Issue 26 item 4: each generation's per-depth calibration started from the prior, so short
    chats never learnt how far the verifier follows the draft (or the heads). Generations of a
    pair now start from what the earlier ones learnt, where that cannot change their tokens."""
    ver, dra = models
    verifier = MLXEngine(ver)
    verifier.batch_invariant = True  # as the CPU kernel serves it: trees cannot move greedy ties
    store = Calibrations()
    prompts = _prompts(ver)

    def start(params: SamplingParams, seed: int | None = None, engine=verifier):
        spec = Speculation(method=method)
        dec = make_decoder(engine, MLXEngine(dra), params, spec, seed=seed, calibrations=store)
        return dec, dec.proposer.predicted.copy(), dec.proposer.realised.copy()

    def learnt(dec) -> tuple[np.ndarray, np.ndarray]:
        for prompt in prompts[-2:]:  # the repetitive ones: long accepted paths
            list(dec.run(prompt, 24))
        return dec.proposer.predicted.copy(), dec.proposer.realised.copy()

    greedy, prior, _ = start(SamplingParams())
    assert np.all(prior == 1.0)
    predicted, realised = learnt(greedy)
    assert not np.array_equal(predicted, prior)
    later, p, r = start(SamplingParams())  # the next generation starts where that one ended
    assert np.array_equal(p, predicted) and np.array_equal(r, realised)
    assert not np.array_equal(learnt(later)[0], predicted)  # and goes on learning
    # what cannot carry over starts from the prior: a seeded sample (the same seed gives the
    # same tokens every time) and greedy decoding whose near ties may fall by the pass's size;
    # an unseeded sample carries over, apart from greedy decoding's
    assert np.all(start(SamplingParams(temperature=1.0), seed=3)[1] == 1.0)
    assert np.all(start(SamplingParams(), engine=MLXEngine(ver))[1] == 1.0)
    sampled, prior, _ = start(SamplingParams(temperature=1.0))
    assert np.all(prior == 1.0)
    predicted, _ = learnt(sampled)
    assert np.array_equal(start(SamplingParams(temperature=1.0))[1], predicted)


def test_a_calibration_keeps_a_bounded_memory():
    store = Calibrations()
    predicted, realised = store.get("draft", 4)
    predicted += [0.0, 4 * CALIBRATION_MEMORY, 10.0, 0.0]
    realised += [0.0, CALIBRATION_MEMORY, 5.0, 0.0]
    ratio = realised / predicted
    again = store.get("draft", 6)  # a deeper proposer: the new depths start from the prior
    assert len(again[0]) == 6 and np.all(again[0][4:] == 1.0) and np.all(again[1][4:] == 1.0)
    assert np.allclose(again[1][:4] / again[0][:4], ratio)
    assert again[0][1] == CALIBRATION_MEMORY and again[0][2] == 11.0  # only the old depth shrank


def test_a_generator_keeps_its_pairs_calibration_until_the_draft_changes(tmp_path, home):
    import ondevice

    v = tiny.write_model(tmp_path / "v", seed=0, layers=2)
    gen = ondevice.load(v, draft=tiny.perturbed_copy(v, tmp_path / "d", noise=0.05))
    sampled = SamplingParams(temperature=1.0)
    for _ in range(2):
        gen.generate([5, 6, 7, 8] * 3, max_tokens=16, method="tree", temperature=1.0)
    store = gen.calibrations
    learnt = store.for_generation(gen.verifier, sampled, None).get("draft", 18)
    assert not np.all(learnt[0] == 1.0)
    gen.draft.name = "coreml"  # as if Core ML failed mid-use: the draft moves to MLX
    gen._leave_core_ml("a test")
    fresh = gen.calibrations.for_generation(gen.verifier, sampled, None).get("draft", 18)
    assert gen.calibrations is not store and np.all(fresh[0] == 1.0)


def test_bad_method_and_missing_draft_are_clear(models):
    from ondevice.errors import OndeviceError

    ver, _ = models
    with pytest.raises(OndeviceError, match="unknown method"):
        make_decoder(MLXEngine(ver), None, SamplingParams(), Speculation(method="beam"))
    with pytest.raises(OndeviceError, match="needs a draft model"):
        make_decoder(MLXEngine(ver), None, SamplingParams(), Speculation(method="tree"))


# -- sampling: the joint law of the first two tokens -----------------------------------------------


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    v, dr = tiny.write_small_vocab_pair(tmp_path_factory.mktemp("sv"))
    ver = load_model(v).model
    write_heads(ver, noise=0.05)  # for method "medusa" (the suite's own ONDEVICE_HOME)
    return MemoEngine(ver), MemoEngine(load_model(dr).model)


N_SAMPLES = 20_000
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]  # repeats: prompt lookup (inside the cascade too) has guesses


def _exact_joint(ver, params, prompt):
    return dict(np.ndenumerate(exact_joint(ver, prompt, params)))


def _joint_counts(method, ver, dra, params, **kw):
    """The first two tokens of N_SAMPLES generations, one seed each (a seed's randomness is keyed
    by position, so one seed always gives the same tokens)."""
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(N_SAMPLES):
        spec = Speculation(method=method, num_draft_tokens=3, profile=False, **kw)
        dec = make_decoder(ver, dra, params, spec, seed=seed)
        toks: list[int] = []
        for r in dec.run(PROMPT, 3):  # room for a depth-2 tree in the first round
            toks.extend(r.tokens)
            if len(toks) >= 2:
                break
        counts[tuple(toks[:2])] += 1
        drafted, accepted = drafted + dec.stats.drafted, accepted + dec.stats.accepted
    return counts, drafted, accepted


ALL_TRANSFORMS = SamplingParams(
    0.8, top_p=0.95, top_k=10, min_p=0.02, repetition_penalty=1.5, presence_penalty=0.7,
    frequency_penalty=0.8, logit_bias={3: 1.0, 6: -1.0},
)  # fmt: skip
CASES = [
    ("tree", SamplingParams(1.0), {"tree_mode": "dynamic"}),
    ("tree", SamplingParams(1.0), {"tree_mode": "sampled"}),
    ("tree", SamplingParams(1.0, top_p=0.9), {"tree_mode": "sampled"}),
    ("cascade", SamplingParams(1.0), {}),
    ("pld", SamplingParams(1.0), {}),
    ("lookahead", SamplingParams(1.0), {}),
    # the other transforms, together; penalties read each node's path
    ("tree", ALL_TRANSFORMS, {"tree_mode": "dynamic"}),
    ("tree", ALL_TRANSFORMS, {"tree_mode": "sampled"}),
    ("tree", SamplingParams(1.0, frequency_penalty=1.5), {"tree_mode": "sampled"}),
    ("cascade", ALL_TRANSFORMS, {}),
    ("medusa", SamplingParams(1.0), {}),
    ("medusa", ALL_TRANSFORMS, {}),
]
CASE_IDS = ["eagle", "specinfer", "specinfer-top-p", "cascade", "pld", "la"]
CASE_IDS += ["eagle-all", "specinfer-all", "specinfer-frequency", "cascade-all"]
CASE_IDS += ["medusa", "medusa-all"]


@pytest.mark.slow
@pytest.mark.parametrize("method,params,kw", CASES, ids=CASE_IDS)
def test_sampled_methods_match_the_verifier_distribution(small_vocab, method, params, kw):
    ver, dra = small_vocab
    counts, drafted, accepted = _joint_counts(method, ver, dra, params, **kw)
    assert drafted > N_SAMPLES and accepted > N_SAMPLES // 50  # proposals were made and used
    assert chi_square_p(counts, _exact_joint(ver, params, PROMPT)) > 0.001


@pytest.mark.slow
def test_a_tree_rule_without_the_residual_update_fails_the_test(small_vocab, monkeypatch):
    ver, dra = small_vocab
    params = SamplingParams(1.0)
    _without_the_residual_update(monkeypatch)
    counts, _, _ = _joint_counts("tree", ver, dra, params, tree_mode="sampled")
    assert chi_square_p(counts, _exact_joint(ver, params, PROMPT)) < 1e-6


@pytest.mark.slow
def test_medusa_with_a_rule_without_the_residual_update_fails_the_test(small_vocab, monkeypatch):
    """The medusa case above can fail: its heads' deterministic guesses, tested against p
    instead of the residual, bias the law."""
    ver, dra = small_vocab
    params = SamplingParams(1.0)
    _without_the_residual_update(monkeypatch)
    counts, _, _ = _joint_counts("medusa", ver, dra, params)
    assert chi_square_p(counts, _exact_joint(ver, params, PROMPT)) < 1e-6

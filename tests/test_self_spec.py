"""Self-speculation by layer skipping (method "self", `ondevice/proposers/layer_skip.py`): the
draft is a view of the verifier (the same weight arrays), its output is the verifier's, and the
skip set is searched once per model and then read from the cache."""

from __future__ import annotations

import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from support.engines import MemoEngine
from support.stats import chi_square_p, exact_joint

from ondevice.decoders.factory import make_decoder
from ondevice.models import load_model
from ondevice.proposers import layer_skip
from ondevice.proposers.resources import Speculation
from ondevice.rules.sampling import SamplingParams
from ondevice.rules.token_tree import TokenTree
from ondevice.runtime import kernel, pass_costs
from ondevice.runtime.engines import MLXEngine, tree_engine
from ondevice.runtime.pass_costs import SIZES, CostProfile, device_name, engine_key, profile_path

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
LAYERS = 6


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """An empty cache (so the search runs here) with a fixed verifier cost profile written per
    model by `_profiled`: the search's score must not depend on the machine's load."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ONDEVICE_HOME", str(tmp_path_factory.mktemp("home")))
    yield
    mp.undo()


def _profiled(model) -> None:
    path = profile_path(device_name(), engine_key(MLXEngine(model)))
    path.parent.mkdir(parents=True, exist_ok=True)
    prof = CostProfile(list(SIZES), [1.0 + 0.02 * n for n in SIZES])
    path.write_text(json.dumps(prof.to_json()))


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory, home):
    arch = request.param
    tie = arch == "qwen2"  # one tied head among them
    path = tiny.write_model(
        tmp_path_factory.mktemp(arch) / "v", seed=3, layers=LAYERS, scale=1.0, arch=arch, tie=tie
    )
    m = load_model(path).model
    _profiled(m)
    return m


def _plain_greedy(model, prompt, n):
    e = MLXEngine(model)
    out, logits = [], e.feed(prompt, last_only=True)
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = e.feed(out[-1:], last_only=True)
    return out


def _prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(5, 96, n).tolist() for n in (6, 12, 20)]


def test_greedy_output_is_the_verifiers_on_every_architecture(model):
    """Exact, and drafted as a tree: where the draft is unsure, its runners-up are verified
    too (a pass over a few tokens costs about what one does: this profile is flat)."""
    accepted, branched = 0, 0
    for k in (None, 3):
        for prompt in _prompts():
            dec = make_decoder(
                MLXEngine(model), None, SamplingParams(), Speculation(method="self",
                num_draft_tokens=k), seed=0,
            )  # fmt: skip
            verify = dec.verify

            def counted(seq, tree, verify=verify):
                nonlocal branched
                branched += max(Counter(tree.parents[1:]).values(), default=0) > 1
                return verify(seq, tree)

            dec.verify = counted
            got = [t for r in dec.run(prompt, 32) for t in r.tokens]
            assert got == _plain_greedy(model, prompt, 32), (k, prompt)
            accepted += dec.stats.accepted
    assert accepted > 0  # the layer-skipped draft was right at times: it did speculate
    if dec.proposer.skip_set.agreement < 0.9:  # an unsure draft (a sure one's path is the tree)
        assert branched > 0  # some round verified a node's runner-up beside it


def test_the_draft_shares_the_verifiers_weight_arrays(model):
    skip = layer_skip.load_skip_set(model, _prompts()[0], None, cache=False)
    assert skip.skip and 0 not in skip.skip and len(skip.keep) + len(skip.skip) == LAYERS
    view = layer_skip.LayerSkipView(model, skip.keep)
    mine = {id(v) for _, v in tree_flatten(model.parameters())}
    theirs = [v for _, v in tree_flatten(view.parameters())]
    assert theirs and all(id(v) in mine for v in theirs)  # not one array of its own
    for j, i in enumerate(skip.keep):
        assert view.layers[j].mlp.down_proj.weight is model.layers[i].mlp.down_proj.weight
    assert len(view.make_cache()) == len(skip.keep)  # its own cache, over the kept layers
    # the view is exactly the verifier run without the skipped layers
    toks = mx.array([_prompts()[1]])
    h = model.model.embed_tokens(toks)
    for i in skip.keep:
        h = model.layers[i](h, "causal", None, None)
    h = model.model.norm(h)
    head = model.model.embed_tokens.as_linear if model.config.tie_word_embeddings else model.lm_head
    assert mx.allclose(view(toks), head(h), atol=1e-5)


def test_the_draft_reads_the_verifiers_cache_and_leaves_it_as_it_found_it(model):
    """The draft keeps no cache of its own: its kept layers' keys and values of the committed
    sequence are the verifier's. A round feeds it the root alone (no catch-up on the prompt or
    the accepted tokens) and forgets its rows before the verifier's pass, whose rows are then
    exactly those of a verifier that never had a draft."""
    ver = MLXEngine(model)
    dec = make_decoder(ver, None, SamplingParams(), Speculation(method="self"), seed=0)
    prompt = _prompts()[2]
    dec.prefill(list(prompt))
    proposer = dec.proposer
    state = proposer.state
    assert state.tokens == [] and ver.length == len(prompt) - 1  # nothing fed for the prompt
    borrowed = state.engine.engine.cache.layers
    assert all(c is ver.cache.layers[i] for c, i in zip(borrowed, proposer.skip_set.keep))
    sizes: list[int] = []  # the tokens of each draft pass
    for name in ("feed", "feed_masked"):
        real = getattr(state.engine, name)
        setattr(
            state.engine,
            name,
            lambda t, *a, real=real, **k: sizes.append(len(t)) or real(t, *a, **k),
        )
    alone = MLXEngine(model)  # the same verifier, no draft beside it
    alone.feed(prompt[:-1])
    seq, fed, rounds = list(prompt), [], []
    for _ in range(6):
        held = ver.length
        before = [np.array(c.keys[..., :held, :]) for c in ver.cache.layers]
        start = len(sizes)
        tree = proposer.propose(seq, 8, dec.chooser.noise)
        rounds.append(sizes[start:])
        fed.append(len(state.tokens) - held)  # nothing left of the round's feeding
        assert ver.length == held and all(c.offset == held for c in ver.cache.layers)
        for c, b in zip(ver.cache.layers, before):  # not a row of the verifier's written
            assert np.array_equal(np.array(c.keys[..., :held, :]), b)
        verdict = dec.verify(seq, tree)
        proposer.observe(seq, tree, verdict)
        new = [tree.tokens[n] for n in verdict.path] + [verdict.token]
        # the verifier's rows are those of the verifier alone fed the same tokens (up to MLX's
        # float32 rounding in passes of other shapes: the kernel's passes agree bitwise)
        alone.feed([seq[-1], *new[:-1]])
        for c, a in zip(ver.cache.layers, alone.cache.layers):
            got, want = (
                np.array(c.keys[..., : ver.length, :]),
                np.array(a.keys[..., : ver.length, :]),
            )
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        seq += new
    assert fed == [0] * 6
    # each round feeds the root alone, then a level's best nodes a pass
    assert all(r and r[0] == 1 and max(r) <= layer_skip.TREE_TOPK for r in rounds)


def test_the_search_scores_the_draft_as_its_rounds_compute(model):
    """The search's one masked pass gives each chain step what a round gives it: the root over
    the verifier's keys and values before it, then each guess (here the text's own token) over
    the same and the draft's rows of the chain so far."""
    text = layer_skip.search_text(model, _prompts()[1])
    keep = [i for i in range(LAYERS) if i not in (2, 3)]
    context = MLXEngine(model)
    context.feed(text, last_only=True)
    view = layer_skip.LayerSkipView(model, keep, cache_of=lambda: context.cache)
    rows, depth = 5, 3
    got = layer_skip._draft_rows(view, text, rows, depth)
    assert got.shape[:2] == (rows, depth) and context.length == len(text)  # its rows forgotten
    T = len(text)
    for r, p in enumerate(range(T - rows - depth + 1, T - depth + 1)):
        ver = MLXEngine(model)
        ver.feed(text[:p])
        v = layer_skip.LayerSkipView(model, keep, cache_of=lambda ver=ver: ver.cache)
        state = layer_skip.SharedCacheState(tree_engine(MLXEngine(v)), model.config.vocab_size)
        state.reset(text[: p + 1])
        want = [state.sync(text[: p + 1])]
        chain, node = TokenTree.root(text[p]), 0
        for j in range(1, depth):
            node = chain.add(node, text[p + j])
            want.append(state.expand(chain, [node])[0])
        state.release()
        assert ver.length == p
        assert np.allclose(got[r], np.stack(want), atol=1e-4), (r, p)
    # not what the draft over its own cache computes (its keys drift from the verifier's)
    own = layer_skip.LayerSkipView(model, keep)(mx.array([text]))[0, T - rows - depth + 1 :]
    assert not np.allclose(np.array(own)[:rows], got[:, 0], atol=1e-2)


def test_a_draft_that_skips_nothing_reaches_every_step(model):
    """`chain_reach` compares each chain step with the verifier's token at that step's own
    position: a view keeping every layer is the verifier, so every chain reaches all the way
    (a step compared one position off would miss on this random text)."""
    text = np.random.default_rng(7).integers(5, 96, 40).tolist()
    context = MLXEngine(model)
    context.feed(text, last_only=True)
    whole = layer_skip.LayerSkipView(model, range(LAYERS), cache_of=lambda: context.cache)
    ref = layer_skip._greedy_rows(model, text, 12)
    for depth in (1, 3):
        assert layer_skip.chain_reach(whole, text, ref, depth) == [1.0] * depth
    assert np.mean(ref[1:] == ref[:-1]) < 0.5  # what makes a step one position off miss


def test_the_predicted_speedup_reads_how_far_the_chains_reached():
    flat = CostProfile(list(SIZES), [1.0] * len(SIZES))
    # one measured step: each further guess accepted as often (independently)
    a, f = 0.9, 0.3
    iid = max(sum(a**j for j in range(k + 1)) / (k * f + 1) for k in range(1, 9))
    assert layer_skip.predicted_speedup([a], f, flat) == pytest.approx(iid)
    assert layer_skip.predicted_speedup([a, a**2, a**3], f, flat) == pytest.approx(iid)
    # the same first step, chains that break off sooner: less
    falling = layer_skip.predicted_speedup([0.9, 0.5, 0.2, 0.05], f, flat)
    assert falling < iid
    assert falling == pytest.approx(max((1 + 0.9) / 1.3, (1 + 0.9 + 0.5) / 1.6))


def test_the_search_is_cached_and_reused(model, monkeypatch):
    layer_skip._MEMORY.clear()
    path = layer_skip.skip_set_path(model)
    path.unlink(missing_ok=True)
    dec = make_decoder(MLXEngine(model), None, SamplingParams(), Speculation(method="self"))
    list(dec.run(_prompts()[2], 4))
    assert path.exists()
    saved = layer_skip.SkipSet.from_json(json.loads(path.read_text()))
    assert saved.tried and saved.cost_profile and saved.speedup > 0
    # deterministic: searching again over the same text gives the same set
    text = layer_skip.search_text(model, _prompts()[2])
    verify = CostProfile(list(SIZES), [1.0 + 0.02 * n for n in SIZES])
    assert layer_skip.search_skip_set(model, text, verify).to_json() == saved.to_json()

    def no_search(*a, **k):
        raise AssertionError("searched again")

    monkeypatch.setattr(layer_skip, "search_skip_set", no_search)
    layer_skip._MEMORY.clear()  # a new process: only the file remains
    for prompt in _prompts():  # other prompts: the cached set, not a new search
        dec = make_decoder(MLXEngine(model), None, SamplingParams(), Speculation(method="self"))
        got = [t for r in dec.run(prompt, 16) for t in r.tokens]
        assert got == _plain_greedy(model, prompt, 16)
    assert any(p == path for p, _ in pass_costs.cached_skip_sets())
    # an unreadable file is searched again, not trusted
    path.write_text("{")
    layer_skip._MEMORY.clear()
    with pytest.raises(AssertionError, match="searched again"):
        layer_skip.load_skip_set(model, _prompts()[0], verify)


needs_kernel = pytest.mark.skipif(
    not kernel.available(), reason=f"no CPU kernel here: {kernel._unavailable or 'not on the CPU'}"
)


def _served(tmp_path, arch, seed=3):
    path = tiny.write_model(
        tmp_path / arch, seed=seed, layers=LAYERS, arch=arch, tie=arch == "qwen2"
    )
    m = load_model(path, dequantize=True).model
    kernel.serve(m, "f32")  # every CPU the kernel loads on has float32 products
    return m


@needs_kernel
@pytest.mark.parametrize("arch", ARCHS)
def test_on_the_cpu_kernel_the_draft_reads_int8_copies_of_the_kept_layers(
    tmp_path, arch, monkeypatch
):
    monkeypatch.setenv(layer_skip.READING_ENV, "int8")  # asked for: copies cost memory
    m = _served(tmp_path, arch)
    keep = [0, 2, 3, LAYERS - 1]
    before = {k: np.array(v) for k, v in tree_flatten(m.parameters())}
    reading = layer_skip.int8_reading(m, keep)
    assert reading is not None and sorted(reading.layers) == keep
    view = layer_skip.LayerSkipView(m, keep, reading)
    for j, i in enumerate(keep):
        mine, theirs = view.layers[j], m.layers[i]
        assert mine is not theirs and mine.mlp.down_proj._dtype == kernel._S8
        assert theirs.mlp.down_proj._dtype != kernel._S8  # the verifier's own stay as served
        assert mine.input_layernorm is theirs.input_layernorm  # the rest is shared
        assert mine.self_attn.rope is theirs.self_attn.rope
    assert view.model.embed_tokens is m.model.embed_tokens and view.head is reading.head
    after = dict(tree_flatten(m.parameters()))
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], np.array(after[k])) for k in before)
    # the view is the verifier without the skipped layers, its products rounded to int8
    toks = mx.array([_prompts()[1]])
    h = m.model.embed_tokens(toks)
    for i in keep:
        h = m.layers[i](h, "causal", None, None)
    want = np.array(mx.array(m.head.as_linear(m.model.norm(h)) if m.config.tie_word_embeddings
                             else m.lm_head(m.model.norm(h))))  # fmt: skip
    got = np.array(view(toks))
    assert got.shape == want.shape and not np.array_equal(got, want)
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
    # and self-speculation through it gives the verifier's greedy tokens
    _profiled(m)
    layer_skip._MEMORY.clear()
    copies = []  # made per generation: once, at the first (each builds its proposer anew)
    real_copy = kernel.int8_copy
    monkeypatch.setattr(kernel, "int8_copy", lambda *a: copies.append(1) or real_copy(*a))
    accepted, made = 0, []
    for prompt in _prompts():
        dec = make_decoder(MLXEngine(m), None, SamplingParams(), Speculation(method="self"))
        assert [t for r in dec.run(prompt, 24) for t in r.tokens] == _plain_greedy(m, prompt, 24)
        accepted += dec.stats.accepted
        made.append(len(copies))
    assert accepted > 0
    assert made[0] > 0 and made[1:] == [made[0]] * 2
    found = layer_skip.cached_skip_set(m)
    assert found is not None and found.reading == "int8" and "int8 copies" in found.describe()
    assert found.draft_fraction > 0  # measured (a tiny model's int8 step is glue: not < 1)


def _self_gives_plains_tokens(m) -> layer_skip.SkipSet:
    """Method `self` on `m` (its skip set searched under a fixed profile) gives plain greedy
    decoding's tokens on every test prompt; the skip set it cached."""
    _profiled(m)
    layer_skip._MEMORY.clear()
    for prompt in _prompts():
        dec = make_decoder(MLXEngine(m), None, SamplingParams(), Speculation(method="self"))
        assert [t for r in dec.run(prompt, 24) for t in r.tokens] == _plain_greedy(m, prompt, 24)
    found = layer_skip.cached_skip_set(m)
    assert found is not None
    return found


needs_avx512_bf16 = pytest.mark.skipif(
    not kernel.available() or "avx512_bf16" not in kernel._cpu_flags(),
    reason="no AVX512-BF16 products here",
)


@needs_avx512_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_self_draft_reads_the_verifiers_own_weights_by_the_one_row_implementation(
    tmp_path, arch, monkeypatch
):
    """By default (no copies asked for) the draft's kept layers and head read the very same
    bf16 buffers as the verifier, through AVX512-BF16's products in its decoding passes (on a
    CPU with AMX, where the verifier's passes get AMX's; elsewhere asked for here, so that the
    path runs on every CPU with AVX512-BF16) except where the verifier's own reading is the
    faster one (its transposed products), and self-speculation still gives plain's tokens."""
    want = kernel.one_row_impl() or kernel.AVX512_BF16
    monkeypatch.setattr(kernel, "one_row_impl", lambda: want)
    monkeypatch.setattr(kernel, "DRAFT_VOCAB", 64)  # the head's first 64 ids of 96, in place
    path = tiny.write_model(tmp_path / arch, seed=3, layers=LAYERS, arch=arch, tie=arch == "qwen2")
    m = load_model(path, dequantize=True).model
    kernel.serve(m, "bf16")
    keep = [0, 2, 3, LAYERS - 1]
    reading = layer_skip.self_reading(m, keep)
    assert reading is not None and reading.kind == "one-row" and sorted(reading.layers) == keep
    theirs = {id(v) for _, v in tree_flatten(m.parameters())}
    for part in [reading.head, *reading.layers.values()]:  # no byte of weights more
        assert all(id(v) in theirs for _, v in tree_flatten(part.parameters()))
    view = layer_skip.LayerSkipView(m, keep, reading)
    for j, i in enumerate(keep):
        mine, own = view.layers[j].mlp.down_proj, m.layers[i].mlp.down_proj
        assert mine is not own and mine._weight_ptr == own._weight_ptr
        assert mine.decode_impl == want and own.decode_impl is None  # the verifier's as served
    assert type(view.head) is kernel.KernelLinear and view.head._weight_ptr == m.head._weight_ptr
    assert view.head.out_features == (view.config.draft_vocab_size or m.head.out_features)
    # the head's first 64 rows, read in place: a row-major head's (transposed on AMX) always, a
    # packed one's where its layout keeps them as one
    in_place = not m.head._packed or m.head.prefix(64) is not None
    assert view.head.out_features == (64 if in_place else m.head.out_features)
    impls: list[tuple[bool, str]] = []
    run = kernel._Plan.run

    def spy(plan, *args):
        if plan.key[2] == kernel._BF16:
            impls.append((plan.transposed, plan.impl))
        run(plan, *args)

    monkeypatch.setattr(kernel._Plan, "run", spy)
    engine = MLXEngine(view)
    engine.feed(_prompts()[1])
    engine.feed([7])  # a first decoding pass: its plans are checked (`_invariant`)
    impls.clear()
    engine.feed([8])  # a decoding pass: every bf16 product the one-row implementation's...
    assert impls and {impl for t, impl in impls if not t} == {want}
    # ...but those the verifier takes transposed (AMX at a few rows, on their row-major weights:
    # faster there than AVX512-BF16 on the same buffer), which the draft reads as it does
    assert any(t for t, _ in impls) == kernel.transposes()
    monkeypatch.setattr(kernel._Plan, "run", run)
    found = _self_gives_plains_tokens(m)
    assert found.reading == "one-row" and "one-row" in found.describe()
    assert "-shared-" in layer_skip.skip_set_path(m).name  # cached for the reading asked for


def test_a_bad_self_reading_is_refused_naming_the_variable(tmp_path, monkeypatch):
    from ondevice.errors import OndeviceError

    m = load_model(tiny.write_model(tmp_path / "v", layers=4)).model
    monkeypatch.setenv(layer_skip.READING_ENV, "fp8")
    with pytest.raises(OndeviceError, match="ONDEVICE_SELF_READING='fp8': choose one of shared"):
        make_decoder(MLXEngine(m), None, SamplingParams(), Speculation(method="self"))


@needs_kernel
def test_a_self_draft_scoring_fewer_ids_changes_no_token(tmp_path, monkeypatch):
    m = _served(tmp_path, "qwen2", seed=7)
    monkeypatch.setattr(kernel, "DRAFT_VOCAB", 40)  # the tiny vocabulary's first 40 ids only
    reading = layer_skip.int8_reading(m, range(LAYERS))
    view = layer_skip.LayerSkipView(m, range(LAYERS), reading)
    assert view.config.draft_vocab_size == 40 and reading.head.out_features == 40
    logits = np.array(view(mx.array([_prompts()[0]])))
    assert np.isneginf(logits[..., 40:]).all() or logits.shape[-1] == 40
    text = layer_skip.search_text(m, _prompts()[2])
    found = layer_skip.search_skip_set(m, text, None, reading, fraction=lambda skip: 0.1)
    assert found.reading == "int8" and found.draft_fraction == 0.1
    later = [t for t in _plain_greedy(m, _prompts()[1], 64) if t >= 40]
    assert later  # the verifier does say ids the draft cannot
    for prompt in _prompts():
        spec = Speculation(method="self", num_draft_tokens=4, profile=False)
        dec = make_decoder(MLXEngine(m), None, SamplingParams(), spec)
        dec.proposer.skip_set = found  # type: ignore[attr-defined]
        assert [t for r in dec.run(prompt, 32) for t in r.tokens] == _plain_greedy(m, prompt, 32)
        assert dec.stats.drafted > 0


@needs_kernel
@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_without_a_one_row_implementation_the_draft_reads_the_heads_first_rows_in_place(
    tmp_path, monkeypatch, kind
):
    """Where the CPU has no faster one-row implementation (AMD's Zen: no AMX), the default
    reading is the verifier's own layers with the head's first `DRAFT_VOCAB` rows, read from
    the head's own buffer (nothing copied), and self-speculation still gives plain's tokens."""
    if kind == "bf16" and kernel.choice() != "bf16":
        pytest.skip("no bf16 kernel here")
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))  # its skip set is its own
    monkeypatch.setattr(kernel, "one_row_impl", lambda: None)
    monkeypatch.setattr(kernel, "DRAFT_VOCAB", 64)  # the head's first 64 ids of 96
    path = tiny.write_model(tmp_path / "q", seed=3, layers=LAYERS, arch="qwen2", tie=True)
    m = load_model(path, dequantize=True).model
    kernel.serve(m, kind)
    reading = layer_skip.self_reading(m, range(LAYERS))
    if reading is None:  # a packed head whose first 64 rows are not laid out as one
        assert m.head._packed and m.head.prefix(64) is None
        return
    assert reading.kind == "head-prefix" and reading.layers == {}
    assert reading.head.out_features == 64 and reading.head._weight_ptr == m.head._weight_ptr
    keep = [0, 2, 3, LAYERS - 1]
    view = layer_skip.LayerSkipView(m, keep, reading)
    assert all(view.layers[j] is m.layers[i] for j, i in enumerate(keep))  # the same modules
    assert view.config.draft_vocab_size == 64
    found = _self_gives_plains_tokens(m)
    assert found.reading == "head-prefix"
    assert "the head's first rows only" in found.describe()
    # a larger vocabulary than the head has: nothing to leave out, the verifier's own head
    monkeypatch.setattr(kernel, "DRAFT_VOCAB", 96)
    assert layer_skip.self_reading(m, keep) is None


@needs_kernel
def test_the_int8_drafts_cost_is_measured_and_falls_with_the_layers_skipped(tmp_path):
    m = _served(tmp_path, "llama")
    reading = layer_skip.int8_reading(m, range(LAYERS))
    fraction = layer_skip.measured_fraction(m, reading)
    none, most = fraction([]), fraction(list(range(1, LAYERS - 1)))
    assert 0 < most <= none and 0.1 < none < 10  # a share of a verifier pass, not seconds


def test_a_verifier_too_shallow_is_refused_clearly(tmp_path):
    from ondevice.errors import OndeviceError

    m = load_model(tiny.write_model(tmp_path / "v", layers=1)).model
    with pytest.raises(OndeviceError, match="at least two layers"):
        make_decoder(MLXEngine(m), None, SamplingParams(), Speculation(method="self"))


def test_through_the_api_without_a_draft(tmp_path, monkeypatch):
    import ondevice

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    gen = ondevice.load(tiny.write_model(tmp_path / "v", layers=4, seed=5))
    assert gen.draft is None
    plain = gen.generate("hello there", max_tokens=20, speculative=False).text
    out = gen.generate("hello there", max_tokens=20, method="self")
    assert out.text == plain


def test_through_the_server_with_the_openai_client(tmp_path, monkeypatch):
    import httpx
    from test_server import LiveServer

    import ondevice

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    gen = ondevice.load(tiny.write_model(tmp_path / "v", layers=4, seed=5))
    messages = [{"role": "user", "content": "hello there"}]
    with LiveServer(gen) as server:
        answers = []
        for extra in ({"speculative": False}, {"method": "self"}):
            r = server.client().chat.completions.create(
                model=gen.model_name, messages=messages, max_tokens=16, temperature=0,
                extra_body=extra,
            )  # fmt: skip
            answers.append(r.choices[0].message.content)
            drafted = r.model_extra["ondevice"]["drafted"]
        assert answers[0] == answers[1]
        assert drafted > 0  # the request's method was used: no draft model, yet drafts
        bad = {"model": gen.model_name, "messages": messages, "method": "selff"}
        r = httpx.post(server.url + "/v1/chat/completions", json=bad, timeout=30)
        assert r.status_code == 400 and "unknown method" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "method"


# -- sampling: the joint law of the first two tokens (as tests/test_tree.py does) -------------------

N_SAMPLES = 20_000
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


@pytest.mark.slow
def test_sampled_self_speculation_matches_the_verifier_distribution(tmp_path):
    cfg = {**tiny.SMALL_VOCAB, "layers": 3}
    model = load_model(tiny.write_model(tmp_path / "v", scale=0.6, **cfg)).model
    ver = MLXEngine(model)  # the self-draft reads its cache
    ver.feed(PROMPT[:-1])  # once: each generation resumes from it
    params = SamplingParams(1.0)
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(N_SAMPLES):
        spec = Speculation(method="self", num_draft_tokens=3, profile=False)
        dec = make_decoder(ver, None, params, spec, seed=seed)
        ver.trim(ver.length - (len(PROMPT) - 1))
        toks: list[int] = []
        for r in dec.run(PROMPT, 3, resume=True):
            toks.extend(r.tokens)
            if len(toks) >= 2:
                break
        counts[tuple(toks[:2])] += 1
        drafted, accepted = drafted + dec.stats.drafted, accepted + dec.stats.accepted
    assert drafted > N_SAMPLES and accepted > N_SAMPLES // 50
    exact = dict(np.ndenumerate(exact_joint(MemoEngine(model), PROMPT, params)))
    assert chi_square_p(counts, exact) > 0.001


def test_doctor_prints_the_cached_skip_sets(tmp_path, monkeypatch):
    from ondevice.apps import doctor

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path))
    found = layer_skip.SkipSet([3, 5], 8, 0.61, 0.7, 1.1, 96, model="qwen2 64x8")
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "skip-abc-def.json").write_text(json.dumps(found.to_json()))
    (tmp_path / "profiles" / "skip-bad-def.json").write_text("{")  # unreadable: left out
    report = doctor.collect()
    assert [s["skip"] for s in report["skip_sets"]] == [[3, 5]]
    assert "self draft  qwen2 64x8: skips 2 of 8 layers [3, 5]" in doctor.render(report)

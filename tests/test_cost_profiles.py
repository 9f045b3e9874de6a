"""Pass-cost profiles that are not stale (issue 26 item 4): a profile is named and checked by what
determines the cost (the kernel serving the products among it), live passes that disagree with it
for several generations get it measured again, and `ondevice doctor` lists what is cached.
`auto`'s candidates without a draft model (issue 30 item 4) are at the end."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest
import tiny
from support.engines import TableEngine, TreeTableEngine
from support.medusa_heads import write_heads

from ondevice.decoders.factory import make_decoder
from ondevice.models import load_model
from ondevice.proposers import layer_skip, registry
from ondevice.proposers.base import NoProposal, Unavailable
from ondevice.proposers.resources import Speculation
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime import kernel, pass_costs
from ondevice.runtime.engines import MLXEngine
from ondevice.runtime.pass_costs import (
    DRIFT_PASSES,
    DRIFT_WARMUP,
    CostProfile,
    CostWatch,
    device_name,
    engine_key,
    load_profile,
    profile_path,
)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _generation(watch: CostWatch, ratio: float) -> None:
    """One generation's timed passes, each `ratio` times what the profile measured."""
    for n in [1, 2] * ((DRIFT_WARMUP + DRIFT_PASSES) // 2 + 1):
        watch.observe(n, float(watch.profile.measured_cost(n)) * ratio)


@pytest.mark.skipif(not kernel.available(), reason="no CPU kernel here")
def test_a_profile_measured_with_mlx_products_is_not_read_once_the_kernel_serves(home, tmp_path):
    model = load_model(tiny.write_model(tmp_path / "v", seed=1)).model
    before = engine_key(MLXEngine(model))
    load_profile(MLXEngine(model), sizes=(1, 2))
    assert kernel.products(model) == "mlx"
    kernel.serve(model, "f32")  # float32 weights either way: only the kernel differs
    assert kernel.products(model) == f"onednn-f32 x{kernel.default_threads()} r{kernel.REVISION}"
    after = engine_key(MLXEngine(model))
    assert after != before
    prof = load_profile(MLXEngine(model), sizes=(1, 2))
    assert prof.model == after  # measured for the served model, not the MLX one's file
    assert prof.kernel == kernel.products(model) and "onednn-f32" in prof.describe()
    assert len(list((home / "profiles").glob("*.json"))) == 2


def test_a_file_measured_for_another_device_or_engine_is_measured_again(home):
    eng = TableEngine.cycle()
    path = profile_path(device_name(), engine_key(eng))
    path.parent.mkdir(parents=True)
    other = CostProfile([1, 2], [5.0, 6.0], "another machine", engine_key(eng), 256, 1.0)
    path.write_text(json.dumps(other.to_json()))
    prof = load_profile(eng, sizes=(1, 2))
    assert eng.fed > 0 and prof.device == device_name() and prof.seconds != [5.0, 6.0]
    # an old format (no kernel in its name, no measurement time) is not read either
    path.write_text(json.dumps({**prof.to_json(), "format": 1}))
    fed = eng.fed
    load_profile(eng, sizes=(1, 2))
    assert eng.fed > fed


def test_live_passes_that_disagree_for_generations_get_the_profile_measured_again(home, capsys):
    eng = TableEngine.cycle()
    prof = load_profile(eng, sizes=(1, 2, 4))
    assert prof.measured > 0 and prof.path is not None
    assert "measuring pass costs on this machine, once" in capsys.readouterr().err
    fed = eng.fed

    def on_disk() -> CostProfile:
        return CostProfile.from_json(json.loads(prof.path.read_text()))

    first = CostWatch(prof)
    _generation(first, 3.0)  # the machine got three times slower
    assert first.judged and on_disk().strikes == 1 and not on_disk().stale
    assert prof.strikes == 0 and prof.seconds == on_disk().seconds  # the generation's own copy
    assert load_profile(eng, sizes=(1, 2, 4)).seconds == prof.seconds and eng.fed == fed
    _generation(CostWatch(load_profile(eng, sizes=(1, 2, 4))), 3.0)
    assert on_disk().stale and on_disk().live_ratio == pytest.approx(3.0)
    assert "stale" in on_disk().describe()
    # a generation never measures: it sizes with the measured costs scaled by the live ratio,
    # and says so once on stderr
    capsys.readouterr()
    for _ in range(2):
        stale = load_profile(eng, sizes=(1, 2, 4))
        assert eng.fed == fed and stale.seconds == prof.seconds
        assert stale(2) == pytest.approx(3.0 * prof(2)) and stale.measured_cost(2) == prof(2)
    assert capsys.readouterr().err.count("are stale: live passes took 3.00x them") == 1
    # its passes are judged against the measured costs: still 3x, still stale
    _generation(CostWatch(stale), 3.0)
    assert on_disk().stale and on_disk().live_ratio == pytest.approx(3.0)
    assert pass_costs.remeasure_stale(TableEngine.cycle(vocab=eng.vocab_size + 1)) is None
    again = pass_costs.remeasure_stale(eng)  # at the next load, announced
    assert "measuring the pass costs in" in capsys.readouterr().err
    assert eng.fed > fed and not again.stale and again.strikes == 0 and again.sizes == [1, 2, 4]
    assert again(2) == again.measured_cost(2) and on_disk().seconds == again.seconds
    fed = eng.fed
    assert pass_costs.remeasure_stale(eng).seconds == again.seconds and eng.fed == fed
    # one strike, then a generation that agrees: cleared
    _generation(CostWatch(again), 0.2)
    assert on_disk().strikes == 1
    _generation(CostWatch(load_profile(eng, sizes=(1, 2, 4))), 1.1)
    assert on_disk().strikes == 0 and not on_disk().stale
    # too few passes: not judged
    short = CostWatch(again)
    for _ in range(DRIFT_WARMUP + DRIFT_PASSES - 1):
        short.observe(1, 100.0)
    assert not short.judged and on_disk().strikes == 0


def test_a_stale_profile_is_measured_at_load_never_in_a_generation(home, tmp_path, capsys):
    """Issue 26 item 4: a stale profile was measured by the next generation's `make_decoder`,
    a silent stall of that request; now the generation sizes with it scaled and says so, and
    `ondevice.load` measures it again, announced."""
    import ondevice

    path = tiny.write_model(tmp_path / "v", seed=1)
    gen = ondevice.load(path)
    prof = load_profile(gen.verifier, sizes=(1, 2))
    stale = {**prof.to_json(), "stale": True, "strikes": 2, "live_ratio": 3.0}
    pass_costs.save_profile(prof.path, stale)
    capsys.readouterr()
    out = gen.generate([5, 6, 7, 5, 6, 7, 5, 6], max_tokens=8, method="pld")
    assert out.tokens and json.loads(prof.path.read_text())["measured"] == prof.measured
    assert "are stale: live passes took 3.00x them" in capsys.readouterr().err
    ondevice.load(path)
    again = json.loads(prof.path.read_text())
    assert again["measured"] > prof.measured and not again["stale"] and again["sizes"] == [1, 2]
    assert "measuring the pass costs in" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["tree", "auto"])
def test_a_stale_mark_never_changes_a_seeded_answer(home, tmp_path, method):
    """A seeded sample gives the same tokens every time on a machine: trees are sized by the
    costs as measured, never by a live ratio the clock wrote into the file between two
    generations (the prompt cache's seeded tree test failed once this way when the machine
    was busy: one generation's passes marked the tiny pair's shared profile stale, and the
    next was sized by a clock-made scale)."""
    import ondevice

    v = tiny.write_endless_model(tmp_path / "v", seed=1)
    gen = ondevice.load(v, tiny.perturbed_copy(v, tmp_path / "d", noise=0.3), draft_backend="mlx")
    prompt = [5, 6, 7, 9, 11, 5, 6, 8]
    kw = {"max_tokens": 24, "method": method, "temperature": 0.8, "seed": 11}
    first = gen.generate(prompt, **kw)
    prof = load_profile(gen.verifier, measure_if_missing=False)
    assert prof is not None and prof.measured and not prof.stale
    for ratio in (50.0, 0.02):  # passes far slower (bigger trees pay), far faster (smaller)
        stale = {**prof.to_json(), "stale": True, "strikes": 2, "live_ratio": ratio}
        pass_costs.save_profile(prof.path, stale)
        assert load_profile(gen.verifier)(4) == pytest.approx(ratio * prof(4))
        again = gen.generate(prompt, **kw)
        assert again.tokens == first.tokens
        # an unseeded sample promises no tokens: it is sized for what passes take now
        unseeded = {**kw, "seed": None}
        assert len(gen.generate(prompt, **unseeded).tokens) == kw["max_tokens"]


def test_a_profile_times_branched_tree_passes_where_the_engine_has_them(home, tmp_path):
    """`CostProfile.branched`: tree passes in two branches are timed beside causal ones (what
    `kernel._path_layout` adds for branched rows is priced); an engine without tree passes
    prices them as causal ones."""
    from ondevice.runtime.engines import MLXTreeEngine

    model = load_model(tiny.write_model(tmp_path / "v", seed=1)).model
    shapes = []
    feed_masked = MLXTreeEngine.feed_masked

    def spy(self, tokens, positions, visible, **kw):
        own = np.asarray(visible)[:, -len(tokens) :]
        shapes.append((len(tokens), list(positions), own.sum(1).tolist()))
        return feed_masked(self, tokens, positions, visible, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MLXTreeEngine, "feed_masked", spy)
        prof = load_profile(MLXEngine(model), sizes=(1, 2, 4, 8))
    assert prof.tree_sizes == [4, 8] and len(prof.tree_seconds) == 2
    # four tokens: a path of two and a branch of two below the first, at depths 0, 1, 1, 2
    n, positions, seen = shapes[0]
    assert n == 4 and np.diff(positions).tolist() == [1, 0, 1] and seen == [1, 2, 2, 3]
    on_disk = load_profile(MLXEngine(model), measure_if_missing=False)
    assert on_disk.tree_seconds == prof.tree_seconds  # cached with the rest
    for k in (2, 4, 6, 8, 12):
        assert prof.branched(k) >= prof(k)
    assert prof.branched(1) == prof(1)
    assert f"branched trees {{4: {prof.branched(4) * 1000:.0f}, " in prof.describe()  # doctor
    stale = replace(prof, stale=True, live_ratio=3.0)
    assert stale.branched(8) == pytest.approx(3.0 * prof.branched(8))
    assert stale.as_measured().branched(8) == prof.branched(8)
    table = load_profile(TableEngine.cycle(), sizes=(1, 2, 4))
    assert table.tree_sizes == [] and table.branched(4) == table(4)


def test_a_draft_expanding_several_nodes_is_charged_a_branched_pass():
    from ondevice.proposers.draft_tree import DraftState
    from ondevice.rules.token_tree import TokenTree

    cost = CostProfile([1, 4], [1.0, 1.3], tree_sizes=[4], tree_seconds=[2.0])
    state = DraftState(TreeTableEngine.cycle(), TreeTableEngine.cycle().vocab_size, cost)
    state.reset([5, 6, 7])
    state.sync([5, 6, 7])
    tree = TokenTree.root(7)
    one = tree.add(0, 8)
    state.work = 0.0
    state.expand(tree, [one])
    assert state.work == pytest.approx(cost(1))
    kids = [tree.add(one, t) for t in (2, 3, 4, 9)]
    state.expand(tree, kids)
    assert state.work == pytest.approx(cost(1) + 2.0)


def test_a_layer_skipped_draft_costs_its_share_of_every_measured_pass():
    """`layer_skip.scaled_profile`: the long context's and the branched passes' costs scale
    too (left unscaled, the long context's growth over a scaled short one priced a self
    draft's steps after a long prompt at several times their share)."""
    verify = CostProfile(
        [1, 4, 8], [1.0, 1.2, 1.4], context=256, long_context=1024, long_sizes=[1, 4, 8],
        long_seconds=[1.1, 1.4, 1.7], tree_sizes=[4, 8], tree_seconds=[1.3, 1.6],
    )  # fmt: skip
    draft = layer_skip.scaled_profile(verify, 0.5)
    for at in (0, 600, 1024, 2000):
        v, d = replace(verify, at=at), replace(draft, at=at)
        for n in (1, 4, 6, 8):
            assert d(n) == pytest.approx(0.5 * v(n))
            assert d.branched(n) == pytest.approx(0.5 * v.branched(n))


def test_a_profile_written_by_hand_is_never_judged(home):
    eng = TableEngine.cycle()
    path = profile_path(device_name(), engine_key(eng))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(CostProfile([1, 2], [5.0, 6.0]).to_json()))
    for _ in range(3):
        _generation(CostWatch(load_profile(eng, sizes=(1, 2))), 1e-4)
    assert json.loads(path.read_text())["strikes"] == 0 and eng.fed == 0


def test_generations_time_their_passes_for_the_watch(home, tmp_path):
    model = load_model(tiny.write_model(tmp_path / "v", seed=1)).model
    dec = make_decoder(MLXEngine(model), None, SamplingParams(), Speculation(method="pld"))
    list(dec.run([5, 6, 7, 5, 6, 7, 5, 6], 12))
    assert dec.cost_watch is not None and dec.cost_watch.seen == dec.stats.rounds > 0


@pytest.mark.parametrize("pipeline", [False, True], ids=["chain", "pipelined"])
def test_chain_generations_tell_the_watch_too(home, tmp_path, pipeline):
    """Issue 26 item 4: only tree decoders told the watch their passes, so generations by
    `chain` (the API's default method), pipelined or not, never noticed a stale profile."""
    model = load_model(tiny.write_endless_model(tmp_path / "v", seed=1)).model
    verifier, draft = MLXEngine(model), MLXEngine(model)
    key = engine_key(verifier)
    path = profile_path(device_name(), key)
    fast = CostProfile([1, 2, 4], [1e-7, 1.1e-7, 1.2e-7], device_name(), key, 8, time.time())
    pass_costs.save_profile(path, fast.to_json())  # "measured" far faster than passes run
    spec = Speculation(method="chain", num_draft_tokens=1, pipeline=pipeline)
    for generation in (1, 2):
        dec = make_decoder(verifier, draft, SamplingParams(), spec)
        list(dec.run([5, 6, 7, 5, 6, 7, 5, 6], 40))
        watch = dec.cost_watch
        assert watch is not None and watch.seen == dec.stats.rounds
        on_disk = json.loads(path.read_text())
        assert watch.judged and on_disk["strikes"] == generation
        assert on_disk["live_ratio"] > pass_costs.DRIFT_FACTOR
    assert on_disk["stale"]
    # nothing cached: nothing watched, and a chain, which sizes nothing by it, measures nothing
    path.unlink()
    assert make_decoder(verifier, draft, SamplingParams(), spec).cost_watch is None
    assert not path.exists()


def test_doctor_lists_the_profiles_with_what_they_were_measured_for(home):
    from ondevice.apps import doctor

    prof = load_profile(TableEngine.cycle(), sizes=(1, 2))
    report = doctor.collect()
    [listed] = report["profiles"]
    assert listed["model"] == prof.model and listed["measured"] == prof.measured
    text = doctor.render(report)
    assert f"pass costs  {prof.model}" in text and "measured 20" in text
    assert not listed["unused"] and "old costs" not in text
    # a profile the kernel measured before its last change of costs (`kernel.REVISION`) is
    # never looked up again: listed apart, as safe to delete; MLX's own products have none
    assert kernel.revision(f"onednn-bf16-blocked x2 r{kernel.REVISION} decode-x") == kernel.REVISION
    assert kernel.revision("mlx") is None
    old = json.loads(prof.path.read_text())
    old["kernel"], old["model"] = f"onednn-bf16 x2 r{kernel.REVISION - 1}", "mlx-0ld"
    stale = prof.path.with_name("mlx-0ld-" + prof.path.name.split("-")[-1])
    stale.write_text(json.dumps(old))
    report = doctor.collect()
    unused = {p["model"]: p["unused"] for p in report["profiles"]}
    assert unused == {prof.model: False, "mlx-0ld": True}
    text = doctor.render(report)
    assert "pass costs  mlx-0ld" not in text and f"pass costs  {prof.model}" in text
    assert "old costs   1 pass-cost profile(s) measured by an older kernel" in text
    assert stale.name in text


# -- auto without a draft model -----------------------------------------------------------------


@pytest.fixture
def verifier(home, tmp_path):
    model = load_model(tiny.write_model(tmp_path / "v", seed=3, layers=4)).model
    path = profile_path(device_name(), engine_key(MLXEngine(model)))
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = CostProfile(list(pass_costs.SIZES), [1.0 + 0.02 * n for n in pass_costs.SIZES])
    path.write_text(json.dumps(flat.to_json()))
    layer_skip._MEMORY.clear()
    yield model
    layer_skip._MEMORY.clear()


def _auto(model, draft=None):
    dec = make_decoder(MLXEngine(model), draft, SamplingParams(), Speculation(method="auto"))
    return dec, [p.name for p in dec.proposer.proposers]


def _cache_skip_set(model, speedup: float) -> None:
    """Cache a skip set for `model` that predicts `speedup` over plain decoding."""
    skip = layer_skip.load_skip_set(model, [5, 6, 7, 8] * 4, None, cache=False)
    path = layer_skip.skip_set_path(model)
    pass_costs.save_profile(path, {**skip.to_json(), "speedup": speedup})
    layer_skip._MEMORY.clear()  # a new process: only the cached file


def test_auto_without_a_draft_takes_self_only_with_a_cached_skip_set_that_pays(
    verifier, monkeypatch
):
    def no_search(*a, **k):
        raise AssertionError("auto must not start a skip-set search")

    dec, names = _auto(verifier)
    assert names == ["plain", "pld", "lookahead"]
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    monkeypatch.setattr(layer_skip, "search_skip_set", no_search)
    list(dec.run(prompt, 8))
    assert "skip set" in dec.extra_stats()["auto_left_out"]["self"]
    monkeypatch.undo()
    _cache_skip_set(verifier, 0.9)
    dec, names = _auto(verifier)
    assert "self" not in names and "predicts 0.90x" in dec.proposer.left_out["self"]
    _cache_skip_set(verifier, 1.3)
    monkeypatch.setattr(layer_skip, "search_skip_set", no_search)
    dec, names = _auto(verifier)
    assert names == ["plain", "pld", "lookahead", "self"]
    out = [t for r in dec.run(prompt, 24) for t in r.tokens]
    plain = make_decoder(MLXEngine(verifier), None, SamplingParams())
    assert out == [t for r in plain.run(prompt, 24) for t in r.tokens]
    assert "self" not in dec.extra_stats().get("auto_left_out", {})  # medusa is: no heads
    # the layer-skipped draft, built at self's first reset, is charged in its rounds
    own = dec.proposer.proposers[names.index("self")]
    assert own.state is not None and any(d is own.state for d in dec.proposer.drafts)
    # a skip set whose draft reads int8 copies (the CPU kernel's) would cost auto a model's
    # worth of memory: left out, saying how much and how to use it
    skip = layer_skip.SkipSet.from_json(json.loads(layer_skip.skip_set_path(verifier).read_text()))
    pass_costs.save_profile(
        layer_skip.skip_set_path(verifier), {**skip.to_json(), "reading": "int8"}
    )
    layer_skip._MEMORY.clear()
    dec, names = _auto(verifier)
    assert "self" not in names
    assert (
        "int8 copies" in dec.proposer.left_out["self"] and " MB " in dec.proposer.left_out["self"]
    )


def test_self_asked_for_says_once_when_its_skip_set_predicts_no_gain(verifier, capsys):
    """Asked for by name, `self` runs whatever its skip set predicts (the output is exact), but
    a set predicting no gain over plain decoding is told once a process, with what else to try;
    one that pays is not."""
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]

    def run() -> list[int]:
        dec = make_decoder(MLXEngine(verifier), None, SamplingParams(), Speculation(method="self"))
        return [t for r in dec.run(prompt, 12) for t in r.tokens]

    plain = make_decoder(MLXEngine(verifier), None, SamplingParams())
    want = [t for r in plain.run(prompt, 12) for t in r.tokens]
    layer_skip._NOTED.clear()
    _cache_skip_set(verifier, 0.9)
    capsys.readouterr()
    assert run() == want
    told = capsys.readouterr().err
    assert "method 'self' is predicted at 0.90x plain decoding" in told
    assert "ONDEVICE_SELF_READING=int8" in told and "'medusa'" in told
    assert run() == want and "predicted" not in capsys.readouterr().err  # once a process
    # a set whose draft already reads int8 copies names no other reading
    layer_skip._NOTED.clear()
    skip = layer_skip.SkipSet.from_json(json.loads(layer_skip.skip_set_path(verifier).read_text()))
    path = layer_skip.skip_set_path(verifier)
    pass_costs.save_profile(path, {**skip.to_json(), "reading": "int8"})
    layer_skip._MEMORY.clear()
    assert run() == want
    told = capsys.readouterr().err
    assert "predicted at 0.90x" in told and "ONDEVICE_SELF_READING" not in told
    layer_skip._NOTED.clear()
    _cache_skip_set(verifier, 1.3)
    assert run() == want and "predicted" not in capsys.readouterr().err


def test_auto_builds_every_registered_candidate_and_says_why_it_left_one_out(verifier):
    def missing(res, spec):
        raise Unavailable("no heads trained for this verifier")

    registry.register(registry.Method("heads", "test", "-", proposer=missing, in_auto=True))
    registry.register(
        registry.Method("nothing", "test", "-", proposer=lambda r, s: NoProposal(), in_auto=True)
    )
    registry.register(registry.Method("hidden", "test", "-", proposer=missing))  # not in auto
    try:
        dec, names = _auto(verifier)
        assert names == ["plain", "pld", "lookahead", "plain"]  # "nothing"'s NoProposal
        left_out = dec.extra_stats()["auto_left_out"]
        assert left_out == {
            "self": dec.proposer.left_out["self"],
            "medusa": left_out["medusa"],  # no heads in the test's cache either
            "heads": "no heads trained for this verifier",
        }
        assert "ondevice distill --heads medusa" in left_out["medusa"]
    finally:
        for name in ("heads", "nothing", "hidden"):
            registry.unregister(name)


def test_auto_with_a_draft_drafts_with_it_and_leaves_the_verifiers_own_layers_out(
    verifier, tmp_path
):
    """The draft's one candidate, its tree, first (the likeliest to pay gets the first tries),
    then the others; the greedy path and the cascade are readings of the tree's guesses
    (docs/benchmarks.md, "Issue 26, session 16"). Lookahead, `self` (even with a skip set
    cached that pays) and Medusa's heads (even where trained) are left out beside a draft,
    saying so: a try of `self` costs a catch-up over the whole prompt through most of the
    verifier's layers (docs/benchmarks.md, "Issue 30, session 19"), and the heads' rounds
    beside the draft only lost ("Issues 26 and 30, session 25")."""
    draft = MLXEngine(load_model(tiny.write_model(tmp_path / "d", seed=4, layers=1)).model)
    _cache_skip_set(verifier, 1.3)
    write_heads(verifier)  # into this test's cache, where method "medusa" finds them
    dec, names = _auto(verifier, draft)
    assert names == ["plain", "tree", "pld"]
    left_out = dec.proposer.left_out
    assert set(left_out) == {"lookahead", "medusa", "self"}
    assert (
        left_out["self"]
        == left_out["lookahead"]
        == left_out["medusa"]
        == ("a draft model is loaded: auto drafts with it instead")
    )
    _, alone = _auto(verifier)  # without the draft the cached skip set and the heads are taken
    assert "self" in alone and "medusa" in alone
    assert registry.METHODS["self"].in_auto and not registry.METHODS["tree"].in_auto


class _Clocked(TableEngine):
    """A table model whose passes advance a fake clock by what they "cost": `per_pass` +
    `per_token` * n + `per_key` for each key each new token attends to, times 3 during a slow
    spell (the first `slow` passes of all engines)."""

    def __init__(self, clock, log, per_pass, per_token, vocab, per_key=0.0):
        super().__init__(vocab=vocab)
        self.clock, self.log, self.per_pass, self.per_token = clock, log, per_pass, per_token
        self.per_key = per_key

    def feed(self, tokens, last_only=False):
        self.log.append(self.vocab_size)
        spell = 3.0 if len(self.log) <= self.clock["slow"] else 1.0
        keys = sum(len(self.tokens) + i + 1 for i in range(len(tokens)))
        cost = self.per_pass + self.per_token * len(tokens) + self.per_key * keys
        self.clock["now"] += cost * spell
        return super().feed(tokens, last_only)


def test_missing_profiles_are_measured_together_so_a_slow_spell_moves_both_alike(
    home, monkeypatch, capsys
):
    """Measured one after the other, a verifier caught in a slow spell of a shared machine and
    its draft measured after it give the draft's step a wrong share of a pass, and every round
    is sized by that share. Measured together, every repeat times both."""
    clock, log = {"now": 0.0, "slow": 0}, []
    fake = type("Time", (), {"perf_counter": lambda: clock["now"], "time": time.time})
    monkeypatch.setattr(pass_costs, "time", fake)
    verifier = _Clocked(clock, log, 1.0, 0.1, vocab=12)
    draft = _Clocked(clock, log, 0.3, 0.03, vocab=13)
    # a slow spell over the first 40% of the passes a measurement makes (prefills included)
    per_engine = 1 + 4 * len(pass_costs.SIZES)  # the budget stops it after 4 rounds here
    clock["slow"] = int(0.4 * 2 * per_engine)
    one_by_one = [pass_costs.measure(e) for e in (verifier, draft)]
    assert one_by_one[1](1) / one_by_one[0](1) < 0.15  # the verifier's costs all slow
    log.clear()
    v, d = pass_costs.load_profiles([verifier, draft])
    assert d(1) / v(1) == pytest.approx(0.33 / 1.1, rel=0.02)
    assert v(8) == pytest.approx(1.8) and d(8) == pytest.approx(0.54)
    # every round times both: the engines take turns after the two prefills
    rounds = [log[i] for i in range(2, len(log), len(pass_costs.SIZES))]
    assert rounds[:4] == [12, 13, 12, 13]
    # each cached in its own file, announced; read back (nothing measured) next time
    assert v.path != d.path and v.path.exists() and d.path.exists()
    assert capsys.readouterr().err.count("measuring pass costs on this machine, once") == 2
    log.clear()
    again = pass_costs.load_profiles([verifier, draft])
    assert [p.seconds for p in again] == [v.seconds, d.seconds] and not log


def test_what_more_tokens_cost_grows_past_the_measured_context_as_the_long_one_measured():
    """A pass's excess over a one-token pass at the committed context `at`: as measured up to
    `context`, then grown by the share of the way to `long_context` (and on beyond it) of what
    that excess grew by between the two; the one-token pass as measured, noise never making a
    size cheaper, and trees sized by the costs smaller on a long prompt."""
    prof = CostProfile(
        [1, 2, 4, 8, 16], [1.0, 1.05, 1.1, 1.2, 1.4], context=256,
        long_context=1024, long_sizes=[1, 4, 8, 16], long_seconds=[1.02, 1.07, 1.6, 2.2],
    )  # fmt: skip
    grown = (1.6 - 1.02) - (1.2 - 1.0)  # at 8 tokens; at 4, noise: (1.07 - 1.02) < 0.1
    for at, share in [(0, 0.0), (200, 0.0), (256, 0.0), (640, 0.5), (1024, 1.0), (1792, 2.0)]:
        prof.at = at
        assert prof(1) == pytest.approx(1.0)
        assert prof(4) == pytest.approx(1.1)
        assert prof(8) == pytest.approx(1.2 + share * grown)
        costs = prof(np.arange(1, 65))
        assert np.all(np.diff(costs) >= 0)
    values = [0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3]
    prof.at = 0
    short = pass_costs.best_size(values, prof)
    prof.at = 2048
    assert pass_costs.best_size(values, prof) < short
    # the file keeps what was measured, not the context it was last asked at
    doc = prof.to_json()
    assert "at" not in doc and doc["long_seconds"] == [1.02, 1.07, 1.6, 2.2]
    back = CostProfile.from_json(doc)
    assert back.at == 0 and back.long_context == 1024 and back(8) == pytest.approx(1.2)
    assert "after 256 tokens" in back.describe() and "after 1024" in back.describe()
    with pytest.raises(ValueError):  # a file of the last format: measured again
        CostProfile.from_json({**doc, "format": 2})
    with pytest.raises(ValueError):
        CostProfile.from_json({**doc, "long_sizes": [1, 4]})


def test_a_measurement_times_the_sizes_at_a_long_context_too(home, monkeypatch):
    """After the sizes at `context`, each engine's cache is grown to `LONG_CONTEXT` once and
    `LONG_SIZES` are timed there, engines in turn: attention's keys make what more tokens
    cost grow with the context, and the profile prices it (here exactly, by a fake clock)."""
    clock, log = {"now": 0.0, "slow": 0}, []
    fake = type("Time", (), {"perf_counter": lambda: clock["now"], "time": time.time})
    monkeypatch.setattr(pass_costs, "time", fake)
    verifier = _Clocked(clock, log, 1.0, 0.1, vocab=12, per_key=1e-4)
    draft = _Clocked(clock, log, 0.3, 0.03, vocab=13, per_key=2e-5)
    v, d = pass_costs.load_profiles([verifier, draft])
    for prof, per_key in ((v, 1e-4), (d, 2e-5)):
        assert (prof.context, prof.long_context) == (256, pass_costs.LONG_CONTEXT)
        assert prof.long_sizes == list(pass_costs.LONG_SIZES)
        extra = prof(8) - prof(1)
        prof.at = pass_costs.LONG_CONTEXT
        assert prof(8) - prof(1) == pytest.approx(extra + per_key * 7 * (1024 - 256))
    # the long sizes' rounds take turns between the engines too, after both caches grew
    tail = log[-2 * (pass_costs.LONG_REPEATS + 1) * len(pass_costs.LONG_SIZES) :]
    assert tail[:: len(pass_costs.LONG_SIZES)][:4] == [12, 13, 12, 13]
    # a model whose context cannot hold the long one: measured at its own context only
    short = TableEngine(vocab=12, context_length=300)
    alone = pass_costs.measure(short)
    assert alone.long_context == 0 and alone.long_seconds == []


def test_tree_rounds_are_priced_at_the_committed_sequences_length(home):
    """The tree decoder sets the verifier's and the draft's profiles to the committed
    sequence's length before each round's proposal, so the costs a tree is sized by are the
    costs of passes after that many tokens."""
    verifier = TreeTableEngine.cycle(context_length=400)
    draft = TreeTableEngine.cycle(sharp=12.0, context_length=400)
    dec = make_decoder(verifier, draft, SamplingParams(), Speculation(method="tree"), seed=0)
    assert len(dec.costs) == 2
    prompt, seen = [5, 6, 7], []
    for rnd in dec.run(prompt, 24):
        seen.append(len(rnd.tokens))
        assert all(c.at == len(prompt) + sum(seen[:-1]) for c in dec.costs)
    assert len(seen) > 1 and sum(seen) == 24

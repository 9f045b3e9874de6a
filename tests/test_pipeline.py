"""The pipelined decoder: the same tokens as the sequential decoder, under any timing."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tiny
from support.engines import TableEngine, TimedEngine
from support.stats import chi_square_p, exact_joint
from test_tree import ALL_TRANSFORMS

from ondevice.decoders.chain import ChainDecoder
from ondevice.decoders.pipelined import PipelinedDecoder
from ondevice.models import load_model
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime.costmodel import CostModel
from ondevice.runtime.engines import MLXEngine

GREEDY = SamplingParams(0.0)
SAMPLE = SamplingParams(1.0)
EOS = tiny.EOS_ID


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(5, 90, int(rng.integers(1, 12)))] for _ in range(n)]


def _tokens(dec, prompt, n) -> list[int]:
    return [t for r in dec.run(prompt, n) for t in r.tokens]


def _alone(engine: MLXEngine, prompt: list[int], n: int) -> list[int]:
    """The verifier's own greedy continuation, one token per pass, cut before EOS."""
    engine.reset()
    logits = engine.feed(prompt, last_only=True)
    out: list[int] = []
    while len(out) < n:
        tok = int(np.argmax(logits))
        if tok == EOS:
            break
        out.append(tok)
        logits = engine.feed([tok], last_only=True)
    return out


class Slow(TimedEngine):
    """An engine that takes `delay` seconds longer per call: changes how the two engines'
    work interleaves, never what they compute."""

    def __init__(self, engine, delay: float):
        super().__init__(engine)
        self.delay = delay

    def feed(self, tokens, last_only=False):
        time.sleep(self.delay)
        return super().feed(tokens, last_only)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipe")
    v = tiny.write_model(tmp / "v", scale=2.0)
    near = tiny.perturbed_copy(v, tmp / "near", 0.05)
    other = tiny.write_model(tmp / "other", seed=7, scale=2.0)
    return {name: load_model(p) for name, p in (("v", v), ("near", near), ("other", other))}


@pytest.fixture(scope="module")
def engines(models):
    verifier = MLXEngine(models["v"].model)
    return {
        "verifier": verifier,
        "near": MLXEngine(models["near"].model),  # often accepted
        "same": MLXEngine(models["v"].model),  # always accepted (its own cache)
        "other": MLXEngine(models["other"].model),  # almost never accepted
    }


# -- greedy: exactly the verifier's tokens ----------------------------------------------------


@pytest.mark.parametrize("draft", ["near", "same", "other"])
@pytest.mark.parametrize("k", [None, 1, 4])
def test_greedy_equals_sequential_and_verifier_alone(engines, draft, k):
    v, d = engines["verifier"], engines[draft]
    accepted = drafted = 0
    for prompt in _prompts(8):
        alone = _alone(v, prompt, 24)
        seq = _tokens(
            ChainDecoder(v, d, GREEDY, eos_token_ids=[EOS], num_draft_tokens=k), prompt, 24
        )
        pipe = PipelinedDecoder(v, d, GREEDY, eos_token_ids=[EOS], num_draft_tokens=k)
        assert _tokens(pipe, prompt, 24) == seq == alone, prompt
        accepted += pipe.stats.accepted
        drafted += pipe.stats.drafted
    if draft == "same":  # all-accepted streaks: every draft passes, blocks come pre-drafted
        assert accepted == drafted
    elif draft == "other":  # all-rejected streaks
        assert accepted <= 0.1 * drafted
    else:
        assert 0 < accepted < drafted


def test_all_accepted_blocks_are_pre_drafted(engines):
    v, d = engines["verifier"], Slow(engines["same"], 0.0)
    # a slow verifier pass leaves the drafter time to prepare the next block
    pipe = PipelinedDecoder(Slow(v, 0.01), d, GREEDY, eos_token_ids=[EOS], num_draft_tokens=3)
    prompt = _prompts(1, seed=3)[0]
    assert _tokens(pipe, prompt, 40) == _alone(v, prompt, 40)
    extra = pipe.extra_stats()
    assert extra["prefetch_hits"] > 0
    assert 0 < extra["overlap"] <= 1


def test_eos_inside_a_block(engines):
    v, d = engines["verifier"], engines["same"]
    found = 0
    for prompt in _prompts(40, seed=1):
        if found == 3:
            break
        alone = _alone(v, prompt, 60)
        if len(alone) == 60 or len(alone) % 5 == 4:
            continue  # no EOS, or EOS right after a block of four drafts
        found += 1
        for k in (4, None):
            pipe = PipelinedDecoder(v, d, GREEDY, eos_token_ids=[EOS], num_draft_tokens=k)
            rounds = list(pipe.run(prompt, 60))
            assert [t for r in rounds for t in r.tokens] == alone
            assert rounds[-1].finish_reason == "stop"
    assert found >= 2


def test_reference_backend_greedy(models, engines, tmp_path):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ondevice.convert.coreml import convert_draft
    from ondevice.runtime.coreml_engines import ReferenceDraftEngine

    loaded = models["near"]
    weights = {
        k: np.array(w.astype(mx.float32)) for k, w in tree_flatten(loaded.model.parameters())
    }
    pkg = tmp_path / "draft.mlpackage"
    convert_draft(loaded.config, weights, pkg, context=256, chunk=8)
    ref = ReferenceDraftEngine(pkg)
    v = engines["verifier"]
    accepted = 0
    for prompt in _prompts(6, seed=2):
        alone = _alone(v, prompt, 24)
        seq = _tokens(ChainDecoder(v, ref, GREEDY, eos_token_ids=[EOS]), prompt, 24)
        pipe = PipelinedDecoder(v, ref, GREEDY, eos_token_ids=[EOS])
        assert _tokens(pipe, prompt, 24) == seq == alone
        accepted += pipe.stats.accepted
    assert accepted > 0


# -- sampling: the sequential decoder's tokens, whatever the timing -----------------------------


@pytest.mark.parametrize("rule", ["leviathan", "coupled"])
@pytest.mark.parametrize("k", [None, 3])
def test_sampling_equals_sequential_under_any_timing(engines, rule, k):
    v, d = engines["verifier"], engines["near"]
    for i, prompt in enumerate(_prompts(6, seed=4)):
        kw = dict(eos_token_ids=[EOS], seed=100 + i, num_draft_tokens=k, rule=rule)
        seq = _tokens(ChainDecoder(v, d, SAMPLE, **kw), prompt, 30)
        assert _tokens(PipelinedDecoder(v, d, SAMPLE, **kw), prompt, 30) == seq
        # a slow verifier (lots of pre-drafting) or a slow draft (little): the same tokens
        assert _tokens(PipelinedDecoder(Slow(v, 0.004), d, SAMPLE, **kw), prompt, 30) == seq
        assert _tokens(PipelinedDecoder(v, Slow(d, 0.004), SAMPLE, **kw), prompt, 30) == seq


def test_coupled_sampling_equals_plain_sampling(engines):
    v, d = engines["verifier"], engines["near"]
    for i, prompt in enumerate(_prompts(4, seed=5)):
        plain = _tokens(ChainDecoder(v, None, SAMPLE, eos_token_ids=[EOS], seed=i), prompt, 30)
        pipe = PipelinedDecoder(v, d, SAMPLE, eos_token_ids=[EOS], seed=i, rule="coupled")
        assert _tokens(pipe, prompt, 30) == plain


def test_same_seed_same_tokens_while_the_cpu_is_loaded(engines):
    v, d = engines["verifier"], engines["near"]
    prompt = _prompts(1, seed=6)[0]
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        runs = [
            _tokens(PipelinedDecoder(v, d, SAMPLE, eos_token_ids=[EOS], seed=11), prompt, 40)
            for _ in range(4)
        ]
    finally:
        burner.kill()
        burner.wait()
    assert all(r == runs[0] for r in runs)
    other = _tokens(PipelinedDecoder(v, d, SAMPLE, eos_token_ids=[EOS], seed=12), prompt, 40)
    assert other != runs[0]


N_SAMPLES = 20_000
TABLE_PROMPT = [3, 5, 7]


@pytest.fixture(scope="module")
def table_pair():
    verifier = TableEngine(12, seed=0)
    return verifier, verifier.perturbed(0.8)


def _joint_counts(verifier, draft, params, rule, n=N_SAMPLES):
    counts = np.zeros((verifier.vocab_size,) * 2)
    hits = 0
    for s in range(n):
        dec = PipelinedDecoder(verifier, draft, params, seed=s, num_draft_tokens=2, rule=rule)
        toks = _tokens(dec, TABLE_PROMPT, 2)
        counts[toks[0], toks[1]] += 1
        hits += dec.extra_stats()["prefetch_hits"]
    return counts, hits


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule,params",
    [
        ("leviathan", SAMPLE),
        ("leviathan", SamplingParams(1.0, top_p=0.9)),
        ("coupled", SAMPLE),
        # every other transform at once; penalties read the pre-drafted tokens too
        ("leviathan", ALL_TRANSFORMS),
    ],
    ids=["t1", "top_p", "coupled", "all"],
)
def test_pipelined_sampling_matches_the_verifier_distribution(table_pair, rule, params):
    verifier, draft = table_pair
    counts, _ = _joint_counts(verifier, draft, params, rule)
    assert chi_square_p(counts, exact_joint(verifier, TABLE_PROMPT, params)) > 0.001


@pytest.mark.slow
def test_a_biased_rule_fails_through_the_pipeline(table_pair):
    def accept_everything(drafts, q, p, at):
        return len(drafts), at(len(drafts)).sample(p[len(drafts)])

    verifier, draft = table_pair
    counts, _ = _joint_counts(verifier, draft, SAMPLE, accept_everything)
    assert chi_square_p(counts, exact_joint(verifier, TABLE_PROMPT, SAMPLE)) < 1e-6


# -- cancellation and stats ---------------------------------------------------------------------


class Failing(Slow):
    """Raises on its n-th call (while a verifier pass is in flight)."""

    def __init__(self, engine, n: int):
        super().__init__(engine, 0.0)
        self.n = n

    def feed(self, tokens, last_only=False):
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("draft failed")
        return self.engine.feed(tokens, last_only)


def test_a_closed_stream_leaves_no_thread_and_no_work(engines):
    v, d = engines["verifier"], engines["near"]
    before = set(threading.enumerate())
    pipe = PipelinedDecoder(Slow(v, 0.01), d, GREEDY, eos_token_ids=[EOS])
    gen = pipe.run(_prompts(1, seed=8)[0], 200)
    next(gen)
    next(gen)
    assert set(threading.enumerate()) > before  # the verifier's worker is running
    gen.close()
    assert set(threading.enumerate()) == before
    assert pipe.in_flight is None

    pipe = PipelinedDecoder(v, Failing(d, 6), GREEDY, eos_token_ids=[EOS])
    with pytest.raises(RuntimeError, match="draft failed"):
        _tokens(pipe, _prompts(1, seed=8)[0], 200)
    assert set(threading.enumerate()) == before
    assert pipe.in_flight is None


def test_extra_stats(engines):
    pipe = PipelinedDecoder(engines["verifier"], engines["near"], GREEDY, eos_token_ids=[EOS])
    start = time.perf_counter()
    _tokens(pipe, _prompts(1, seed=9)[0], 30)
    wall = time.perf_counter() - start
    s = pipe.extra_stats()
    assert 0 <= s["overlap"] <= 1
    # an engine's idle and busy times share the decoding's wall time, and the time both engines
    # are busy (the overlap) lies within either one's busy time
    for idle, busy in (
        (s["draft_idle_s"], pipe.time_draft),
        (s["verify_idle_s"], pipe.time_verify),
    ):
        assert 0 < busy and idle + busy <= wall + 1e-6
        assert s["overlap"] * (idle + busy) <= busy + 1e-6
    assert s["wasted_drafts"] >= 0 and s["pipelined"] is True
    seq = ChainDecoder(engines["verifier"], engines["near"], GREEDY, eos_token_ids=[EOS])
    _tokens(seq, _prompts(1, seed=9)[0], 30)
    assert set(seq.extra_stats()) <= set(s) and seq.extra_stats()["overlap"] == 0


class SlowSubmit(Slow):
    """An MLX engine whose pass submission blocks for `delay` seconds, as `mx.async_eval` does
    on the CPU (measured: it runs ~60 of a ~75 ms SmolLM2 pass before returning)."""

    @property
    def cache(self):
        return self.engine.cache

    def forward(self, tokens, last_only=False):
        time.sleep(self.delay)
        return self.engine.forward(tokens, last_only)


def test_a_blocking_submit_is_charged_to_the_verifier_once(engines):
    delay = 0.03
    pipe = PipelinedDecoder(
        SlowSubmit(engines["verifier"], delay), engines["near"], GREEDY, eos_token_ids=[EOS]
    )
    _tokens(pipe, _prompts(1)[0], 16)
    assert min(t for _, t in pipe.calls["verify"]) >= delay  # the pass's time includes it
    assert max(pipe.calls["host"]) < delay / 2  # and the host's does not (it did: 2x charge)


def test_cost_model():
    cm = CostModel(alpha_prior=0.8)
    for L in (1, 2, 3, 5, 8):
        cm.observe_verify(L, 0.010 + 0.002 * L)
    assert cm.verify_seconds(4) == pytest.approx(0.018)
    for _ in range(3):
        cm.observe_draft(0.001)
        cm.observe_host(0.0)
    # a cheap draft that is often right: long blocks; pipelining is never slower
    assert cm.best_k(False, 12) >= 4
    assert all(cm.rate(k, True) >= cm.rate(k, False) for k in range(1, 12))
    # drafting ahead pays while it does not slow the verifier down
    assert cm.prefetch_pays(3, 3)
    cm.observe_contention(4, 0.020, busy=False)
    cm.observe_contention(4, 0.0205, busy=True)
    assert cm.contention == pytest.approx(1.025)
    assert cm.prefetch_pays(3, 3)  # saves 0.8^4 * 4 drafts = 1.6 ms, costs 2.5% of 18 ms
    cm.observe_contention(4, 0.04, busy=True)
    assert not cm.prefetch_pays(3, 3)  # the verifier slowed down a lot: not worth it
    # a draft that is always wrong: the shortest block, and no drafting ahead under contention
    for _ in range(200):
        cm.observe_block(4, 0)
    assert cm.best_k(False, 12) == 1 and cm.alpha < 0.05
    assert not cm.prefetch_pays(1, 1)

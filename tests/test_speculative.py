"""Lossless speculative decoding: greedy identity, exact acceptance rule, distribution tests."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tiny
from support.engines import MemoEngine
from support.enumeration import assert_emits_the_verifier_law, law, random_dist
from support.medusa_heads import write_heads
from support.stats import chi_square_p, exact_joint

import ondevice
from ondevice.decoders.chain import ChainDecoder
from ondevice.errors import ContextLengthError, OndeviceError, TokenizerMismatchError
from ondevice.models import load_model
from ondevice.proposers.registry import METHODS
from ondevice.rules import accept
from ondevice.rules.sampling import SamplingParams, probabilities

PROMPTS = [
    "hello world",
    "the cat sat",
    "a",
    "abcabcabc",
    "Hi!",
    "zzz",
    "one two three",
    "What?",
    "1 2 3 4",
    "x.y.z",
    "AAAA",
    "lorem ipsum",
    "q",
    "speculative",
    "decoding",
    "tiny model",
    "!!!",
    "mixed CASE",
    "end.",
    "more text here",
]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_equals_verifier_alone(gen, k):
    total_accepted = 0
    for prompt in PROMPTS:
        plain = gen.generate(prompt, max_tokens=24, speculative=False)
        spec = gen.generate(prompt, max_tokens=24, num_draft_tokens=k)
        assert spec.tokens == plain.tokens, prompt
        assert spec.text == plain.text
        assert spec.finish_reason == plain.finish_reason
        total_accepted += spec.stats["accepted"]
    assert total_accepted > 0  # the draft resembles the verifier: some drafts pass


def test_adaptive_k_is_lossless_and_reports_stats(gen):
    r = gen.generate("hello world", max_tokens=30)
    assert r.tokens == gen.generate("hello world", max_tokens=30, speculative=False).tokens
    s = r.stats
    for key in (
        "prompt_tokens",
        "generation_tokens",
        "rounds",
        "drafted",
        "accepted",
        "acceptance_rate",
        "mean_accepted_length",
        "tokens_per_second",
        "time_draft_s",
        "time_verify_s",
        "peak_memory_bytes",
    ):
        assert key in s
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"])
    assert s["draft_backend"] == "mlx"


@pytest.mark.parametrize("k", [1, 3, 6])
def test_identical_draft_accepts_everything(pair, k, draft_as_verifier):
    g = ondevice.load(pair[0], pair[0])
    r = g.generate("the cat sat", max_tokens=40, num_draft_tokens=k, chat_template=False)
    assert r.stats["acceptance_rate"] == 1.0
    assert r.stats["mean_accepted_length"] == k + 1


def test_eos_inside_an_accepted_block_ends_generation(tmp_path, draft_as_verifier):
    v = tiny.write_model(tmp_path / "v", scale=1.5)
    g0 = ondevice.load(v)
    prompt = next(
        p for p in PROMPTS if len(g0.generate(p, max_tokens=20, chat_template=False).tokens) >= 8
    )
    plain = g0.generate(prompt, max_tokens=20, chat_template=False)
    # make the 6th generated token an end-of-sequence token, then draft with the verifier itself
    cfg = json.loads((v / "config.json").read_text())
    cfg["eos_token_id"] = [tiny.EOS_ID, plain.tokens[5]]
    (v / "config.json").write_text(json.dumps(cfg))
    first = plain.tokens.index(plain.tokens[5])
    g = ondevice.load(v, v)
    r = g.generate(prompt, max_tokens=20, num_draft_tokens=8, chat_template=False)
    assert r.tokens == plain.tokens[:first]
    assert r.finish_reason == "stop"
    assert r.stats["rounds"] == 1  # the EOS came inside the first, fully accepted block


def test_stop_strings_are_cut_and_not_emitted(gen):
    full = gen.generate("hello world", max_tokens=30, speculative=False).text
    assert len(full) > 6
    stop = full[3:5]  # spans token boundaries (one character per token)
    r = gen.generate("hello world", max_tokens=30, stop=[stop])
    assert r.text == full[: full.index(stop)]
    assert r.finish_reason == "stop"


def test_prompt_longer_than_context(gen):
    with pytest.raises(ContextLengthError, match="context"):
        gen.generate(list(range(5, 90)) * 7, max_tokens=4)


def test_sampling_is_reproducible_with_a_seed(gen):
    a = gen.generate("hello", max_tokens=30, temperature=1.0, seed=7)
    b = gen.generate("hello", max_tokens=30, temperature=1.0, seed=7)
    c = gen.generate("hello", max_tokens=30, temperature=1.0, seed=8)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_bad_arguments_are_clear(gen):
    with pytest.raises(OndeviceError, match="temperature"):
        gen.generate("x", temperature=-1)
    with pytest.raises(OndeviceError, match="top_p"):
        gen.generate("x", top_p=0)
    with pytest.raises(OndeviceError, match="outside the vocabulary"):
        gen.generate([1, 10_000])


def test_prompt_forms(gen):
    msgs = [{"role": "user", "content": "hello world"}]
    a = gen.generate(msgs, max_tokens=8)
    b = gen.generate("hello world", max_tokens=8)
    ids = gen.tokenizer.encode(gen.tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    c = gen.generate(ids, max_tokens=8)
    assert a.tokens == b.tokens == c.tokens


def test_stream_and_astream_agree_with_generate(pair, draft_as_verifier):
    import asyncio

    gen = ondevice.load(pair[0], pair[0])  # identical draft: from_draft must show up

    ref = gen.generate("hello world", max_tokens=20)
    chunks = list(gen.stream("hello world", max_tokens=20))
    assert [t for c in chunks for t in c.tokens] == ref.tokens
    assert "".join(c.text for c in chunks) == ref.text
    assert chunks[-1].finish_reason == ref.finish_reason and chunks[-1].stats
    assert 0 < sum(c.from_draft for c in chunks) <= ref.stats["accepted"]

    async def collect():
        return [c async for c in gen.astream("hello world", max_tokens=20)]

    achunks = asyncio.run(collect())
    assert [t for c in achunks for t in c.tokens] == ref.tokens


def test_mismatched_tokenizers_fail_before_generation(tmp_path):
    v = tiny.write_model(tmp_path / "v")
    d = tiny.write_model(tmp_path / "d", seed=1)
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = [k for k, i in vocab.items() if i in (10, 11)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(TokenizerMismatchError, match="token id 10"):
        ondevice.load(v, d)


# -- the acceptance rule by exact enumeration ------------------------------------------------
# `accept.speculative` is the rule every chain decoder runs (with position-keyed noise for `at`);
# here its random source is `support.enumeration`'s, which walks every outcome.


@pytest.mark.parametrize("seed", range(5))
def test_chain_rule_emits_exactly_p_two_positions(seed):
    """K=2 drafts over V=4 with context-dependent distributions: the joint law of the first two
    emitted tokens equals the verifier's p(x1) p(x2 | x1), to rounding."""
    rng = np.random.default_rng(seed)
    V = 4
    p1, q1 = random_dist(rng, V), random_dist(rng, V, zeros=1)
    p2 = {x: random_dist(rng, V, zeros=seed % 2) for x in range(V)}
    q2 = {x: random_dist(rng, V) for x in range(V)}
    p3 = {x: random_dist(rng, V) for x in range(V)}  # bonus position after two drafts
    joint: Counter = Counter()
    for d1, d2 in itertools.product(range(V), range(V)):
        w = q1[d1] * q2[d1][d2]
        if w == 0:
            continue
        q = np.stack([q1, q2[d1]])
        p = np.stack([p1, p2[d1], p3[d2]])

        def fn(r, q=q, p=p, d1=d1, d2=d2):
            n, tok = accept.speculative([d1, d2], q, p, r)
            first = d1 if n >= 1 else tok
            second = (d2 if n == 2 else tok) if n >= 1 else None
            return first, second, n

        for (first, second, n), pr in law(fn).items():
            joint[(first, second, n)] += w * pr
    assert_emits_the_verifier_law(joint, p1, p2)


def test_greedy_rule():
    assert accept.greedy([3, 4, 5], [3, 4, 9, 1]) == (2, 9)
    assert accept.greedy([3, 4], [3, 4, 7]) == (2, 7)
    assert accept.greedy([3], [2, 0]) == (0, 2)


def test_enumeration_catches_a_rule_without_the_residual():
    """The same exact enumeration shows a subtly wrong rule (resampling from p instead of the
    residual after a rejection) to be biased, so the check above has teeth."""
    p, q = np.array([0.6, 0.3, 0.1]), np.array([0.2, 0.2, 0.6])

    def wrong(drafts, q, p, at):
        x = drafts[0]
        if at(0).uniform() < accept.acceptance_probability(p[0], x, q[0]):
            return 1, 0
        return 0, at(0).resample(p[0])

    first = np.zeros(3)
    for d in range(3):
        outcomes = law(
            lambda r, d=d: (lambda n, t: d if n else t)(*wrong([d], q[None], np.stack([p, p]), r))
        )
        for tok, pr in outcomes.items():
            first[tok] += q[d] * pr
    assert np.abs(first - p).max() > 0.05


def test_sampling_transform():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    np.testing.assert_allclose(probabilities(logits, SamplingParams(1.0)), [0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(
        probabilities(logits, SamplingParams(1.0, top_k=2)), [0.625, 0.375, 0, 0]
    )
    np.testing.assert_allclose(
        probabilities(logits, SamplingParams(1.0, top_p=0.75)), [0.625, 0.375, 0, 0]
    )
    np.testing.assert_allclose(
        probabilities(logits, SamplingParams(1.0, top_p=0.81)),
        [0.5, 0.3, 0.15, 0] / np.float64(0.95),
    )
    np.testing.assert_allclose(probabilities(logits, SamplingParams(0.0)), [1, 0, 0, 0])
    hot = probabilities(logits, SamplingParams(2.0))
    assert hot[3] > 0.05 and hot.sum() == pytest.approx(1.0)


# -- end to end: the distribution of the first two tokens ----------------------------------------


def _joint_counts(verifier, draft, params, prompt, n, rule=None, k=3):
    counts: Counter = Counter()
    for s in range(n):
        dec = ChainDecoder(verifier, draft, params, seed=s, num_draft_tokens=k, rule=rule)
        toks = [t for r in dec.run(prompt, 2) for t in r.tokens]
        counts[tuple(toks)] += 1
    return counts


def _exact_joint(verifier, params, prompt):
    return dict(np.ndenumerate(exact_joint(verifier, prompt, params)))


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    v, dr = tiny.write_small_vocab_pair(tmp_path_factory.mktemp("sv"))
    return MemoEngine(load_model(v).model), MemoEngine(load_model(dr).model)


N_SAMPLES = 20_000
PROMPT = [5, 6, 7]


# every transform of the distribution, alone and together (penalties read the drafted tokens)
TRANSFORMS = {
    "t1": SamplingParams(1.0),
    "top_p": SamplingParams(1.0, top_p=0.9),
    "top_k": SamplingParams(1.0, top_k=5),
    "min_p": SamplingParams(1.0, min_p=0.15),
    "repetition": SamplingParams(1.0, repetition_penalty=2.0),
    "presence": SamplingParams(1.0, presence_penalty=1.5),
    "frequency": SamplingParams(1.0, frequency_penalty=1.5),
    "logit_bias": SamplingParams(1.0, logit_bias={3: 2.0, 5: -1.5}),
    "all": SamplingParams(
        0.8, top_p=0.95, top_k=10, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.7,
        frequency_penalty=0.5, logit_bias={3: 1.0},
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("params", TRANSFORMS.values(), ids=TRANSFORMS.keys())
def test_speculative_sampling_matches_verifier_distribution(small_vocab_pair, params):
    ver, dra = small_vocab_pair
    counts = _joint_counts(ver, dra, params, PROMPT, N_SAMPLES)
    expected = _exact_joint(ver, params, PROMPT)
    assert chi_square_p(counts, expected) > 0.001


@pytest.mark.slow
def test_a_biased_rule_fails_the_distribution_test(small_vocab_pair):
    ver, dra = small_vocab_pair
    params = SamplingParams(1.0)

    def accept_everything(drafts, q, p, at):
        return len(drafts), at(len(drafts)).sample(p[len(drafts)])

    counts = _joint_counts(ver, dra, params, PROMPT, N_SAMPLES, rule=accept_everything)
    assert chi_square_p(counts, _exact_joint(ver, params, PROMPT)) < 1e-6


@pytest.mark.slow
def test_a_verifier_blind_to_drafted_tokens_fails_the_distribution_test(
    small_vocab_pair, monkeypatch
):
    """Penalties depend on the drafted tokens before a position: a verifier that scores every
    row with the committed context only (forgetting the drafts before it) is biased."""
    from ondevice.rules import chooser as decoder

    ver, dra = small_vocab_pair
    params = TRANSFORMS["frequency"]
    monkeypatch.setattr(decoder, "chain_paths", lambda drafts: [[]] * (len(drafts) + 1))
    counts = _joint_counts(ver, dra, params, PROMPT, N_SAMPLES)
    assert chi_square_p(counts, _exact_joint(ver, params, PROMPT)) < 1e-6


def test_load_in_one_thread_generate_in_another(pair):
    """MLX streams belong to threads: nothing lazy may cross from the loading thread (a chat app
    loads in one worker and generates in another)."""
    import threading

    box: dict = {}

    def load():
        box["g"] = ondevice.load(*pair)

    def generate():
        try:
            box["tokens"] = box["g"].generate("hello", max_tokens=8).tokens
        except Exception as e:  # reported below
            box["error"] = e

    for target in (load, generate):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert "error" not in box, box.get("error")
    assert box["tokens"] == box["g"].generate("hello", max_tokens=8).tokens


def test_closing_astream_early_stops_the_worker(gen):
    import asyncio

    async def first_then_close():
        agen = gen.astream("hello world", max_tokens=200)
        async for _ in agen:
            break
        await agen.aclose()

    asyncio.run(first_then_close())
    # the generation ended before aclose returned: a model still generating refuses another
    # call at once (it does not wait), so this one is served only if the model is free
    assert gen.generate("hi", max_tokens=4).tokens


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads through /proc")
@pytest.mark.parametrize("pipeline", [False, True])
def test_repeated_astream_calls_do_not_accumulate_native_threads(gen, pipeline):
    import asyncio
    import os

    def native_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    async def some(n: int) -> int:
        for _ in range(n):
            async for _ in gen.astream("hello", max_tokens=6, pipeline=pipeline):
                pass
        return native_threads()

    async def run() -> tuple[int, int]:
        return await some(2), await some(8)

    warm, later = asyncio.run(run())
    # MLX keeps native worker threads per Python thread that used it; a thread per request
    # used to leave two behind on every call
    assert later <= warm, (warm, later)


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_through_the_api_is_lossless(gen, method):
    write_heads(gen.verifier.model)  # method "medusa" finds them in the cache
    for prompt in ("hello world hello world", "abcabcabc", "the cat sat"):
        plain = gen.generate(prompt, max_tokens=24, speculative=False)
        spec = gen.generate(prompt, max_tokens=24, method=method)
        assert spec.tokens == plain.tokens
        if method != "chain":  # tree decoders say which proposer made each round
            assert sum(spec.stats["rounds_by_method"].values()) == spec.stats["rounds"]


def test_pipeline_switch_keeps_tokens_and_reports_overlap(gen):
    greedy = gen.generate("hello world", max_tokens=24, speculative=False).tokens
    on = gen.generate("hello world", max_tokens=24, pipeline=True)
    off = gen.generate("hello world", max_tokens=24, pipeline=False)
    assert on.tokens == off.tokens == greedy
    assert "overlap" in on.stats and 0.0 <= on.stats["overlap"] <= 1.0
    a = gen.generate("hello", max_tokens=24, temperature=1.0, seed=5, pipeline=True)
    b = gen.generate("hello", max_tokens=24, temperature=1.0, seed=5, pipeline=False)
    assert a.tokens == b.tokens


def test_unknown_method_is_a_clear_error(gen):
    with pytest.raises(OndeviceError, match="unknown method"):
        gen.generate("x", method="magic")


def test_generate_cli_method_and_pipeline_flags(pair):
    import subprocess
    import sys

    def run(*extra):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "ondevice",
                "generate",
                "--model",
                str(pair[0]),
                "--draft",
                str(pair[1]),
                "--prompt",
                "hello world",
                "--max-tokens",
                "12",
                "--json",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    base = run("--no-speculative")
    assert run("--method", "tree")["tokens"] == base["tokens"]
    piped = run("--pipeline")
    assert piped["tokens"] == base["tokens"] and "overlap" in piped["stats"]
    assert run("--no-pipeline")["tokens"] == base["tokens"]


def test_truncated_vocabulary_draft_is_lossless(tmp_path, pair):
    import shutil

    d = tmp_path / "d"
    shutil.copytree(pair[1], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["draft_vocab_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    g = ondevice.load(pair[0], d)
    for prompt in ("hello world", "the cat sat"):
        plain = g.generate(prompt, max_tokens=24, speculative=False)
        for t in (0.0, 1.0):
            r = g.generate(prompt, max_tokens=24, temperature=t, seed=1)
            if t == 0.0:
                assert r.tokens == plain.tokens
            assert all(0 <= x < 96 for x in r.tokens)

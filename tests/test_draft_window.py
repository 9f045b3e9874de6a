"""Long prompts: past its context the draft keeps drafting from a sliding window of the newest
tokens (`runtime.engines.DraftWindow`), with the MLX draft and with the saved .mlpackage run by
the reference executor, for every method that uses a draft; and when speculation is off, the
stats say why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny import perturbed_copy, write_model

import ondevice
from ondevice.convert import cli
from ondevice.models import load_model
from ondevice.runtime.engines import DraftWindow, MLXEngine, draft_window

CONTEXT, CHUNK = 32, 8  # the draft's context; the verifier's is 512
WORDS = "the cat sat on the mat. a dog ran to the park, and the cat ran after it! "
LONG = (WORDS * 3)[: 4 * CONTEXT]  # 128 tokens (one per character): 4x the draft's context
SHORT = WORDS[:20]
NEW = 48


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("window")
    verifier = write_model(root / "verifier", seed=0, scale=1.5)
    draft = perturbed_copy(verifier, root / "draft", noise=0.1)
    out = root / "tiny.bundle"
    args = ["--verifier", str(verifier), "--draft", str(draft), "-o", str(out)]
    assert cli.main([*args, "--context", str(CONTEXT), "--draft-chunk", str(CHUNK)]) == 0
    return out


@pytest.fixture(scope="module", params=["reference", "mlx"])
def gen(request: pytest.FixtureRequest, bundle: Path):
    g = ondevice.load(bundle, draft_backend=request.param)
    assert g.draft_backend == request.param
    return g


def _plain(gen, prompt: str) -> list[int]:
    r = gen.generate(prompt, max_tokens=NEW, speculative=False, chat_template=False)
    return r.tokens


# -- the window itself ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_model(bundle: Path):
    return load_model(bundle / "draft" / "mlx").model


def test_window_logits_are_a_fresh_draft_over_the_window(draft_model) -> None:
    """Whatever the history of feeds and trims, the logits at a position are those of a fresh
    draft fed only the window that position's start rule names."""
    win = draft_window(MLXEngine(draft_model, CONTEXT), context_length=512)
    assert isinstance(win, DraftWindow) and win.window == CONTEXT
    rng = np.random.default_rng(0)
    seq = rng.integers(5, 90, 120).tolist()
    win.feed(seq[:70], last_only=True)  # a prompt past the window: only its tail is fed
    assert win.length == 70 and win.start == win.window_start(69) > 0
    for i in range(70, 100):  # one at a time, across moves
        row = win.feed([seq[i]], last_only=True)
        if i % 7 == 0:  # and now and then back across a move, and forward again
            win.trim(20)
            win.feed(seq[i - 19 : i + 1])
        start = win.window_start(i)
        fresh = MLXEngine(draft_model, CONTEXT)
        want = fresh.feed(seq[start : i + 1], last_only=True)
        np.testing.assert_allclose(row, want, rtol=1e-4, atol=1e-4)
        assert win.engine.length <= CONTEXT
    rows = win.feed(seq[100:120])  # a long feed that needs every row crosses a move
    assert rows.shape[0] == 20
    fresh = MLXEngine(draft_model, CONTEXT)
    start = win.window_start(119)
    np.testing.assert_allclose(
        rows[-1], fresh.feed(seq[start:120], last_only=True), rtol=1e-4, atol=1e-4
    )
    assert win.moves > 0


class CountingEngine(MLXEngine):
    fed = 0

    def feed(self, tokens, last_only=False):
        self.fed += len(tokens)
        return super().feed(tokens, last_only)


@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_drafts_rejected_across_a_move_cost_no_refill(bundle: Path, draft_model, backend) -> None:
    """Drafting across the window's move, then trimming back (rejected drafts), round after
    round: the window left behind is taken up again, not refilled from the sequence."""
    from ondevice.runtime.coreml_engines import ReferenceDraftEngine

    if backend == "mlx":
        engine = CountingEngine(draft_model, CONTEXT)
    else:
        engine = ReferenceDraftEngine(bundle / "draft" / "draft.mlpackage")
        fed = {"n": 0}
        feed = engine.feed

        def counting(tokens, last_only=False):
            fed["n"] += len(tokens)
            return feed(tokens, last_only)

        engine.feed = counting  # type: ignore[method-assign]
    win = draft_window(engine, context_length=512)
    seq = [5 + t % 80 for t in range(3 * CONTEXT)]
    win.feed(seq[: 2 * CONTEXT - 2], last_only=True)
    count = (lambda: engine.fed) if backend == "mlx" else (lambda: fed["n"])
    before = count()
    for _ in range(6):  # drafts cross the move at 2 * CONTEXT, all but one rejected
        n = win.length
        for t in seq[n : n + 4]:
            last = win.feed([t], last_only=True)
        win.trim(3)
        start = win.window_start(win.length)
        fresh = MLXEngine(draft_model, CONTEXT)
        want = fresh.feed(seq[start : win.length + 3], last_only=True)
        if win.window_start(n + 3) == start:
            np.testing.assert_allclose(last, want, atol=0.1)  # the package is float16
    # one refill of the new window (CONTEXT / 2 tokens) in all, then only the drafts
    assert count() - before <= CONTEXT // 2 + 6 * 4 + 2, count() - before


def test_the_package_draft_never_exceeds_its_context(bundle: Path) -> None:
    from ondevice.runtime.coreml_engines import ReferenceDraftEngine

    engine = ReferenceDraftEngine(bundle / "draft" / "draft.mlpackage")
    win = draft_window(engine, context_length=512)
    win.feed([5 + t % 80 for t in range(3 * CONTEXT)], last_only=True)
    for t in range(40):
        win.feed([5 + t % 80], last_only=True)
        assert engine.length <= CONTEXT
    assert win.length == 3 * CONTEXT + 40


# -- long prompts through the API -----------------------------------------------------------------


@pytest.mark.parametrize(
    "method, pipeline", [("chain", False), ("chain", True), ("tree", None), ("auto", None)]
)
def test_long_prompt_keeps_drafting_with_the_plain_tokens(gen, method, pipeline) -> None:
    want = _plain(gen, LONG)
    r = gen.generate(
        LONG, max_tokens=NEW, chat_template=False, method=method, pipeline=pipeline,
        cache_prompt=False,
    )  # fmt: skip
    assert r.tokens == want
    s = r.stats
    assert s["prompt_tokens"] > 3 * CONTEXT
    # auto may find, from the costs measured on this machine, that 14 tokens do not repay
    # trying the draft (its exploration budget): that it could, and past the window, is below
    assert s["drafted"] > 0 or method == "auto", s
    if method == "chain":  # tree and auto size their proposals by measured costs (profiles)
        assert s["accepted"] > 0, s
        assert s["draft_backend"] == gen.draft_backend
    assert s["draft_window"] == CONTEXT and s["draft_window_moves"] > 0
    # nothing skipped the draft (a draft past its context did once); auto may propose nothing
    assert s.get("draft_skipped", "nothing was proposed") == "nothing was proposed"
    assert "draft_skipped" not in s or (method == "auto" and not s["drafted"])


def test_a_seed_means_the_same_past_the_window(gen) -> None:
    """The window depends only on positions, so the pipelined decoder (which drafts ahead and
    trims back across moves) gives the sequential decoder's tokens for a seed."""
    kw = {"max_tokens": NEW, "chat_template": False, "temperature": 1.0, "seed": 3}
    seq = gen.generate(LONG, pipeline=False, num_draft_tokens=3, cache_prompt=False, **kw)
    pipe = gen.generate(LONG, pipeline=True, num_draft_tokens=3, cache_prompt=False, **kw)
    assert seq.tokens == pipe.tokens and seq.stats["drafted"] > 0


def test_long_prompts_with_the_prompt_cache(gen) -> None:
    """A conversation that grows past the window: each turn from the cache, the same tokens."""
    gen.clear_prompt_cache()
    prompt = SHORT
    for turn in range(3):
        want = _plain(gen, prompt)
        r = gen.generate(prompt, max_tokens=NEW, chat_template=False)
        assert r.tokens == want, turn
        assert r.stats["drafted"] > 0
        prompt = prompt + r.text + WORDS[: 10 + 7 * turn]
    assert len(gen.encode_prompt(prompt, chat_template=False)) > 3 * CONTEXT
    assert gen.prompt_cache_stats()["hits"] >= 2


def test_a_saved_prompt_longer_than_the_window(gen, tmp_path: Path) -> None:
    path = tmp_path / "long.safetensors"
    n = len(gen.encode_prompt(LONG, chat_template=False))
    assert gen.save_prompt_cache(path, LONG, chat_template=False) == n > 3 * CONTEXT
    assert gen.load_prompt_cache(path) == n
    want = _plain(gen, LONG + "the")
    r = gen.generate(LONG + "the", max_tokens=NEW, chat_template=False)
    assert r.tokens == want and r.stats["cached_tokens"] >= n - 2
    assert r.stats["drafted"] > 0
    gen.clear_prompt_cache()


def test_short_prompts_draft_as_before(gen) -> None:
    r = gen.generate(SHORT, max_tokens=8, chat_template=False, cache_prompt=False)
    assert r.tokens == _plain(gen, SHORT)[:8]
    assert r.stats["drafted"] > 0 and r.stats["draft_window_moves"] == 0


# -- when speculation is off, the stats say why ---------------------------------------------------


def test_draft_skipped_says_why(gen) -> None:
    def reason(**kw) -> str:
        r = gen.generate(SHORT, chat_template=False, cache_prompt=False, **kw)
        assert r.stats["drafted"] == 0
        return r.stats["draft_skipped"]

    assert reason(max_tokens=8, speculative=False) == "speculative=False"
    assert reason(max_tokens=8, num_draft_tokens=0) == "num_draft_tokens=0"
    assert "no room for drafts" in reason(max_tokens=1)
    assert "no room for drafts" in reason(max_tokens=1, method="tree")
    assert gen.draft_context == CONTEXT and gen.context_length == 512


def test_without_a_draft_the_stats_say_so(bundle: Path) -> None:
    g = ondevice.load(bundle / "verifier")
    r = g.generate(SHORT, max_tokens=4, chat_template=False)
    assert r.stats["draft_skipped"] == "no draft model is loaded"
    assert g.draft_context is None


def test_a_bare_draft_engine_says_its_context_is_full(bundle: Path, draft_model) -> None:
    """Decoders given a draft engine without a window (not through `ondevice.load`) still say
    why they stopped drafting."""
    from ondevice.decoders.factory import make_decoder
    from ondevice.proposers.resources import Speculation
    from ondevice.rules.sampling import SamplingParams

    verifier = MLXEngine(load_model(bundle / "verifier").model)
    dec = make_decoder(
        verifier, MLXEngine(draft_model, CONTEXT), SamplingParams(), Speculation(profile=False)
    )
    list(dec.run(list(range(5, 5 + 2 * CONTEXT)), 4))
    assert dec.stats.drafted == 0
    assert "longer than the draft's 32-token context" in (dec.skip_reason or "")


# -- the chat knows both limits -------------------------------------------------------------------


def test_the_chat_knows_both_limits_and_says_when_the_draft_window_moved(bundle: Path) -> None:
    from ondevice.apps.chat_controller import ChatController, Settings
    from ondevice.apps.formatting import format_limits, format_stats

    ctrl = ChatController(settings=Settings(max_tokens=24, temperature=0.0))
    assert ctrl.limits() is None and format_limits(None) == "context: no model loaded"
    assert ctrl.load(bundle, draft_backend="reference", wait=True) and ctrl.error is None
    assert ctrl.limits() == {"context": 512, "draft_window": CONTEXT}
    assert format_limits(ctrl.limits()) == f"context 512 tokens, draft reads the last {CONTEXT}"
    assert ctrl.send(LONG)
    ctrl.wait()
    stats = ctrl.last_stats
    assert ctrl.error is None and stats["drafted"] > 0 and stats["draft_window_moves"] > 0
    assert f"draft read the last {CONTEXT} tokens" in format_stats(stats)
    line = format_stats({**stats, "drafted": 0, "draft_skipped": "speculative=False"})
    assert line.endswith("no drafting: speculative=False")


def test_the_server_says_why_and_keeps_drafting_on_long_prompts(bundle: Path) -> None:
    """Over HTTP with the official client: a long prompt drafts (package draft, reference
    executor), plain decoding says why it did not, and the model card gives both limits."""
    import httpx
    from test_server import LiveServer

    g = ondevice.load(bundle, draft_backend="reference")
    with LiveServer(g) as server:
        client = server.client()
        model = client.models.list().data[0].id
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert card["context_length"] == 512 and card["draft_context_length"] == CONTEXT
        kw = {"model": model, "prompt": LONG, "max_tokens": 24, "temperature": 0}
        spec = client.completions.create(**kw)
        plain = client.completions.create(**kw, extra_body={"speculative": False})
        assert spec.choices[0].text == plain.choices[0].text
        s = spec.model_extra["ondevice"]
        assert s["drafted"] > 0 and s["draft_window_moves"] > 0 and "draft_skipped" not in s
        assert plain.model_extra["ondevice"]["draft_skipped"] == "speculative=False"

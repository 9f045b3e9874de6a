"""The prompt (KV prefix) cache: a hit never changes an output, for every decoder and draft
backend; it is bounded in bytes; saved prompts; and where it shows (stats, server, chat)."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
import tiny
from support.kernel import decode_apart

import ondevice
from ondevice.api import Generator, _Pair
from ondevice.apps import cli
from ondevice.apps.chat import ChatController, Settings, TerminalChat
from ondevice.errors import ContextLengthError, OndeviceError
from ondevice.models import load_model
from ondevice.models.cache import KVCache
from ondevice.runtime import kernel
from ondevice.runtime.engines import coreml_available
from ondevice.runtime.prefix_cache import PrefixCache, PromptCacheError

CONTEXT = 512
VOCAB = 96


def write_model(path: Path, seed: int = 0) -> Path:
    """A tiny model whose EOS logit is 0, so answers run to max_tokens."""
    return tiny.write_endless_model(path, seed=seed, scale=1.5, context=CONTEXT)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix-cache")
    v = write_model(root / "v")
    return {
        "verifier": v,
        "draft": tiny.perturbed_copy(v, root / "d", noise=0.3),
        "other_draft": tiny.perturbed_copy(v, root / "d2", noise=0.3, seed=7),
        "other": write_model(root / "other", seed=3),
    }


@pytest.fixture(scope="module")
def gen(models) -> Generator:
    return ondevice.load(models["verifier"], models["draft"], draft_backend="mlx")


@pytest.fixture(scope="module")
def uncached(models) -> Generator:
    """The same pair without a prompt cache: what every output must equal."""
    return ondevice.load(
        models["verifier"], models["draft"], draft_backend="mlx", prompt_cache_bytes=0
    )


def ids(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(5, VOCAB, n)]


@contextlib.contextmanager
def fed(engine) -> Iterator[list[int]]:
    """The lengths of the token runs fed to `engine` while the block runs (MLX engines are
    watched at `forward`, which every feed and verifier pass goes through)."""
    name = "forward" if hasattr(engine, "forward") else "feed"
    original = getattr(engine, name)
    lengths: list[int] = []

    def spy(tokens, *args, **kwargs):
        lengths.append(len(list(tokens)))
        return original(tokens, *args, **kwargs)

    setattr(engine, name, spy)
    try:
        yield lengths
    finally:
        delattr(engine, name)


def assert_resumed(verifier_runs: list[int], draft_runs: list[int], prompt: int, stats) -> None:
    """The first (prefill) runs fed only what the caches lacked."""
    # decoders feed all but the prompt's last token (plain greedy decoding: all of it)
    assert verifier_runs[0] - (prompt - stats["cached_tokens"] - 1) in (0, 1)
    if draft_runs:
        assert draft_runs[0] <= prompt - stats["draft_cached_tokens"]


GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "seed": 11}
DECODERS = {
    "chain": {},
    "pipelined": {"pipeline": True},
    "tree": {"method": "tree"},
    "cascade": {"method": "cascade"},
    "auto": {"method": "auto"},
    "pld": {"method": "pld"},
    "plain": {"speculative": False},
}
USES_DRAFT = ("chain", "pipelined", "tree", "cascade", "auto")


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_a_hit_inside_the_previous_answer_changes_no_token(gen, uncached, decoder, sampling):
    kw = {"max_tokens": 16, **DECODERS[decoder], **sampling}
    gen.clear_prompt_cache()
    first = ids(40, seed=1)
    answer = gen.generate(first, **kw).tokens
    assert answer == uncached.generate(first, **kw).tokens
    assert len(answer) == 16
    # the next prompt shares the first prompt and half of the answer, then differs
    turn = first + answer[:8] + [answer[8] % (VOCAB - 5) + 4, 50, 51, 52]
    with fed(gen.verifier) as v_runs, fed(gen.draft) as d_runs:
        hit = gen.generate(turn, **kw)
    assert_resumed(v_runs, d_runs, len(turn), hit.stats)
    assert hit.tokens == uncached.generate(turn, **kw).tokens
    assert hit.stats["cached_tokens"] == len(first) + 8
    if decoder in USES_DRAFT:  # the draft resumed too (auto's tries are budgeted: on a
        # 16-token answer it may have drafted in its first round only, within the prompt)
        least = len(first) if decoder == "auto" else len(first) + 1
        assert hit.stats["draft_cached_tokens"] >= least
    assert gen.prompt_cache_stats()["hits"] >= 1


@pytest.fixture(scope="module")
def apart(models) -> Iterator[tuple[Generator, Generator]]:
    """The pair (cached, uncached) with decoding passes computed apart from prompts
    (runtime/kernel.py, "Prompts apart"): AVX512-BF16 against AMX on a CPU with both; elsewhere
    oneDNN's first choice named for decoding, which runs the same bookkeeping."""
    if not kernel.available() or kernel.choice() != "bf16":
        pytest.skip("no bf16 kernel here")
    with pytest.MonkeyPatch.context() as mp:
        decode_apart(mp)
        pair = tuple(
            ondevice.load(models["verifier"], models["draft"], draft_backend="mlx", **kw)
            for kw in ({}, {"prompt_cache_bytes": 0})
        )
    assert all(g.verifier.prompts_apart for g in pair)  # type: ignore[attr-defined]
    yield pair  # type: ignore[misc]
    for g in pair:
        g.close()


@pytest.mark.parametrize(
    ("decoder", "sampling"),
    [(d, GREEDY) for d in ("plain", "chain", "tree", "auto")] + [("chain", SAMPLED)],
    ids=["plain", "chain", "tree", "auto", "chain-seeded"],
)
def test_decoded_rows_computed_apart_are_never_reused(apart, decoder, sampling):
    """Where decoding passes take other instructions than prompts, a decoded row is not what
    a prompt pass writes: the cache keeps the prompt's rows only (all but its last token), and
    the next turn prefills the answer again, giving what the uncached pair gives."""
    gen, uncached = apart
    kw = {"max_tokens": 16, **DECODERS[decoder], **sampling}
    gen.clear_prompt_cache()
    first = ids(40, seed=4)
    answer = gen.generate(first, **kw).tokens
    assert answer == uncached.generate(first, **kw).tokens
    turn = first + answer + [50, 51]
    with fed(gen.verifier) as v_runs:
        hit = gen.generate(turn, **kw)
    assert hit.tokens == uncached.generate(turn, **kw).tokens
    assert hit.stats["cached_tokens"] == len(first) - 1
    assert v_runs[0] == len(turn) - len(first)  # the prompt's last token, the answer, the turn


@pytest.mark.parametrize("decoder", ["chain", "tree", "plain"])
def test_a_prompt_inside_a_cached_sequence_still_feeds_its_last_token(gen, uncached, decoder):
    kw = {"max_tokens": 12, **DECODERS[decoder], **GREEDY}
    gen.clear_prompt_cache()
    first = ids(30, seed=2)
    answer = gen.generate(first, **kw).tokens
    for prompt in (first[:10], first, first + answer):  # strict prefixes and the whole sequence
        r = gen.generate(prompt, **kw)
        assert r.tokens == uncached.generate(prompt, **kw).tokens
        assert r.stats["cached_tokens"] == len(prompt) - 1


def test_conversations_keep_their_own_history(gen, uncached):
    """A prompt that leaves an entry early copies the shared part: the entry stays for its
    own conversation's next turn."""
    gen.clear_prompt_cache()
    system = ids(30, seed=3)
    a = gen.generate(system + [60, 61], max_tokens=8).tokens
    gen.generate(system + [70, 71], max_tokens=8)  # shares only the system prompt
    turn = system + [60, 61] + a + [80]
    r = gen.generate(turn, max_tokens=8)
    # all but the answer's last token, which no model was fed
    assert r.stats["cached_tokens"] == len(system) + 2 + len(a) - 1
    assert r.tokens == uncached.generate(turn, max_tokens=8).tokens


def test_eviction_keeps_the_cache_within_its_budget(models, uncached):
    probe = ondevice.load(models["verifier"], models["draft"], draft_backend="mlx")
    probe.generate(ids(50, seed=4), max_tokens=8)
    one = probe.prompt_cache_stats()["bytes"]
    assert one > 0
    budget = int(one * 1.5)  # room for one entry, not two
    gen = ondevice.load(
        models["verifier"], models["draft"], draft_backend="mlx", prompt_cache_bytes=budget
    )
    a, b = ids(50, seed=4), ids(50, seed=5)  # no common prefix
    for prompt, evictions in ((a, 0), (b, 1), (a, 2)):
        r = gen.generate(prompt, max_tokens=8)
        assert r.stats["cached_tokens"] == 0  # b evicted a; then a evicted b
        assert r.tokens == uncached.generate(prompt, max_tokens=8).tokens
        s = gen.prompt_cache_stats()
        assert s["evictions"] == evictions and s["entries"] == 1
        assert 0 < s["bytes"] <= budget
    r = gen.generate(a + [9], max_tokens=8)
    assert r.stats["cached_tokens"] == len(a)
    # an entry larger than the whole budget is not kept
    tiny_budget = ondevice.load(models["verifier"], prompt_cache_bytes=one // 4)
    tiny_budget.generate(a, max_tokens=8)
    s = tiny_budget.prompt_cache_stats()
    assert s["entries"] == 0 and s["bytes"] == 0 and s["evictions"] == 1


def test_off_and_per_call(models, gen, uncached):
    gen.clear_prompt_cache()
    prompt = ids(30, seed=6)
    gen.generate(prompt, max_tokens=4, cache_prompt=False)
    assert gen.prompt_cache_stats()["entries"] == 0
    uncached.generate(prompt, max_tokens=4)
    r = uncached.generate(prompt, max_tokens=4)
    assert r.stats["cached_tokens"] == 0 and uncached.prompt_cache_stats()["bytes"] == 0


def test_a_cancelled_stream_keeps_what_it_decided(gen, uncached):
    """Closing a stream stops the decoder between rounds: its caches are consistent and kept."""
    gen.clear_prompt_cache()
    prompt = ids(30, seed=8)
    stream = gen.stream(prompt, max_tokens=200)
    got = [t for _, c in zip(range(5), stream) for t in c.tokens]
    stream.close()
    turn = prompt + got + [7]
    r = gen.generate(turn, max_tokens=10)
    assert r.stats["cached_tokens"] >= len(prompt)
    assert r.tokens == uncached.generate(turn, max_tokens=10).tokens


def test_generations_run_on_the_models_thread(gen):
    """Every generation of a model runs on one thread, whichever thread asks, so its caches
    (MLX arrays of that thread's stream) can be kept between calls."""
    import threading

    seen = []
    original = gen._cached_stream

    def spy(*args, **kwargs):
        seen.append(threading.current_thread())
        return original(*args, **kwargs)

    gen._cached_stream = spy
    try:
        gen.generate("hello", max_tokens=2)
        t = threading.Thread(target=lambda: gen.generate("hello", max_tokens=2))
        t.start()
        t.join()
    finally:
        del gen._cached_stream
    assert len(seen) == 2 and seen[0] is seen[1] and seen[0] is not threading.current_thread()


# -- KVCache helpers ---------------------------------------------------------------------------


def test_kv_cache_copy_is_independent():
    c = KVCache(2)
    for layer in c.layers:
        layer.update_and_fetch(mx.ones((1, 2, 5, 4)), mx.ones((1, 2, 5, 4)) * 2)
    copy = c.copy(3)
    assert copy.offset == 3 and c.offset == 5
    c.trim(4)
    for layer in c.layers:  # overwrite position 1 of the source
        layer.update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    k, v = copy.prefix(3)[0]
    assert float(k.sum()) == 1 * 2 * 3 * 4 and float(v.sum()) == 2 * 2 * 3 * 4
    assert copy.nbytes == 2 * 2 * (1 * 2 * 256 * 4 * 4)  # buffers grow by 256 positions
    with pytest.raises(ValueError):
        c.prefix(6)


def test_negative_budget_is_refused():
    for bad in (-1, 1.5, "1GB", True):
        with pytest.raises(OndeviceError, match="prompt_cache_bytes must be an integer >= 0"):
            PrefixCache(bad)


# -- the Core ML draft's cache (its package run by the reference executor) ----------------------


@pytest.fixture(scope="module", params=["state", "io"])
def package_pair(request, models, tmp_path_factory):
    from mlx.utils import tree_flatten

    from ondevice.convert.coreml import convert_draft

    draft = load_model(models["draft"])
    pkg = tmp_path_factory.mktemp("pkg") / f"draft-{request.param}.mlpackage"
    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(draft.model.parameters())}
    convert_draft(draft.config, weights, pkg, context=256, chunk=8, kv=request.param)
    return models["verifier"], pkg


def package_generator(package_pair, **kwargs) -> Generator:
    verifier, pkg = package_pair
    loaded = load_model(verifier)
    kernel.serve(loaded.model)  # as `ondevice.load` does on this machine
    return Generator(_Pair(loaded, None, pkg, 256), "reference", **kwargs)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("decoder", ["chain", "pipelined", "tree"])
def test_the_package_drafts_cache_is_reused_exactly(package_pair, decoder, sampling, monkeypatch):
    # pass costs where drafting pays (the tree is sized by them; measured ones, under a loaded
    # machine, may leave it empty, and this test needs drafts to reuse)
    from ondevice.proposers import resources
    from ondevice.runtime.engines import DraftWindow
    from ondevice.runtime.pass_costs import SIZES, CostProfile

    costs = {True: [1.0 + 0.02 * n for n in SIZES], False: [0.1 + 0.01 * n for n in SIZES]}
    monkeypatch.setattr(
        resources,
        "load_profiles",
        lambda engines: [
            CostProfile(list(SIZES), costs[not isinstance(e, DraftWindow)]) for e in engines
        ],
    )
    gen = package_generator(package_pair)
    ref = package_generator(package_pair, prompt_cache_bytes=0)
    assert gen.draft_backend == "reference"
    kw = {"max_tokens": 10, **DECODERS[decoder], **sampling}
    first = ids(30, seed=9)
    answer = gen.generate(first, **kw).tokens
    turn = first + answer[:5] + [answer[5] % (VOCAB - 5) + 4, 40]
    with fed(gen.verifier) as v_runs, fed(gen.draft) as d_runs:
        r = gen.generate(turn, **kw)
    assert_resumed(v_runs, d_runs, len(turn), r.stats)
    assert r.tokens == ref.generate(turn, **kw).tokens
    assert r.stats["cached_tokens"] == len(first) + 5
    assert r.stats["draft_cached_tokens"] > len(first)
    assert r.stats["drafted"] > 0


@pytest.mark.macos
@pytest.mark.skipif(not coreml_available(), reason="Core ML prediction needs macOS 15+")
@pytest.mark.parametrize("decoder", ["chain", "pipelined"])
def test_the_coreml_drafts_state_is_reused_exactly(package_pair, decoder, tmp_path):
    """The same on the Neural Engine: the prefix goes through MLState.read_state/write_state."""
    verifier, pkg = package_pair
    gen = Generator(_Pair(load_model(verifier), None, pkg, 256), "coreml")
    ref = Generator(_Pair(load_model(verifier), None, pkg, 256), "coreml", prompt_cache_bytes=0)
    kw = {"max_tokens": 10, **DECODERS[decoder], **SAMPLED}
    first = ids(30, seed=9)
    answer = gen.generate(first, **kw).tokens
    turn = first + answer[:5] + [answer[5] % (VOCAB - 5) + 4, 40]
    r = gen.generate(turn, **kw)
    assert r.tokens == ref.generate(turn, **kw).tokens
    assert r.stats["draft_cached_tokens"] > len(first) and r.stats["draft_backend"] == "coreml"
    gen.save_prompt_cache(tmp_path / "doc.kv", first)
    fresh = Generator(_Pair(load_model(verifier), None, pkg, 256), "coreml")
    fresh.load_prompt_cache(tmp_path / "doc.kv")
    r = fresh.generate(first + [7, 8], **kw)
    assert r.stats["draft_cached_tokens"] == len(first)
    assert r.tokens == ref.generate(first + [7, 8], **kw).tokens


# -- saved prompts -------------------------------------------------------------------------------


def test_a_saved_prompt_starts_later_prompts(models, gen, uncached, tmp_path):
    doc = ids(60, seed=10)
    path = tmp_path / "doc.kv"
    assert gen.save_prompt_cache(path, doc) == 60
    loaded = ondevice.load(
        models["verifier"], models["draft"], draft_backend="mlx", prompt_cache=path
    )
    for tail in ([30, 31, 32], [40, 41]):  # the saved entry is pinned: copied, never used up
        prompt = doc + tail
        r = loaded.generate(prompt, max_tokens=10, **SAMPLED)
        assert r.tokens == uncached.generate(prompt, max_tokens=10, **SAMPLED).tokens
        assert r.stats["cached_tokens"] == 60 and r.stats["draft_cached_tokens"] == 60
        loaded.generate(ids(20, seed=99), max_tokens=4)  # another prompt in between
    # zero budget: nothing else is kept, the saved prompt still is
    off = ondevice.load(models["verifier"], models["draft"], draft_backend="mlx",
                        prompt_cache=path, prompt_cache_bytes=0)  # fmt: skip
    assert off.generate(doc + [5], max_tokens=4).stats["cached_tokens"] == 60


def test_a_saved_prompt_for_another_model_is_refused(models, gen, tmp_path):
    path = tmp_path / "doc.kv"
    gen.save_prompt_cache(path, ids(20, seed=11))
    with pytest.raises(PromptCacheError, match="another verifier model"):
        ondevice.load(models["other"], prompt_cache=path)
    with pytest.raises(PromptCacheError, match="another verifier model"):
        ondevice.load(models["verifier"], dtype="float16", prompt_cache=path)
    with pytest.raises(PromptCacheError, match="no such prompt cache"):
        ondevice.load(models["verifier"], prompt_cache=tmp_path / "missing.kv")
    (tmp_path / "junk.kv").write_bytes(b"not a safetensors file")
    with pytest.raises(PromptCacheError, match="not a readable prompt cache"):
        ondevice.load(models["verifier"], prompt_cache=tmp_path / "junk.kv")
    # the same verifier with another draft: the verifier's part is used, the draft prefills
    with pytest.warns(UserWarning, match="another draft"):
        other = ondevice.load(models["verifier"], models["other_draft"], draft_backend="mlx",
                              prompt_cache=path)  # fmt: skip
    r = other.generate(ids(20, seed=11) + [5], max_tokens=4)
    assert r.stats["cached_tokens"] == 20 and r.stats["draft_cached_tokens"] == 0


def test_saving_a_prompt_too_long_writes_nothing(gen, tmp_path):
    path = tmp_path / "long.kv"
    with pytest.raises(ContextLengthError):
        gen.save_prompt_cache(path, ids(CONTEXT + 5, seed=12))
    assert list(tmp_path.iterdir()) == []


def test_a_package_drafts_saved_prompt(models, package_pair, tmp_path):
    gen = package_generator(package_pair)
    doc = ids(40, seed=13)
    gen.save_prompt_cache(tmp_path / "doc.kv", doc)
    fresh = package_generator(package_pair)
    fresh.load_prompt_cache(tmp_path / "doc.kv")
    ref = package_generator(package_pair, prompt_cache_bytes=0)
    r = fresh.generate(doc + [7, 8], max_tokens=8)
    assert r.stats["cached_tokens"] == 40 and r.stats["draft_cached_tokens"] == 40
    assert r.tokens == ref.generate(doc + [7, 8], max_tokens=8).tokens
    with pytest.warns(UserWarning, match="another draft"):  # an MLX draft cannot use it
        ondevice.load(package_pair[0], models["draft"], draft_backend="mlx",
                      prompt_cache=tmp_path / "doc.kv")  # fmt: skip


def test_cache_prompt_command_and_generate_flag(models, uncached, tmp_path, capsys):
    path = tmp_path / "doc.kv"
    doc = "the quick brown fox jumps over the lazy dog. " * 4
    pair = ["--model", str(models["verifier"]), "--draft", str(models["draft"]),
            "--draft-backend", "mlx"]  # fmt: skip
    assert cli.main(["cache-prompt", *pair, "--prompt", doc, "-o", str(path)]) == 0
    assert "saved the KV of" in capsys.readouterr().err
    question = doc + "What jumps?"
    argv = ["generate", *pair, "--prompt", question, "--max-tokens", "8", "--json"]
    assert cli.main([*argv, "--prompt-cache", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    want = uncached.generate(question, max_tokens=8)
    assert out["tokens"] == want.tokens
    n_doc = len(uncached.tokenizer.encode(
        uncached.tokenizer.apply_chat_template([{"role": "user", "content": doc}], False),
        add_special_tokens=False,
    ))  # fmt: skip
    # the saved user message ends with <|im_end|>: the hit is the message's text before it
    assert n_doc - 3 <= out["stats"]["cached_tokens"] < n_doc
    # another model's file: a clear error, exit code 1
    other = ["generate", "--model", str(models["other"]), "--prompt", "hi", "--json"]
    assert cli.main([*other, "--prompt-cache", str(path)]) == 1
    assert "made for another verifier model" in capsys.readouterr().err
    assert cli.main(["cache-prompt", *pair, "-o", str(tmp_path / "x.kv")]) == 1
    assert "nothing to save" in capsys.readouterr().err


# -- visible: server and chat --------------------------------------------------------------------


def test_server_reports_cached_tokens_and_metrics(models, uncached):
    from test_server import LiveServer

    gen = ondevice.load(models["verifier"], models["draft"], draft_backend="mlx")
    system = {"role": "system", "content": "You answer questions about foxes. " * 6}
    q1 = [system, {"role": "user", "content": "hello"}]
    q2 = [system, {"role": "user", "content": "goodbye"}]
    with LiveServer(gen) as server:
        client = server.client()
        r1 = client.chat.completions.create(model=gen.model_name, messages=q1, max_tokens=8,
                                            temperature=0)  # fmt: skip
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        r2 = client.chat.completions.create(model=gen.model_name, messages=q2, max_tokens=8,
                                            temperature=0)  # fmt: skip
        n_system = len(gen.encode_prompt([system])) - len("<|im_start|>assistant\n")
        cached = r2.usage.prompt_tokens_details.cached_tokens
        assert n_system <= cached < r2.usage.prompt_tokens
        shown = {"hide_tokens": server.api.hidden_tokens}  # the server hides special tokens
        assert r2.choices[0].message.content == uncached.generate(q2, max_tokens=8, **shown).text
        chunks = list(client.chat.completions.create(
            model=gen.model_name, messages=q2, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ))  # fmt: skip
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens - 1
        done = client.completions.create(model=gen.model_name, prompt="hello hello", max_tokens=4)
        assert done.usage.prompt_tokens_details.cached_tokens == 0
        metrics = httpx.get(server.url + "/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("ondevice_prompt_cache")
    }
    assert values["ondevice_prompt_cache_hits_total"] == 2
    assert values["ondevice_prompt_cache_misses_total"] == 2
    assert (
        values["ondevice_prompt_cache_cached_tokens_total"] == cached + r2.usage.prompt_tokens - 1
    )
    assert values["ondevice_prompt_cache_bytes"] == gen.prompt_cache_stats()["bytes"] > 0
    assert values["ondevice_prompt_cache_evictions_total"] == 0
    assert values["ondevice_prompt_cache_max_bytes"] == 1 << 30


def test_chat_stats_show_the_prompt_cache(models):
    ctrl = ChatController(settings=Settings(max_tokens=12, temperature=0.0))
    assert ctrl.load(models["verifier"], draft=models["draft"], draft_backend="mlx", wait=True)
    for text in ("hello", "and then?"):
        assert ctrl.send(text)
        ctrl.wait()
    out = io.StringIO()
    TerminalChat(ctrl, out=out).command("/stats")
    first, limits, second = out.getvalue().splitlines()
    assert limits.startswith("context 512 tokens, draft reads the last ")
    turn = ctrl.last_stats
    assert turn["cached_tokens"] > 0
    assert f"prompt {turn['prompt_tokens']} tokens" in first
    assert f"({turn['cached_tokens']} from the prompt cache)" in first
    assert second.startswith("prompt cache: 1 entries") and "1 hits" in second


def test_no_warnings_from_a_plain_load(models):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ondevice.load(models["verifier"]).generate("hi", max_tokens=2)


# -- issue 29: saved prompts are checksummed, checked and written cleanly --------------------------


def _forge(src: Path, dest: Path, edit) -> Path:  # noqa: ANN001
    """A copy of the saved prompt `src` changed by `edit(arrays, meta)`, with a valid checksum
    (anyone can compute one): what the loader must still refuse by its contents."""
    from ondevice.runtime.prefix_cache import _digest

    arrays, meta = mx.load(str(src), format="safetensors", return_metadata=True)
    arrays, meta = dict(arrays), dict(meta)
    edit(arrays, meta)
    meta["sha256"] = _digest(arrays, meta)
    mx.save_safetensors(str(dest) + ".safetensors", arrays, metadata=meta)  # MLX adds it
    Path(str(dest) + ".safetensors").rename(dest)
    return dest


def test_a_damaged_or_forged_saved_prompt_is_refused(models, gen, tmp_path):
    """A flipped byte changed the answers silently; forged files gave tracebacks."""
    doc = ids(20, seed=14)
    path = tmp_path / "doc.kv"
    gen.save_prompt_cache(path, doc)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # in the last array's values
    (tmp_path / "flip.kv").write_bytes(bytes(data))
    load = lambda p: ondevice.load(models["verifier"], prompt_cache=p)  # noqa: E731
    with pytest.raises(PromptCacheError, match="damaged"):
        load(tmp_path / "flip.kv")

    def wrong_heads(a, m):  # noqa: ANN001, ANN202
        a["verifier.0.keys"] = a["verifier.0.keys"][:, :1]

    cases = [
        (lambda a, m: m.update(tokens="[1, 2"), "token list"),
        (lambda a, m: m.update(tokens="[-1, 5]"), "token list"),
        (lambda a, m: m.update(tokens=json.dumps([10**9] * 20)), "token list"),
        (lambda a, m: m.update(tokens="[]"), "token list"),
        (wrong_heads, "does not match the loaded verifier"),
        (lambda a, m: m.update(format_version="1"), "format 1"),
    ]
    for i, (edit, says) in enumerate(cases):
        with pytest.raises(PromptCacheError, match=says):
            load(_forge(path, tmp_path / f"forged{i}.kv", edit))
    assert load(path).generate(doc + [5], max_tokens=2).stats["cached_tokens"] == 20


def test_a_saved_prompt_that_cannot_be_written_is_a_clean_error(gen, tmp_path, monkeypatch):
    doc = ids(20, seed=15)
    (tmp_path / "file").write_text("x")
    for where in (tmp_path / "missing" / "doc.kv", tmp_path / "file" / "doc.kv"):
        with pytest.raises(PromptCacheError, match="cannot write the prompt cache"):
            gen.save_prompt_cache(where, doc)
    # A full disk: MLX reports nothing and leaves a short file; the read-back finds it.
    from ondevice.runtime import prefix_cache

    real = mx.save_safetensors

    def short_write(file, arrays, metadata=None):  # noqa: ANN001, ANN202
        real(file, arrays, metadata=metadata)
        with open(file, "r+b") as f:
            f.truncate(Path(file).stat().st_size // 2)

    monkeypatch.setattr(prefix_cache.mx, "save_safetensors", short_write)
    with pytest.raises(PromptCacheError, match="cannot write the prompt cache"):
        gen.save_prompt_cache(tmp_path / "doc.kv", doc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing half-written
    monkeypatch.undo()
    code = cli.main(["cache-prompt", "--model", str(gen._pair.verifier.path), "--prompt", "hi",
                     "-o", str(tmp_path / "file" / "doc.kv")])  # fmt: skip
    assert code != 0

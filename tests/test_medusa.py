"""Method "medusa": Medusa heads on the verifier's hidden states (lossless on every
architecture, through the API, the CLI and the server), the heads folder and its checks, and
`ondevice distill --heads medusa` end to end on a tiny verifier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import tiny
from support.medusa_heads import write_heads
from test_server import LiveServer

import ondevice
from ondevice.distill.medusa import distill_heads
from ondevice.models import load_model
from ondevice.proposers.base import Unavailable
from ondevice.proposers.medusa import META, WEIGHTS, load_heads, read_heads

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ("hello world hello world", "abcabcabc", "the cat sat on the mat")


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> Path:
    return tiny.write_model(tmp_path_factory.mktemp("medusa") / "v", layers=2, scale=1.5)


@pytest.fixture(scope="module")
def heads(verifier, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("heads") / "heads"
    return write_heads(load_model(verifier).model, out, num_heads=3, noise=0.05)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
@pytest.mark.parametrize("arch", sorted(tiny.ARCH_DEFAULTS))
def test_greedy_output_is_plain_decodings_on_every_architecture(arch, kind, tmp_path):
    tie = arch in ("qwen2", "qwen3")  # the output matrix shared with the embedding, or not
    v = tiny.write_model(tmp_path / arch, arch=arch, tie=tie, layers=2, scale=1.5)
    h = write_heads(load_model(v).model, tmp_path / "heads", num_heads=4, noise=0.05, kind=kind)
    gen = ondevice.load(v, heads=h)
    drafted = 0
    for prompt in PROMPTS:
        plain = gen.generate(prompt, max_tokens=24, speculative=False)
        spec = gen.generate(prompt, max_tokens=24, method="medusa")
        assert spec.tokens == plain.tokens, (arch, prompt)
        assert spec.stats["rounds_by_method"] == {"medusa": spec.stats["rounds"]}
        drafted += spec.stats["drafted"]
        # seeded sampling: the same seed gives the same tokens
        a = gen.generate(prompt, max_tokens=12, method="medusa", temperature=1.0, seed=4)
        b = gen.generate(prompt, max_tokens=12, method="medusa", temperature=1.0, seed=4)
        assert a.tokens == b.tokens
    assert drafted > 0


def test_heads_folder_round_trip(verifier, heads):
    model = load_model(verifier).model
    arrays, info = read_heads(heads)
    assert (info.num_heads, info.hidden_size) == (3, model.config.hidden_size)
    assert info.extra["verifier"] == "a tiny test model"
    assert all(v.dtype == mx.float16 for v in arrays.values())  # stored as float16
    loaded, info2 = load_heads(heads, model)
    assert info2 == info and len(loaded.heads) == 3
    for k in range(3):
        w = np.array(loaded.heads[k].weight)
        np.testing.assert_array_equal(w, np.array(arrays[f"heads.{k}.weight"].astype(mx.float32)))
        assert np.abs(w).max() > 0  # the noise was stored, not zeros
    doc = json.loads((heads / META).read_text())
    assert doc["format"] == "ondevice-medusa-heads" and doc["num_heads"] == 3


def test_heads_over_the_size_limit_are_stored_quantized_and_still_decode_losslessly(
    verifier, tmp_path
):
    """`--max-mb` (30 MB: what Package.resources may ship) applies to heads as to a draft: heads
    whose float16 matrices do not fit are stored with the most bits that do (4 sequential heads
    of the 1.5B verifier: 37.7 MB in float16, about 19 MB in 8 bits), and load as float heads
    close to the trained ones."""
    model = load_model(verifier).model
    full = write_heads(model, tmp_path / "f16", num_heads=4, noise=0.05, kind="hydra")
    f16 = (full / WEIGHTS).stat().st_size
    limit = (64 << 10) + f16 * 6 // 10  # float16 does not fit, 8 bits does
    small = write_heads(model, tmp_path / "q", num_heads=4, noise=0.05, kind="hydra",
                        max_bytes=limit)  # fmt: skip
    doc = json.loads((small / META).read_text())
    assert doc["bits"] == 8 and (small / WEIGHTS).stat().st_size < f16 * 6 // 10
    ref, _ = load_heads(full, model)
    got, info = load_heads(small, model)
    for a, b in zip(ref.heads, got.heads):
        err = np.abs(np.array(a.weight) - np.array(b.weight))
        scale = np.abs(np.array(a.weight)).max()
        assert 0 < err.max() < scale / 100  # quantized, by less than a percent of the range
    gen = ondevice.load(verifier, heads=small)
    for prompt in PROMPTS[:2]:
        plain = gen.generate(prompt, max_tokens=16, speculative=False)
        assert gen.generate(prompt, max_tokens=16, method="medusa").tokens == plain.tokens
    with pytest.raises(ondevice.OndeviceError, match="--max-mb"):
        write_heads(model, tmp_path / "none", num_heads=4, kind="hydra", max_bytes=f16 // 20)
    assert not list(tmp_path.glob("none*"))  # nothing half-written


def test_heads_of_another_verifier_are_refused_clearly(verifier, heads, tmp_path):
    other = tiny.write_model(tmp_path / "other", seed=7, layers=2, scale=1.5)
    with pytest.raises(ondevice.OndeviceError, match="another verifier") as e:
        ondevice.load(other, heads=heads)
    assert str(heads / META) in str(e.value) and "ondevice distill --heads medusa" in str(e.value)
    wide = tiny.write_model(tmp_path / "wide", layers=2, hidden_size=32, heads=2, kv_heads=1)
    with pytest.raises(ondevice.OndeviceError, match="hidden size 64, this verifier's is 32"):
        ondevice.load(wide, heads=heads)
    with pytest.raises(ondevice.OndeviceError, match="not found"):
        ondevice.load(verifier, heads=tmp_path / "nowhere")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / META).write_text("{not json")
    (broken / WEIGHTS).write_bytes(b"")
    with pytest.raises(ondevice.OndeviceError, match="not a readable Medusa heads description"):
        ondevice.load(verifier, heads=broken)


def test_without_heads_the_method_is_unavailable_and_says_how_to_train_them(
    verifier, tmp_path, monkeypatch
):
    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    gen = ondevice.load(verifier)
    with pytest.raises(Unavailable, match="ondevice distill --heads medusa"):
        gen.generate("hi", max_tokens=4, method="medusa")
    # heads in the cache are found without heads=...
    write_heads(gen.verifier.model)
    out = gen.generate("hello world", max_tokens=12, method="medusa")
    assert out.tokens == gen.generate("hello world", max_tokens=12, speculative=False).tokens
    assert out.stats["drafted"] > 0


def test_heads_shipped_with_the_package_are_found_by_the_verifiers_fingerprint(
    verifier, tmp_path, monkeypatch
):
    """Heads in `ondevice.resources/heads/*/` serve the verifier they were trained for (by
    the fingerprint in heads.json), after the cache; others and broken folders are passed over."""
    import importlib.resources

    from ondevice.proposers.medusa import shipped_heads

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    root = tmp_path / "resources"
    monkeypatch.setattr(importlib.resources, "files", lambda package: root)
    gen = ondevice.load(verifier)
    other = tiny.write_model(tmp_path / "other", layers=3)  # another fingerprint
    write_heads(load_model(other).model, root / "heads" / "a-other")
    (root / "heads" / "b-broken").mkdir()
    (root / "heads" / "b-broken" / META).write_text("{not json")
    assert shipped_heads(gen.verifier.model) is None
    with pytest.raises(Unavailable):
        gen.generate("hi", max_tokens=4, method="medusa")
    write_heads(gen.verifier.model, root / "heads" / "c-mine")
    assert shipped_heads(gen.verifier.model) == root / "heads" / "c-mine"
    out = gen.generate("hello world", max_tokens=12, method="medusa")
    assert out.tokens == gen.generate("hello world", max_tokens=12, speculative=False).tokens
    assert out.stats["drafted"] > 0


def test_cli_generate_takes_heads_and_method_medusa(verifier, heads):
    run = [sys.executable, "-m", "ondevice", "generate", "--model", str(verifier)]
    args = ["--prompt", "hello world", "--max-tokens", "12", "--json"]
    plain = subprocess.run(run + args + ["--no-speculative"], capture_output=True, text=True)
    spec = subprocess.run(
        run + args + ["--heads", str(heads), "--method", "medusa"], capture_output=True, text=True
    )
    assert spec.returncode == 0, spec.stderr
    assert json.loads(spec.stdout)["text"] == json.loads(plain.stdout)["text"]
    assert json.loads(spec.stdout)["stats"]["rounds_by_method"].keys() == {"medusa"}


def test_server_takes_method_medusa(verifier, heads):
    gen = ondevice.load(verifier, heads=heads)
    messages = [{"role": "user", "content": "hello there"}]
    ref = gen.generate(messages, max_tokens=16, speculative=False)
    with LiveServer(gen) as server:
        resp = server.client().chat.completions.create(
            model=gen.model_name, messages=messages, max_tokens=16, temperature=0,
            extra_body={"method": "medusa"},
        )  # fmt: skip
    assert resp.choices[0].message.content == ref.text
    assert resp.model_extra["ondevice"]["rounds_by_method"].keys() == {"medusa"}


# -- training ---------------------------------------------------------------------------------------


def test_distill_heads_trains_resumes_and_exports_heads_that_run(verifier, tmp_path):
    docs = []
    for i in range(30):  # small documents: --data first, then the packages' own text
        f = tmp_path / f"doc{i}.txt"
        f.write_text(("the cat sat on the mat. " * (i % 5 + 2)) + f"number {i} is here.\n")
        docs.append(str(f))
    out = tmp_path / "heads"
    small = dict(
        data_files=docs, num_heads=3, vocab=80, tokens=6000, seq_len=64, batch_size=64,
        eval_every=10, checkpoint_every=10, learning_rate=3e-3, progress=False,
        chat_fraction=0.3, gen_batch=4, max_tokens=48,
    )  # fmt: skip
    first = distill_heads(verifier, out, steps=30, **small)
    losses = first["losses"]
    assert first["step"] == 30 and np.mean(losses[-5:]) < np.mean(losses[:5])
    assert first["held_out_loss"] < first["held_out_loss_start"]
    assert len(first["head_agreement"]) == 3
    assert first["documents"] > len(docs)  # the local text filled up --tokens
    assert first["chat_answers"]["train"] >= 1800 and first["chat_answers"]["held_out"] > 0
    assert first["data"][0] == "self-written chat answers"
    info = json.loads((out / META).read_text())
    assert info["head_agreement"] == first["head_agreement"] and info["step"] == 30
    with pytest.raises(ondevice.OndeviceError, match="--resume"):
        distill_heads(verifier, out, steps=30, **small)
    again = distill_heads(verifier, out, steps=40, resume=True, **small)
    assert again["step"] == 40 and len(again["losses"]) == 10  # continued, not restarted
    assert "head_agreement_start" not in again
    # resumed on other text (more documents): continues; other heads: refused, naming the option
    more = {**small, "chat_fraction": 0.2, "tokens": 7000, "code_share": 0.5,
            "max_tokens": 320}  # fmt: skip
    with pytest.raises(ondevice.OndeviceError, match="num_heads=3, not 2"):
        distill_heads(verifier, out, steps=45, resume=True, **{**more, "num_heads": 2})
    third = distill_heads(verifier, out, steps=45, resume=True, **more)
    assert third["step"] == 45 and third["documents"] > again["documents"]
    # half of the answers now written under the coding system prompt, in their own shards
    work = out.with_name(out.name + ".work") / "hidden"
    assert sorted(p.name for p in work.glob("code-*.npz"))[0] == "code-00000.npz"
    assert third["data"][1].startswith("a share of 0.5 of them")
    # --init: a new run starts from the trained heads, not the identity (the same text)
    start = distill_heads(verifier, tmp_path / "h2", steps=0, init=out, **small)
    assert start["held_out_loss_start"] < first["held_out_loss_start"] - 1.0
    assert json.loads((tmp_path / "h2" / META).read_text())["init"] == str(out.resolve())
    trained, copied = read_heads(out)[0], read_heads(tmp_path / "h2")[0]
    assert trained.keys() == copied.keys()
    assert all(mx.array_equal(trained[k], copied[k]).item() for k in trained)
    resumed = distill_heads(verifier, tmp_path / "h2", steps=2, resume=True, **small)  # no --init
    assert resumed["step"] == 2 and len(resumed["losses"]) == 2
    with pytest.raises(ondevice.OndeviceError, match=r"heads.json: num_heads is 3 where .* 2"):
        distill_heads(verifier, tmp_path / "h3", steps=1, init=out, **{**small, "num_heads": 2})
    gen = ondevice.load(verifier, heads=out)
    for prompt in PROMPTS:
        spec = gen.generate(prompt, max_tokens=16, method="medusa")
        assert spec.tokens == gen.generate(prompt, max_tokens=16, speculative=False).tokens


def test_self_written_chats_record_the_states_and_targets_of_the_verifiers_own_answers(
    verifier, tmp_path
):
    """The heads' chat data: each recorded hidden state and top-k belongs to the position it is
    filed under (what a teacher-forced pass over the finished conversation computes there), and
    the shards hold exactly the answers' positions."""
    from ondevice.distill.data import answers_only, chat_turn_tokens, magpie_batch
    from ondevice.distill.medusa import chat_shards
    from ondevice.runtime.kernel import load_served

    teacher = load_served(verifier)
    model = teacher.model
    shard = magpie_batch(model, teacher.tokenizer, batch=3, k=4, max_tokens=40, seed=1000,
                         hidden=True)  # fmt: skip
    ends = np.append(shard.starts[1:], len(shard.tokens))
    assert len(ends) == 3
    P = len(chat_turn_tokens(teacher.tokenizer)[0])  # the template's opening: prefilled
    for a, b in zip(shard.starts, ends):
        logits, h = model(mx.array(shard.tokens[a:b][None]), hidden=True)
        n = b - a - 1  # the state after the last token is not recorded
        got, want = shard.hidden[a + P - 1 : a + n], np.array(h[0, P - 1 : n])
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=1e-2)
        top = np.array(logits[0, P - 1 : n].argmax(-1))
        assert (shard.ids[a + P - 1 : a + n, 0] == top).mean() > 0.95
    answers = answers_only(shard, chat_turn_tokens(teacher.tokenizer)[1])
    train, held = chat_shards(teacher, tmp_path, 150, k=4, batch=3, max_tokens=40, seed=0)
    assert [p.name for p in held] == ["chat-00000.npz"] and len(train) >= 1
    with np.load(held[0]) as z:
        length, hid, ids, toks = z["length"], z["hidden"], z["ids"], z["tokens"]
    kept = answers.mask.reshape(-1)
    assert length.sum() == kept.sum() > 0  # batch 0 is the one made above, its answers only
    first = np.nonzero(kept)[0][: length[0]]
    np.testing.assert_array_equal(hid[0, : length[0]], shard.hidden[first])
    np.testing.assert_array_equal(ids[0, : length[0]], shard.ids[first])
    # the text's token after each position: what sequential heads read with its state
    np.testing.assert_array_equal(toks[0, : length[0]], shard.tokens[first + 1])
    again = chat_shards(teacher, tmp_path, 150, k=4, batch=3, max_tokens=40, seed=0)
    assert again == (train, held)  # resumed from the shards, nothing written again


def test_cli_distill_heads(verifier, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("a b c d e f g. " * 40)
    out = tmp_path / "h"
    cmd = [sys.executable, "-m", "ondevice", "distill", "--heads", "medusa", "--verifier",
           str(verifier), "-o", str(out), "--data", str(doc), "--tokens", "600", "--steps", "3",
           "--seq-len", "32", "--batch-size", "16", "--num-heads", "2", "-q"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "held-out greedy agreement per head" in r.stdout
    assert json.loads((out / META).read_text())["num_heads"] == 2
    other = [*cmd[:9], str(tmp_path / "h2"), *cmd[10:], "--init", str(out)]
    other[other.index("medusa")] = "hydra"  # other kind of heads than --init's
    r = subprocess.run(other, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "kind is 'medusa' where this run trains 'hydra'" in r.stderr
    draft = [sys.executable, "-m", "ondevice", "distill", "--verifier", str(verifier), "-o",
             str(tmp_path / "d"), "--init", str(out)]  # fmt: skip
    r = subprocess.run(draft, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "needs --heads" in r.stderr and "Traceback" not in r.stderr


def test_the_tree_holds_the_best_paths_by_the_product_of_head_probabilities(verifier, heads):
    from ondevice.proposers.base import Verification, fixed_budget
    from ondevice.proposers.medusa import MedusaProposer
    from ondevice.rules.noise import PositionNoise

    model = load_model(verifier).model
    loaded, info = load_heads(heads, model)
    prop = MedusaProposer(model, loaded, info, depth=2, budget=fixed_budget(5))
    table = np.zeros((3, 96))
    table[0, [10, 11, 12, 13]] = [0.5, 0.3, 0.15, 0.05]  # head 1
    table[1, [20, 21, 22]] = [0.7, 0.25, 0.05]  # head 2
    prop.head_probs = lambda state: table  # type: ignore[method-assign]
    prop.reset([1, 2])
    assert prop.propose([1, 2], 4, PositionNoise(0)).size == 0  # no state: a plain step
    prop.state = np.zeros(model.config.hidden_size, np.float32)
    tree = prop.propose([1, 2], 4, PositionNoise(0))
    # by value: 10 (.5), 10-20 (.35), 11 (.3), 11-20 (.21), 12 (.15); then 10-21 (.125) ...
    paths = sorted(tuple(tree.path_tokens(n)) for n in range(1, len(tree)))
    assert paths == [(10,), (10, 20), (11,), (11, 20), (12,)]
    assert all(d is None for draws in tree.draws for _, d in draws)  # deterministic draws
    # a verification that accepts 10, 20 teaches the calibration and hands over the state
    path = [tree.children[tree.children[0][10]][20]]
    path.insert(0, tree.parents[path[0]])
    hidden = np.ones((len(tree), model.config.hidden_size), np.float32)
    prop.observe([1, 2], tree, Verification(path, 5, np.zeros(len(tree), int), hidden))
    assert np.array_equal(prop.state, hidden[path[-1]])
    assert prop.realised[1] == prop.realised[2] == 2
    assert prop.predicted[1] == pytest.approx(1 + 0.95) and prop.predicted[2] == pytest.approx(1.56)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_the_first_round_drafts_from_the_prompts_last_state(kind, verifier, tmp_path, monkeypatch):
    """The prefill's last row is the verifier's state at prompt[-2], where each later round's
    guesses start from a verification's: the heads draft the first round from it instead of
    spending it on a plain step (one pass an answer). A prompt the cache held whole has no
    such row: None, and the first round is a plain step as before."""
    from ondevice.decoders.tree import TreeDecoder
    from ondevice.rules.engine import prefill
    from ondevice.runtime.engines import MLXEngine, innermost, tree_engine

    h = write_heads(load_model(verifier).model, tmp_path / "heads", num_heads=3, noise=0.05,
                    kind=kind)  # fmt: skip
    seen: list[tuple[list[int], np.ndarray | None, np.ndarray | None]] = []
    served: list = []  # the model as the generation serves it (the CPU kernel's products)
    step = TreeDecoder.step

    def first_step(self, seq, room):  # the proposer's state when the first round is built
        if len(seen) < 1:
            p = self.proposer
            state = p.heads_draft.hidden if kind == "hydra" else p.state
            seen.append((list(seq), self.prompt_state, None if state is None else state.copy()))
            served.append(innermost(self.verifier).model)  # type: ignore[attr-defined]
        return step(self, seq, room)

    monkeypatch.setattr(TreeDecoder, "step", first_step)
    gen = ondevice.load(verifier, heads=h)
    plain = gen.generate(PROMPTS[2], max_tokens=16, speculative=False)
    spec = gen.generate(PROMPTS[2], max_tokens=16, method="medusa", cache_prompt=False)
    assert spec.tokens == plain.tokens
    ((prompt, handed, used),) = seen
    assert handed is not None and used is not None
    np.testing.assert_array_equal(used, handed)  # what the first round drafts from
    model = served[0]
    _, states = model(mx.array([prompt[:-1]]), model.make_cache(), hidden=True)
    rows = np.array(states[0].astype(mx.float32))
    np.testing.assert_allclose(handed, rows[-1], rtol=1e-3, atol=1e-3)  # prompt[-2]'s state
    assert not np.allclose(handed, rows[-2], rtol=1e-3, atol=1e-3)
    engine = tree_engine(MLXEngine(model))
    np.testing.assert_allclose(prefill(engine, prompt[:-1], hidden=True), handed, atol=1e-6)
    assert prefill(engine, prompt[:-1], resume=True, hidden=True) is None  # held whole


def test_in_auto_the_heads_draft_from_the_latest_state_whoever_proposed(verifier, heads):
    """auto shows the heads every round's verdict: after rounds of plain steps, their next
    guesses start from the state at the last accepted token, not the one of their own last
    round; only their own trees calibrate them."""
    from ondevice.proposers.auto import AutoProposer
    from ondevice.proposers.base import NoProposal, Verification, fixed_budget
    from ondevice.proposers.medusa import MedusaProposer
    from ondevice.rules.noise import PositionNoise
    from ondevice.runtime.pass_costs import CostProfile

    model = load_model(verifier).model
    loaded, info = load_heads(heads, model)
    medusa = MedusaProposer(model, loaded, info, depth=2, budget=fixed_budget(3))
    auto = AutoProposer([NoProposal(), medusa], CostProfile([1], [1.0]))
    auto.reset([1, 2])
    d = model.config.hidden_size
    auto.start_from(np.full(d, 7.0, np.float32))  # the prompt's last state, to the heads
    assert np.array_equal(medusa.state, np.full(d, 7.0))
    seq, names = [1, 2], []
    auto._choose = lambda room, skip: len(names) % 2  # type: ignore[method-assign]  # alternate
    for r in range(6):
        tree = auto.propose(seq, 4, PositionNoise(0))
        before = medusa.predicted.copy()
        hidden = np.full((len(tree), d), float(r), np.float32)
        auto.observe(seq, tree, Verification([], 5, np.zeros(len(tree), int), hidden))
        assert np.array_equal(medusa.state, hidden[0])  # the latest, whoever proposed
        if auto.last_name != "medusa":
            assert np.array_equal(medusa.predicted, before)  # another's tree: no calibration
        seq = seq + [5]
        names.append(auto.last_name)
    assert "medusa" in names and len(set(names)) == 2  # both kinds of round were checked


def test_server_without_heads_answers_a_clear_error(verifier, tmp_path, monkeypatch):
    import openai

    monkeypatch.setenv("ONDEVICE_HOME", str(tmp_path / "home"))
    gen = ondevice.load(verifier)
    with LiveServer(gen) as server, pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=gen.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"method": "medusa"},
        )  # fmt: skip
    assert "ondevice distill --heads medusa" in str(e.value)


# -- sequential (Hydra) heads ------------------------------------------------------------------------


def test_sequential_heads_train_on_the_embedding_of_the_token_each_state_was_followed_by(
    verifier, tmp_path
):
    """Head k at position t reads the embedding of the text's token at t+k (what the tree's
    path holds there at generation) and learns the teacher's distribution at t+k: an
    off-by-one here would teach every head the wrong token."""
    from ondevice.distill.medusa import Positions, TokenEmbeddings, hidden_shards
    from ondevice.proposers.medusa import embed_tokens
    from ondevice.runtime.kernel import load_served

    teacher = load_served(verifier)
    rng = np.random.default_rng(0)
    pieces = [rng.integers(3, 90, size=n).astype(np.int32) for n in (20, 13)]
    paths = hidden_shards(teacher, tmp_path, "train", pieces, k=4)
    assert hidden_shards(teacher, tmp_path, "none", [], k=4) == []  # --chat-fraction 1
    pos = Positions(paths, 3, TokenEmbeddings(teacher.model))
    sel = np.arange(pos.n)
    h, e, ids, logp, w = pos.gather(sel)
    assert e is not None and e.shape == (pos.n, 3, teacher.config.hidden_size)
    r, t = pos.rows[sel], pos.cols[sel]
    for k in range(1, 4):
        ok = np.array(w[:, k - 1]) > 0
        assert ok.sum() > 0
        want = np.stack([pieces[a][b + k] for a, b in zip(r[ok], t[ok])])
        np.testing.assert_array_equal(
            np.array(e[:, k - 1])[ok], np.array(embed_tokens(teacher.model, want))
        )
        # and its target is the teacher's distribution after that token
        logits = teacher.model(mx.array(pieces[0][None]))[0]
        first = (r[ok] == 0) & (t[ok] + k < len(pieces[0]) - 1)
        top = np.array(logits.argmax(-1))[t[ok][first] + k]
        assert (np.array(ids[:, k - 1, 0])[ok][first] == top).mean() > 0.95


def test_sequential_heads_grow_each_path_from_its_own_tokens(verifier, tmp_path):
    """A node's children come from the next head over the state its own token was guessed from
    and that token's embedding, so siblings' children differ; a level is one product over its
    frontier, equal to the nodes taken one by one."""
    from ondevice.proposers.medusa import HeadsDraft, embed_tokens, head_logits
    from ondevice.rules.token_tree import TokenTree

    model = load_model(verifier).model
    folder = write_heads(model, tmp_path / "h", num_heads=3, noise=0.2, kind="hydra")
    heads, info = load_heads(folder, model)
    d, vocab = model.config.hidden_size, model.config.vocab_size
    draft = HeadsDraft(model, heads, info, vocab, (np.ones(5), np.ones(5)), level_cost=0.5)
    draft.hidden = np.random.default_rng(1).normal(size=d).astype(np.float32)
    root = draft.sync([4, 7])
    z1 = heads.step(0, mx.array(draft.hidden[None]), embed_tokens(model, [7]))
    np.testing.assert_allclose(
        root, np.array(head_logits(model, z1, vocab))[0], rtol=1e-5, atol=1e-5
    )
    tree = TokenTree.root(7)
    a, b = tree.add(0, 11), tree.add(0, 12)
    rows = draft.expand(tree, [a, b])
    for node, row in zip((a, b), rows):
        z2 = heads.step(1, z1, embed_tokens(model, [tree.tokens[node]]))
        want = np.array(head_logits(model, z2, vocab))[0]
        np.testing.assert_allclose(row, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(rows[0], rows[1])  # the path's token matters
    c = tree.add(a, 20)
    deeper = draft.expand(tree, [c])[0]  # from node a's own state, not the root's
    z2a = heads.step(1, z1, embed_tokens(model, [11]))
    z3 = heads.step(2, z2a, embed_tokens(model, [20]))
    np.testing.assert_allclose(deeper, np.array(head_logits(model, z3, vocab))[0], rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    assert draft.work == pytest.approx(1.5)  # three levels' estimated seconds


def test_in_auto_the_sequential_heads_work_counts_in_their_rounds(verifier, tmp_path):
    """auto adds the heads' estimated seconds to their rounds' (as a draft's), so cheap passes
    do not make trees that cost more than they find look free."""
    from dataclasses import replace

    from ondevice.proposers import auto
    from ondevice.proposers.medusa import HeadsDraft, HydraProposer
    from ondevice.proposers.resources import Resources, Speculation
    from ondevice.rules.noise import PositionNoise
    from ondevice.rules.sampling import SamplingParams
    from ondevice.runtime.pass_costs import CostProfile

    model = load_model(verifier).model
    folder = write_heads(model, tmp_path / "h", num_heads=3, noise=0.05, kind="hydra")
    gen = ondevice.load(verifier, heads=folder)
    res = Resources.build(gen.verifier, None, SamplingParams(), profile=False, heads=folder)
    res = replace(res, verify_cost=CostProfile([1, 16], [1.0, 1.0]))
    picker = auto.build(res, Speculation(method="auto"))
    (hydra,) = [p for p in picker.proposers if isinstance(p, HydraProposer)]
    picker.reset([1, 2])  # a generation starts: auto collects its candidates' drafts
    assert [type(d) for d in picker.drafts] == [HeadsDraft]
    assert hydra.heads_draft.level_cost > 0
    before = picker._draft_work()
    hydra.heads_draft.hidden = np.zeros(model.config.hidden_size, np.float32)
    hydra.propose([1, 2], 3, PositionNoise(0))
    assert picker._draft_work() > before


def test_shards_without_tokens_are_refused_for_sequential_heads(tmp_path):
    from ondevice.distill.data import save_npz
    from ondevice.distill.medusa import Positions

    path = tmp_path / "hidden" / "chat-00000.npz"
    path.parent.mkdir()
    save_npz(path, hidden=np.zeros((1, 4, 8), np.float16), ids=np.zeros((1, 4, 2), np.int32),
             logp=np.zeros((1, 4, 2), np.float16), length=np.array([4], np.int32))  # fmt: skip
    assert Positions([path], 2).n == 3  # independent heads need no tokens
    with pytest.raises(ondevice.OndeviceError, match="delete"):
        Positions([path], 2, embeddings=object())  # type: ignore[arg-type]


def test_sequential_heads_verify_a_copy_of_the_context_beside_their_guesses(verifier, tmp_path):
    """The lookup's branch (what followed the context's tail earlier) joins the heads' tree;
    its model learns how far the verifier followed it, and a path through it does not
    calibrate the heads."""
    from ondevice.proposers.base import Verification, fixed_budget
    from ondevice.proposers.lookup import PromptLookup
    from ondevice.proposers.medusa import HeadsDraft, HydraProposer
    from ondevice.rules.noise import PositionNoise
    from ondevice.rules.sampling import SamplingParams

    model = load_model(verifier).model
    d, vocab = model.config.hidden_size, model.config.vocab_size
    heads, info = load_heads(write_heads(model, tmp_path / "h", num_heads=2, noise=0.1,
                                         kind="hydra"), model)  # fmt: skip
    draft = HeadsDraft(model, heads, info, vocab, (np.ones(4), np.ones(4)))
    prop = HydraProposer(draft, vocab, SamplingParams(), mode="dynamic", depth=2, topk=2,
                         budget=fixed_budget(3), lookup=PromptLookup(branches=1, max_tokens=4))  # fmt: skip
    seq = [5, 6, 7, 8, 9, 5, 6]  # the tail (5, 6) occurred before: followed by 7 8 9 5
    prop.reset(seq)
    tree = prop.propose(seq, 4, PositionNoise(0))  # no state yet: the copy alone
    assert len(tree) == 5 and tree.path_tokens(4) == [7, 8, 9, 5]
    hidden = np.ones((len(tree), d), np.float32)
    prop.observe(seq, tree, Verification([1, 2], 9, np.zeros(len(tree), int), hidden))
    assert (prop.lookup.models[2].acc, prop.lookup.models[2].rej) == (3, 2)  # 2 of 4, rejected
    seq = seq + [7, 8, 9]  # tail (7, 8, 9): followed earlier by 5 6 7 8
    tree = prop.propose(seq, 4, PositionNoise(0))
    copied = prop._copied
    assert [tree.tokens[n] for n in copied] == [5, 6, 7, 8]
    heads_nodes = [n for n in range(1, len(tree)) if n not in copied]
    assert 1 <= len(heads_nodes) <= 3  # the heads' budget
    before, tried = prop.realised.copy(), prop._depth_pred > 0
    kept = len(prop._kept)  # the nodes the heads grew come first in the tree
    assert all(n >= kept for n in copied[1:])
    path = copied[:3]  # the verifier follows the copy for three tokens
    prop.observe(
        seq, tree, Verification(path, 8, np.zeros(len(tree), int), np.ones((len(tree), d)))
    )
    assert (prop.lookup.models[3].acc, prop.lookup.models[3].rej) == (4, 2)  # its own length
    own = 1 if copied[0] < kept else 0  # the copy's first token may be a heads' guess too
    depth = np.arange(len(before))
    np.testing.assert_array_equal(prop.realised - before, tried & (depth >= 1) & (depth <= own))


def test_the_heads_shipped_for_the_default_verifier_are_a_readable_folder():
    """`Package.resources/heads/*/`: sequential heads for Qwen2.5-Coder-1.5B, within the 30 MB
    a shipped resource may take, their weights the shapes heads.json says."""
    folders = sorted((ROOT / "Package.resources" / "heads").glob(f"*/{META}"))
    assert folders
    for meta in folders:
        arrays, info = read_heads(meta.parent)
        assert info.kind == "hydra" and info.num_heads == len(info.extra["head_agreement"])
        d = info.hidden_size
        assert {k: tuple(v.shape) for k, v in arrays.items()} == {
            **{f"heads.{k}.weight": (d, 2 * d) for k in range(info.num_heads)},
            **{f"heads.{k}.bias": (d,) for k in range(info.num_heads)},
        }
        assert (meta.parent / WEIGHTS).stat().st_size < 30e6

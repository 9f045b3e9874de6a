"""Grammar-constrained decoding (llguidance): the masks, structured output through the API
and the server, and the constrained law through chain, tree and pipeline (chi-square)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import tiny
from support.engines import MemoEngine, TableEngine
from support.stats import chi_square_p, exact_joint

import ondevice
from ondevice.decoders.chain import ChainDecoder
from ondevice.decoders.factory import make_decoder
from ondevice.decoders.pipelined import PipelinedDecoder
from ondevice.errors import OndeviceError
from ondevice.models import load_model
from ondevice.models.tokenizer import Tokenizer
from ondevice.proposers.resources import Speculation
from ondevice.rules.grammar import Grammar, GrammarError, ll_tokenizer
from ondevice.rules.sampling import SamplingParams

# over the vocabulary of tiny.write_tokenizer(vocab_size=16): a=5, b=6, c..h=7..12, EOS=2.
# Which tokens may follow depends on the first one, so the mask depends on the context.
LARK = "start: /(a|b)[c-h]*|[c-h](a|b)*/"
A, B, C, H = 5, 6, 7, 12


@pytest.fixture(scope="module")
def tok16(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok16")
    tiny.write_tokenizer(d, 16)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def grammar16(tok16):
    return Grammar.lark(
        ll_tokenizer(tok16.hf.backend_tokenizer, 16, [tiny.EOS_ID]), LARK, 16, [tiny.EOS_ID]
    )


def _ids(mask):
    return None if mask is None else set(np.flatnonzero(mask).tolist())


def test_masks_follow_the_grammar_in_any_order(grammar16):
    contexts = {
        (): set(range(A, H + 1)),
        (A,): {tiny.EOS_ID, *range(C, H + 1)},
        (A, C, H): {tiny.EOS_ID, *range(C, H + 1)},
        (C,): {tiny.EOS_ID, A, B},
        (C, B, A): {tiny.EOS_ID, A, B},
        (A, A): None,  # leaves the grammar
        (A, tiny.EOS_ID): None,  # nothing follows the end
    }
    state = grammar16.start()
    order = list(contexts) * 3
    np.random.default_rng(0).shuffle(order)
    for ctx in order:  # rollbacks and the cache give what a fresh state gives
        assert _ids(state.allowed(list(ctx))) == contexts[ctx], ctx
        assert _ids(grammar16.start().allowed(list(ctx))) == contexts[ctx], ctx


def test_bad_grammars_are_clear_errors(tok16):
    llt = ll_tokenizer(tok16.hf.backend_tokenizer, 16, [tiny.EOS_ID])
    with pytest.raises(GrammarError):
        Grammar.lark(llt, "start: (", 16, [tiny.EOS_ID])
    with pytest.raises(GrammarError):
        Grammar.json_schema(llt, {"type": "no-such-type"}, 16, [tiny.EOS_ID])


# -- structured output through the API and the server ---------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpair")
    v = tiny.write_model(d / "v", layers=2, scale=1.5, vocab_size=128)  # JSON's characters
    return v, tiny.perturbed_copy(v, d / "d", noise=0.3)


@pytest.fixture(scope="module")
def gen(pair):
    return ondevice.load(*pair, draft_backend="mlx")


def _check(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    return obj


@pytest.mark.parametrize(
    "kw",
    [{}, {"method": "tree"}, {"pipeline": True}, {"temperature": 0.8, "seed": 3}],
    ids=["chain", "tree", "pipeline", "sampled"],
)
def test_json_schema_output_is_valid_and_lossless(gen, kw):
    """Greedy: the verifier's own constrained tokens. Sampled: the sequential and the pipelined
    decoder give the same tokens for a seed (the law itself is tested below), every one of
    them allowed by the grammar; whether a sample closes the object within the budget depends
    on the draws (and so on the draft's rounding: an integer may run on), so only a greedy
    answer must."""
    g = gen.grammar(json_schema=SCHEMA)
    args = dict(max_tokens=60, num_draft_tokens=3, grammar=g, **kw)
    spec = gen.generate("hello", **args)
    if "seed" in kw:
        plain = gen.generate("hello", pipeline=True, **args)
    else:
        plain = gen.generate("hello", speculative=False, **args)
    assert spec.tokens == plain.tokens
    state = g.start()
    for i, t in enumerate(spec.tokens):
        mask = state.allowed(spec.tokens[:i])
        assert mask is None or mask[t], (i, t)
    if "seed" not in kw or spec.finish_reason == "stop":
        assert spec.finish_reason == "stop"
        _check(spec.text)
    assert spec.stats["drafted"] > 0


def test_any_json_object_and_regex(gen):
    r = gen.generate("hi", max_tokens=40, grammar=gen.grammar(json_schema=True))
    assert r.finish_reason == "length" or isinstance(json.loads(r.text), dict)
    r = gen.generate("hi", max_tokens=10, grammar=gen.grammar(regex=r"[0-9]{3}-[a-z]{2}"))
    assert r.finish_reason == "stop" and len(r.text) == 6 and r.text[3] == "-"
    with pytest.raises(OndeviceError, match="exactly one"):
        gen.grammar()


def test_response_format_over_http(gen):
    from test_server import LiveServer

    with LiveServer(gen) as s:
        client = s.client()
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "who?"}], max_tokens=60,
            response_format=fmt, temperature=0,
        )  # fmt: skip
        _check(r.choices[0].message.content)
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "who?"}], max_tokens=60,
            response_format={"type": "json_object"}, temperature=0,
        )  # fmt: skip
        assert r.choices[0].finish_reason == "length" or json.loads(r.choices[0].message.content)
        import httpx

        bad = {"model": "m", "messages": [{"role": "user", "content": "x"}],
               "response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": {"type": "nope"}}}}  # fmt: skip
        r = httpx.post(s.url + "/v1/chat/completions", json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


# -- the constrained law, through chain, tree and pipeline --------------------------------------

N = 10_000
PROMPT = [5, 6, 7]


def _joint(run, n=N) -> Counter:
    counts: Counter = Counter()
    for s in range(n):
        counts[tuple(run(s)[:2])] += 1
    return counts


def _p(counts: Counter, exact: np.ndarray) -> float:
    table = np.zeros_like(exact)
    for (a, *rest), c in counts.items():
        table[a, rest[0] if rest else 0] += c
    return chi_square_p(table, exact)


@pytest.fixture(scope="module")
def tables():
    ver = TableEngine(16, seed=0)
    return ver, ver.perturbed(0.8)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_constrained_chain_and_pipeline_match_the_masked_law(tables, grammar16, temperature):
    ver, dra = tables
    params = SamplingParams(temperature, grammar=grammar16)
    exact = exact_joint(ver, PROMPT, params)

    def chain(s):
        dec = ChainDecoder(ver, dra, params, seed=s, num_draft_tokens=2)
        return [t for r in dec.run(PROMPT, 2) for t in r.tokens]

    def pipe(s):
        dec = PipelinedDecoder(ver, dra, params, seed=s, num_draft_tokens=2)
        return [t for r in dec.run(PROMPT, 2) for t in r.tokens]

    for run, n in ((chain, N), (pipe, N // 4)):
        counts = _joint(run, n)
        assert all(a in range(A, H + 1) for a, *_ in counts)  # never outside the grammar
        assert _p(counts, exact) > 0.001


@pytest.mark.slow
def test_a_verifier_that_ignores_the_mask_fails(tables, grammar16, monkeypatch):
    """The draft masked, the verifier not: the output leaves the constrained law."""
    from ondevice.rules import chooser as decoder

    ver, dra = tables
    params = SamplingParams(1.0, grammar=grammar16)
    exact = exact_joint(ver, PROMPT, params)
    real = decoder.TokenChooser.decide

    def unmasked_decide(self, drafts, q, logits, start, seq=()):
        p = decoder.probabilities(logits, self.params)  # no grammar for the verifier
        return self.rule(drafts, q, p, self.noise.offsets(start))

    monkeypatch.setattr(decoder.TokenChooser, "decide", unmasked_decide)

    def chain(s):
        dec = ChainDecoder(ver, dra, params, seed=s, num_draft_tokens=2)
        return [t for r in dec.run(PROMPT, 2) for t in r.tokens]

    assert _p(_joint(chain, 5000), exact) < 1e-6
    monkeypatch.setattr(decoder.TokenChooser, "decide", real)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dynamic", "sampled"])
def test_constrained_tree_matches_the_masked_law(tmp_path, grammar16, mode):
    v, d = tiny.write_small_vocab_pair(tmp_path)
    ver, dra = MemoEngine(load_model(v).model), MemoEngine(load_model(d).model)
    params = SamplingParams(1.0, grammar=grammar16)
    accepted = 0

    def tree(s):  # one seed per generation: a seed's randomness is keyed by position
        nonlocal accepted
        spec = Speculation(method="tree", num_draft_tokens=2, profile=False, tree_mode=mode)
        dec = make_decoder(ver, dra, params, spec, seed=s)
        out: list[int] = []
        for r in dec.run(PROMPT, 3):
            out += r.tokens
            if len(out) >= 2:
                break
        accepted += dec.stats.accepted
        return out

    counts = _joint(tree, N // 2)
    assert accepted > 0
    assert _p(counts, exact_joint(ver, PROMPT, params)) > 0.001


def test_json_schema_with_sequential_heads_of_a_cut_vocabulary(pair, tmp_path):
    """Heads whose rows cover only the first ids (the chooser pads their logits to every id
    for the grammar's mask): the constrained greedy answer is the verifier's own, and valid."""
    from support.medusa_heads import write_heads

    from ondevice.models import load_model

    v = pair[0]
    heads = write_heads(load_model(v).model, tmp_path / "h", num_heads=3, noise=0.05,
                        vocab_subset=100, kind="hydra")  # fmt: skip
    g = ondevice.load(v, heads=heads)
    grammar = g.grammar(json_schema=SCHEMA)
    spec = g.generate("hello", max_tokens=60, method="medusa", grammar=grammar)
    plain = g.generate("hello", max_tokens=60, speculative=False, grammar=grammar)
    assert spec.tokens == plain.tokens and spec.finish_reason == "stop"
    _check(spec.text)
    assert spec.stats["drafted"] > 0

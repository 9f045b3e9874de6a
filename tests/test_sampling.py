"""The sampling transform's parts (min-p, penalties, logit bias), greedy decoding under them,
log-probabilities, and the OpenAI fields that reach them. The distribution tests of every
transform through chain, tree and pipeline are in test_speculative.py, test_tree.py and
test_pipeline.py (TRANSFORMS / ALL_TRANSFORMS)."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
from test_server import LiveServer, write_model

import ondevice
from ondevice.decoders.chain import ChainDecoder
from ondevice.decoders.factory import make_decoder
from ondevice.errors import OndeviceError
from ondevice.proposers.resources import Speculation
from ondevice.rules.sampling import SamplingParams, Transform, probabilities
from ondevice.runtime.engines import MLXEngine

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05]))


def _probs(params: SamplingParams, seq=(), prompt=()) -> np.ndarray:
    tf = Transform(params, 4)
    tf.start(list(prompt))
    return tf.probs(LOGITS, list(seq))


def test_min_p_keeps_tokens_near_the_best():
    np.testing.assert_allclose(
        probabilities(LOGITS, SamplingParams(1.0, min_p=0.5)), [0.625, 0.375, 0, 0]
    )
    np.testing.assert_allclose(
        probabilities(LOGITS, SamplingParams(1.0, min_p=0.1)), [0.5, 0.3, 0.15, 0.05]
    )


def test_logit_bias_adds_to_logits_and_can_ban():
    p = _probs(SamplingParams(1.0, logit_bias={3: np.log(10.0)}))
    np.testing.assert_allclose(p, np.array([0.5, 0.3, 0.15, 0.5]) / 1.45)
    assert _probs(SamplingParams(1.0, logit_bias={"0": -100}))[0] < 1e-40
    # greedy: the bias moves the argmax
    assert _probs(SamplingParams(0.0, logit_bias={2: 5.0})).argmax() == 2


def test_penalties_follow_their_definitions():
    prompt, gen = [1], [2, 2]
    seq = prompt + gen
    # presence: once per generated token seen; frequency: per occurrence; prompt not counted
    z = LOGITS.copy()
    z[2] -= 0.5 + 2 * 0.25
    expected = np.exp(z) / np.exp(z).sum()
    got = _probs(SamplingParams(1.0, presence_penalty=0.5, frequency_penalty=0.25), seq, prompt)
    np.testing.assert_allclose(got, expected)
    # repetition (CTRL): every context token, prompt included; negative logits multiplied
    z = LOGITS.copy()
    z[[1, 2]] *= 2.0
    expected = np.exp(z) / np.exp(z).sum()
    got = _probs(SamplingParams(1.0, repetition_penalty=2.0), seq, prompt)
    np.testing.assert_allclose(got, expected)
    pos = Transform(SamplingParams(1.0, repetition_penalty=2.0), 2)
    pos.start([])
    np.testing.assert_allclose(pos.logits(np.array([4.0, -4.0]), [0, 1]), [2.0, -8.0])


def test_paths_extend_the_context_row_by_row():
    tf = Transform(SamplingParams(1.0, frequency_penalty=1.0), 4)
    tf.start([])
    rows = tf.logits(np.stack([LOGITS] * 3), [0], [[], [1], [1, 1]])
    np.testing.assert_allclose(rows[:, 0], LOGITS[0] - 1.0)
    np.testing.assert_allclose(rows[:, 1], LOGITS[1] - np.array([0.0, 1.0, 2.0]))


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_parameters_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(1.0, **kw)


# -- through the decoders and the API ------------------------------------------------------------


PENALISED = dict(repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.5)


def _plain(gen, prompt, n, params):
    dec = ChainDecoder(gen.verifier, None, params)
    return [t for r in dec.run(prompt, n) for t in r.tokens]


@pytest.mark.parametrize("method", ["chain", "tree", "cascade", "pipeline"])
def test_greedy_with_penalties_equals_the_verifier_alone(gen, method):
    """Greedy decoding under penalties and a bias: every method gives the verifier's own greedy
    tokens under the same transform; and the transform did change them."""
    params = SamplingParams(0.0, logit_bias={7: 1.5}, **PENALISED)
    prompt = gen.encode_prompt("the cat sat on the mat", chat_template=False)
    ref = _plain(gen, prompt, 40, params)
    assert ref != _plain(gen, prompt, 40, SamplingParams(0.0))
    if method == "pipeline":
        from ondevice.decoders.pipelined import PipelinedDecoder

        dec = PipelinedDecoder(gen.verifier, gen.draft, params, num_draft_tokens=3)
    else:
        spec = Speculation(method=method, num_draft_tokens=3, profile=False)
        dec = make_decoder(gen.verifier, gen.draft, params, spec)
    got = [t for r in dec.run(prompt, 40) for t in r.tokens]
    assert got == ref
    assert dec.stats.accepted > 0


def test_api_penalties_change_the_answer_and_stay_lossless(gen):
    # a prompt whose answer is long enough for penalties to bite, with either CPU kernel
    a = gen.generate("the cat", max_tokens=30, **PENALISED)
    b = gen.generate("the cat", max_tokens=30, speculative=False, **PENALISED)
    c = gen.generate("the cat", max_tokens=30)
    assert a.tokens == b.tokens != c.tokens
    with pytest.raises(OndeviceError, match="logit_bias"):
        gen.generate("hello", max_tokens=2, logit_bias={10**9: 1.0})
    with pytest.raises(OndeviceError, match="min_p"):
        gen.generate("hello", max_tokens=2, min_p=2.0)


@pytest.mark.parametrize("speculative", [True, False])
def test_logprobs_are_the_verifiers(pair, speculative, draft_as_verifier):
    """Log-probabilities of emitted tokens are the verifier's raw log-softmax at each position,
    whether the token came from the draft or not (the draft is the verifier itself here, so
    drafts are accepted)."""
    gen = ondevice.load(pair[0], pair[0])
    r = list(gen.stream("hello", max_tokens=12, temperature=0.9, seed=3, logprobs=3,
                        speculative=speculative))  # fmt: skip
    tokens = [t for c in r for t in c.tokens]
    lps = [lp for c in r for lp in c.logprobs or ()]
    assert [lp.token for lp in lps] == tokens and len(tokens) >= 4
    prompt = gen.encode_prompt("hello")
    ver = MLXEngine(gen.verifier.model)
    logits = ver.feed(prompt + tokens[:-1])[len(prompt) - 1 :]
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    ref -= logits.max(-1, keepdims=True)
    for i, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(ref[i, tokens[i]], abs=1e-4)
        assert len(lp.top) == 3 and lp.top[0][0] == int(np.argmax(logits[i]))
    if speculative:
        assert any(c.from_draft for c in r)


# -- over HTTP with the openai client ----------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    v = write_model(root / "tiny-verifier")
    g = ondevice.load(v, draft=tiny.perturbed_copy(v, root / "d", noise=0.1), draft_backend="mlx")
    with LiveServer(g) as s:
        yield s, g


MESSAGES = [{"role": "user", "content": "hello there"}]


def test_openai_fields_reach_the_sampler(server):
    s, g = server
    client = s.client()
    kw = dict(model=g.model_name, messages=MESSAGES, max_completion_tokens=20, temperature=0)
    plain = client.chat.completions.create(**kw)
    ref = g.generate(MESSAGES, max_tokens=20, presence_penalty=1.0, frequency_penalty=0.5,
                     logit_bias={5: 3.0})  # fmt: skip
    got = client.chat.completions.create(
        **kw, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={"5": 3.0}, user="u1",
        extra_body={"min_p": 0.0, "repetition_penalty": 1.0},
    )  # fmt: skip
    assert got.choices[0].message.content == ref.text != plain.choices[0].message.content
    assert got.usage.completion_tokens == 20


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(server, stream):
    s, g = server
    kw = dict(model=g.model_name, messages=MESSAGES, max_tokens=10, temperature=0)
    resp = s.client().chat.completions.create(**kw, logprobs=True, top_logprobs=2, stream=stream)
    if stream:
        content = [c for ch in resp if ch.choices and ch.choices[0].logprobs
                   for c in ch.choices[0].logprobs.content]  # fmt: skip
    else:
        content = resp.choices[0].logprobs.content
    ref = g.generate(MESSAGES, max_tokens=10, logprobs=2)
    assert [c.token for c in content] == [g.tokenizer.decode([t]) for t in ref.tokens]
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-6  # greedy: the best is chosen


def test_completion_logprobs(server):
    s, g = server
    r = s.client().completions.create(model=g.model_name, prompt="hi", max_tokens=5, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"store": True}, "store"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"min_p": -0.1}, "min_p"),
    ],
)
def test_unsupported_or_bad_fields_are_refused_by_name(server, extra, param):
    import httpx

    s, g = server
    body = {"model": g.model_name, "messages": MESSAGES, "max_tokens": 2, **extra}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"] or r.json()["error"]["param"] == param


@pytest.mark.parametrize("method", ["chain", "pipeline", "cascade"])
def test_the_draft_sees_the_verifiers_context(pair, method, draft_as_verifier):
    """With the verifier as its own draft, every draft is accepted under penalties only if the
    draft penalises exactly what the verifier will (its own drafted tokens included)."""
    g = ondevice.load(pair[0], pair[0])
    kw = {"pipeline": True} if method == "pipeline" else {"method": method}
    # token 10 wins once, then its penalty cancels its bias: a draft blind to its own drafts
    # would propose it again (measured: acceptance 0.81 with such a draft in the chain)
    r = g.generate("the cat sat", max_tokens=40, num_draft_tokens=4, chat_template=False,
                   frequency_penalty=30.0, logit_bias={10: 30.0, tiny.EOS_ID: -100.0}, **kw)  # fmt: skip
    assert r.tokens[0] == 10 and 10 not in r.tokens[1:4]
    assert r.stats["drafted"] > 10 and r.stats["acceptance_rate"] == 1.0

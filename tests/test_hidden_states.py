"""The seam for proposers that read the verifier (Medusa, EAGLE): a proposer in one file
(`support/hidden_head.py`) plus one registry entry runs through the API, receives the
verifier's real hidden states, and leaves greedy output exactly the verifier's."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
from support import hidden_head

import ondevice
from ondevice.decoders.factory import make_decoder
from ondevice.decoders.tree import TreeDecoder
from ondevice.proposers.registry import Method, register, unregister
from ondevice.proposers.resources import Speculation
from ondevice.rules.sampling import SamplingParams


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> ondevice.Generator:
    return ondevice.load(tiny.write_model(tmp_path_factory.mktemp("hidden") / "v"))


@pytest.fixture
def registered():
    register(Method("hidden-head", "a head over the verifier's hidden states (a test's)",
                    "unused", proposer=hidden_head.build))  # fmt: skip
    yield
    unregister("hidden-head")


PROMPTS = ("hello world hello world", "abcabcabc", "the cat sat on the mat")


def test_greedy_output_with_a_hidden_state_proposer_is_the_verifiers(gen, registered):
    for prompt in PROMPTS:
        plain = gen.generate(prompt, max_tokens=24, speculative=False)
        spec = gen.generate(prompt, max_tokens=24, method="hidden-head")
        assert spec.tokens == plain.tokens, prompt
        assert spec.stats["rounds_by_method"] == {"hidden-head": spec.stats["rounds"]}
        assert spec.stats["drafted"] > 0


def test_the_proposer_receives_the_verifiers_hidden_states(gen, registered):
    dec = make_decoder(gen.verifier, None, SamplingParams(), Speculation(method="hidden-head"))
    ids = gen.tokenizer.encode("hello world hello world")
    list(dec.run(ids, 16))
    prop = dec.proposer
    hidden_size = gen.verifier.model.config.hidden_size
    assert prop.shapes and all(s[1] == hidden_size for s in prop.shapes)
    # the verifier's output layer over the states gives its own greedy token at every node
    assert prop.checked > 16 and prop.agreed == prop.checked


def test_without_the_registry_entry_the_method_is_unknown(gen):
    with pytest.raises(ondevice.OndeviceError, match="unknown method 'hidden-head'"):
        gen.generate("hi", max_tokens=2, method="hidden-head")


def test_a_verifier_without_hidden_states_is_refused_clearly():
    class TreeOnly:  # an engine with tree passes but no hidden states
        name = "tree-only"
        vocab_size = 4

        def feed_masked(self, tokens, positions, visible):
            raise AssertionError("never called")

    prop = hidden_head.HiddenHeadProposer(np.zeros((4, 4), np.float32))
    with pytest.raises(ondevice.OndeviceError, match="hidden states"):
        TreeDecoder(TreeOnly(), prop, SamplingParams())  # type: ignore[arg-type]

"""The method registry: every method declared once.

A `Method` says what the CLI, the bench, the API and the tests need to know about a method:
whether it needs or uses a draft, what `num_draft_tokens` means for it, a one-line summary (the
CLI's help and `docs/design.md` print it), and which function builds its proposer from the
shared `Resources` (named, not imported, so that this module stays light: `ondevice --help`
reads it without loading MLX). "chain" has no proposer: it is the chain decoder, and plain
decoding without a draft; every other method is the tree decoder with its proposer
(`decoders/factory.py` builds them).

A new method is one entry in `METHODS` (or a `register` call) and its proposer's file under
`proposers/`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ondevice.errors import OndeviceError

if TYPE_CHECKING:
    from ondevice.proposers.base import Proposer
    from ondevice.proposers.resources import Resources, Speculation

ProposerBuilder = Callable[["Resources", "Speculation"], "Proposer"]


@dataclass(frozen=True)
class Method:
    """One way to propose tokens.

    summary: one line for people. num_draft_tokens: what a fixed `num_draft_tokens` means for
    it. needs_draft: refused without a draft model. uses_draft: drafts with the draft model when
    one is loaded. plain_without_draft: without a draft it is plain decoding (so measuring it
    needs one). proposer: "module:function" building its proposer from (Resources, Speculation),
    or the function itself; None: the chain decoder.
    """

    name: str
    summary: str
    num_draft_tokens: str
    needs_draft: bool = False
    uses_draft: bool = False
    plain_without_draft: bool = False
    proposer: str | ProposerBuilder | None = None
    in_auto: bool = False

    def build_proposer(self, res: Resources, spec: Speculation) -> Proposer:
        assert self.proposer is not None, f"{self.name} is not a proposer's method"
        build = self.proposer
        if isinstance(build, str):
            module, _, function = build.partition(":")
            build = getattr(importlib.import_module(module), function)
        return build(res, spec)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("chain", "a draft chain checked by the speculative rule (the default; plain decoding "
           "without a draft)", "tokens drafted per round (0: plain decoding)",
           uses_draft=True, plain_without_draft=True),
    Method("tree", "a token tree of draft guesses verified in one pass (EAGLE-2, SpecInfer)",
           "the tree's depth", needs_draft=True, uses_draft=True,
           proposer="ondevice.proposers.draft_tree:build_tree"),
    Method("pld", "prompt lookup: n-grams copied from the context, no draft needed",
           "tokens proposed per branch", proposer="ondevice.proposers.lookup:build", in_auto=True),
    Method("lookahead", "lookahead decoding: a Jacobi window's n-grams, no draft needed",
           "the n-gram length minus one", proposer="ondevice.proposers.lookahead:build",
           in_auto=True),
    Method("cascade", "a draft chain whose own drafting is sped up by prompt lookup",
           "the draft chain's length", needs_draft=True, uses_draft=True,
           proposer="ondevice.proposers.cascade:build"),
    Method("self", "self-speculation: the verifier drafts with a measured skip set of its own "
           "layers, no draft model", "the draft path's longest length",
           proposer="ondevice.proposers.layer_skip:build", in_auto=True),
    Method("medusa", "heads on the verifier's last hidden state propose a token tree, no draft "
           "model (heads shipped for the default verifier, or from `ondevice distill --heads`)",
           "the tree's depth (at most the number of heads)",
           proposer="ondevice.proposers.medusa:build", in_auto=True),
    Method("auto", "picks per round among plain steps, the draft's tree "
           "and the one-model methods (pld, lookahead, self with a cached skip set, medusa with "
           "trained heads) by measured acceptance and pass costs",
           "each candidate's size", uses_draft=True, proposer="ondevice.proposers.auto:build"),
)}  # fmt: skip


def method(name: str) -> Method:
    """The registered method `name` (OndeviceError naming the choices otherwise)."""
    if not isinstance(name, str) or name not in METHODS:
        raise OndeviceError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}.")
    return METHODS[name]


def register(m: Method) -> None:
    """Add a method (a proposer outside the package, a test's): from then on the API, the CLI
    and `make_decoder` know it by `m.name`."""
    if m.name in METHODS:
        raise ValueError(f"method {m.name!r} is already registered")
    METHODS[m.name] = m


def unregister(name: str) -> None:
    METHODS.pop(name, None)

"""The one decoder factory: `make_decoder(method, ...)` for every method.

- "chain": a draft proposes a chain, checked by Leviathan's rule (`SpeculativeDecoder`, or
  `PipelinedDecoder` with `pipeline=True`, the drafter working while the verifier checks).
  Without a draft (or with num_draft_tokens=0) it is plain decoding (`PlainGreedyDecoder` for
  untransformed greedy decoding on MLX).
- "tree", "pld", "lookahead", "cascade", "auto": a `TreeDecoder` with that proposer; tree and
  proposal sizes come from the measured cost of a verifier pass on this device (`treecost`)
  unless `num_draft_tokens` fixes them.

Every decoder it returns is a `Decoder` (`decoders/base.py`), and a seed means the same
for all of them (position-keyed noise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ondevice.decoders.base import Decoder
from ondevice.decoders.chain import CustomRule, SpeculativeDecoder
from ondevice.decoders.pipelined import PipelinedDecoder
from ondevice.decoders.plain import PlainGreedyDecoder
from ondevice.decoders.tree import Rule, TreeDecoder
from ondevice.errors import OndeviceError
from ondevice.proposers.auto import AutoProposer
from ondevice.proposers.base import NoProposal, Proposer
from ondevice.proposers.cascade import CascadeProposer
from ondevice.proposers.draft_tree import DraftState, DraftTreeProposer
from ondevice.proposers.lookahead import Lookahead
from ondevice.proposers.lookup import PromptLookup
from ondevice.rules.engine import Engine
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime.engines import MLXEngine, tree_engine
from ondevice.runtime.pass_costs import CostProfile, best_rate, best_size, load_profile

METHODS = ("chain", "tree", "pld", "lookahead", "cascade", "auto")
NEEDS_DRAFT = ("tree", "cascade")  # chain without a draft is plain decoding


def make_decoder(
    method: str,
    verifier: Engine,
    draft: Engine | None,
    params: SamplingParams,
    *,
    seed: int | None = None,
    eos_token_ids: Sequence[int] = (),
    num_draft_tokens: int | None = None,
    pipeline: bool = False,
    profile: bool = True,
    tree_mode: str = "dynamic",
    rule: str | CustomRule | Rule | None = None,
) -> Decoder:
    """The decoder for `method`. A draft is needed by tree and cascade; pld and lookahead run
    with the verifier alone, chain without one is plain decoding. With `profile` (default)
    proposal sizes come from the verifier's (and draft's) measured pass costs, cached per device
    and model; `num_draft_tokens` fixes the depth instead. `pipeline`: chain drafts while the
    verifier works. `tree_mode`: "dynamic" (EAGLE-2 top-k tree) or "sampled" (a static tree of
    i.i.d. draft samples, SpecInfer; greedy decoding uses top-k children either way). `rule`:
    the acceptance rule (chain: a name in `accept.RULES` or a chain rule; the others: a tree
    rule), for tests that show a wrong one is caught."""
    check_method(method)
    if num_draft_tokens is not None and num_draft_tokens < 1 and method != "chain":
        raise OndeviceError(f"method {method!r} needs num_draft_tokens >= 1 (or None for auto).")
    if method in NEEDS_DRAFT and draft is None:
        raise OndeviceError(
            f"method {method!r} needs a draft model; load one (draft=...) or use method='pld' "
            "or 'lookahead', which run with the verifier alone."
        )
    opts = {"eos_token_ids": eos_token_ids, "seed": seed}
    if method == "chain":
        if draft is None or num_draft_tokens == 0:
            plain: Decoder
            if (
                params.greedy and params.plain and params.logprobs is None
                and isinstance(verifier, MLXEngine) and rule is None
            ):  # fmt: skip
                plain = PlainGreedyDecoder(verifier, eos_token_ids)
            else:
                plain = SpeculativeDecoder(verifier, None, params, rule=rule, **opts)
            plain.skip_reason = "num_draft_tokens=0" if draft else "no draft model is loaded"
            return plain
        chain = PipelinedDecoder if pipeline else SpeculativeDecoder
        return chain(verifier, draft, params, num_draft_tokens=num_draft_tokens, rule=rule, **opts)
    verifier = tree_engine(verifier)
    parts = _Proposers(verifier, draft, params, num_draft_tokens, profile, tree_mode)
    proposer: Proposer = getattr(parts, method)()
    return TreeDecoder(verifier, proposer, params, rule=rule, draft_state=parts.state, **opts)


def check_method(method: str) -> None:
    if method not in METHODS:
        raise OndeviceError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}.")


class _Proposers:
    """Builds the proposer of each tree-based method (a method per name) for one pair."""

    def __init__(
        self,
        verifier: Engine,
        draft: Engine | None,
        params: SamplingParams,
        k: int | None,
        profile: bool,
        tree_mode: str,
    ) -> None:
        self.vocab, self.params, self.k, self.tree_mode = verifier.vocab_size, params, k, tree_mode
        self.vprof = load_profile(verifier) if profile else None
        self.dprof = None
        self.state = None
        if draft is not None:
            self.dprof = load_profile(draft) if profile else None
            self.state = DraftState(tree_engine(draft), verifier.vocab_size, self.dprof)

    def tree(self) -> DraftTreeProposer:
        vprof, dprof, state, k = self.vprof, self.dprof, self.state, self.k
        depth = k or 6
        topk = 4
        fixed = float(dprof(1)) if dprof else 0.0  # the draft catching up: once per round
        if self.tree_mode == "sampled":
            shape = [(0,) * d for d in range(1, depth + 1)] + [(1,), (2,), (0, 1), (1, 0)]
            return DraftTreeProposer(
                state, self.vocab, self.params, mode="static", shape=shape, sampled=True
            )
        return DraftTreeProposer(
            state, self.vocab, self.params, mode="dynamic", depth=depth, topk=topk,
            budget=_budget(vprof, fixed),
            expand_cost=float(dprof(topk)) if dprof else 0.0,
            rate=_rate(vprof, fixed),
        )  # fmt: skip

    def chain(self) -> DraftTreeProposer:
        # a one-child-per-level tree: the draft's greedy chain, as long as the cost profiles say
        # its confidence pays (a strong draft agrees for many tokens: this is what wins then)
        vprof, dprof = self.vprof, self.dprof
        fixed = float(dprof(1)) if dprof else 0.0
        return DraftTreeProposer(
            self.state, self.vocab, self.params, mode="dynamic", depth=self.k or 8, topk=1,
            budget=_budget(vprof, fixed),
            expand_cost=float(dprof(1)) if dprof else 0.0,
            rate=_rate(vprof, fixed), name="chain",
        )  # fmt: skip

    def pld(self) -> PromptLookup:
        # a fixed K: up to K tokens per branch; otherwise the cost profile sizes the proposal
        k = self.k
        return PromptLookup(max_tokens=k or 10, budget=None if k else _budget(self.vprof))

    def lookahead(self) -> Lookahead:
        return Lookahead(**lookahead_size(self.vprof, self.k))

    def cascade(self) -> CascadeProposer:
        per = float(self.dprof(1)) if self.dprof else 0.0
        budget = self.k if self.k else _budget(self.vprof, per_node=per, cap=12)
        return CascadeProposer(self.state, self.vocab, self.params, budget=budget)

    def auto(self) -> AutoProposer:
        state, vprof = self.state, self.vprof
        cands: list[Proposer] = [NoProposal(), self.pld()]
        cands += (
            [self.chain(), self.tree(), self.cascade()] if state is not None else [self.lookahead()]
        )
        if vprof is None:
            vprof = CostProfile([1], [1.0])  # unprofiled: every pass costs the same
        return AutoProposer(cands, vprof, [state] if state is not None else [])


def _budget(
    verify: CostProfile | None, fixed: float = 0.0, per_node: float = 0.0, cap: int = 64
) -> Callable[[np.ndarray], int]:
    """A budget function from the verifier's cost profile (None: a fixed default of 8)."""
    if verify is None:
        return lambda values: min(len(values), 8)
    return lambda values: best_size(np.asarray(values)[:cap], verify, fixed, per_node)


def _rate(
    verify: CostProfile | None, fixed: float = 0.0, cap: int = 64
) -> Callable[[np.ndarray, float], float] | None:
    """The best tokens per second over candidate values after `spent` seconds of drafting
    beyond `fixed` (None without a profile: trees then grow to their full depth)."""
    if verify is None:
        return None
    return lambda values, spent: best_rate(np.asarray(values)[:cap], verify, fixed + spent)[1]


def lookahead_size(verify: CostProfile | None, k: int | None = None) -> dict[str, int]:
    """Window, n-gram and candidate counts for lookahead decoding. The pass carries
    1 + (window + candidates) * (ngram - 1) tokens; on hardware where a pass costs about the same
    whatever its size (GPUs) use a wide window, where cost grows with tokens (CPUs) spend at most
    about one extra pass's worth of time on guesses."""
    ngram = 4 if k is None else max(2, min(k, 6) + 1)
    for width in (8, 6, 4, 3, 2, 1):
        tokens = 1 + 2 * width * (ngram - 1)
        if verify is None or verify(tokens) <= 2.0 * verify(1) or width == 1:
            return {"window": width, "ngram": ngram, "candidates": width}
    raise AssertionError("unreachable")

"""Tree decoding: one verifier pass scores a whole token tree, the accepted path is kept.

`TreeDecoder` has the interface of the sequential `SpeculativeDecoder` (`run(prompt, max_tokens)`
yields `Round`s; `stats`, `time_draft`, `time_verify`, `time_prefill`) and the same invariants:
at the start of a round the verifier's cache holds seq[:-1]; the round feeds seq[-1] (the root)
with every proposed node, at positions root + depth under a tree mask, and afterwards keeps only
the root and the accepted path (`KVCache.keep`), so the cache again holds the committed sequence
minus its last token.

`make_decoder(method, ...)` builds the decoder for "chain" | "tree" | "pld" | "lookahead" |
"cascade" | "auto"; tree and proposal sizes come from the measured cost of a verifier pass on this
device (`treecost`) unless `num_draft_tokens` fixes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from ondevice.errors import ContextLengthError, OndeviceError
from ondevice.runtime.engines import MLXEngine
from ondevice.runtime.treecost import CostProfile, best_rate, best_size, load_profile
from ondevice.speculative.decoder import DecodeStats, Round, SpeculativeDecoder
from ondevice.speculative.engine import Engine, prefill
from ondevice.speculative.proposers import (
    CascadeProposer,
    DraftState,
    DraftTreeProposer,
    Lookahead,
    NoProposal,
    PromptLookup,
    Proposer,
)
from ondevice.speculative.sampling import SamplingParams, Transform, token_logprobs
from ondevice.speculative.tree import TokenTree, accept_greedy, accept_sampled

METHODS = ("chain", "tree", "pld", "lookahead", "cascade", "auto")
NEEDS_DRAFT = ("chain", "tree", "cascade")


class MLXTreeEngine:
    """An `MLXEngine` (same model, same cache) that can also score tokens under any attention
    mask at explicit positions, and keep a subset of the last cache entries."""

    def __init__(self, engine: MLXEngine):
        self.engine = engine
        self.name = engine.name
        self.vocab_size = engine.vocab_size
        self.context_length = engine.context_length
        self.model = engine.model

    @property
    def length(self) -> int:
        return self.engine.length

    def reset(self) -> None:
        self.engine.reset()

    def feed(self, tokens: Sequence[int], last_only: bool = False) -> np.ndarray:
        return self.engine.feed(tokens, last_only)

    def trim(self, n: int) -> None:
        self.engine.trim(n)

    def feed_masked(
        self, tokens: Sequence[int], positions: Sequence[int], visible: np.ndarray
    ) -> np.ndarray:
        """Append `tokens` at `positions`; token i attends where `visible[i]` is True, over the
        new tokens (L, L; the cached prefix is visible to all) or the whole cache (L, cache+L).
        Returns float32 logits (L, vocab)."""
        mask = mx.array(np.where(visible, 0.0, -np.inf).astype(np.float32))
        logits = self.engine.model(
            mx.array([list(tokens)]),
            self.engine.cache,
            positions=mx.array(np.asarray(positions, np.int32)),
            mask=mask,
        )[0]
        return np.array(logits.astype(mx.float32))

    def keep(self, n_recent: int, indices: Sequence[int]) -> None:
        self.engine.cache.keep(n_recent, indices)


def tree_engine(engine: Engine) -> Engine:
    """`engine` with tree passes when it can have them (MLX); other engines as they are."""
    if hasattr(engine, "feed_masked"):
        return engine
    if isinstance(engine, MLXEngine):
        return MLXTreeEngine(engine)
    return engine


Rule = Callable[..., tuple[list[int], int]]


class TreeDecoder:
    """Drives a tree-capable verifier with any proposer over one prompt."""

    def __init__(
        self,
        verifier: Engine,
        proposer: Proposer,
        params: SamplingParams,
        *,
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        rule: Rule | None = None,
        draft_state: DraftState | None = None,
    ) -> None:
        verifier = tree_engine(verifier)
        if not hasattr(verifier, "feed_masked"):
            raise OndeviceError(
                f"the {verifier.name!r} verifier cannot score token trees; use method='chain'."
            )
        self.verifier = verifier
        self.proposer = proposer
        self.draft_state = draft_state  # the proposers' draft, if they have one
        self.params = params
        self.transform = Transform(params, verifier.vocab_size)
        self.eos = frozenset(eos_token_ids)
        self.rng = np.random.default_rng(seed)
        self.stats = DecodeStats()
        # the sampling rule; replaceable so tests can show that a wrong rule is caught
        self.rule = rule or accept_sampled
        self.time_draft = 0.0
        self.time_verify = 0.0
        self.time_prefill = 0.0

    def prefill(self, prompt: Sequence[int], resume: bool = False) -> None:
        """Fill the caches with prompt[:-1]; `resume`: they already hold a prefix of it."""
        if not prompt:
            raise ValueError("the prompt is empty")
        limit = self.verifier.context_length
        if len(prompt) >= limit:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but the model's context is {limit} tokens; "
                "shorten the prompt."
            )
        t = time.perf_counter()
        prefill(self.verifier, prompt[:-1], resume)
        if resume and self.draft_state is not None:
            engine = self.draft_state.engine
            self.draft_state.resume(prompt[: min(engine.length, len(prompt) - 1)])
        self.proposer.reset(prompt)
        self.transform.start(prompt)
        self.time_prefill += time.perf_counter() - t

    def verify(self, seq: list[int], tree: TokenTree) -> tuple[list[int], int, np.ndarray]:
        """Score the tree in one pass; return (accepted nodes, next token, argmax per node)."""
        logits = self.verifier.feed_masked(
            tree.tokens, tree.positions(len(seq) - 1), tree.ancestors()
        )
        tf = self.transform
        # node i's context: the committed sequence and the tokens on the path to i
        paths = [tree.path_tokens(n) for n in range(len(tree))] if tf.active else None
        target = tf.argmax(logits, seq, paths) if tf.active else np.argmax(logits, -1)
        if self.params.greedy:
            path, tok = accept_greedy(tree, target)
        else:
            rows: dict[int, np.ndarray] = {}

            def p(node: int) -> np.ndarray:  # only the visited nodes' distributions
                if node not in rows:
                    ctx = [paths[node]] if paths is not None else [()]
                    rows[node] = tf.probs(logits[node], seq, ctx)
                return rows[node]

            path, tok = self.rule(tree, p, self.rng)
        self.verifier.keep(len(tree), [0, *path])
        self._logits, self._nodes = logits, [0, *path]
        return path, tok, target

    def draft_prefix_length(self) -> int:
        """How many leading entries of the draft's cache hold the sequence committed so far."""
        state = self.draft_state
        return len(state.tokens) if state is not None and state.tokens is not None else 0

    def run(self, prompt: Sequence[int], max_tokens: int, resume: bool = False) -> Iterator[Round]:
        """Rounds of tokens after `prompt`. resume: the engines' caches already hold a prefix
        of the prompt (see `prefill`)."""
        seq = list(prompt)
        self.prefill(seq, resume)
        produced = 0
        limit = self.verifier.context_length
        per_method = self.stats.extra.setdefault("rounds_by_method", {})
        while produced < max_tokens:
            room = min(max_tokens - produced, limit - len(seq))
            if room <= 0:
                yield Round([], [], 0, 0, "length")
                return
            t = time.perf_counter()
            proposed = room > 1
            if proposed:
                tree = self.proposer.propose(seq, room - 1, self.rng)
            else:
                tree = TokenTree.root(seq[-1])
            t2 = time.perf_counter()
            path, tok, target = self.verify(seq, tree)
            t3 = time.perf_counter()
            if proposed:
                self.proposer.observe(seq, tree, path, tok, target)
            self.time_draft += (t2 - t) + (time.perf_counter() - t3)
            self.time_verify += t3 - t2
            name = getattr(self.proposer, "last_name", self.proposer.name)
            per_method[name] = per_method.get(name, 0) + 1
            self.stats.rounds += 1
            self.stats.drafted += tree.size
            self.stats.accepted += len(path)
            out = [*(tree.tokens[n] for n in path), tok]
            flags = [True] * len(path) + [False]
            finish = None
            for i, x in enumerate(out):
                if x in self.eos:
                    out, flags, finish = out[:i], flags[:i], "stop"
                    break
            if finish is None and len(out) >= room:
                out, flags = out[:room], flags[:room]
                finish = "length"
            seq.extend(out)
            produced += len(out)
            lp = None
            if self.params.logprobs is not None:
                lp = token_logprobs(self._logits[self._nodes], out, self.params.logprobs)
            yield Round(out, flags, tree.size, len(path), finish, lp)
            if finish:
                return


class AutoProposer:
    """Picks a proposer per round by measured acceptance and estimated cost.

    Each candidate is tried `explore` rounds; afterwards the one with the best tokens per second
    (an exponential average of tokens per round over seconds per round) proposes, and every
    `period` rounds the least recently tried other candidate gets one round, so a change in the
    text (a passage to copy, say) is noticed. Seconds are estimated from the cost profiles (the
    verifier's pass over the tree's size plus the draft work the proposer reports), not from the
    clock, so the choice depends only on accepted counts and a seed gives the same tokens.
    """

    name = "auto"

    def __init__(
        self,
        proposers: Sequence[Proposer],
        verify_cost: CostProfile,
        drafts: Sequence[DraftState] = (),
        *,
        explore: int = 2,
        period: int = 16,
        decay: float = 0.8,
    ):
        if not proposers:
            raise ValueError("auto needs at least one proposer")
        self.proposers = list(proposers)
        self.verify_cost = verify_cost
        self.drafts = list(drafts)
        self.explore, self.period, self.decay = explore, period, decay
        self._reset_scores()

    def _reset_scores(self) -> None:
        n = len(self.proposers)
        self.tried = [0] * n
        self.last_tried = [-1] * n
        self.tokens = [0.0] * n
        self.seconds = [0.0] * n
        self.round = 0
        self._current = 0
        self._work = 0.0
        self.last_name = self.proposers[0].name

    def reset(self, prompt: Sequence[int]) -> None:
        self._reset_scores()
        for p in self.proposers:
            p.reset(prompt)

    def score(self, i: int) -> float:
        return self.tokens[i] / self.seconds[i] if self.seconds[i] > 0 else float("inf")

    def _choose(self) -> int:
        n = len(self.proposers)
        for i in range(n):
            if self.tried[i] < self.explore:
                return i
        best = max(range(n), key=self.score)
        if n > 1 and self.round % self.period == 0:
            return min((i for i in range(n) if i != best), key=lambda i: self.last_tried[i])
        return best

    def _draft_work(self) -> float:
        return sum(d.work for d in self.drafts)

    def propose(self, seq: list[int], max_depth: int, rng: np.random.Generator) -> TokenTree:
        self._current = i = self._choose()
        self.last_name = self.proposers[i].name
        self._work = self._draft_work()
        return self.proposers[i].propose(seq, max_depth, rng)

    def observe(self, seq, tree, path, token, target) -> None:
        i = self._current
        self.proposers[i].observe(seq, tree, path, token, target)
        secs = float(self.verify_cost(len(tree))) + self._draft_work() - self._work
        a = self.decay if self.tried[i] else 0.0
        self.tokens[i] = a * self.tokens[i] + (1 - a) * (len(path) + 1)
        self.seconds[i] = a * self.seconds[i] + (1 - a) * secs
        self.tried[i] += 1
        self.round += 1
        self.last_tried[i] = self.round


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


def make_decoder(
    method: str,
    verifier: Engine,
    draft: Engine | None,
    params: SamplingParams,
    *,
    eos_token_ids: Sequence[int] = (),
    seed: int | None = None,
    num_draft_tokens: int | None = None,
    profile: bool = True,
    tree_mode: str = "dynamic",
    rule: Rule | None = None,
):
    """The decoder for `method`. A draft is needed by chain, tree and cascade; pld and lookahead
    run with the verifier alone. With `profile` (default) proposal sizes come from the verifier's
    (and draft's) measured pass costs, cached per device and model; `num_draft_tokens` fixes the
    depth instead. `tree_mode`: "dynamic" (EAGLE-2 top-k tree) or "sampled" (a static tree of
    i.i.d. draft samples, SpecInfer; greedy decoding uses top-k children either way)."""
    if method not in METHODS:
        raise OndeviceError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}.")
    if num_draft_tokens is not None and num_draft_tokens < 1 and method != "chain":
        raise OndeviceError(f"method {method!r} needs num_draft_tokens >= 1 (or None for auto).")
    if method in NEEDS_DRAFT and draft is None:
        raise OndeviceError(
            f"method {method!r} needs a draft model; load one (draft=...) or use method='pld' "
            "or 'lookahead', which run with the verifier alone."
        )
    if method == "chain":
        return SpeculativeDecoder(
            verifier, draft, params, eos_token_ids=eos_token_ids, seed=seed,
            num_draft_tokens=num_draft_tokens,
        )  # fmt: skip
    verifier = tree_engine(verifier)
    vprof = load_profile(verifier) if profile else None
    dprof = None
    state = None
    if draft is not None:
        dprof = load_profile(draft) if profile else None
        state = DraftState(tree_engine(draft), verifier.vocab_size, dprof)
    k = num_draft_tokens

    def tree_proposer() -> DraftTreeProposer:
        depth = k or 6
        topk = 4
        fixed = float(dprof(1)) if dprof else 0.0  # the draft catching up: once per round
        if tree_mode == "sampled":
            shape = [(0,) * d for d in range(1, depth + 1)] + [(1,), (2,), (0, 1), (1, 0)]
            return DraftTreeProposer(
                state, verifier.vocab_size, params, mode="static", shape=shape, sampled=True
            )
        return DraftTreeProposer(
            state, verifier.vocab_size, params, mode="dynamic", depth=depth, topk=topk,
            budget=_budget(vprof, fixed),
            expand_cost=float(dprof(topk)) if dprof else 0.0,
            rate=_rate(vprof, fixed),
        )  # fmt: skip

    def chain_proposer() -> DraftTreeProposer:
        # a one-child-per-level tree: the draft's greedy chain, as long as the cost profiles say
        # its confidence pays (a strong draft agrees for many tokens: this is what wins then)
        fixed = float(dprof(1)) if dprof else 0.0
        return DraftTreeProposer(
            state, verifier.vocab_size, params, mode="dynamic", depth=k or 8, topk=1,
            budget=_budget(vprof, fixed),
            expand_cost=float(dprof(1)) if dprof else 0.0,
            rate=_rate(vprof, fixed),
        )  # fmt: skip

    def pld() -> PromptLookup:
        # a fixed K: up to K tokens per branch; otherwise the cost profile sizes the proposal
        return PromptLookup(max_tokens=k or 10, budget=None if k else _budget(vprof))

    def lookahead() -> Lookahead:
        return Lookahead(**lookahead_size(vprof, k))

    def cascade() -> CascadeProposer:
        per = float(dprof(1)) if dprof else 0.0
        budget = k if k else _budget(vprof, per_node=per, cap=12)
        return CascadeProposer(state, verifier.vocab_size, params, budget=budget)

    if method == "tree":
        proposer: Proposer = tree_proposer()
    elif method == "pld":
        proposer = pld()
    elif method == "lookahead":
        proposer = lookahead()
    elif method == "cascade":
        proposer = cascade()
    else:
        cands: list[Proposer] = [NoProposal(), pld()]
        cands += (
            [chain_proposer(), tree_proposer(), cascade()] if state is not None else [lookahead()]
        )
        if vprof is None:
            vprof = CostProfile([1], [1.0])  # unprofiled: every pass costs the same
        proposer = AutoProposer(cands, vprof, [state] if state is not None else [])
    return TreeDecoder(
        verifier, proposer, params, eos_token_ids=eos_token_ids, seed=seed, rule=rule,
        draft_state=state,
    )  # fmt: skip

"""Self-speculation by layer skipping: the draft is the verifier itself with some of its layers
skipped (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024), so no second model is
loaded.

- `LayerSkipView`: a `Model` made of a subset of another model's layers. It holds the very
  same modules (the same weight arrays: nothing is copied) and, as a draft, the verifier's own
  KV cache of the layers it keeps (`SharedCacheState`: the committed sequence's keys and
  values are the verifier's, so a round feeds the draft its root and guesses only). A draft's
  rounding changes how often its guesses are accepted, never a token of the output, so the
  view may read the kept layers another way (`Reading`, chosen by
  `self_reading`): by default the verifier's own bf16 weights through the CPU kernel's fastest
  one-row implementation where it is not the verifier's (AVX512-BF16 beside AMX: a step about
  three quarters of a verifier pass, no byte of memory more), or, asked for with
  `ONDEVICE_SELF_READING=int8`, int8 copies of the kept layers and of the head's first 65,536
  rows (`int8_reading`: half the bytes a step, about one byte per kept weight of memory).
  Where the CPU has no faster one-row implementation (AMD's Zen: no AMX), the draft still
  reads only the head's first 65,536 rows, in place (`head_prefix_reading`): the verifier's
  151,936-row head is about a seventh of its pass.
- `search_skip_set`: which layers to skip, found by measurement. Over one text (the first
  prompt the method sees and the verifier's own greedy continuation of it), chains of the
  draft's greedy tokens from each of its last positions, computed as rounds compute them (the
  verifier's keys and values before the chain, the draft's own rows of it: `chain_reach`), are
  compared with the verifier's (teacher-forced agreement). Each middle layer is dropped alone
  (first steps only: how much it matters), then layers are dropped cumulatively, least harmful
  first, until agreement falls below `MIN_AGREEMENT`; each set is scored by the tokens per
  second draft chains that reach as far would give over plain decoding, with the
  draft's cost the kept share of the verifier's weights (through a reading: measured,
  `measured_fraction`) and the verifier's measured pass costs (`runtime/pass_costs.py`).
  Deterministic where the costs are counted: the same weights, text and cost profile give the
  same set. The result is cached as JSON beside the pass-cost profiles
  (`cache_dir()/profiles/skip-*.json`), keyed by the weights, the device and the reading
  asked for, so the search runs once per model; `ondevice doctor` lists what is cached
  (`pass_costs.cached_skip_sets`).
- `SelfDraftProposer`: on its first `reset`, finds (or reads) the skip set, then drafts a
  tree of the layer-skipped view's guesses with `DraftTreeProposer` (the draft machinery every
  draft model uses: the greedy path where the view is sure, its runners-up beside it where
  they pay for a pass that costs about what one token's does); the tree decoder verifies it
  losslessly, as it does every proposal.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ondevice.errors import OndeviceError
from ondevice.models.cache import BorrowedCache, KVCache
from ondevice.models.transformer import Model, as_mlx, norm_weights
from ondevice.proposers.base import (
    Unavailable,
    Verification,
    cost_budget,
    cost_pick,
    cost_rate,
    not_beside_a_draft,
)
from ondevice.proposers.draft_tree import DraftState, DraftTreeProposer
from ondevice.rules.noise import PositionNoise
from ondevice.rules.token_tree import TokenTree
from ondevice.runtime.engines import MLXEngine, innermost, tree_engine
from ondevice.runtime.pass_costs import (
    CostProfile,
    SkipSet,
    device_name,
    engine_key,
    measure_together,
    profile_path,
    save_profile,
)

if TYPE_CHECKING:
    from ondevice.proposers.resources import Resources, Speculation
    from ondevice.rules.chooser import TokenChooser

SEARCH_CONTEXT = 192  # tokens of the prompt's tail the search reads
SEARCH_CONTINUATION = 24  # greedy tokens of the verifier appended to them
SCORED = 96  # the last positions of that text where the draft's greedy token is compared
MAX_CHAIN = 8  # the longest draft chain the score considers
CHAIN_DEPTH = 4  # of which the search measures this many steps (one masked pass a set)
# the cumulative drops stop once agreement falls below this: the score is not monotone in the
# layers dropped (agreement falls first, the cost later), so no earlier stop is safe
MIN_AGREEMENT = 0.3
READING_ENV = "ONDEVICE_SELF_READING"  # how a self-draft reads the kept layers (`self_reading`)
READINGS = ("shared", "int8")
# each level's best nodes get this many children: a pass over a few tokens costs about what a
# pass over one does, so the draft's runners-up cost little to draft and to verify
TREE_TOPK = 4


class _Layers(nn.Module):
    """A backbone over a subset of another backbone's layers (the same modules)."""

    def __init__(self, backbone: nn.Module, keep: Sequence[int], layers: dict[int, nn.Module]):
        super().__init__()
        self.embed_tokens = backbone.embed_tokens
        self.layers = [layers.get(i, backbone.layers[i]) for i in keep]
        self.norm = backbone.norm


class LayerSkipView(Model):
    """`model` with only the layers in `keep` (in order): the same modules and weight arrays.
    `reading`: other modules for some layers and the head (`self_reading`); the embedding and
    everything else stay the model's own. Its cache (`make_cache`) is its own over the kept
    layers, or with `cache_of` those layers of the cache `cache_of()` returns (`BorrowedCache`:
    the verifier's, see `SharedCacheState`)."""

    def __init__(
        self,
        model: Model,
        keep: Sequence[int],
        reading: Reading | None = None,
        cache_of: Callable[[], KVCache] | None = None,
    ):
        nn.Module.__init__(self)  # not Model.__init__: that would allocate new weights
        self.keep = [int(i) for i in keep]
        self._cache_of = cache_of
        self.config = replace(model.config, num_hidden_layers=len(self.keep))
        self.model = _Layers(model.model, self.keep, reading.layers if reading else {})
        if reading is not None:  # its own head: untied from the embedding it still looks up
            rows = reading.head.out_features  # type: ignore[union-attr]
            self.config.tie_word_embeddings = False
            self.config.draft_vocab_size = rows if rows < model.config.vocab_size else None
            self.lm_head = reading.head
        elif not model.config.tie_word_embeddings:
            self.lm_head = model.lm_head

    def make_cache(self) -> KVCache:
        if self._cache_of is None:
            return super().make_cache()
        return BorrowedCache(self._cache_of, self.keep)


@dataclass
class Reading:
    """Other modules for a model's layers (by index) and its head, read by a `LayerSkipView`.
    kind: `int8` (copies, `int8_reading`), `one-row` (the same weights, `one_row_reading`) or
    `head-prefix` (the same layers, the head's first rows: `head_prefix_reading`)."""

    layers: dict[int, nn.Module]
    head: nn.Module
    kind: str = "int8"


def reading_asked() -> str:
    """How a self-draft is asked to read the verifier's kept layers (`READING_ENV`): `shared`
    (the default: the verifier's own weights, no memory more) or `int8` (copies)."""
    want = os.environ.get(READING_ENV, "shared").strip().lower() or "shared"
    if want not in READINGS:
        raise OndeviceError(f"{READING_ENV}={want!r}: choose one of {', '.join(READINGS)}.")
    return want


def self_reading(model: Model, layers: Sequence[int], kind: str | None = None) -> Reading | None:
    """The reading a self-draft of `model` uses for `layers` (and the head), None for the
    verifier's own products. kind: a skip set's (`int8`, `one-row` or `shared`, as searched);
    None: as asked (`reading_asked`): int8 copies where asked and the CPU kernel serves the
    model, else the verifier's weights by the kernel's one-row implementation where it has one
    (`one_row_reading`), else the verifier's products with the head's first rows only
    (`head_prefix_reading`), else the verifier's products as they are."""
    if kind is None:  # as asked: copies where they can be made, else the one-row reading
        if reading_asked() == "int8":
            found = int8_reading(model, layers)
            if found is not None:
                return found
        return one_row_reading(model, layers) or head_prefix_reading(model)
    if kind == "int8":
        return int8_reading(model, layers)
    if kind == "head-prefix":
        return head_prefix_reading(model)
    return one_row_reading(model, layers) if kind == "one-row" else None


def copies_bytes(model: Model, keep: Sequence[int]) -> int:
    """About the memory an `int8_reading` of the layers `keep` takes: a byte per weight, and
    the head's first `kernel.DRAFT_VOCAB` rows."""
    from ondevice.runtime import kernel

    rows = min(kernel.DRAFT_VOCAB, model.config.vocab_size)
    return sum(_size(model.layers[i]) for i in keep) + rows * model.config.hidden_size


def one_row_reading(model: Model, layers: Sequence[int]) -> Reading | None:
    """`layers` and the head read through the CPU kernel's one-row implementation where it is
    not the one the verifier's passes get (`kernel.one_row_reading`: AVX512-BF16 beside AMX,
    whose one-token pass reads the same weights in about three quarters of the time); the very
    same weights, nothing copied; the head's first `kernel.DRAFT_VOCAB` rows only where they
    are read in place (an int8 draft's vocabulary). None elsewhere (no such implementation,
    MLX on Metal)."""
    from ondevice.runtime import kernel

    return _read_through(model, layers, kernel.one_row_reading, "one-row")


def head_prefix_reading(model: Model) -> Reading | None:
    """The verifier's own layers and products, and its head's first `kernel.DRAFT_VOCAB` rows
    read in place (`kernel.first_rows_in_place`: nothing copied; ids past them are never
    drafted, and the rule stays exact). None where the head cannot be read so. For CPUs
    without a faster one-row implementation: on the default verifier (AMD Zen 4, coding) the
    search predicted 1.07x plain decoding with the whole head and 1.13x with its first 65,536
    rows, and a round's drafting took 16% less for the same tokens (docs/benchmarks.md,
    "session 31")."""
    from ondevice.runtime import kernel

    head = kernel.first_rows_in_place(model.head, kernel.DRAFT_VOCAB)
    return Reading({}, head, "head-prefix") if head is not None else None


def int8_reading(model: Model, layers: Sequence[int]) -> Reading | None:
    """int8 copies of `layers` and of the head's first `kernel.DRAFT_VOCAB` rows, where the CPU
    kernel serves the model in bf16 or float32 (`kernel.int8_copy`); None elsewhere (MLX on
    Metal). On the CPU a draft pass is bound by the bytes it reads: in int8 a step costs about
    half of what reading the verifier's bf16 weights does, for about a byte of memory per
    kept weight (docs/benchmarks.md, "Issue 30, session 12")."""
    from ondevice.runtime import kernel

    return _read_through(model, layers, kernel.int8_copy, "int8")


def _read_through(
    model: Model,
    layers: Sequence[int],
    read: Callable[..., nn.Module | None],
    kind: str,
) -> Reading | None:
    """A `Reading` of `layers` and of the head (its first `kernel.DRAFT_VOCAB` rows where `read`
    can keep only those) made by `read(module[, rows])`; None where it cannot read one."""
    from ondevice.runtime import kernel

    head = read(model.head, kernel.DRAFT_VOCAB)
    if head is None:
        return None
    found = {i: read(model.layers[i]) for i in layers}
    if any(c is None for c in found.values()):
        return None
    return Reading(found, head, kind)  # type: ignore[arg-type]


# -- the search -----------------------------------------------------------------------------------


def _size(module: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()) if isinstance(v, mx.array))


def draft_fraction(model: Model, skip: Sequence[int]) -> float:
    """A draft pass's cost as a share of a verifier pass: the share of weights it reads (the
    layers it keeps and the output head; a pass over a few tokens is bound by reading them)."""
    layers = [_size(layer) for layer in model.layers]
    h = _size(model.head)
    kept = sum(s for i, s in enumerate(layers) if i not in set(skip))
    return (kept + h) / (sum(layers) + h)


def predicted_speedup(reach: Sequence[float], fraction: float, verify: CostProfile | None) -> float:
    """Tokens per second of a draft chain over plain decoding's, at the best length up to
    `MAX_CHAIN`: reach[j] the chance that its first j + 1 guesses are all accepted (past the
    measured depths, each further guess accepted as often as the last measured one was after
    its predecessor), a draft step costing `fraction` of a one-token verifier pass, the
    verification pass over k + 1 tokens costing what `verify` says (every pass alike without a
    profile). Below 1 where no chain pays (the proposer then mostly makes plain steps: its
    rounds are sized by the costs)."""
    one = float(verify(1)) if verify is not None else 1.0
    reach = list(reach)
    last = reach[-1] / reach[-2] if len(reach) > 1 and reach[-2] > 0 else reach[-1]
    while len(reach) < MAX_CHAIN:
        reach.append(reach[-1] * last)
    best = 0.0
    for k in range(1, MAX_CHAIN + 1):
        tokens = 1.0 + sum(reach[:k])
        check = float(verify(k + 1)) if verify is not None else one
        best = max(best, tokens * one / (k * fraction * one + check))
    return best


def _greedy_rows(model: Model, tokens: Sequence[int], rows: int) -> np.ndarray:
    """The model's greedy token after each of the last `rows` prefixes of `tokens` (one pass, no
    cache; only those rows go through the output head, the pass's costliest part here)."""
    _, h = model(mx.array([list(tokens)]), hidden=True)  # the logits are never evaluated
    h = h[0, -rows:]
    head = model.model.embed_tokens.as_linear if model.config.tie_word_embeddings else model.lm_head
    return np.array(mx.argmax(head(h), axis=-1))


def _draft_rows(view: LayerSkipView, text: Sequence[int], rows: int, depth: int) -> np.ndarray:
    """A self-draft's logits (rows, depth, V) along teacher-forced chains: row r starts at
    position p = T - rows - depth + 1 + r of `text` (T tokens) and its step j is computed as a
    round's j-th step is (`SharedCacheState`): over text[p + j], attending to the verifier's
    keys and values of the positions before p and to the draft's own rows p..p + j of that
    chain (as if its earlier guesses had been the text's tokens, which is when a step counts).
    One masked pass of `view`, whose cache is borrowed from a verifier's that holds all of
    `text`."""
    T = len(text)
    engine = tree_engine(MLXEngine(view))
    assert engine.length == T, "the borrowed cache must hold the whole text"
    start = np.arange(T - rows - depth + 1, T - depth + 1)  # each chain's first position
    step = np.arange(depth)
    positions = (start[:, None] + step).reshape(-1)  # slot r * depth + j: position start[r] + j
    n = rows * depth
    visible = np.zeros((n, T + n), dtype=bool)
    visible[:, :T] = np.arange(T) < np.repeat(start, depth)[:, None]
    own = np.tril(np.ones((depth, depth), dtype=bool))  # a chain's step sees its earlier steps
    visible[:, T:] = np.kron(np.eye(rows, dtype=bool), own)  # and no other chain's
    tokens = [int(text[p]) for p in positions]
    logits = engine.feed_masked(tokens, positions, visible)  # type: ignore[attr-defined]
    engine.trim(n)
    return logits.reshape(rows, depth, -1)


def chain_reach(
    view: LayerSkipView, text: Sequence[int], ref: np.ndarray, depth: int
) -> list[float]:
    """Per step j < depth, the share of teacher-forced chains (`_draft_rows`) whose first j + 1
    greedy tokens are all the verifier's. ref: the verifier's greedy token after each of the
    last len(ref) prefixes of `text`; the chains start at each of those positions that leaves
    room for `depth` steps, so chain r's step j is compared with ref[r + j]."""
    rows = len(ref) - depth + 1
    guess = np.argmax(_draft_rows(view, text, rows, depth), axis=-1)  # (rows, depth)
    want = np.stack([ref[j : j + rows] for j in range(depth)], axis=1)
    hits = np.cumprod(guess == want, axis=1)
    return [float(v) for v in hits.mean(axis=0)]


def search_text(model: Model, prompt: Sequence[int]) -> list[int]:
    """The text the search compares on: the prompt's tail and the verifier's greedy
    continuation of it (what a draft meets while decoding)."""
    text = [int(t) for t in prompt[-SEARCH_CONTEXT:]]
    engine = MLXEngine(model)
    logits = engine.feed(text, last_only=True)
    for _ in range(SEARCH_CONTINUATION):
        text.append(int(np.argmax(logits)))
        logits = engine.feed(text[-1:], last_only=True)
    return text


def measured_fraction(model: Model, reading: Reading) -> Callable[[Sequence[int]], float]:
    """A draft pass's cost through `reading` as a share of a verifier pass, by the layers it
    skips: one-token steps of the reading with every layer and with every other layer, timed
    together with the verifier's one-token pass (`pass_costs.measure_together`: a slow spell
    moves all three alike), and a line through the two (every layer costs the same). Measured,
    not counted in bytes: an int8 step's rounding and glue are a larger share of it than of a
    bf16 pass."""
    n = len(model.layers)
    half = list(range(0, n, 2))
    views = [LayerSkipView(model, keep, reading) for keep in (range(n), half)]
    engines = [MLXEngine(model), *(MLXEngine(v) for v in views)]
    verify, full, part = (p.seconds[0] for p in measure_together(engines, (1,)))
    per_layer = max(full - part, 0.0) / (n - len(half))
    fixed = max(full - n * per_layer, 0.0)
    return lambda skip: (fixed + (n - len(skip)) * per_layer) / verify


def search_skip_set(
    model: Model,
    text: Sequence[int],
    verify: CostProfile | None = None,
    reading: Reading | None = None,
    fraction: Callable[[Sequence[int]], float] | None = None,
) -> SkipSet:
    """Which layers to skip (see the module's docstring). Candidates are the middle layers
    (the first and the last are always kept; with two layers, the second is the candidate); at
    least one layer is skipped. reading: the draft reads every layer and the head through it
    (`int8_reading`); fraction: a draft pass's share of a verifier pass by the layers skipped
    (default: the kept share of the weights read, or `measured_fraction` with a reading)."""
    n = len(model.layers)
    if n < 2:
        raise ValueError("self-speculation needs a verifier with at least two layers")
    if fraction is None:
        fraction = (
            measured_fraction(model, reading)
            if reading is not None
            else lambda skip: draft_fraction(model, skip)
        )
    candidates = list(range(1, n - 1)) if n > 2 else [1]
    # not the first few positions (too little context), nor chains running past the text
    depth = max(1, min(CHAIN_DEPTH, len(text) // 4))
    rows = min(SCORED, len(text) - min(4, len(text) - 1) - depth + 1)
    ref = _greedy_rows(model, text, rows + depth - 1)
    context = MLXEngine(model)  # the verifier's keys and values of the text, as a draft reads them
    context.feed(list(text), last_only=True)

    def measure(skip: list[int], steps: int) -> tuple[list[float], float]:
        keep = [i for i in range(n) if i not in set(skip)]
        view = LayerSkipView(model, keep, reading, cache_of=lambda: context.cache)
        reach = chain_reach(view, text, ref, steps)
        return reach, predicted_speedup(reach, fraction(skip), verify)

    tried: list[list] = []
    alone = {}
    for i in candidates:  # each layer dropped alone, first steps only: how much it matters
        alone[i] = measure([i], 1)[0][0]
    order = sorted(candidates, key=lambda i: (-alone[i], i))
    best: tuple[list[int], list[float], float] | None = None
    skip: list[int] = []
    for i in order:  # then cumulatively, least harmful first, chains scored
        skip = sorted([*skip, i])
        reach, speed = measure(skip, depth)
        tried.append([skip, reach[0], speed])
        if best is None or speed > best[2]:
            best = (skip, reach, speed)
        if reach[0] < MIN_AGREEMENT:
            break
    assert best is not None
    cfg = model.config
    return SkipSet(
        best[0], n, best[1][0], fraction(best[0]), best[2], rows, tried,
        verify is not None, f"{cfg.model_type} {cfg.hidden_size}x{n}",
        reading.kind if reading is not None else "shared", best[1],
    )  # fmt: skip


# -- the cache ------------------------------------------------------------------------------------


def weights_fingerprint(model: Model) -> str:
    """What identifies a model's weights cheaply: its shapes and dtype (`engine_key`) and the
    values of its norms and first embedding rows (a fine-tune changes them), as looked up.
    Kept on the model object: each generation's `self` asks for it, and it walks every module."""
    known = getattr(model, "_skip_fingerprint", None)
    if known is not None:
        return known
    h = hashlib.sha256(engine_key(MLXEngine(model)).encode())
    for a in [as_mlx(model.model.embed_tokens(mx.arange(4))), *norm_weights(model)]:
        h.update(np.array(a.astype(mx.float32)).tobytes())
    model._skip_fingerprint = h.hexdigest()[:16]
    return model._skip_fingerprint


def skip_set_path(model: Model) -> Path:
    """Where the skip set of `model` for the reading asked for (`reading_asked`) is cached."""
    return profile_path(device_name(), f"skip-{weights_fingerprint(model)}-{reading_asked()}")


# (fingerprint, reading asked, costs profiled) -> this process's skip set
_MEMORY: dict[tuple[str, str, bool], SkipSet] = {}


def cached_skip_set(model: Model, *, cache: bool = True) -> SkipSet | None:
    """The skip set of `model` found earlier in this process or (with `cache`) cached on this
    device, or None: nothing is searched."""
    key = (weights_fingerprint(model), reading_asked(), cache)
    if key in _MEMORY:
        return _MEMORY[key]
    path = skip_set_path(model) if cache else None
    if path is None or not path.exists():
        return None
    try:
        found = SkipSet.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        return None  # unreadable or old: search again
    if found.layers != len(model.layers):
        return None
    _MEMORY[key] = found
    return found


def load_skip_set(
    model: Model,
    prompt: Sequence[int],
    verify: CostProfile | None,
    *,
    cache: bool = True,
    reading: Reading | None = None,
) -> SkipSet:
    """The cached skip set of `model` on this device, or a search's over `prompt` (printing one
    line: it takes a while on a large model) saved for next time, the draft reading its layers
    through `reading` if given (`search_skip_set`). Without `cache` (unprofiled costs) nothing
    is read from or written to disk; within a process the result is reused."""
    found = cached_skip_set(model, cache=cache)
    if found is not None:
        return found
    path = skip_set_path(model) if cache else None
    if path is not None:
        print(
            "ondevice: finding which layers method 'self' skips for this model (first use; "
            f"cached in {path.parent})...",
            file=sys.stderr,
            flush=True,
        )
    found = search_skip_set(model, search_text(model, prompt), verify, reading)
    if path is not None:
        save_profile(path, found.to_json())
    _MEMORY[(weights_fingerprint(model), reading_asked(), cache)] = found
    return found


# -- the proposer ---------------------------------------------------------------------------------


class SharedCacheState(DraftState):
    """A self-draft's state over the verifier's own cache (a `LayerSkipView` with `cache_of`):
    the kept layers' keys and values of the committed sequence are the verifier's, written by
    its prefill and its verification passes, so the draft never feeds an accepted token or the
    prompt (an own cache fed both: a round's first step ran over two tokens, 0.9 of a verifier
    pass where one costs 0.65, and `auto` switching to it paid a pass over the whole prompt:
    docs/benchmarks.md, "Issue 30, session 19"), and each guess reads the verifier's exact
    context rather than the skipped layers' drift. A round feeds the sequence's last token (the
    verifier feeds it with the round's pass) and the guesses after it, and `release`s them
    before the verifier's pass writes those positions: the verifier reads only rows it wrote,
    so its tokens are what they would be without a draft."""

    _held: int | None = None  # the verifier's rows when this round's feeding began

    def reset(self, prompt: Sequence[int]) -> None:
        self.release()
        self.tokens, self.slots, self.last = [], [], None  # the verifier prefilled the prompt

    def resume(self, prefix: Sequence[int]) -> None:
        self.reset(prefix)

    def sync(self, seq: Sequence[int]) -> np.ndarray:
        self.release()
        held = self.engine.length
        if held >= len(seq):
            raise AssertionError("the verifier's cache must leave the sequence's last token")
        self._held, self.tokens, self.slots = held, [int(t) for t in seq[:held]], []
        return self.feed(seq[held:])[-1]

    def commit(self, tree: TokenTree, path: Sequence[int]) -> None:
        self.release()  # the verifier's pass wrote the accepted tokens' rows

    def release(self) -> None:
        """Forget what this round fed (before the verifier's pass: see the class)."""
        if self._held is not None:
            self.engine.trim(self.engine.length - self._held)
            self.tokens = (self.tokens or [])[: self._held]
            self.slots, self.last, self._held = [], None, None


def scaled_profile(verify: CostProfile, fraction: float) -> CostProfile:
    """A draft pass's cost: `fraction` of the verifier's for the same number of tokens."""
    return replace(
        verify,
        seconds=[s * fraction for s in verify.seconds],
        long_seconds=[s * fraction for s in verify.long_seconds],
        tree_seconds=[s * fraction for s in verify.tree_seconds],
        model="",
    )


class SelfDraftProposer:
    """Drafts with the verifier's own layers, a skip set of them left out (see the module).

    The skip set is found (or read from the cache) at the first `reset`, from its prompt; from
    then on a tree of the layer-skipped view's guesses is grown by a `DraftTreeProposer` (the
    best `TREE_TOPK` children of a level's best nodes, each level's pass and the verified
    nodes sized by the cost profiles, up to `depth` deep), as the "tree" method grows a draft
    model's: a chain where the view is sure, side nodes where they pay (docs/benchmarks.md,
    "Issues 26 and 30, session 32")."""

    name = "self"

    def __init__(
        self,
        verifier: MLXEngine,
        vocab: int,
        chooser: TokenChooser,
        verify: CostProfile | None,
        *,
        depth: int = 8,
        cache: bool = True,
        skip_set: SkipSet | None = None,
    ):
        self.verifier, self.model = verifier, verifier.model
        self.vocab, self.chooser = vocab, chooser
        self.verify, self.depth, self.cache = verify, depth, cache
        self.skip_set = skip_set  # None: found (or read) at the first reset
        self.draft: DraftTreeProposer | None = None

    def _build(self, prompt: Sequence[int]) -> DraftTreeProposer:
        n, reading = len(self.model.layers), None
        if self.skip_set is None:
            self.skip_set = cached_skip_set(self.model, cache=self.cache)
        if self.skip_set is None:  # the search reads every layer as the draft will
            reading = self_reading(self.model, range(n))
            self.skip_set = load_skip_set(
                self.model, prompt, self.verify, cache=self.cache, reading=reading
            )
        _note_no_gain(self.model, self.skip_set, self.cache)
        keep = self.skip_set.keep
        # made once per model and layers kept (each generation builds its proposer anew, and
        # int8 copies of a 1.5B's kept layers took a second and a byte a weight every time)
        kept = (self.skip_set.reading, tuple(keep))
        held = getattr(self.model, "_self_reading", None)
        if reading is not None:  # the skipped layers' readings go
            reading.layers = {i: reading.layers[i] for i in keep if i in reading.layers}
        elif held is not None and held[0] == kept:
            reading = held[1]
        else:
            reading = self_reading(self.model, keep, self.skip_set.reading)
        object.__setattr__(self.model, "_self_reading", (kept, reading))  # not a module's child
        view = LayerSkipView(self.model, keep, reading, cache_of=lambda: self.verifier.cache)
        cost = None
        if self.verify is not None:
            cost = scaled_profile(self.verify, self.skip_set.draft_fraction)
        state = SharedCacheState(tree_engine(MLXEngine(view)), self.vocab, cost)
        fixed = float(cost(1)) if cost is not None else 0.0  # the root's step, once a round
        expand = (lambda n: float(cost.branched(n))) if cost is not None else 0.0
        return DraftTreeProposer(
            state, self.vocab, self.chooser, mode="dynamic", depth=self.depth, topk=TREE_TOPK,
            budget=cost_budget(self.verify, fixed), expand_cost=expand,
            rate=cost_rate(self.verify, fixed),
            pick=cost_pick(self.verify, fixed) if self.verify is not None else None, name="self",
        )  # fmt: skip

    @property
    def state(self) -> SharedCacheState | None:
        """The layer-skipped view's cache and work (None before the first `reset`)."""
        return self.draft.state if self.draft is not None else None  # type: ignore[return-value]

    @property
    def expected(self) -> float | None:
        """See `DraftTreeProposer.expected`."""
        return self.draft.expected if self.draft is not None else None

    def reset(self, prompt: Sequence[int]) -> None:
        if self.draft is None:
            self.draft = self._build(prompt)
        self.draft.reset(prompt)

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        assert self.draft is not None and self.state is not None, "reset() first"
        tree = self.draft.propose(seq, max_depth, noise)
        self.state.release()  # the verifier's pass comes next, in the same rows
        return tree

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        assert self.draft is not None
        self.draft.observe(seq, tree, verdict)


def _note_no_gain(model: Model, found: SkipSet, cache: bool) -> None:
    """One line, once per model and reading in a process, where `self` was asked for and its
    skip set predicts no gain over plain decoding: the output stays exact, only slower, and on
    a CPU whose one kernel reads the verifier's weights for both, a draft of the kept layers
    costs nearly a verifier pass (docs/benchmarks.md, "Issues 26 and 30, session 30")."""
    if not cache or found.speedup > 1.0:
        return
    key = (weights_fingerprint(model), found.reading)
    if key in _NOTED:
        return
    _NOTED.add(key)
    other = (
        f"; {READING_ENV}=int8 reads int8 copies of the kept layers instead (more memory)"
        if found.reading != "int8"
        else ""
    )
    print(
        f"ondevice: method 'self' is predicted at {found.speedup:.2f}x plain decoding on this "
        f"machine ({found.describe()}){other}; method 'medusa' or 'auto' may pay",
        file=sys.stderr,
        flush=True,
    )


_NOTED: set[tuple[str, str]] = set()  # (fingerprint, reading) told of no gain


def build(res: Resources, spec: Speculation) -> SelfDraftProposer:
    """The "self" method: a tree of the verifier's guesses with a measured skip set of its
    layers (num_draft_tokens: the tree's depth, default 8); no draft model is used. As a
    candidate of `auto` only a skip set already found is used, and only one predicted to beat
    plain decoding: the search is not started silently (`Unavailable` otherwise)."""
    engine = innermost(res.verifier)
    model = getattr(engine, "model", None)
    if not isinstance(engine, MLXEngine) or not isinstance(model, Model):
        raise Unavailable(
            "method 'self' drafts with the verifier's own layers and needs an MLX verifier."
        )
    if len(model.layers) < 2:
        raise Unavailable("method 'self' needs a verifier with at least two layers.")
    not_beside_a_draft(res, spec)
    cache = res.verify_cost is not None
    reading_asked()  # a bad value of its variable is refused here, not at the first round
    found = None
    if spec.method == "auto":
        found = cached_skip_set(model, cache=cache)
        if found is None:
            raise Unavailable(
                "no skip set is cached for this model yet; run method 'self' once to search "
                "for one (it is cached for auto's next generations)"
            )
        if found.speedup <= 1.0:  # every try of it would be a round slower than a plain step
            raise Unavailable(
                f"its cached skip set predicts {found.speedup:.2f}x plain decoding, no gain "
                f"({found.describe()})"
            )
        if found.reading == "int8":  # auto's candidates add no memory of a model's size
            mb = copies_bytes(model, found.keep) / 1e6
            raise Unavailable(
                f"its draft reads int8 copies of {len(found.keep)} layers (about {mb:.0f} MB "
                "beside the verifier's weights); ask for method 'self' to use it"
            )
    return SelfDraftProposer(
        engine, res.vocab, res.chooser, res.verify_cost, depth=spec.num_draft_tokens or 8,
        cache=cache, skip_set=found,
    )  # fmt: skip

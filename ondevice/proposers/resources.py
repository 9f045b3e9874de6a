"""What a decoder and its proposer are built from, as two objects built once per generation,
and what proposers learn across generations of one loaded pair (`Calibrations`):

- `Speculation`: how to speculate (the method, what `num_draft_tokens` fixes, pipelining, cost
  profiles, the tree mode); the registry (`proposers/registry.py`) says what each field means
  for each method.
- `Resources`: the shared parts (the verifier, the draft and its cache state, the sampling
  parameters, the measured pass costs). A proposer's builder reads what it needs from it, so a
  new proposer that needs a new part adds a field here, not a parameter to every factory.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ondevice.rules.chooser import TokenChooser
from ondevice.rules.engine import Engine, batch_invariant
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime.engines import tree_engine
from ondevice.runtime.pass_costs import CostProfile, CostWatch, load_profiles

if TYPE_CHECKING:
    from ondevice.proposers.draft_tree import DraftState

TREE_MODES = ("dynamic", "sampled")
# rounds of evidence per depth a calibration keeps: older rounds weigh less as newer ones come,
# so a session whose text changes (code, then prose) follows it
CALIBRATION_MEMORY = 256


@dataclass(frozen=True, kw_only=True)
class Speculation:
    """How one generation speculates.

    method: a name in `proposers.registry.METHODS`.
    num_draft_tokens: None lets the cost profiles size each proposal; otherwise what it fixes
        depends on the method (`Method.num_draft_tokens` in the registry says what).
    pipeline: chain only: the draft works while the verifier checks (same tokens either way).
    profile: size proposals by the verifier's (and draft's) measured pass costs, cached per
        device and model; False: every pass costs the same.
    tree_mode: "dynamic" (EAGLE-2 top-k tree) or "sampled" (a static tree of i.i.d. draft
        samples, SpecInfer; greedy decoding uses top-k children either way).
    """

    method: str = "chain"
    num_draft_tokens: int | None = None
    pipeline: bool = False
    profile: bool = True
    tree_mode: str = "dynamic"

    def __post_init__(self) -> None:
        if self.tree_mode not in TREE_MODES:
            raise ValueError(f"tree_mode must be one of {', '.join(TREE_MODES)}")


class Calibrations:
    """Per depth, how far the verifier follows a proposer's predicted acceptance: the summed
    predicted acceptance of verified nodes and the rounds that accepted that deep, one pair of
    arrays per name ("draft": every tree grown from the draft model, `DraftState.calibration`;
    ("medusa", folder): those heads), updated in place by the proposers.

    A `Generator` keeps one for its pair (a new one when its draft changes), so a generation
    starts from what earlier generations of the pair learned instead of the prior, by sampling
    settings (a temperature changes how far the verifier follows), and only where that cannot
    change its tokens (`for_generation`). Each generation's start keeps at most
    `CALIBRATION_MEMORY` rounds' evidence per depth, the ratio unchanged.

    `rates`: what `auto` learnt of each candidate, by name: its tokens and seconds per round
    over its rounds so far (long-run averages) and how many rounds, where the next generation
    starts from."""

    def __init__(self) -> None:
        self._arrays: dict[Hashable, tuple[np.ndarray, np.ndarray]] = {}
        self.rates: dict[str, tuple[float, float, int]] = {}
        self._by_sampling: dict[tuple, Calibrations] = {}

    def get(self, name: Hashable, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(predicted, realised) for `name`, at least `size` depths long (new depths: the prior,
        one round of perfect calibration)."""
        predicted, realised = self._arrays.get(name, (np.ones(0), np.ones(0)))
        if len(predicted) < size:
            grow = np.ones(size - len(predicted))
            predicted, realised = (
                np.concatenate([predicted, grow]),
                np.concatenate([realised, grow]),
            )
        shrink = np.minimum(1.0, CALIBRATION_MEMORY / np.maximum(predicted, realised))
        predicted *= shrink
        realised *= shrink
        self._arrays[name] = predicted, realised
        return predicted, realised

    def for_generation(
        self, verifier: Engine, params: SamplingParams, seed: int | None
    ) -> Calibrations:
        """What one generation reads and updates: this pair's calibrations for its sampling
        settings where trees sized from them cannot change its tokens (greedy decoding with a
        batch-invariant verifier, whose greedy tokens do not depend on the tree; sampling
        without a seed, which promises no particular tokens), else a fresh one (a seeded
        sample, or greedy decoding whose near ties may fall by the pass's size, gives the
        same tokens every time)."""
        if reproducible(verifier, params, seed):
            return Calibrations()
        key = (params.greedy, params.temperature, params.top_p, params.top_k, params.min_p)
        return self._by_sampling.setdefault(key, Calibrations())


def reproducible(verifier: Engine, params: SamplingParams, seed: int | None) -> bool:
    """Whether a generation must give the same tokens every time it is asked: a seeded sample,
    or greedy decoding whose near ties may fall by the pass's size (a verifier that is not
    batch-invariant). Such a generation sizes its proposals by nothing that earlier
    generations or the clock taught: fresh calibrations, and the pass costs as measured (a
    stale profile's live ratio, written by the clock, unapplied)."""
    return seed is not None if not params.greedy else not batch_invariant(verifier)


@dataclass
class Resources:
    """The parts a tree decoder and its proposer share for one generation.

    verifier: the verifier as a tree engine (`runtime.engines.tree_engine`).
    draft: the draft's cache kept in step with the committed tokens (None: no draft loaded).
    chooser: the generation's one token chooser (sampling transform, noise, rule).
    verify_cost, draft_cost: seconds of a pass over n tokens (None: not profiled).
    heads: a folder of Medusa heads given explicitly (`load(..., heads=...)`); None: method
        "medusa" looks in the cache for heads trained for this verifier.
    verify_watch: judges the live verifier passes against `verify_cost` (None: not profiled).
    calibrations: what the proposers learn per depth (see `Calibrations`).
    """

    verifier: Engine
    draft: DraftState | None
    chooser: TokenChooser
    verify_cost: CostProfile | None = None
    draft_cost: CostProfile | None = None
    heads: Path | None = None
    verify_watch: CostWatch | None = None
    calibrations: Calibrations = field(default_factory=Calibrations)

    @classmethod
    def build(
        cls,
        verifier: Engine,
        draft: Engine | None,
        params: SamplingParams,
        *,
        seed: int | None = None,
        profile: bool = True,
        heads: Path | None = None,
        calibrations: Calibrations | None = None,
    ) -> Resources:
        """The verifier wrapped for trees, the draft's state, the token chooser (its noise
        keyed by `seed`), (with `profile`) the cached pass costs of both, the heads folder
        given, if any, and the calibrations this generation starts from (of the pair given,
        where `Calibrations.for_generation` allows; else the prior). A `reproducible`
        generation reads the costs as measured."""
        from ondevice.proposers.draft_tree import DraftState

        verifier = tree_engine(verifier)
        # measured together where missing: a slow spell moves both alike (`measure_together`)
        engines = [verifier] if draft is None else [verifier, draft]
        costs = load_profiles(engines) if profile else [None] * len(engines)
        if reproducible(verifier, params, seed):
            costs = [c and c.as_measured() for c in costs]
        vcost, dcost = costs[0], (costs[1] if draft is not None else None)
        learned = (calibrations or Calibrations()).for_generation(verifier, params, seed)
        state = None
        if draft is not None:
            state = DraftState(tree_engine(draft), verifier.vocab_size, dcost, learned)
        chooser = TokenChooser(params, verifier.vocab_size, seed)
        watch = CostWatch(vcost) if vcost is not None else None
        return cls(verifier, state, chooser, vcost, dcost, heads, watch, learned)

    @property
    def params(self) -> SamplingParams:
        return self.chooser.params

    @property
    def vocab(self) -> int:
        return self.verifier.vocab_size

    def draft_pass(self, n: int) -> float:
        """Estimated seconds of a draft pass over n tokens (0 unprofiled)."""
        return float(self.draft_cost(n)) if self.draft_cost else 0.0

    def draft_expand(self, n: int) -> float:
        """Estimated seconds of a draft pass expanding n tree nodes at once, each on its own
        path (`CostProfile.branched`; 0 unprofiled)."""
        return float(self.draft_cost.branched(n)) if self.draft_cost else 0.0

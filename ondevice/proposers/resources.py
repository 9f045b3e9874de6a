"""What a decoder and its proposer are built from, as two objects built once per generation:

- `Speculation`: how to speculate (the method, what `num_draft_tokens` fixes, pipelining, cost
  profiles, the tree mode); the registry (`proposers/registry.py`) says what each field means
  for each method.
- `Resources`: the shared parts (the verifier, the draft and its cache state, the sampling
  parameters, the measured pass costs). A proposer's builder reads what it needs from it, so a
  new proposer that needs a new part adds a field here, not a parameter to every factory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ondevice.rules.chooser import TokenChooser
from ondevice.rules.engine import Engine
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime.engines import tree_engine
from ondevice.runtime.pass_costs import CostProfile, CostWatch, load_profile

if TYPE_CHECKING:
    from ondevice.proposers.draft_tree import DraftState

TREE_MODES = ("dynamic", "sampled")


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
    """

    verifier: Engine
    draft: DraftState | None
    chooser: TokenChooser
    verify_cost: CostProfile | None = None
    draft_cost: CostProfile | None = None
    heads: Path | None = None
    verify_watch: CostWatch | None = None

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
    ) -> Resources:
        """The verifier wrapped for trees, the draft's state, the token chooser (its noise
        keyed by `seed`), (with `profile`) the cached pass costs of both, and the heads folder
        given, if any."""
        from ondevice.proposers.draft_tree import DraftState

        verifier = tree_engine(verifier)
        vcost = load_profile(verifier) if profile else None
        dcost = load_profile(draft) if profile and draft is not None else None
        state = None
        if draft is not None:
            state = DraftState(tree_engine(draft), verifier.vocab_size, dcost)
        chooser = TokenChooser(params, verifier.vocab_size, seed)
        watch = CostWatch(vcost) if vcost is not None else None
        return cls(verifier, state, chooser, vcost, dcost, heads, watch)

    @property
    def params(self) -> SamplingParams:
        return self.chooser.params

    @property
    def vocab(self) -> int:
        return self.verifier.vocab_size

    def draft_pass(self, n: int) -> float:
        """Estimated seconds of a draft pass over n tokens (0 unprofiled)."""
        return float(self.draft_cost(n)) if self.draft_cost else 0.0

"""Where the draft runs: the placement the cost model predicts fastest from measured profiles.

On a Mac a pair bundle's draft can run on the Neural Engine (Core ML) or on the GPU beside the
verifier (MLX). Which is faster depends on the pair and the machine: a 0.5B draft step on the
Neural Engine can cost about what a 1.5B verifier pass costs on the GPU, so the Core ML draft pays
only behind a slower verifier or when it drafts while the verifier checks (pipelining), which a
draft sharing the GPU cannot do without slowing the verifier down. So instead of choosing Core
ML from the OS version alone, `choose` takes the measured cost profiles (`pass_costs.py`) of the
verifier and of each available draft backend, and for every backend, K and pipelining predicts
tokens per second with the cost model (`costmodel.CostModel`, the formulas the pipelined decoder
uses), and returns the best.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ondevice.rules.engine import Engine
from ondevice.runtime.costmodel import CostModel
from ondevice.runtime.pass_costs import CostProfile, load_profile

# Draft backends that run on other silicon than an MLX verifier, so drafting ahead while the
# verifier checks costs the verifier nothing (the Neural Engine beside the GPU).
BESIDE_VERIFIER = frozenset({"coreml"})
# Acceptance assumed before any has been measured (Qwen2.5-Coder 1.5B + 0.5B accept 0.76 on
# Spec-Bench dev and 0.94 on the demo's code prompt, docs/benchmarks.md).
DEFAULT_ALPHA = 0.75


@dataclass(frozen=True)
class Placement:
    backend: str
    pipelined: bool
    k: int
    tokens_per_second: float


def predicted_model(verify: CostProfile, draft: CostProfile, alpha: float, k_max: int) -> CostModel:
    """A cost model that has 'measured' what the profiles say, at acceptance `alpha`."""
    model = CostModel(decay=1.0, alpha_prior=alpha, prior_weight=1e9)
    for _ in range(2):
        model.observe_draft(float(draft(1)))
    for n in range(1, k_max + 2):
        model.observe_verify(n, float(verify(n)))
    return model


def candidates(
    verify: CostProfile,
    drafts: Mapping[str, CostProfile],
    *,
    alpha: float = DEFAULT_ALPHA,
    k_max: int = 8,
) -> list[Placement]:
    """Every (backend, pipelined) among `drafts` (backend -> its draft's profile) at its best K,
    with its predicted tokens per second; pipelined only where drafting runs beside the GPU."""
    out = []
    for backend, profile in drafts.items():
        model = predicted_model(verify, profile, alpha, k_max)
        for pipelined in (False, True) if backend in BESIDE_VERIFIER else (False,):
            k = model.best_k(pipelined, k_max)
            out.append(Placement(backend, pipelined, k, model.rate(k, pipelined)))
    return out


def choose(verify: CostProfile, drafts: Mapping[str, CostProfile], **options: Any) -> Placement:
    """The fastest of `candidates(verify, drafts, **options)` (alpha, k_max); the first of
    equals, in `drafts`' order."""
    if not drafts:
        raise ValueError("no draft backend to choose from")
    found = candidates(verify, drafts, **options)
    return max(found, key=lambda p: p.tokens_per_second)


def place_draft(
    verifier: Engine, engines: Mapping[str, Engine], *, alpha: float = DEFAULT_ALPHA
) -> tuple[Engine, Placement]:
    """Of the same draft on several backends (backend -> engine), the engine `choose` picks,
    from profiles measured once per device and model and cached (`pass_costs.load_profile`)."""
    verify = load_profile(verifier)
    profiles = {name: load_profile(engine) for name, engine in engines.items()}
    assert verify is not None and all(p is not None for p in profiles.values())
    placement = choose(verify, profiles, alpha=alpha)  # type: ignore[arg-type]
    return engines[placement.backend], placement

"""The one decoder factory: `make_decoder(verifier, draft, params, spec)` for every method of
the registry (`proposers/registry.py`).

Every decoder it returns is a `Decoder` (`decoders/base.py`), and a seed means the same for all
of them (position-keyed noise).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ondevice.decoders.base import Decoder
from ondevice.decoders.chain import ChainDecoder
from ondevice.decoders.pipelined import PipelinedDecoder
from ondevice.decoders.plain import PlainGreedyDecoder
from ondevice.decoders.tree import Rule, TreeDecoder
from ondevice.errors import OndeviceError
from ondevice.proposers.registry import method
from ondevice.proposers.resources import Calibrations, Resources, Speculation
from ondevice.rules.chooser import CustomRule
from ondevice.rules.engine import Engine
from ondevice.rules.sampling import SamplingParams
from ondevice.runtime.engines import MLXEngine
from ondevice.runtime.pass_costs import CostWatch


def make_decoder(
    verifier: Engine,
    draft: Engine | None,
    params: SamplingParams,
    spec: Speculation | None = None,
    *,
    seed: int | None = None,
    eos_token_ids: Sequence[int] = (),
    rule: str | CustomRule | Rule | None = None,
    heads: Path | None = None,
    calibrations: Calibrations | None = None,
) -> Decoder:
    """The decoder for `spec.method` (default: a chain with the defaults of `Speculation`).

    verifier, draft: engines (draft None: no draft; "chain" then decodes plainly, "pld",
    "lookahead" and "auto" run with the verifier alone, "tree" and "cascade" refuse).
    params: the sampling parameters; seed: the position-keyed noise's seed (None: random).
    rule: the acceptance rule (chain: a name in `accept.RULES` or a chain rule; the others: a
    tree rule), for tests that show a wrong one is caught. heads: a Medusa heads folder for
    method "medusa" (None: found in the cache). calibrations: what the proposers learnt in
    earlier generations of the same pair (`Calibrations`; None: start from the prior).
    """
    spec = spec or Speculation()
    m = method(spec.method)
    k = spec.num_draft_tokens
    if k is not None and k < 1 and m.proposer is not None:
        raise OndeviceError(f"method {m.name!r} needs num_draft_tokens >= 1 (or None for auto).")
    if m.needs_draft and draft is None:
        raise OndeviceError(
            f"method {m.name!r} needs a draft model; load one (draft=...) or use method='pld' "
            "or 'lookahead', which run with the verifier alone."
        )
    opts = {"eos_token_ids": eos_token_ids, "seed": seed}
    if m.proposer is None:
        if draft is None or k == 0:
            plain = _plain(verifier, params, rule, opts)
            plain.skip_reason = "num_draft_tokens=0" if draft else "no draft model is loaded"
            return plain
        chain = PipelinedDecoder if spec.pipeline else ChainDecoder
        watch = CostWatch.of(verifier) if spec.profile else None  # sizes nothing: never measured
        return chain(
            verifier, draft, params, num_draft_tokens=k, rule=rule, cost_watch=watch, **opts
        )
    res = Resources.build(
        verifier, draft, params, seed=seed, profile=spec.profile, heads=heads,
        calibrations=calibrations,
    )  # fmt: skip
    proposer = m.build_proposer(res, spec)
    return TreeDecoder(
        res.verifier, proposer, params, rule=rule, draft_state=res.draft, chooser=res.chooser,
        eos_token_ids=eos_token_ids, cost_watch=res.verify_watch,
        costs=[c for c in (res.verify_cost, res.draft_cost) if c is not None],
    )  # fmt: skip


def _plain(verifier: Engine, params: SamplingParams, rule: object, opts: dict) -> Decoder:
    """Plain decoding: the fast greedy loop on MLX where nothing transforms the logits."""
    if (
        params.greedy and not params.processed and params.logprobs is None
        and isinstance(verifier, MLXEngine) and rule is None
    ):  # fmt: skip
        return PlainGreedyDecoder(verifier, opts["eos_token_ids"])
    return ChainDecoder(verifier, None, params, rule=rule, **opts)  # type: ignore[arg-type]

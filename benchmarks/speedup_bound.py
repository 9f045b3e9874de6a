"""What speedup speculative decoding can reach on this machine, for a given acceptance rate.

    python benchmarks/speedup_bound.py VERIFIER_PROFILE.json DRAFT_PROFILE.json [--draft-scale S]

The profiles are the cost profiles `ondevice` measures and caches per device and model
(`<cache>/profiles/*.json`: seconds of one forward pass over n tokens). With acceptance alpha per
drafted token (`ondevice/runtime/costmodel.py`, used here as it is), a block of K drafts yields
(1 - alpha^(K+1)) / (1 - alpha) tokens per verifier pass, and costs (no host overhead: an upper
bound):

- sequential: V(K+1) + K*d + alpha^K * d (the draft catches up on the bonus token when all passed)
- pipelined (perfect overlap, no contention): V(K+1) + (1 - h)*K*d + h*max(0, (K+1)*d - V(K+1)),
  h = alpha^(K+1): the next block is already drafted only when the block and the guess were right.

Speedup = that rate over plain decoding's 1/V(1), for the best K in 1..8. `--draft-scale` rescales
the draft's cost (e.g. 0.5 for a draft half as expensive, such as a one-layer EAGLE-style head).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ondevice.runtime.costmodel import CostModel
from ondevice.runtime.pass_costs import CostProfile


class ProfileCosts(CostModel):
    """The runtime's cost model with a measured profile for the verifier's pass (interpolated,
    not the runtime's running linear fit), a fixed draft call cost and no host overhead."""

    def __init__(self, verify: CostProfile, draft_seconds: float) -> None:
        super().__init__()
        self._verify = verify
        self.draft.value, self.draft.n = draft_seconds, 1

    def verify_seconds(self, length: int) -> float:
        return float(self._verify(length))


def speedups(cm: CostModel, alpha: float, k_max: int = 8) -> tuple[tuple[float, int], ...]:
    """(speedup over plain, best K) sequential and pipelined, at acceptance `alpha`."""
    v1 = cm.verify_seconds(1)
    return tuple(
        max((cm.rate(k, pipelined, alpha) * v1, k) for k in range(1, k_max + 1))
        for pipelined in (False, True)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("verifier_profile")
    ap.add_argument("draft_profile")
    ap.add_argument("--draft-scale", type=float, default=1.0)
    args = ap.parse_args()
    verify = CostProfile.from_json(json.loads(Path(args.verifier_profile).read_text()))
    draft = CostProfile.from_json(json.loads(Path(args.draft_profile).read_text()))
    d = float(draft(1)) * args.draft_scale
    v1 = verify(1)
    print(f"device: {verify.device}")
    print(
        f"V(1) = {v1 * 1000:.1f} ms, V(4)/V(1) = {verify(4) / v1:.2f}, "
        f"V(8)/V(1) = {verify(8) / v1:.2f}, draft call / V(1) = {d / v1:.3f}"
    )
    print("alpha  sequential (best K)  pipelined, ideal overlap (best K)")
    for alpha in (0.14, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        (s, ks), (p, kp) = speedups(ProfileCosts(verify, d), alpha)
        print(f"{alpha:5.2f}  {s:5.2f}x (K={ks})          {p:5.2f}x (K={kp})")


if __name__ == "__main__":
    main()

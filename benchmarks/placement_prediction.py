"""What the cost model predicts for the default pair on a Mac, from published figures.

    python benchmarks/placement_prediction.py [--bandwidth-gbs 273] [--ane-ms 18] [--alphas ...]

No Mac has run this project's pair yet, so the costs of each side are estimated from public
figures (docs/benchmarks.md cites them):

- the verifier's pass and the MLX draft's step on the GPU: decoding is bound by memory
  bandwidth, so a pass costs (weight bytes) / (the bandwidth MLX reaches); mlx_lm reaches about
  73% of the nominal bandwidth (Qwen3.5-4B 4-bit, 2.25 GB, at 39 tok/s on a base M4 of 120 GB/s).
  A pass over 9 tokens reads the same weights, so it costs about what one over 1 costs
  (`--verify-growth`: the extra share at 9 tokens).
- the Core ML draft's step on the Neural Engine: `--ane-ms` (about 18 ms per token for 0.5-0.8B
  models through Core ML on an M4 Pro, ANEMLL).

Then `placement.choose` (the runtime's own choice) is run on those profiles at each acceptance,
and every placement's predicted tokens per second is printed next to plain decoding's.
"""

from __future__ import annotations

import argparse

from ondevice.runtime.pass_costs import CostProfile
from ondevice.runtime.placement import candidates, choose

VERIFIER_BYTES = 3.09e9  # Qwen2.5-Coder-1.5B, bfloat16 (1.54B parameters, tied head)
DRAFT_BYTES = 0.99e9  # Qwen2.5-Coder-0.5B, bfloat16 (0.49B parameters, tied head)


def gpu_profile(weight_bytes: float, gbs: float, efficiency: float, growth: float) -> CostProfile:
    one = weight_bytes / (gbs * 1e9 * efficiency)
    return CostProfile([1, 9, 64], [one, one * (1 + growth), one * (1 + growth * 8)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bandwidth-gbs", type=float, default=273.0, help="M4 Pro: 273 (Apple)")
    ap.add_argument("--efficiency", type=float, default=0.73)
    ap.add_argument("--verify-growth", type=float, default=0.1)
    ap.add_argument("--ane-ms", type=float, default=18.0)
    ap.add_argument("--alphas", default="0.6,0.76,0.94")
    args = ap.parse_args()
    g = args.verify_growth
    verify = gpu_profile(VERIFIER_BYTES, args.bandwidth_gbs, args.efficiency, g)
    drafts = {
        "mlx": gpu_profile(DRAFT_BYTES, args.bandwidth_gbs, args.efficiency, g),
        "coreml": CostProfile([1, 64], [args.ane_ms / 1000, args.ane_ms / 1000 * 8]),
    }
    plain = 1.0 / float(verify(1))
    print(
        f"verifier pass {float(verify(1)) * 1000:.1f} ms, MLX draft step "
        f"{float(drafts['mlx'](1)) * 1000:.1f} ms, Core ML draft step {args.ane_ms:.1f} ms; "
        f"plain decoding {plain:.0f} tok/s"
    )
    for alpha in (float(a) for a in args.alphas.split(",")):
        best = choose(verify, drafts, alpha=alpha)
        print(f"alpha {alpha:.2f}: choose -> {best.backend}, pipelined={best.pipelined}, "
              f"K={best.k}, {best.tokens_per_second / plain:.2f}x plain")  # fmt: skip
        for c in candidates(verify, drafts, alpha=alpha):
            how = "pipelined" if c.pipelined else "sequential"
            rate = c.tokens_per_second
            print(f"    {c.backend} {how} K={c.k}: {rate:.0f} tok/s = {rate / plain:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

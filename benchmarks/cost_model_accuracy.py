"""How close the cost model's predicted speed is to the measured one, run by run.

    python benchmarks/cost_model_accuracy.py RESULTS.json MODEL [--draft D] [--draft-backend mlx]

RESULTS.json is what `ondevice bench` wrote. For each plain, chain and pipeline record the
cost model (`costmodel.CostModel`, the formulas `placement.choose` and the pipelined decoder
use) is given the pair's cached cost profiles (`pass_costs.load_profile`, never measured here) and
what the run itself saw: its rounds, its mean K (drafted per round) and the acceptance alpha
that makes the geometric model yield the run's tokens per round. It predicts the seconds of the
decoding rounds; the prediction is compared with the measured decode time (prefill and first
pass excluded, as `ondevice bench` times it). Two verifier models are shown: the linear fit
a + b * L the runtime's CostModel keeps, and the profile itself (piecewise linear in L).

Tree and auto rounds have no per-round record in the results (their tree sizes vary), so they
are not predicted here.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np

import ondevice
from ondevice.runtime.costmodel import CostModel
from ondevice.runtime.pass_costs import CostProfile, load_profile
from ondevice.runtime.placement import predicted_model

METHODS = ("plain", "chain", "pipeline")


def fit_alpha(tokens_per_round: float, k: float) -> float:
    """The alpha at which the cost model's geometric tokens per round equals the measured."""
    geometric = CostModel().tokens_per_round
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        if geometric(k, mid) < tokens_per_round:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def predict(rec: dict, verify: CostProfile, draft: CostProfile) -> tuple[float, float] | None:
    """Predicted decode seconds of one record: (linear verifier fit, profile as measured)."""
    rounds = rec["rounds"] - 1  # the first pass is outside the decode time
    if rounds < 1 or not rec.get("decode_s"):
        return None
    if rec["method"] == "plain":
        return rounds * float(verify(1)), rounds * float(verify(1))
    k = rec["drafted"] / rec["rounds"]
    alpha = fit_alpha(rec["mean_accepted_length"] or 1.0, k)
    pipelined = rec["method"] == "pipeline"
    model = predicted_model(verify, draft, alpha, k_max=16)
    linear = model.round_seconds(k, pipelined, alpha)
    # the same formula with the profile's own cost for a pass over k + 1 tokens
    exact = linear - model.verify_seconds(k + 1) + float(verify(k + 1))
    return rounds * linear, rounds * exact


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="the JSON `ondevice bench` wrote")
    ap.add_argument("model", help="the pair bundle (or verifier) the results were measured with")
    ap.add_argument("--draft", help="draft model (a bundle brings its own)")
    ap.add_argument("--draft-backend", default="mlx")
    args = ap.parse_args()
    results = json.loads(open(args.results).read())
    gen = ondevice.load(args.model, draft=args.draft, draft_backend=args.draft_backend)
    verify = load_profile(gen.verifier, measure_if_missing=False)
    draft = load_profile(gen.draft, measure_if_missing=False)
    if verify is None or draft is None:
        raise SystemExit("no cached cost profile for this pair: run benchmarks/profiles.py first")
    sums: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(3))
    for rec in results["records"]:
        if rec["method"] not in METHODS:
            continue
        p = predict(rec, verify, draft)
        if p is None:
            continue
        for key in (rec["method"], f"{rec['method']} / {rec['category']}"):
            sums[key] += (rec["decode_s"], *p)
    print(f"{'run':34s} {'measured s':>10s} {'linear fit':>16s} {'profile':>16s}")
    for key in sorted(sums, key=lambda k: (METHODS.index(k.split(" / ")[0]), "/" in k, k)):
        measured, linear, exact = sums[key]
        print(
            f"{key:34s} {measured:10.1f} {linear:9.1f} ({linear / measured - 1:+5.0%})"
            f" {exact:9.1f} ({exact / measured - 1:+5.0%})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

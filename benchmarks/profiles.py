"""The cost profiles the runtime sizes its trees with: one pass over N new tokens, per model.

    python benchmarks/profiles.py BUNDLE [--draft-backend mlx] [--fresh]

Loads the pair and prints the verifier's and the draft's profile as `load_profile` keeps them
(cached per device, BLAS and model under the cache's `profiles/`; measured when missing, or
always with --fresh, which deletes the cached ones first).
"""

from __future__ import annotations

import argparse
import time

import ondevice
from ondevice.runtime.pass_costs import device_name, engine_key, load_profile, profile_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a pair bundle, or a verifier with --draft")
    ap.add_argument("--draft", help="draft model (a bundle brings its own)")
    ap.add_argument("--draft-backend", default="mlx")
    ap.add_argument("--fresh", action="store_true", help="measure again")
    args = ap.parse_args()
    gen = ondevice.load(args.model, draft=args.draft, draft_backend=args.draft_backend)
    print(device_name())
    for name, engine in (("verifier", gen.verifier), ("draft", gen.draft)):
        if engine is None:
            continue
        if args.fresh:
            profile_path(device_name(), engine_key(engine)).unlink(missing_ok=True)
        t = time.perf_counter()
        p = load_profile(engine)
        assert p is not None
        ms = "  ".join(f"{n}: {s * 1000:.0f}" for n, s in zip(p.sizes, p.seconds))
        print(f"{name:8s} ({time.perf_counter() - t:.1f} s)  ms per pass over N tokens  {ms}")


if __name__ == "__main__":
    main()

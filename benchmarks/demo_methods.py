"""The demo's question answered by several methods in one process, plain runs in between.

    python benchmarks/demo_methods.py BUNDLE [--max-tokens 64] [--runs plain,chain,auto,chain:3,plain]

Each run is `Generator.generate(prompt, method=M, num_draft_tokens=K)` on the bundle loaded once
(draft in MLX, prompt cache off so every run prefills alike); `chain:3` fixes K. Prints tokens per
second (prefill excluded), acceptance, tokens per verifier pass and the draft/verify time split,
and checks every run's tokens against the first plain run.
"""

from __future__ import annotations

import argparse
import time

import ondevice
from ondevice.apps.demo import DEFAULT_PROMPT


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", default="plain,chain,auto,chain:3,plain")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    args = p.parse_args()
    t = time.perf_counter()
    gen = ondevice.load(args.bundle, draft_backend="mlx")
    print(f"loaded in {time.perf_counter() - t:.1f} s", flush=True)
    reference = None
    for run in args.runs.split(","):
        method, _, k = run.partition(":")
        kw = {"num_draft_tokens": int(k)} if k else {}
        r = gen.generate(
            args.prompt, max_tokens=args.max_tokens, speculative=method != "plain",
            method="chain" if method == "plain" else method, cache_prompt=False, **kw,
        )  # fmt: skip
        reference = reference or r.tokens
        st = r.stats
        print(
            f"{run:10s} {st['tokens_per_second']:6.2f} tok/s  acceptance "
            f"{st.get('acceptance_rate', 0):.2f}  tokens/pass {st.get('mean_accepted_length', 1):.2f}"
            f"  draft {st.get('time_draft_s', 0):.1f} s  verify {st.get('time_verify_s', 0):.1f} s"
            f"  {'same tokens' if r.tokens == reference else 'DIFFERENT TOKENS'}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

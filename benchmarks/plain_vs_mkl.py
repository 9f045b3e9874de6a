"""Plain decoding's pass on the CPU kernel against MKL float32's, the same verifier loaded both
ways in one process, passes alternating.

    python benchmarks/plain_vs_mkl.py VERIFIER [--passes 24] [--rounds 2] [--context 300]

Issue 26's goal compares plain decoding with the kernel against the path before it (MLX's own
products through MKL, `ONDEVICE_KERNEL=mlx`) "in the same run". Separate processes a few
minutes apart move by 15% on the shared two-core machines here, where one process that
alternates the two verifiers' one-token passes gives both the same conditions: each pass runs
on its own model's generation thread (the kernel's plans and OpenMP pool belong to that
thread), the order alternates, and a pause before each pass lets the other one's thread pool
stop spinning. Both caches hold the same context (`--context` tokens of a fixed text); each
pass decodes one token and is rolled back, so every pass sees the same context length.
Prints each round's medians and the ratio MKL / kernel (above 1: the kernel is faster); the
memory of both models at once (the kernel's bf16 verifier and MKL's float32 one) is about
three times the kernel's alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ondevice
from ondevice.runtime import kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a verifier (a GGUF file, a folder or a catalog name)")
    ap.add_argument("--passes", type=int, default=24, help="passes of each per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=300, help="tokens in the cache")
    ap.add_argument("--pause", type=float, default=0.3, help="seconds before each pass")
    args = ap.parse_args()

    saved = os.environ.get(kernel.ENV)
    os.environ[kernel.ENV] = "mlx"
    try:
        mkl = ondevice.load(args.model, draft=None)
    finally:
        if saved is None:
            os.environ.pop(kernel.ENV)
        else:
            os.environ[kernel.ENV] = saved
    ours = ondevice.load(args.model, draft=None)
    print(
        f"kernel: {kernel.products(ours.verifier.model)}; baseline: {kernel.products(mkl.verifier.model)}"
    )
    gens = {"kernel": ours, "mkl": mkl}
    context = [1000 + i % 5000 for i in range(args.context)]

    def prepare(gen: ondevice.Generator) -> None:
        gen.verifier.reset()
        gen.verifier.feed(context, last_only=True)

    def one_pass(gen: ondevice.Generator) -> float:
        t = time.perf_counter()
        gen.verifier.feed([7], last_only=True)
        took = time.perf_counter() - t
        gen.verifier.trim(1)
        return took

    for r in range(args.rounds):
        for gen in gens.values():
            gen._call(lambda g=gen: prepare(g))
        times: dict[str, list[float]] = {name: [] for name in gens}
        for i in range(args.passes + 2):  # the first two of each: warm-up
            order = list(gens) if i % 2 else list(reversed(gens))
            for name in order:
                time.sleep(args.pause)
                took = gens[name]._call(lambda g=gens[name]: one_pass(g))
                if i >= 2:
                    times[name].append(took)
        k, m = (statistics.median(times[n]) for n in ("kernel", "mkl"))
        paired = statistics.median(b / a for a, b in zip(times["kernel"], times["mkl"]))
        print(
            f"round {r + 1}: kernel {k * 1e3:.1f} ms, MKL float32 {m * 1e3:.1f} ms a pass: "
            f"{m / k:.2f}x (median of paired ratios {paired:.2f}x)"
        )


if __name__ == "__main__":
    main()

"""Plain decoding's pass on the CPU kernel against MKL float32's, the same verifier loaded both
ways in one process, passes alternating.

    python benchmarks/plain_vs_mkl.py VERIFIER [--turns 12] [--block 8] [--rounds 2] [--context 300]

Issue 26's goal compares plain decoding with the kernel against the path before it (MLX's own
products through MKL, `ONDEVICE_KERNEL=mlx`) "in the same run". Separate processes a few
minutes apart move by 15% on the shared two-core machines here, where one process that
alternates the two verifiers gives both the same conditions: each turn runs on its own
model's generation thread (the kernel's plans and OpenMP pool belong to that thread), the
order alternates, and a pause before each turn lets the other one's thread pool stop
spinning. A turn is `--block` one-token passes back to back, as decoding makes them, the
first of them dropped (it pays for the pause: caches and threads gone cold); `--block 1`
times single passes after a pause each, which made the kernel's pass 9% dearer than back to
back (192 against 176 ms) and MKL's no dearer (docs/benchmarks.md, "Issue 26, session 24").
Both caches hold the same context (`--context` tokens of a fixed text); each pass decodes one
token and is rolled back, so every pass sees the same context length. Prints each round's
median pass and the ratio MKL / kernel (above 1: the kernel is faster), of the medians and the
median of the turns' paired ratios; the memory of both models at once (the kernel's bf16
verifier and MKL's float32 one) is about three times the kernel's alone.
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
    ap.add_argument("--turns", type=int, default=12, help="turns of each model per round")
    ap.add_argument("--block", type=int, default=8, help="passes back to back per turn")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=300, help="tokens in the cache")
    ap.add_argument("--pause", type=float, default=0.3, help="seconds before each turn")
    args = ap.parse_args()
    if args.turns < 1 or args.block < 1:
        ap.error("--turns and --block must be at least 1")

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

    def turn(gen: ondevice.Generator) -> list[float]:
        """`--block` one-token passes back to back (the first dropped past a single one)."""
        took = []
        for _ in range(args.block + (args.block > 1)):
            t = time.perf_counter()
            gen.verifier.feed([7], last_only=True)
            took.append(time.perf_counter() - t)
            gen.verifier.trim(1)
        return took[args.block > 1 :]

    for r in range(args.rounds):
        for gen in gens.values():
            gen._call(lambda g=gen: prepare(g))
        times: dict[str, list[list[float]]] = {name: [] for name in gens}
        for i in range(args.turns + 2):  # the first two of each: warm-up
            order = list(gens) if i % 2 else list(reversed(gens))
            for name in order:
                time.sleep(args.pause)
                took = gens[name]._call(lambda g=gens[name]: turn(g))
                if i >= 2:
                    times[name].append(took)
        k, m = (
            statistics.median(t for block in times[n] for t in block) for n in ("kernel", "mkl")
        )
        paired = statistics.median(
            statistics.median(b) / statistics.median(a)
            for a, b in zip(times["kernel"], times["mkl"])
        )
        print(
            f"round {r + 1}: kernel {k * 1e3:.1f} ms, MKL float32 {m * 1e3:.1f} ms a pass: "
            f"{m / k:.2f}x (median of paired ratios {paired:.2f}x)"
        )


if __name__ == "__main__":
    main()

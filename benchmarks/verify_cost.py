"""Cost of one verifier pass over L new tokens, per way of computing the linear products.

    python benchmarks/verify_cost.py MODEL [--kernels mlx,bf16] [--lengths 1,2,4,8,16] [--reps 9]

Kernels: `mlx` (float32 weights, MLX's products: the BLAS it was given, runtime/blas.py),
`bf16` / `f32` (the CPU kernel, runtime/kernel.py), `quantized` (MLX's quantized products on
the file's own quantized weights); `bf16/1` runs the kernel on one thread. The model is loaded once; the kernels' copies share its
float32 weights until they convert them. Every repetition times each length on each kernel in
turn, so that all of them see the same load on a shared machine (median of `--reps`).
"""

from __future__ import annotations  # noqa: I001  (ondevice first: it opens the BLAS)

import argparse
import resource
import statistics
import time

import ondevice  # noqa: F401
import mlx.core as mx
from mlx.utils import tree_flatten

from ondevice.models import Model, load_model
from ondevice.runtime import kernel
from ondevice.runtime.engines import MLXEngine


def pass_ms(engine: MLXEngine, L: int) -> float:
    t = time.perf_counter()
    mx.eval(engine.forward(list(range(200, 200 + L))))
    ms = (time.perf_counter() - t) * 1000
    engine.trim(L)
    return ms


def copy_of(model: Model) -> Model:
    """Another module tree over the same weight arrays (nothing copied)."""
    other = Model(model.config)
    other.load_weights(tree_flatten(model.parameters()))
    return other


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--kernels", default="mlx,bf16")
    ap.add_argument("--lengths", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    kinds = args.kernels.split(",")
    lengths = [int(n) for n in args.lengths.split(",")]
    flt = load_model(args.model, dequantize=True).model
    models = {}
    for kind in kinds:
        if kind == "quantized":
            models[kind] = load_model(args.model).model
        elif kind == "mlx":
            models[kind] = flt
        else:
            name, _, threads = kind.partition("/")
            models[kind] = copy_of(flt)
            kernel.serve(models[kind], name, int(threads or 0))
    if "mlx" not in kinds:
        del flt
    engines = {k: MLXEngine(m) for k, m in models.items()}
    for e in engines.values():
        e.feed(list(range(100, 164)), last_only=True)  # a 64-token prompt
        for L in lengths:  # warm up: primitives, buffers, caches
            pass_ms(e, L)
    times: dict = {(k, L): [] for k in kinds for L in lengths}
    for _ in range(args.reps):
        for L in lengths:
            for k, e in engines.items():
                times[k, L].append(pass_ms(e, L))
    print(f"peak memory of this process (all kernels' models): "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GB")  # fmt: skip
    head = " | ".join(f"{L} tok ms" for L in lengths)
    ratios = " | ".join(f"{L} / 1" for L in lengths[1:])
    print(f"| kernel | {head} | {ratios} |")
    print("|" + "---|" * (1 + 2 * len(lengths) - 1))
    for k in kinds:
        ms = [statistics.median(times[k, L]) for L in lengths]
        cells = " | ".join(f"{m:.0f}" for m in ms)
        print(f"| {k} | {cells} | " + " | ".join(f"{m / ms[0]:.2f}" for m in ms[1:]) + " |")


if __name__ == "__main__":
    main()

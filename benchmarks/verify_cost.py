"""Cost of one verifier pass over L new tokens, per way of computing the linear products.

    python benchmarks/verify_cost.py MODEL [--kernels mlx,bf16] [--lengths 1,2,4,8,16] [--reps 9]

Kernels: `mlx` (float32 weights, MLX's products: the BLAS it was given, runtime/blas.py),
`bf16` / `f32` (the CPU kernel, runtime/kernel.py), `quantized` (MLX's quantized products on
the file's own quantized weights); `bf16/1` runs the kernel on one thread.

Each kernel is timed in a process of its own, one after another: MKL's OpenMP threads spin
for a while after each of its products and oneDNN's (libgomp) after each of its own, so in one
process each kernel's pass ran with the other's threads still busy on the same two cores (a
bf16 pass measured 1000 ms beside MKL's float32 model, 230 ms alone). Within a process every
repetition times each length in turn (median of `--reps`).
"""

from __future__ import annotations  # noqa: I001  (ondevice first: it opens the BLAS)

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import ondevice  # noqa: F401
import mlx.core as mx

from ondevice.models import load_model
from ondevice.runtime import kernel
from ondevice.runtime.engines import MLXEngine


def pass_ms(engine: MLXEngine, L: int) -> float:
    t = time.perf_counter()
    mx.eval(engine.forward(list(range(200, 200 + L))))
    ms = (time.perf_counter() - t) * 1000
    engine.trim(L)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--kernels", default="mlx,bf16")
    ap.add_argument("--lengths", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    kinds = args.kernels.split(",")
    lengths = [int(n) for n in args.lengths.split(",")]
    if not args.child:
        report(args, kinds, lengths)
        return
    assert len(kinds) == 1, "a child process times one kernel"
    kind = kinds[0]
    name, _, threads = kind.partition("/")
    if kind == "quantized":
        model = load_model(args.model).model
    elif kind == "mlx":
        model = load_model(args.model, dequantize=True).model
    else:  # read in the kernel's dtype, as `ondevice.load` does
        dtype = kernel.weight_dtype(name)
        model = load_model(args.model, dequantize=True, product_dtype=dtype).model
        kernel.serve(model, name, int(threads or 0))
    engine = MLXEngine(model)
    engine.feed(list(range(100, 164)), last_only=True)  # a 64-token prompt
    for L in lengths:  # warm up: primitives, buffers, caches
        pass_ms(engine, L)
    times: dict = {L: [] for L in lengths}
    for _ in range(args.reps):
        for L in lengths:
            times[L].append(pass_ms(engine, L))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    ms = {L: statistics.median(times[L]) for L in lengths}
    print(json.dumps({"kernel": kinds[0], "ms": ms, "peak_gb": peak}))


def report(args: argparse.Namespace, kinds: list[str], lengths: list[int]) -> None:
    """Each kernel in a child process (see the module), then one table."""
    rows = []
    for kind in kinds:
        cmd = [sys.executable, __file__, args.model, "--kernels", kind, "--child"]
        cmd += ["--lengths", args.lengths, "--reps", str(args.reps)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    head = " | ".join(f"{L} tok ms" for L in lengths)
    ratios = " | ".join(f"{L} / 1" for L in lengths[1:])
    print(f"| kernel | {head} | {ratios} | peak GB |")
    print("|" + "---|" * (2 * len(lengths) + 1))
    for row in rows:
        ms = [row["ms"][str(L)] for L in lengths]
        cells = " | ".join(f"{m:.0f}" for m in ms)
        ratio = " | ".join(f"{m / ms[0]:.2f}" for m in ms[1:])
        print(f"| {row['kernel']} | {cells} | {ratio} | {row['peak_gb']:.1f} |")


if __name__ == "__main__":
    main()

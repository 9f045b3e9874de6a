"""Cost of one verifier pass over L new tokens: quantized vs dequantized float32 weights.

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/verify_cost.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from ondevice.models import load_model
from ondevice.runtime.engines import MLXEngine


def pass_ms(model, L: int, reps: int) -> float:
    engine = MLXEngine(model)
    engine.feed(list(range(100, 140)), last_only=True)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(engine.forward(list(range(200, 200 + L))))
        engine.trim(L)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", default="1,4,8,16")
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    quant = load_model(args.model).model
    flt = load_model(args.model, dequantize=True).model
    print("L  quantized_ms  float32_ms")
    for L in map(int, args.lengths.split(",")):
        print(
            f"{L:<3}{pass_ms(quant, L, args.reps):12.1f}{pass_ms(flt, L, args.reps):12.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

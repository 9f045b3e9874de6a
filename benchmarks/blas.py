"""Verifier pass cost per BLAS and CPU kernel on Linux: what should serve the linear products?

    python benchmarks/blas.py MODEL [--blas mkl,openblas,reference] [--kernels mlx,bf16,f32]
        [--tokens 1,2,4,8] [--reps 5]

For each BLAS and kernel (a fresh process each, `ONDEVICE_BLAS=<kind>` and
`ONDEVICE_KERNEL=<kind>`, since the library is chosen before MLX loads) it loads MODEL as
`ondevice.load` would on this machine (float32 on the CPU, linear products through the kernel
unless it is `mlx`), then times one verifier pass over 1, 2, 4, 8 new tokens after a 64-token
prompt, median of `--reps`, and reports the process's peak memory.
What speculation needs is both a cheap one-token pass (plain decoding's speed) and a K-token
pass that costs little more than one (so verifying a draft is nearly free).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = "--child"


def child(model: str, tokens: list[int], reps: int) -> dict:
    import ondevice  # noqa: F401, I001  (first: opens the BLAS this process was asked for)
    import resource

    import mlx.core as mx
    from ondevice.models import load_model
    from ondevice.runtime import blas, kernel
    from ondevice.runtime.engines import MLXEngine

    t = time.perf_counter()
    loaded = load_model(model, dequantize=True)
    served = kernel.serve(loaded.model)
    load_s = time.perf_counter() - t
    engine = MLXEngine(loaded.model)
    prompt = list(range(100, 164))
    mx.eval(engine.forward(prompt, last_only=True))
    out: dict = {"blas": blas._enabled or "reference", "kernel": served, "load_s": load_s}
    out["pass_ms"] = {}
    for n in tokens:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            mx.eval(engine.forward(list(range(200, 200 + n))))
            times.append(time.perf_counter() - t)
            engine.trim(n)
        out["pass_ms"][n] = 1e3 * statistics.median(times)
    out["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--blas", default="mkl,openblas,reference")
    p.add_argument("--kernels", default="mlx", help="ONDEVICE_KERNEL values (mlx: MLX's own)")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.child:
        print(json.dumps(child(args.model, tokens, args.reps)))
        return 0
    rows = []
    for kind in args.blas.split(","):
        for kern in args.kernels.split(","):
            env = dict(os.environ, ONDEVICE_BLAS=kind, ONDEVICE_KERNEL=kern)
            env.pop("LD_PRELOAD", None)
            cmd = [sys.executable, __file__, args.model, "--tokens", args.tokens]
            cmd += ["--reps", str(args.reps), CHILD]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                print(f"{kind}/{kern}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append((kind, json.loads(proc.stdout.strip().splitlines()[-1])))
    header = "| BLAS | library | kernel | load s | peak GB | "
    header += " | ".join(f"{n} tok ms" for n in tokens)
    header += " | " + " | ".join(f"{n} tok / 1 tok" for n in tokens[1:]) + " |"
    print(header)
    print("|" + "---|" * (4 + 2 * len(tokens)))
    for kind, r in rows:
        ms = [r["pass_ms"][str(n)] for n in tokens]
        cells = " | ".join(f"{m:.0f}" for m in ms)
        ratios = " | ".join(f"{m / ms[0]:.2f}" for m in ms[1:])
        print(
            f"| {kind} | {os.path.basename(r['blas'])} | {r['kernel']} | {r['load_s']:.1f} | "
            f"{r['peak_gb']:.1f} | {cells} | {ratios} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Verifier decode speed: ondevice vs mlx_lm on the same weights, interleaved, same process.

    python benchmarks/plain_decode.py --model smollm2-135m-instruct --runs 5

Greedy, batch 1, 128 new tokens (EOS ignored by both), after one warm-up each. The model is saved
once in the MLX layout both libraries read, so they run identical weights. `import ondevice`
comes first: it chooses the BLAS both run on (`ondevice doctor` names it); never preload one.
On Linux x86_64 ondevice's own products are the CPU kernel's (runtime/kernel.py) unless
`ONDEVICE_KERNEL=mlx`, which compares the two on MLX's products alone.
"""

from __future__ import annotations  # noqa: I001  (ondevice first: it opens the BLAS)

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ondevice  # noqa: F401
import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    import mlx_lm
    from mlx_lm.generate import generate_step

    from ondevice.models import load_model
    from ondevice.models.weights import save_model
    from ondevice.runtime.engines import MLXEngine

    lm = load_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(lm.model, tmp)
        lm.tokenizer.save(tmp)
        ref, _ = mlx_lm.load(tmp)
        ours = load_model(Path(tmp)).model
    prompt_text = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
    )
    prompt = lm.tokenizer.encode(prompt_text, add_special_tokens=False)

    def run_ours() -> float:
        from ondevice.decoders.plain import PlainGreedyDecoder

        dec = PlainGreedyDecoder(MLXEngine(ours), eos_token_ids=())
        n = 0
        t1 = 0.0
        for rnd in dec.run(prompt, args.tokens):
            n += len(rnd.tokens)
            if n == 1:  # time from the first token on: decode speed, not prompt processing
                t1 = time.perf_counter()
        return (n - 1) / (time.perf_counter() - t1)

    def run_ref() -> float:
        n = 0
        t1 = 0.0
        for _tok, _ in generate_step(mx.array(prompt), ref, max_tokens=args.tokens):
            n += 1
            if n == 1:
                t1 = time.perf_counter()
        return (n - 1) / (time.perf_counter() - t1)

    run_ours(), run_ref()  # warm-up
    a, b = [], []
    for _ in range(args.runs):
        a.append(run_ours())
        b.append(run_ref())
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"model={args.model} prompt={len(prompt)} tokens new={args.tokens} runs={args.runs}")
    print(f"ondevice {ma:.1f} tok/s  mlx_lm {mb:.1f} tok/s  ratio {ma / mb:.3f}")
    print("ondevice runs:", " ".join(f"{x:.1f}" for x in a))
    print("mlx_lm runs:  ", " ".join(f"{x:.1f}" for x in b))


if __name__ == "__main__":
    main()

"""How to run the drafter beside the verifier: one verifier pass with N draft steps at once.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/draft_concurrency.py --verifier GGUF [--draft-layers 0,1,28,29]

Modes, interleaved round by round (median wall time of one round):
  serial   verifier pass, then the draft steps (the sequential decoder)
  streams  verifier pass submitted with mx.async_eval, draft steps on a second MLX stream in the
           same Python thread (what decoders/pipelined.py does)
  thread   draft steps in a persistent Python thread with its own stream, verifier pass in the
           main thread
  process  draft steps in a persistent child process with its own copy of the draft
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import threading
import time

import mlx.core as mx
from models_util import add_verifier_argument, load_pair

from ondevice.runtime.engines import MLXEngine


def _draft_steps(engine: MLXEngine, tokens: list[int]) -> None:
    for t in tokens:
        engine.feed([t], last_only=True)
    engine.trim(len(tokens))


def _child(conn, verifier: str, draft_layers: str, prompt: list[int]) -> None:
    _, d, _ = load_pair(verifier, None, draft_layers)
    engine = MLXEngine(d)
    engine.feed(prompt, last_only=True)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        _draft_steps(engine, msg)
        conn.send("done")


def _arguments() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser()
    add_verifier_argument(ap)
    ap.add_argument("--draft-layers", default="0,1,28,29")
    ap.add_argument("--block", type=int, default=5, help="tokens per verifier pass")
    ap.add_argument("--steps", type=int, default=5, help="draft steps per round")
    ap.add_argument("--rounds", type=int, default=8)
    return ap.parse_args()


def main() -> None:
    args = _arguments()

    v, d, desc = load_pair(args.verifier, None, args.draft_layers)
    prompt = v.tokenizer.encode("Explain how a rainbow forms, step by step, for a child. " * 4)
    V, D = MLXEngine(v.model), MLXEngine(d)
    V.feed(prompt, last_only=True)
    D.feed(prompt, last_only=True)
    block = prompt[: args.block]
    steps = prompt[: args.steps]

    def verify_sync() -> None:
        mx.eval(V.forward(block))
        V.trim(len(block))

    def serial() -> None:
        verify_sync()
        _draft_steps(D, steps)

    dstream = mx.new_thread_local_stream(mx.default_device())

    def streams() -> None:
        out = V.forward(block)
        mx.async_eval(out)
        with mx.stream(dstream):
            _draft_steps(D, steps)
        mx.eval(out)
        V.trim(len(block))

    # a persistent drafter thread with its own engine (own cache) and stream
    D2 = MLXEngine(d)
    D2.feed(prompt, last_only=True)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    done: queue.SimpleQueue = queue.SimpleQueue()

    def drafter() -> None:
        with mx.stream(mx.new_stream(mx.default_device())):
            while (job := jobs.get()) is not None:
                _draft_steps(D2, job)
                done.put(True)

    th = threading.Thread(target=drafter, daemon=True)
    th.start()

    def thread() -> None:
        jobs.put(steps)
        verify_sync()
        done.get()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, args.verifier, args.draft_layers, prompt))
    proc.start()
    assert parent.recv() == "ready"

    def process() -> None:
        parent.send(steps)
        verify_sync()
        assert parent.recv() == "done"

    def draft_only() -> None:
        _draft_steps(D, steps)

    modes = {
        "verify only": verify_sync,
        "draft only": draft_only,
        "serial": serial,
        "streams": streams,
        "thread": thread,
        "process": process,
    }
    times = _time_modes(modes, args.rounds)
    jobs.put(None)
    th.join()
    parent.send(None)
    proc.join()
    print(f"verifier {args.verifier}; draft {desc}; block {args.block}, {args.steps} draft steps")
    _report(times)


def _time_modes(modes: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each mode per round, the modes interleaved (after one warm-up each)."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    for fn in modes.values():  # warm-up
        fn()
    for _ in range(rounds):
        for m, fn in modes.items():
            t = time.perf_counter()
            fn()
            times[m].append(time.perf_counter() - t)
    return times


def _report(times: dict[str, list[float]]) -> None:
    med = {m: statistics.median(ts) * 1e3 for m, ts in times.items()}
    ideal = max(med["verify only"], med["draft only"])
    for m, ms in med.items():
        print(f"  {m:12s} {ms:8.1f} ms")
    print(
        f"  ideal overlap (max of the two) {ideal:.1f} ms; serial sum "
        f"{med['verify only'] + med['draft only']:.1f} ms"
    )


if __name__ == "__main__":
    main()

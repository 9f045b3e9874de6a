"""Prompt cache: time to first token of a chat's second turn, and a server workload whose requests
share a long system prompt, with the prompt cache on and off in the same run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/prompt_cache.py --verifier PATH --draft PATH [--json out.json]

1. Chat: turn 1 is a long user message (a document) and its answer, about `--history-tokens`
   tokens together; turn 2 asks a short question after them. Measured: the time from the call to
   the first streamed token of turn 2 (`Generator.stream`, the chat's own path), with the cache
   on (turn 1 ran just before, as in a chat) and off (`cache_prompt=False`, which prefills all as
   before the cache existed), `--runs` times each, interleaved; medians reported.
2. Server: `--requests` chat requests over HTTP to the OpenAI-compatible server (in process, on a
   loopback port), each with the same `--system-tokens` system prompt and its own question.
   Measured: the sum of the requests' prompt processing times (the server's `prompt_seconds`) and
   the wall time of the workload, with the prompt cache off (budget 0) and on (the default
   budget); the cache's bytes after every request (bounded by the budget).

Both models load once; on and off differ only in the cache. Every answer with the cache is
checked to be identical to the one without (greedy decoding).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from typing import Any

import httpx

WORDS = (
    "the river carried old boats past the mill while children counted the swallows above the "
    "bridge and a baker sold warm bread to travellers who had walked all night from the hills "
).split()


def text_of(gen: Any, tokens: int, role: str, start: int = 0) -> str:
    """Words enough for a message of about `tokens` tokens."""
    words: list[str] = []
    i = start
    while True:
        words += [WORDS[i % len(WORDS)] for i in range(i, i + 32)]
        i += 32
        text = " ".join(words)
        if gen.count_tokens([{"role": role, "content": text}]) >= tokens:
            return text


def first_token(
    gen: Any, messages: list[dict[str, str]], **kw: Any
) -> tuple[float, list[int], dict]:
    """(seconds to the first token, all tokens, stats) of one streamed answer."""
    t0 = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    stats: dict = {}
    for chunk in gen.stream(messages, temperature=0.0, **kw):
        if chunk.tokens and ttft is None:
            ttft = time.perf_counter() - t0
        tokens += chunk.tokens
        stats = chunk.stats or stats
    return ttft if ttft is not None else float("nan"), tokens, stats


def chat_second_turn(gen: Any, args: argparse.Namespace) -> dict:
    document = text_of(gen, args.history_tokens - args.answer_tokens, "user")
    turn1 = [{"role": "user", "content": document}]
    on, off = [], []
    same = True
    for _ in range(args.runs):
        # off: the whole conversation is prefilled, as before the prompt cache
        answer = gen.generate(turn1, max_tokens=args.answer_tokens, cache_prompt=False)
        turn2 = turn1 + [
            {"role": "assistant", "content": answer.text},
            {"role": "user", "content": "Summarise that in one sentence."},
        ]
        t_off, tok_off, s_off = first_token(
            gen, turn2, max_tokens=args.max_tokens, cache_prompt=False
        )
        off.append(t_off)
        # on: turn 1 leaves its KV in the cache, turn 2 starts from it
        gen.clear_prompt_cache()
        gen.generate(turn1, max_tokens=args.answer_tokens)
        t_on, tok_on, s_on = first_token(gen, turn2, max_tokens=args.max_tokens)
        on.append(t_on)
        same &= tok_on == tok_off
    return {
        "history_tokens": s_on["prompt_tokens"],
        "cached_tokens": s_on["cached_tokens"],
        "ttft_off_s": statistics.median(off),
        "ttft_on_s": statistics.median(on),
        "speedup": statistics.median(off) / statistics.median(on),
        "runs_off_s": off,
        "runs_on_s": on,
        "identical": same,
    }


class _Server:
    """`OpenAIServer` on uvicorn in a thread, on a free loopback port."""

    def __init__(self, gen: Any) -> None:
        import uvicorn

        from ondevice.apps.server import OpenAIServer

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = OpenAIServer(gen).uvicorn_config(log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def __enter__(self) -> _Server:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise SystemExit("the server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()


def server_workload(gen: Any, args: argparse.Namespace) -> dict:
    system = {"role": "system", "content": text_of(gen, args.system_tokens, "system")}
    questions = [
        f"Question {i}: what did the {WORDS[i % len(WORDS)]} do?" for i in range(args.requests)
    ]
    budget = gen.prompt_cache.max_bytes
    out: dict[str, Any] = {"system_tokens": gen.count_tokens([system]), "budget_bytes": budget}
    answers: dict[str, list[str]] = {}
    with _Server(gen) as server, httpx.Client(base_url=server.url, timeout=3600) as client:
        for mode, max_bytes in (("off", 0), ("on", budget)):
            gen.clear_prompt_cache()
            gen.prompt_cache.max_bytes = max_bytes
            prompt_s, cached, peak = 0.0, 0, 0
            answers[mode] = []
            t0 = time.perf_counter()
            for q in questions:
                body = {
                    "model": gen.model_name,
                    "messages": [system, {"role": "user", "content": q}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                }
                r = client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                resp = r.json()
                prompt_s += resp["ondevice"]["prompt_seconds"]
                cached += resp["usage"]["prompt_tokens_details"]["cached_tokens"]
                answers[mode].append(resp["choices"][0]["message"]["content"])
                peak = max(peak, gen.prompt_cache_stats()["bytes"])
            out[mode] = {
                "prompt_seconds": prompt_s,
                "wall_seconds": time.perf_counter() - t0,
                "cached_tokens": cached,
                "peak_cache_bytes": peak,
            }
    gen.prompt_cache.max_bytes = budget
    out["prompt_speedup"] = out["off"]["prompt_seconds"] / out["on"]["prompt_seconds"]
    out["wall_speedup"] = out["off"]["wall_seconds"] / out["on"]["wall_seconds"]
    out["identical"] = answers["on"] == answers["off"]
    out["within_budget"] = out["on"]["peak_cache_bytes"] <= budget
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--verifier", required=True, help="verifier (folder, .gguf, bundle or name)")
    p.add_argument("--draft", help="draft model (a bundle brings its own)")
    p.add_argument(
        "--draft-backend", default="auto", choices=("auto", "coreml", "reference", "mlx")
    )
    p.add_argument("--history-tokens", type=int, default=1500, help="chat history before turn 2")
    p.add_argument("--answer-tokens", type=int, default=64, help="turn 1's answer length")
    p.add_argument("--system-tokens", type=int, default=1000, help="server: shared system prompt")
    p.add_argument("--requests", type=int, default=20, help="server: requests")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per measured answer")
    p.add_argument("--runs", type=int, default=3, help="chat: repetitions (median)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args()

    import ondevice

    gen = ondevice.load(args.verifier, args.draft, draft_backend=args.draft_backend)
    from ondevice.apps.serve import warm_up

    warm_up(gen)
    chat = chat_second_turn(gen, args)
    print(
        f"chat, turn 2 after {chat['history_tokens']} tokens ({chat['cached_tokens']} cached): "
        f"first token {chat['ttft_off_s']:.3f} s without the prompt cache, "
        f"{chat['ttft_on_s']:.3f} s with it = {chat['speedup']:.1f}x; identical: {chat['identical']}"
    )
    srv = server_workload(gen, args)
    print(
        f"server, {args.requests} requests sharing a {srv['system_tokens']}-token system prompt: "
        f"prompt time {srv['off']['prompt_seconds']:.2f} s -> {srv['on']['prompt_seconds']:.2f} s "
        f"= {srv['prompt_speedup']:.1f}x, wall {srv['off']['wall_seconds']:.2f} s -> "
        f"{srv['on']['wall_seconds']:.2f} s = {srv['wall_speedup']:.1f}x; cache peak "
        f"{srv['on']['peak_cache_bytes'] / 1e6:.1f} MB of {srv['budget_bytes'] / 1e6:.0f} MB; "
        f"identical: {srv['identical']}"
    )
    result = {
        "verifier": args.verifier,
        "draft": args.draft,
        "draft_backend": gen.draft_backend,
        "chat": chat,
        "server": srv,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

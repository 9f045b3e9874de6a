"""Soak: bounded requests against `ondevice serve` on 127.0.0.1 with a tiny random pair.

    python benchmarks/soak.py --requests 1000 --concurrency 4
    python benchmarks/soak.py --minutes 10 --concurrency 8     # bounded by time instead

Run it from outside the source tree to measure committed code in another checkout:
`cd /tmp && PYTHONPATH=/path/to/checkout python /path/to/checkout/benchmarks/soak.py` (with the
source tree as the working directory, `python -m ondevice` imports the tree's own copy).

The server runs as `ondevice serve` in a subprocess (the command users run), with a short queue
(--max-queue 2) so that concurrent clients also meet a full queue. The mix: whole and streamed
chat completions, text completions, clients that disconnect mid-stream or before the answer,
and bad requests (broken JSON, unknown model, a prompt beyond the context, a foreign Origin or
Host, a form post, a chat template sent in `chat_template_kwargs`, an integer past Python's
digit limit, a non-ASCII digit as a logit_bias key, a 60 KB request head). Greedy answers to the
same request must be the same text every time (a corrupted or mixed answer would differ); every
request whose answer is compared says temperature 0, and `--prompts N` repeats N texts so that
most answers are compared (with fresh random texts few requests ever repeat). Every answer is classified: expected outcomes by kind (200, 4xx for the bad
inputs, 429 when the queue is full, the intended disconnects) and anything else as unexpected
(a 5xx, a malformed body, a wrong status, a transport error nobody asked for). The server's RSS
is read from /proc after warm-up, in the middle and at the end. Goal (issue 16): 0 unexpected
errors, RSS at the end within 10% of the warm-up value. The prompt cache keeps KV of past
prompts up to its budget by design, so the soak gives it a small one (--prompt-cache-mb 8) that
fills during the warm-up. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny  # noqa: E402  (the tests' tiny random checkpoints)
from server_overhead import wait_until_healthy  # noqa: E402  (this folder: the script's path)

CONTEXT = 1024
MODEL = "soak"


def write_pair(root: Path) -> tuple[Path, Path]:
    """A tiny verifier whose EOS logit is 0 (answers run to max_tokens) and a noisy draft."""
    verifier = tiny.write_endless_model(root / "verifier", seed=0, scale=2.0, context=CONTEXT)
    return verifier, tiny.perturbed_copy(verifier, root / "draft", noise=0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_server(
    verifier: Path, draft: Path, port: int, args: argparse.Namespace
) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ondevice", "serve", "--model", str(verifier), "--draft",
           str(draft), "--draft-backend", "mlx", "--port", str(port), "--name", MODEL,
           "--max-queue", str(args.max_queue), "--log-level", "error", "--read-timeout", "10",
           "--prompt-cache-mb", str(args.prompt_cache_mb)]  # fmt: skip
    return wait_until_healthy(subprocess.Popen(cmd), port, 120)


def chat(content: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip


def completion(prompt: str, max_tokens: int) -> dict:
    # temperature 0 said explicitly: OpenAI's default is 1, whose answers differ by design
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


# kind -> (weight, what counts as the expected answer)
KINDS = {
    "chat": 30, "chat_stream": 20, "completion": 10, "disconnect_stream": 8,
    "disconnect_wait": 4, "bad_json": 5, "other_model_name": 5, "too_long": 5,
    "foreign_origin": 5, "foreign_host": 4, "form_post": 4,
    # issue 29: a template from the request, numbers past the digit limit, logit_bias keys
    # that str.isdigit() takes, a 60 KB request head
    "template_attack": 3, "huge_number": 2, "unicode_bias": 2, "long_head": 2,
}  # fmt: skip
# Greedy answers seen so far, by request: a later answer to the same request must be the same
# text (an answer mixed with another's, or corrupted, would differ).
ANSWERS: dict[tuple[str, str, int], str] = {}
COMPARED = collections.Counter()  # answers checked against an earlier one to the same request


def same_as_before(kind: str, body: dict, text: str, n: int, answer: str) -> str | None:
    """None if `answer` matches earlier answers to this request, else what differs. Only
    greedy requests may be compared: a sampled answer differs from the last by design."""
    if body.get("temperature") != 0:
        raise ValueError(f"{kind}: only greedy answers (temperature 0) are comparable")
    key = (kind, text, n)
    if key in ANSWERS:
        COMPARED[kind] += 1
    first = ANSWERS.setdefault(key, answer)
    return (
        None
        if first == answer
        else f"unexpected corrupted answer to {kind} {text!r} max_tokens={n}: "
        f"{answer[:40]!r} != {first[:40]!r}"
    )


def prompt_text(rng: random.Random, pool: int) -> str:
    """Six random words; with `pool`, one of that many fixed texts (repeated requests, so most
    greedy answers are compared with an earlier one)."""
    if pool:
        rng = random.Random(rng.randrange(pool))
    return " ".join(rng.choice(["hello", "there", "robot", "paint", "story"]) for _ in range(6))


async def _one_stream(client: httpx.AsyncClient, kind: str, text: str, n: int) -> str:
    """A streamed chat ("chat_stream"), or one left after a few events ("disconnect_stream")."""
    url = "/v1/chat/completions"
    body = chat(text, n if kind == "chat_stream" else 400, stream=True)
    async with client.stream("POST", url, json=body) as r:
        if r.status_code == 429:
            return "ok:429 queue full"
        if r.status_code != 200:
            return f"unexpected {r.status_code}"
        events, pieces = 0, []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            if kind == "disconnect_stream" and events == 4:
                return "ok:disconnect mid-stream"  # leaving the block closes the connection
            if line == "data: [DONE]":
                wrong = same_as_before("chat", body, text, n, "".join(pieces))
                return wrong or "ok:200 stream"
            event = json.loads(line[6:])
            if "error" in event:
                return f"unexpected error event {line[:120]}"
            if event.get("choices"):
                pieces.append(event["choices"][0]["delta"].get("content") or "")
        return "unexpected stream without [DONE]"


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random, pool: int = 0) -> str:
    """Send one request of `kind`; return its outcome ("ok:..." expected, else unexpected)."""
    n = rng.randint(4, 24)
    text = prompt_text(rng, pool)
    url = "/v1/chat/completions"
    if kind in ("chat", "completion"):
        body = chat(text, n) if kind == "chat" else completion(text, n)
        r = await client.post(url if kind == "chat" else "/v1/completions", json=body)
        if r.status_code == 429:
            return "ok:429 queue full"
        if r.status_code != 200:
            return f"unexpected {r.status_code}: {r.text[:120]}"
        usage = r.json()["usage"]
        choice = r.json()["choices"][0]
        answer = choice["message"]["content"] if kind == "chat" else choice["text"]
        if (wrong := same_as_before(kind, body, text, n, answer)) is not None:
            return wrong
        return "ok:200" if usage["completion_tokens"] == n else f"unexpected usage {usage}"
    if kind in ("chat_stream", "disconnect_stream"):
        return await _one_stream(client, kind, text, n)
    if kind == "disconnect_wait":
        try:
            r = await client.post(url, json=chat(text, 600), timeout=0.3)
        except httpx.ReadTimeout:
            return "ok:disconnect before the answer"
        return "ok:429 queue full" if r.status_code == 429 else "ok:200 (finished first)"
    if kind == "other_model_name":  # any name reaches the one served model (llama.cpp's habit)
        r = await client.post(url, json={**chat(text, n), "model": "nope"})
        if r.status_code in (200, 429):
            return f"ok:{r.status_code} {kind}"
        return f"unexpected {r.status_code} for {kind} (want 200 or 429): {r.text[:120]}"
    expected = {"bad_json": 400, "too_long": 400, "foreign_origin": 403,
                "foreign_host": 421, "form_post": 415, "template_attack": 400,
                "huge_number": 400, "unicode_bias": 400, "long_head": 431}[kind]  # fmt: skip
    headers = {"Content-Type": "application/json"}
    content = json.dumps(chat(text, n)).encode()
    if kind == "bad_json":
        content = content[:-3]
    elif kind == "too_long":
        content = json.dumps(chat("word " * 200_000, n)).encode()  # 1 MB, far past the context
    elif kind == "foreign_origin":
        headers["Origin"] = "https://evil.example"
    elif kind == "foreign_host":
        headers["Host"] = "attacker.example"
    elif kind == "form_post":
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    elif kind == "template_attack":  # 146 bytes that rendered a 3 MB prompt before issue 29
        template = {"template": "{{ 'ab ' * 1000000 }}"}
        content = json.dumps(chat(text, n, chat_template_kwargs=template)).encode()
    elif kind == "huge_number":
        content = content[:-1] + b', "x": ' + b"9" * 5000 + b"}"
    elif kind == "unicode_bias":
        content = json.dumps(chat(text, n, logit_bias={rng.choice("²①٣𝟘"): 1})).encode()
    elif kind == "long_head":
        headers.update({f"X-Pad-{i}": "y" * 1000 for i in range(60)})
    r = await client.post(url, content=content, headers=headers)
    if r.status_code == 429 and expected == 400:  # a full line answers before the body is read
        return "ok:429 queue full"
    if r.status_code != expected:
        return f"unexpected {r.status_code} for {kind} (want {expected}): {r.text[:120]}"
    err = r.json().get("error", {})
    if set(err) != {"message", "type", "param", "code"}:
        return f"unexpected error shape for {kind}: {r.text[:120]}"
    return f"ok:{expected} {kind}"


async def soak(args: argparse.Namespace, port: int, pid: int) -> dict:
    rng = random.Random(args.seed)
    mix = {k: w for k, w in KINDS.items() if not args.kinds or k in args.kinds}
    outcomes: collections.Counter[str] = collections.Counter()
    rss: dict[str, float] = {"start": rss_mb(pid)}
    samples: list[tuple[float, float]] = []  # (seconds, RSS MB) every 30 s
    done = 0
    t_start = time.monotonic()

    def kinds() -> Iterator[str]:
        """The requests to send: `--requests` of them, or as many as `--minutes` allow."""
        n = 0
        while time.monotonic() - t_start < args.minutes * 60 if args.minutes else n < args.requests:
            n += 1
            yield rng.choices(list(mix), weights=list(mix.values()))[0]

    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits
    ) as client:
        todo = kinds()

        async def worker() -> None:
            nonlocal done
            for kind in todo:
                try:
                    outcome = await one(client, kind, rng, args.prompts)
                except Exception as e:  # a transport error nobody asked for
                    outcome = f"unexpected {type(e).__name__}: {e}"
                outcomes[outcome.split(":")[0] + ":" + outcome.split(":", 1)[1][:60]
                         if outcome.startswith("ok:") else outcome[:160]] += 1  # fmt: skip
                done += 1
                if done >= args.warmup and "warm-up" not in rss:
                    rss["warm-up"] = rss_mb(pid)
                elapsed = time.monotonic() - t_start
                half = elapsed >= args.minutes * 30 if args.minutes else done >= args.requests // 2
                if half and "middle" not in rss:
                    rss["middle"] = rss_mb(pid)
                if not samples or elapsed - samples[-1][0] >= 30:
                    samples.append((elapsed, rss_mb(pid)))
                if "429" in outcome:
                    await asyncio.sleep(0.1)  # as a client does: back off, then go on

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - t0
        await asyncio.sleep(1.0)  # let the last cancelled generations stop
        health = (await client.get("/health")).json()
    rss["end"] = rss_mb(pid)
    return {"outcomes": outcomes, "rss_mb": rss, "seconds": elapsed, "health": health,
            "requests": done, "rss_every_30s": samples}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=0, help="run this long instead of --requests")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=2)
    p.add_argument("--warmup", type=int, default=100, help="requests before the RSS baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompt-cache-mb",
        type=int,
        default=8,
        help="the server's prompt cache budget (default 8: full within the warm-up, so RSS "
        "growth after it is not the cache filling up; the server's own default is 1024)",
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=0,
        help="draw the texts from this many fixed ones, so that most greedy answers repeat an "
        "earlier request and are compared (default 0: six random words each time, of 15,625)",
    )
    p.add_argument("--kinds", nargs="*", choices=list(KINDS), help="only these kinds of request")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        verifier, draft = write_pair(Path(tmp))
        port = free_port()
        proc = start_server(verifier, draft, port, args)
        try:
            result = asyncio.run(soak(args, port, proc.pid))
        finally:
            proc.terminate()
            proc.wait(30)
    outcomes = result["outcomes"]
    unexpected = sum(n for k, n in outcomes.items() if not k.startswith("ok:"))
    rss = result["rss_mb"]
    drift = (rss["end"] - rss["warm-up"]) / rss["warm-up"]
    print(f"{result['requests']} requests, {args.concurrency} clients, --max-queue "
          f"{args.max_queue}, {result['seconds']:.1f} s")  # fmt: skip
    for k, n in sorted(outcomes.items(), key=lambda kv: (not kv[0].startswith("ok:"), kv[0])):
        print(f"  {n:5d}  {k}")
    print(f"unexpected: {unexpected}")
    compared = ", ".join(f"{k} {n}" for k, n in sorted(COMPARED.items())) or "none"
    print(f"greedy answers compared with an earlier answer to the same request: {compared}")
    print("server RSS (MB): " + ", ".join(f"{k} {v:.1f}" for k, v in rss.items()))
    print(f"RSS end vs warm-up: {drift:+.1%}; health after: {result['health']}")
    trace = ", ".join(f"{t / 60:.1f} min {v:.1f}" for t, v in result["rss_every_30s"])
    print(f"RSS every 30 s (MB): {trace}")
    if args.json:
        result.update(unexpected=unexpected, compared=dict(COMPARED))
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if unexpected == 0 and abs(drift) <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())

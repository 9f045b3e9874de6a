"""Server overhead: tokens/s through the streamed HTTP API vs direct `Generator.stream` calls.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/server_overhead.py --model smollm2-135m-instruct --runs 5

The server runs as `ondevice serve` in a subprocess (the same command users run, same LD_PRELOAD),
the direct calls run in this process on the same model; the two are interleaved run by run so
machine load affects both alike. Both are timed end to end (prompt processing included) with the
same greedy request, so both produce the same tokens. The HTTP side reads the SSE stream with
httpx and parses only the final usage chunk, so the client costs as little as possible.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPT = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ondevice", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--name", "bench", "--log-level", "warning"]
    if args.draft:
        cmd += ["--draft", args.draft, "--draft-backend", args.draft_backend]
    return wait_until_healthy(subprocess.Popen(cmd), port, 300)


def wait_until_healthy(proc: subprocess.Popen, port: int, timeout: float) -> subprocess.Popen:
    """`proc` once its /health answers 200 on loopback `port`; exits if it dies or is late."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start within {timeout:.0f} s")


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) a process has used, from /proc (Linux only)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_direct(gen, options: dict) -> tuple[int, float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for chunk in gen.stream(PROMPT, **options):
        n += len(chunk.tokens)
    return n, time.perf_counter() - t0, time.process_time() - c0


def run_http(url: str, options: dict, pid: int) -> tuple[int, float, float | None]:
    body = {"model": "bench", "messages": PROMPT, "stream": True}
    body["stream_options"] = {"include_usage": True}
    body |= {k: v for k, v in options.items() if k in ("max_tokens", "temperature", "speculative")}
    last = ""
    c0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = line
    elapsed = time.perf_counter() - t0
    c1 = cpu_seconds(pid)
    cpu = c1 - c0 if c0 is not None and c1 is not None else None
    return json.loads(last[6:])["usage"]["completion_tokens"], elapsed, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft")
    ap.add_argument("--draft-backend", default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    import ondevice
    from ondevice.apps.serve import warm_up

    gen = ondevice.load(args.model, draft=args.draft, draft_backend=args.draft_backend)
    warm_up(gen)
    options = {"max_tokens": args.tokens, "temperature": 0.0, "speculative": bool(args.draft)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    try:
        run_direct(gen, options)  # warm-up of both paths, not timed
        run_http(url, options, proc.pid)
        direct, http, direct_cpu, http_cpu = [], [], [], []
        for i in range(args.runs):
            n_d, t_d, c_d = run_direct(gen, options)
            n_h, t_h, c_h = run_http(url, options, proc.pid)
            assert n_d == n_h, f"direct made {n_d} tokens, HTTP {n_h}: not the same greedy answer"
            direct.append(n_d / t_d)
            http.append(n_h / t_h)
            direct_cpu.append(n_d / c_d)
            line = f"run {i + 1}: {n_d} tokens; wall: direct {n_d / t_d:.1f} tok/s, "
            line += f"HTTP {n_h / t_h:.1f} tok/s; per CPU-second: direct {n_d / c_d:.1f}"
            if c_h:
                http_cpu.append(n_h / c_h)
                line += f", server {n_h / c_h:.1f}"
            print(line)
    finally:
        proc.terminate()
        proc.wait(30)
    # On a shared machine other jobs slow some runs a lot: the best run of each side is the
    # estimate least disturbed by them; the median is printed as well. Tokens per CPU-second
    # (this process for direct calls, the server process for HTTP) hardly depend on such load.
    rows = [("wall, best", max, direct, http), ("wall, median", statistics.median, direct, http)]
    if http_cpu:
        rows.append(("per CPU-second, median", statistics.median, direct_cpu, http_cpu))
    for name, pick, d_runs, h_runs in rows:
        d, h = pick(d_runs), pick(h_runs)
        print(f"{name}: direct {d:.1f} tok/s, streamed HTTP {h:.1f} tok/s, ratio {h / d:.3f}")
    print(f"preloaded: {os.environ.get('LD_PRELOAD', 'nothing')}")


if __name__ == "__main__":
    main()

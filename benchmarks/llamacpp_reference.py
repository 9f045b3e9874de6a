"""llama.cpp on the same GGUF files, as a reference point for this CPU (issue 26, item 6).

    python benchmarks/llamacpp_reference.py --bin LLAMA_CPP_BUILD/bin --verifier V.gguf \
        --draft D.gguf [--threads 2] [--tokens 96] [--n-max 3,8]

llama.cpp is not a dependency: build it from the llama-cpp-python source distribution on the
package index (its `vendor/llama.cpp`), for example
`pip download llama-cpp-python --no-deps --no-binary=:all:`, unpack, then
`cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF && cmake --build build --target llama-bench
llama-speculative-simple` (about 25 minutes at nice 19 on two busy cores).

Prints plain decoding speed of both models (`llama-bench`, text generation only) and greedy
speculative decoding of the verifier with the draft on the demo's prompt
(`llama-speculative-simple`, temperature 0), one line each.
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
from pathlib import Path

from ondevice.apps.demo import DEFAULT_PROMPT


def run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return out.stdout + out.stderr


def plain_speed(binary: Path, model: str, threads: int, tokens: int) -> str:
    text = run([str(binary / "llama-bench"), "-m", model, "-p", "0", "-n", str(tokens),
                "-t", str(threads), "-r", "3", "-o", "csv"])  # fmt: skip
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("build_commit,"))
    row = list(csv.DictReader(lines[start:]))[-1]
    return f"{float(row['avg_ts']):.2f} tok/s (sd {float(row['stddev_ts']):.2f})"


def speculative(binary: Path, verifier: str, draft: str, threads: int, tokens: int, n_max: int):
    text = run([str(binary / "llama-speculative-simple"), "-m", verifier, "-md", draft,
                "-p", DEFAULT_PROMPT, "-n", str(tokens), "--temp", "0", "-t", str(threads),
                "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max), "-s", "0"])  # fmt: skip
    speed = re.search(
        r"decoded\s+(\d+)\s+tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text
    )
    accept = re.search(r"accept\s*=\s*([\d.]+)%", text)
    if speed is None:
        raise SystemExit(f"could not read llama-speculative-simple's output:\n{text[-2000:]}")
    rate = f", acceptance {accept.group(1)}%" if accept else ""
    return f"{speed.group(3)} tok/s ({speed.group(1)} tokens in {speed.group(2)} s{rate})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, required=True, help="llama.cpp's build/bin folder")
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--n-max", default="3,8", help="draft lengths to try, comma-separated")
    a = ap.parse_args()
    print(f"verifier plain: {plain_speed(a.bin, a.verifier, a.threads, a.tokens)}", flush=True)
    print(f"draft plain:    {plain_speed(a.bin, a.draft, a.threads, a.tokens)}", flush=True)
    for n in (int(x) for x in a.n_max.split(",")):
        print(f"speculative n_max={n}: {speculative(a.bin, a.verifier, a.draft, a.threads, a.tokens, n)}",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

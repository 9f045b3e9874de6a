"""Streaming detokenization: cost per token as the answer grows, DecodeStream vs decoding the
whole answer again per token (the detokenizer before issue 17).

Uses the SmolLM2 tokenizer shipped with the package's default draft, on token ids of real text
repeated to length (ids of the package's built-in prompts). Prints microseconds per token at
each answer length; DecodeStream's cost stays flat, the old one grows with the length.

    .venv/bin/python benchmarks/detokenize.py [--lengths 100,500,1000,2000,4000,8000]
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

from ondevice.models.tokenizer import Tokenizer


class WholeDecode:
    """The previous detokenizer: decode everything so far, emit the new suffix."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.ids, self.text = tok, [], ""

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""
        new, self.text = text[len(self.text) :], text
        return new


def corpus_ids(tok: Tokenizer, n: int) -> list[int]:
    root = resources.files("ondevice.resources")
    lines = root.joinpath("prompts.jsonl").read_text().splitlines()
    text = "\n".join(t for line in lines if line.strip() for t in json.loads(line)["turns"])
    ids = tok.encode(text, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def per_token_us(make, ids: list[int], window: int = 100) -> float:
    """Mean microseconds per token over the last `window` tokens of an answer of len(ids)."""
    d = make()
    for i in ids[:-window]:
        d.add([i])
    t = time.perf_counter()
    for i in ids[-window:]:
        d.add([i])
    return (time.perf_counter() - t) / window * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="100,500,1000,2000,4000,8000")
    args = ap.parse_args()
    draft = resources.files("ondevice.resources").joinpath("draft")
    tok = Tokenizer.from_dir(str(draft))
    print(f"{'tokens':>7} {'DecodeStream us/token':>22} {'whole decode us/token':>22}")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = corpus_ids(tok, n)
        window = min(100, n)
        new = per_token_us(tok.detokenizer, ids, window)
        old = per_token_us(lambda: WholeDecode(tok), ids, window)
        print(f"{n:>7} {new:>22.1f} {old:>22.1f}")


if __name__ == "__main__":
    main()

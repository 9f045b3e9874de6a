"""Tree methods' speed over plain decoding as the cost profiles price their rounds, not the clock.

    python benchmarks/modelled_speedup.py MODEL [--draft D] --prompts spec_bench_dev.jsonl \
        [--per-category 1] [--categories coding,math] [--max-tokens 64] [--methods tree,auto] \
        [--warm-up] [--trace] [--out modelled.json]

Each round of a tree decoder (tree, auto, medusa, self, pld, lookahead) is charged what `auto`
itself estimates: the verifier's profiled pass over the round's tree plus the draft work the
proposers report (`DraftState.work`, switching excluded); plain decoding is one one-token pass a
token. The figures depend only on accepted counts and the cached profiles, so they repeat
exactly run after run (the clock moves one answer by up to 25% on a shared two-core machine)
and compare two versions of the code where a timed benchmark cannot. What they leave out is
what the profiles do not see (Python overhead, a pass slower than its profile).

Prompts are encoded as `ondevice bench` encodes them; methods run in turn per prompt in one
process, as there; without its warm-up, so auto starts the first prompt with nothing remembered
(a fresh process, as the demo's), unless `--warm-up` runs it as the bench does (every method a
few tokens on the first prompt, not counted; what auto remembers of it stays). `--trace`
prints every round: the proposer, the tree's size, the tokens it gave, what it expected
(`expected`, where it says) and auto's scores.
"""

from __future__ import annotations  # noqa: I001  (ondevice first: it opens the BLAS)

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import ondevice
from ondevice.decoders.tree import TreeDecoder
from ondevice.runtime.engines import tree_engine
from ondevice.runtime.pass_costs import CostProfile, load_profile
from ondevice.speedtest.prompts import read_prompts, select
from ondevice.speedtest.runner import WARMUP_TOKENS


def _drafts(proposer: Any) -> list[Any]:
    """The draft states whose work a round of `proposer` costs: auto's own list (collected at
    its reset), else the proposer's draft."""
    if hasattr(proposer, "drafts"):
        return list(proposer.drafts)
    state = getattr(proposer, "state", None)
    return [state] if hasattr(state, "switch_work") else []


def _work(proposer: Any) -> float:
    return sum(s.work - s.switch_work for s in _drafts(proposer))


class Rounds:
    """Records every tree decoder round in this process: (proposer, tree size, tokens, draft
    seconds); prints it where `trace`."""

    def __init__(self, verify: CostProfile, trace: bool):
        self.verify, self.trace = verify, trace
        self.log: list[tuple[str, int, int, float]] = []
        step = TreeDecoder.step

        def recorded(dec: TreeDecoder, seq: list[int], room: int) -> Any:
            before = _work(dec.proposer)
            out = step(dec, seq, room)
            work = _work(dec.proposer) - before
            p = dec.proposer
            name = getattr(p, "last_name", p.name)
            self.log.append((name, out.drafted + 1, len(out.tokens), work))
            if self.trace:
                chosen = p.proposers[p._current] if hasattr(p, "proposers") else p
                scores = [round(p.score(i), 2) for i in range(len(getattr(p, "proposers", [])))]
                # (a round with no room for a guess proposes nothing: no expectation)
                expected = getattr(chosen, "expected", None) if room > 1 else None
                print(
                    f"  {len(self.log):3d} {name:12s} size {out.drafted + 1:3d} "
                    f"got {len(out.tokens):2d} expected "
                    f"{'-' if expected is None else f'{expected:.2f}'} "
                    f"{self.seconds(self.log[-1]):.3f} s  scores {scores}"
                )
            return out

        TreeDecoder.step = recorded  # type: ignore[method-assign]

    def seconds(self, r: tuple[str, int, int, float]) -> float:
        return float(self.verify(r[1])) + r[3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a pair bundle, or a verifier (with --draft)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", required=True, help="Spec-Bench style JSONL")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--categories", default=None, help="comma-separated (default: all)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--methods", default="tree,auto", help="tree decoder methods, in run order")
    ap.add_argument("--warm-up", action="store_true", help="warm up as `ondevice bench` does")
    ap.add_argument("--trace", action="store_true", help="print every round")
    ap.add_argument("--out", type=Path, default=None, help="write per-prompt results (JSON)")
    args = ap.parse_args()

    gen = ondevice.load(args.model, args.draft)
    verify = load_profile(tree_engine(gen.verifier), measure_if_missing=False)
    if verify is None:
        raise SystemExit("no cost profile for the verifier: run `ondevice demo` or a bench first")
    rounds = Rounds(verify, args.trace)
    cats = args.categories.split(",") if args.categories else None
    prompts = select(read_prompts(args.prompts)[0], args.per_category, cats)
    methods = args.methods.split(",")
    one = float(verify(1))
    print(f"verifier pass: {[round(float(verify(n)), 3) for n in (1, 2, 4, 8, 16)]} s")
    results: dict[str, dict[str, Any]] = {m: {} for m in methods}
    if args.warm_up and prompts:
        ids = gen.encode_prompt(prompts[0].text)
        for m in methods:
            gen.generate(ids, max_tokens=WARMUP_TOKENS, method=m, chat_template=False)
    for p in prompts:
        ids = gen.encode_prompt(p.text)
        for m in methods:
            rounds.log.clear()
            r = gen.generate(ids, max_tokens=args.max_tokens, method=m, chat_template=False)
            if not rounds.log:
                raise SystemExit(f"method {m!r} does not run on the tree decoder")
            secs = sum(rounds.seconds(x) for x in rounds.log)
            n = len(r.tokens)
            by = dict(Counter(x[0] for x in rounds.log))
            results[m][p.question_id] = {
                "category": p.category,
                "tokens": n,
                "rounds": len(rounds.log),
                "seconds": secs,
                "plain_seconds": n * one,
                "rounds_by_method": by,
                "text": r.text,
            }
            print(
                f"{p.category:15s} {p.question_id:>6s} {m:8s} {n * one / secs:6.3f}x "
                f"{n / len(rounds.log):5.2f} tokens a pass  {by}",
                flush=True,
            )
    for m in methods:
        rs = results[m].values()
        plain, secs = sum(x["plain_seconds"] for x in rs), sum(x["seconds"] for x in rs)
        tpp = sum(x["tokens"] for x in rs) / sum(x["rounds"] for x in rs)
        print(f"all {m:8s} {plain / secs:6.3f}x {tpp:5.2f} tokens a pass")
    differ = [q for q in results[methods[0]] if len({results[m][q]["text"] for m in methods}) > 1]
    print("outputs identical" if not differ else f"outputs differ: {differ}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""How many benchmark prompts a GGUF file's tokenizer splits differently before and after issue 24.

Before issue 24 every byte-level GGUF vocabulary got GPT-2's split; now the split follows the
file's `tokenizer.ggml.pre` (Qwen2's for the default pair). This script tokenizes each prompt's
first turn through the chat template, as the benchmarks send it, with both, and with
transformers' own Qwen2 tokenizer built from the same vocabulary and merges (its class carries
Qwen2's published split and normalizer), then prints how many prompts differ and by how many
tokens. Also times building the tokenizer and reading the header (own reader vs
`gguf.GGUFReader`) with peak memory, in separate processes.

With `--acceptance BUNDLE`, also decodes every prompt that tokenizes differently with the pair of
that bundle (MLX verifier and draft, greedy chain, `convert.acceptance.measure`), once from the
old split's ids and once from the new split's, and prints the acceptance of each: what the fix
changed in how often the draft agrees with the verifier.

    .venv/bin/python benchmarks/gguf_tokenizer.py --prompts PATH.jsonl [--gguf FILE] [--no-header]
        [--acceptance BUNDLE [--max-tokens 32] [--json OUT]]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from itertools import zip_longest
from pathlib import Path
from statistics import mean, median

from ondevice.models.gguf import read_header
from ondevice.models.gguf_tokenizer import tokenizer_from_metadata
from ondevice.models.tokenizer import transformers
from ondevice.sources.hub import resolve
from ondevice.speedtest.prompts import read_prompts

DEFAULT = "qwen2.5-coder-1.5b-instruct"


def _header_cost(reader: str, path: Path) -> dict[str, float]:
    """Seconds and peak RSS of reading the metadata (vocabulary and merges included), measured
    in a fresh process (imports outside the timing) so one reader's memory does not hide the
    other's."""
    code = f"""
import json, resource, time
import gguf
from ondevice.models.gguf import read_header
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = time.perf_counter()
if {reader!r} == "ondevice":
    meta = read_header({str(path)!r}).metadata
    n = len(meta["tokenizer.ggml.tokens"]) + len(meta["tokenizer.ggml.merges"])
else:
    r = gguf.GGUFReader({str(path)!r})
    n = sum(len(r.fields[k].contents()) for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
dt = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"s": dt, "peak_rss_mb": rss, "added_mb": rss - rss0, "n": n}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True, help="Spec-Bench style JSONL (turns)")
    ap.add_argument("--gguf", default=DEFAULT, help=f"GGUF file or cached name ({DEFAULT})")
    ap.add_argument("--no-header", action="store_true", help="skip timing the header readers")
    ap.add_argument("--acceptance", metavar="BUNDLE", help="decode the changed prompts with it")
    ap.add_argument("--max-tokens", type=int, default=32, help="per decoding (--acceptance)")
    ap.add_argument("--json", type=Path, help="write the acceptance rows here (--acceptance)")
    args = ap.parse_args()
    path = resolve(args.gguf)

    for reader in () if args.no_header else ("ondevice", "gguf.GGUFReader"):
        c = _header_cost(reader, path)
        print(
            f"header {reader:16s} {c['s']:6.2f} s  peak RSS {c['peak_rss_mb']:5.0f} MB "
            f"({c['added_mb']:+.0f} MB over the imports)"
        )

    meta = read_header(path).metadata
    print(f"{path.name}: tokenizer.ggml.model={meta.get('tokenizer.ggml.model')} "
          f"pre={meta.get('tokenizer.ggml.pre')}")  # fmt: skip
    t = time.perf_counter()
    new = tokenizer_from_metadata(meta, str(path))
    print(f"tokenizer built in {time.perf_counter() - t:.2f} s")
    old = tokenizer_from_metadata({**meta, "tokenizer.ggml.pre": "gpt-2"}, str(path))
    tokens = meta["tokenizer.ggml.tokens"]
    hf = transformers().Qwen2Tokenizer(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]],
    )
    specials = [t for t, ty in zip(tokens, meta["tokenizer.ggml.token_type"]) if ty == 3]
    hf.add_special_tokens({"additional_special_tokens": specials})

    prompts, _ = read_prompts(args.prompts)
    rows = []
    changed: list[tuple[str, list[int], list[int]]] = []
    for p in prompts:
        text = new.apply_chat_template([{"role": "user", "content": p.text}])
        a = old.encode(text, add_special_tokens=False)
        b = new.encode(text, add_special_tokens=False)
        c = hf.encode(text, add_special_tokens=False)
        rows.append((p.category, len(a), len(b), a != b, b == c, a == c))
        if a != b:
            changed.append((p.category, a, b))
    n = len(rows)
    differ = [r for r in rows if r[3]]
    print(f"prompts: {n}; tokenized differently before vs after: {len(differ)}")
    print(f"tokens, all prompts: before {sum(r[1] for r in rows)}, after {sum(r[2] for r in rows)}")
    if differ:
        change = [100 * (r[1] - r[2]) / r[2] for r in differ]
        print(
            f"  among those: before is longer by mean {mean(change):.1f}%, median "
            f"{median(change):.1f}%, max {max(change):.1f}%, min {min(change):.1f}% of the new length"
        )
    print(f"equal to transformers' Qwen2Tokenizer: after {sum(r[4] for r in rows)}/{n}, "
          f"before {sum(r[5] for r in rows)}/{n}")  # fmt: skip
    cats: dict[str, list[int]] = {}
    for cat, *_rest, diff, _b, _c in rows:
        cats.setdefault(cat, [0, 0])
        cats[cat][0] += 1
        cats[cat][1] += diff
    print(
        "per category (differ/prompts): " + ", ".join(f"{c} {d}/{k}" for c, (k, d) in cats.items())
    )
    print(
        f"peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )
    if args.acceptance:
        _acceptance(Path(args.acceptance), changed, args.max_tokens, args.json, new.eos_token_ids)


def _rate(domains: list[dict]) -> str:
    acc = sum(d["accepted"] for d in domains)
    rej = sum(d["rejected"] for d in domains)
    rounds = sum(d["rounds"] for d in domains)
    tokens = sum(d["tokens"] for d in domains)
    return f"acceptance {acc / max(acc + rej, 1):.3f} ({acc}/{acc + rej}), {tokens / rounds:.2f} tok/pass"


def _acceptance(
    bundle: Path,
    changed: list[tuple[str, list[int], list[int]]],
    max_tokens: int,
    out: Path | None,
    eos: set[int],
) -> None:
    """Greedy chain acceptance of the bundle's pair on each changed prompt, old ids vs new ids."""
    from ondevice.convert.acceptance import measure
    from ondevice.models import load_model

    verifier = load_model(bundle / "verifier").model
    draft = load_model(bundle / "draft" / "mlx").model
    # round-robin over categories, so that a run stopped early still covers each of them
    by_cat: dict[str, list] = {}
    for item in changed:
        by_cat.setdefault(item[0], []).append(item)
    changed = [x for group in zip_longest(*by_cat.values()) for x in group if x is not None]
    results = []
    for i, (cat, old_ids, new_ids) in enumerate(changed):
        row: dict = {"category": cat, "old_tokens": len(old_ids), "new_tokens": len(new_ids)}
        for split, ids in (("old", old_ids), ("new", new_ids)):
            rec = measure(verifier, draft, {cat: ids}, max_tokens, eos_token_ids=sorted(eos))
            row[split] = rec["domains"][cat]
        results.append(row)
        print(f"[{i + 1}/{len(changed)}] {cat}: old {_rate([row['old']])}; new {_rate([row['new']])}",
              flush=True)  # fmt: skip
        if out:
            out.write_text(json.dumps(results, indent=1))
    print(f"all {len(results)} changed prompts, {max_tokens} tokens each:")
    for split in ("old", "new"):
        print(f"  {split} split: {_rate([r[split] for r in results])}")
    for cat in sorted({r["category"] for r in results}):
        sel = [r for r in results if r["category"] == cat]
        print(f"  {cat} ({len(sel)}): old {_rate([r['old'] for r in sel])}; "
              f"new {_rate([r['new'] for r in sel])}")  # fmt: skip


if __name__ == "__main__":
    main()

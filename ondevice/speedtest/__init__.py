"""The speed test behind the `ondevice bench` command (`apps/bench.py`): speed, acceptance and
memory of every decoding method against plain decoding (and against peers such as mlx-lm) on
Spec-Bench-format prompts, measured interleaved in one run. (The top-level `benchmarks/` folder
holds the project's measurement scripts, which are not part of the package.)

    results = run_bench(gen, prompts, BenchOptions(max_tokens=128, peers=("mlx-lm",)))
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from ondevice.speedtest.peers import SPEC
from ondevice.speedtest.prompts import BenchPrompt, builtin_prompts_path, read_prompts, select
from ondevice.speedtest.report import (
    aggregate,
    machine_info,
    mismatches,
    per_prompt_speedups,
    table,
)
from ondevice.speedtest.runner import Bench, BenchOptions, draft_mlx_model, param_bytes

__all__ = [
    "BenchOptions",
    "BenchPrompt",
    "builtin_prompts_path",
    "read_prompts",
    "run_bench",
    "select",
    "table",
]


def _model_info(gen: Any) -> dict[str, Any]:
    v = {"name": gen.model_name, "param_bytes": param_bytes(gen.verifier.model)}
    info: dict[str, Any] = {"verifier": v, "draft": None, "draft_to_verifier_memory": None}
    draft = draft_mlx_model(gen)
    if gen.draft is not None:
        path = gen.loaded_draft.path if gen.loaded_draft is not None else None
        name = "draft" if path is None else path.name
        if path is not None and path.name == "mlx" and path.parent.name == "draft":
            name = f"{path.parent.parent.name} draft"  # the MLX twin inside a pair bundle
        d: dict[str, Any] = {"name": name, "backend": gen.draft_backend}
        if draft is not None:
            d["param_bytes"] = param_bytes(draft)
            info["draft_to_verifier_memory"] = d["param_bytes"] / v["param_bytes"]
        info["draft"] = d
    return info


def run_bench(
    gen: Any,
    prompts: Sequence[BenchPrompt],
    options: BenchOptions,
    settings: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure every run on every prompt and return the results document (JSON-ready)."""
    bench = Bench(gen, options)
    encoded, skipped = _encode(gen, prompts, options.max_tokens)
    if options.warmup:
        bench.warm_up(encoded[0][1])
    t0 = time.perf_counter()
    records = _measure(bench, encoded, progress)
    per_prompt_speedups(records)
    results: dict[str, Any] = {
        "ondevice_bench_format": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_seconds": time.perf_counter() - t0,
        "machine": machine_info(),
        "models": _model_info(gen),
        "settings": {
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "seed": options.seed,
            "methods": bench.runs,
            "num_draft_tokens": options.num_draft_tokens,
            "peers": list(options.peers),
            "timing": "tokens_per_second = tokens after the first verifier pass / time from "
            "that pass to the last token (prefill excluded); speedup = that rate over plain "
            "decoding's on the same prompts, run interleaved"
            + (
                f"; each run {options.repeats} times in alternating order, its record the "
                "repeat with the median decode time"
                if options.repeats > 1
                else ""
            ),
            "repeats": options.repeats,
            **(settings or {}),
        },
        "prompts": {
            "count": len(encoded),
            "categories": sorted({p.category for p, _ in encoded}),
            "skipped": skipped,
        },
        "aggregates": aggregate(records, bench.runs),
        "records": records,
    }
    if bench.peer is not None:
        results["settings"]["peer_draft_tokens"] = list(options.peer_draft_tokens)
        results["settings"]["peer_weights"] = (
            "ondevice's loaded weights, saved with save_model and loaded by mlx_lm.utils.load_model"
        )
    bad = mismatches(records)
    results["mismatches"] = bad
    results["greedy_outputs_match"] = None if options.temperature > 0 else not bad
    _summary(results)
    return results


def _encode(
    gen: Any, prompts: Sequence[BenchPrompt], max_tokens: int
) -> tuple[list[tuple[BenchPrompt, list[int]]], list[dict[str, Any]]]:
    """The prompts' token ids, and the prompts skipped because they leave no room for the
    answer (they would only measure the error path)."""
    encoded, skipped = [], []
    for p in prompts:
        ids = gen.encode_prompt(p.text)
        if len(ids) + max_tokens >= gen.context_length:
            reason = f"{len(ids)} prompt tokens exceed the context"
            skipped.append({"question_id": p.question_id, "category": p.category, "reason": reason})
            continue
        encoded.append((p, ids))
    if not encoded:
        from ondevice.errors import OndeviceError

        raise OndeviceError("no prompt fits the model's context with --max-tokens; nothing to run.")
    return encoded, skipped


def _measure(
    bench: Bench, encoded: list[tuple[BenchPrompt, list[int]]], progress: bool
) -> list[dict]:
    """Every run on every prompt, under one progress bar; the records in order."""
    from tqdm import tqdm

    records: list[dict] = []
    with tqdm(
        total=len(encoded) * len(bench.runs) * bench.repeats,
        desc="bench",
        unit="run",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        for p, ids in encoded:

            def tick(method: str, p: BenchPrompt = p) -> None:
                bar.set_postfix_str(f"{p.category}/{p.question_id} {method}")

            recs = bench.run_prompt(p, ids, tick)
            bar.update(len(recs) * bench.repeats)
            records.extend(recs)
    return records


def _summary(results: dict[str, Any]) -> None:
    agg = results["aggregates"]

    def tps(m: str) -> float | None:
        return agg.get(m, {}).get("all", {}).get("tokens_per_second")

    s: dict[str, Any] = {m: agg[m]["all"].get("speedup") for m in agg if "all" in agg[m]}
    summary: dict[str, Any] = {"speedup_over_plain": s}
    if tps("chain") and tps("mlx-lm-spec"):
        summary["chain_over_mlx_lm_spec"] = tps("chain") / tps("mlx-lm-spec")
    if tps("mlx-lm-spec") and tps("mlx-lm"):
        summary["mlx_lm_spec_over_mlx_lm_plain"] = tps("mlx-lm-spec") / tps("mlx-lm")
    # mlx-lm's speculative decoding at its best fixed K, and each ondevice method against it
    spec = {m: tps(m) for m in agg if m.startswith(SPEC) and tps(m)}
    if spec:
        best = max(spec, key=lambda m: spec[m])
        summary["mlx_lm_spec_best"] = best
        summary["over_mlx_lm_spec_best"] = {
            m: tps(m) / spec[best]
            for m in agg
            if not m.startswith("mlx-lm") and m != "plain" and tps(m)
        }
    results["summary"] = summary

"""The float16 range probe: how close each op of a converted draft comes to float16's 65,504.

The converter runs it on real prompts before it writes a package (`convert_draft` refuses one
whose ops exceed its limit): the reference executor, probing, records the largest magnitude of
every op's outputs and intermediates (squares, sums), which is what the device's float16 must
hold for these inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ondevice.runtime.mil.interpreter import ReferenceModel
from ondevice.runtime.mil.numerics import F16, F32
from ondevice.runtime.mil.package import read_description


@dataclass(frozen=True)
class RangeReport:
    """Largest magnitudes per op over a probe run, largest first."""

    peaks: list[tuple[str, str, float]]  # (op name, op type, largest magnitude)
    tokens: int  # tokens the probe fed

    @property
    def peak(self) -> float:
        return self.peaks[0][2] if self.peaks else 0.0

    def over(self, limit: float) -> list[tuple[str, str, float]]:
        return [p for p in self.peaks if not p[2] <= limit]  # NaN and inf count as over

    def describe(self, n: int = 5) -> str:
        return ", ".join(
            f"{name} ({op_type}) {value:,.0f}" for name, op_type, value in self.peaks[:n]
        )


def probe_float16_range(
    path: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    decode_steps: int = 8,
    accumulate: str = "float32",
) -> RangeReport:
    """Run a converted draft on `prompts` (token ids: prefill through `chunk`, then
    `decode_steps` greedy steps through `decode`) and report each op's largest magnitude,
    intermediates included: what the device's float16 must hold for these inputs."""
    meta = read_description(path)
    models = ReferenceModel.load_functions(
        path, ["decode", "chunk"], accumulate=accumulate, probe=True
    )
    fed = sum(_run_prompt(models, meta, prompt, decode_steps) for prompt in prompts)
    return RangeReport(peaks=_peaks(models), tokens=fed)


def _run_prompt(
    models: dict[str, ReferenceModel], meta: dict, prompt: Sequence[int], decode_steps: int
) -> int:
    """Prefill `prompt` through `chunk` (the rest through `decode`), then `decode_steps` greedy
    steps through `decode`, from an empty cache; return the number of positions fed."""
    chunk, context = int(meta["chunk"]), int(meta["context"])
    shape = tuple(meta["kv_cache"]["shape"])
    ids = [int(t) for t in prompt][: max(1, context - decode_steps)]
    state = models["decode"].make_state() if meta["kv"] == "state" else None
    caches = {"key_cache": np.zeros(shape, F16), "value_cache": np.zeros(shape, F16)}
    call = partial(_last_logits, models, meta["logits"], state=state, caches=caches)
    pos = 0
    while len(ids) - pos >= chunk:
        logits = call("chunk", ids[pos : pos + chunk], pos)
        pos += chunk
    while pos < len(ids):
        logits = call("decode", ids[pos : pos + 1], pos)
        pos += 1
    for _ in range(min(decode_steps, context - pos)):
        logits = call("decode", [int(np.argmax(logits))], pos)
        pos += 1
    return pos


def _last_logits(
    models: dict[str, ReferenceModel],
    names: Sequence[str],
    function: str,
    tokens: list[int],
    pos: int,
    *,
    state: Any,
    caches: dict[str, np.ndarray],
) -> np.ndarray:
    """One call of `function` on `tokens` at `pos`: the last position's logits. Without a state
    (kv="io") the caches are inputs and the call's new rows are stored into them."""
    inputs: dict[str, Any] = {
        "input_ids": np.array([tokens], np.int32),
        "position": np.array([pos], np.int32),
    }
    if state is None:
        inputs.update(caches)
    out = models[function].predict(inputs, state)
    if state is None:
        end = pos + len(tokens)
        caches["key_cache"][:, :, pos:end] = out["new_keys"]
        caches["value_cache"][:, :, pos:end] = out["new_values"]
    return np.concatenate([np.asarray(out[n], F32)[0, -1] for n in names])


def _peaks(models: dict[str, ReferenceModel]) -> list[tuple[str, str, float]]:
    """Every op's largest magnitude over all functions, largest first (NaN, then inf, first)."""
    merged: dict[str, tuple[str, float]] = {}
    for model in models.values():
        assert model.magnitudes is not None
        for name, (op_type, value) in model.magnitudes.items():
            if name not in merged or not value <= merged[name][1]:
                merged[name] = (op_type, value)
    return sorted(
        ((n, t, v) for n, (t, v) in merged.items()),
        key=lambda p: -np.inf if np.isnan(p[2]) else -p[2],  # NaN first, then inf, then values
    )

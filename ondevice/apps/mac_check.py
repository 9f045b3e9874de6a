"""`ondevice doctor --mac-check`: what only a Mac can answer, measured once, in one JSON file.

For the default pair's draft (or `--draft`) it converts the draft with each compression and, per
package: its size and conversion time, the Neural Engine lint, whether Core ML compiles and
starts it (in a child process, as every load does: `coreml_probe`), where Core ML plans each
function's cost (`coreml_plan.compute_plan`), and the cost of a draft step on the Neural Engine. Beside
those: a draft step of the same draft in MLX on the GPU, and the verifier's passes over 1-8 tokens.
A maintainer reads the file; nothing here changes how ondevice runs.

Off macOS (or without Core ML) the Core ML parts record why they were skipped, so the rest of the
check runs anywhere.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEP_SIZES = (1,)
VERIFY_SIZES = (1, 2, 4, 8)


def _profile(engine: Any, sizes: tuple[int, ...], context: int) -> dict[str, float]:
    """Milliseconds of a pass over n new tokens after `context` tokens, for each n."""
    from ondevice.runtime.pass_costs import measure

    prof = measure(engine, sizes, context=context, repeats=5, budget_s=20.0)
    return {str(n): round(1000 * s, 3) for n, s in zip(prof.sizes, prof.seconds, strict=True)}


def check_package(package: Path, context: int) -> dict[str, Any]:
    """Lint, Core ML start and plan, and a Neural Engine draft step of one converted package."""
    from ondevice.convert import lint
    from ondevice.errors import OndeviceError
    from ondevice.runtime import coreml_plan
    from ondevice.runtime.coreml_engines import CoreMLDraftEngine, coreml_status
    from ondevice.runtime.coreml_probe import verdict

    findings = lint.check_mlpackage(package)
    out: dict[str, Any] = {
        "lint_errors": [str(f) for f in findings if f.severity == "error"],
        "lint_warnings": len([f for f in findings if f.severity == "warning"]),
    }
    reason = coreml_status()
    if reason is None:
        reason = verdict(package)
    if reason is not None:
        out["coreml"] = {"starts": False, "reason": reason}
        return out
    out["coreml"] = {"starts": True}
    try:
        plan = coreml_plan.compute_plan(package)
        out["coreml"]["neural_engine_share"] = {
            fn: round(p.share("NeuralEngine"), 3) for fn, p in plan.items()
        }
        out["coreml"]["plan"] = {fn: str(p) for fn, p in plan.items()}
    except Exception as e:  # the plan is information; its absence is recorded
        out["coreml"]["plan_error"] = f"{type(e).__name__}: {e}"
    try:
        t = time.perf_counter()
        engine = CoreMLDraftEngine(package)
        out["coreml"]["load_seconds"] = round(time.perf_counter() - t, 3)
        out["coreml"]["step_ms"] = _profile(engine, STEP_SIZES, context)
    except OndeviceError as e:
        out["coreml"].update(starts=False, reason=str(e))
    return out


def run_check(
    verifier: str,
    draft: str,
    compressions: list[str],
    *,
    context: int = 512,
    measure_context: int = 128,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """The whole check (see the module docstring) as one JSON-ready dict."""
    import coremltools

    from ondevice.apps import doctor
    from ondevice.convert.cli import draft_numpy_weights
    from ondevice.convert.coreml import convert_draft
    from ondevice.models import load_model
    from ondevice.runtime.engines import MLXEngine

    machine = doctor.collect()
    report: dict[str, Any] = {
        "format": 1,
        "time": time.time(),
        "machine": {
            "platform": machine["platform"],
            "python": machine["python"]["version"],
            "mlx": machine["mlx"],
            "coremltools": coremltools.__version__,
            "macos": platform.mac_ver()[0] or None,
            "coreml_reason": machine["coreml"]["reason"],
        },
        "verifier": str(verifier),
        "draft": str(draft),
        "packages": {},
    }
    d = load_model(draft, dequantize=True)
    weights = draft_numpy_weights(d.model)
    with tempfile.TemporaryDirectory(prefix="ondevice-mac-check-", dir=workdir) as tmp:
        for compress in compressions:
            package = Path(tmp) / f"draft-{compress}.mlpackage"
            entry: dict[str, Any] = {}
            t = time.perf_counter()
            try:
                desc = convert_draft(d.config, weights, package, context=context, compress=compress)
            except Exception as e:  # one compression failing must not end the check
                entry["convert_error"] = f"{type(e).__name__}: {e}"
            else:
                entry["convert_seconds"] = round(time.perf_counter() - t, 3)
                entry["size_bytes"] = int(desc["size_bytes"])
                entry.update(check_package(package, measure_context))
            report["packages"][compress] = entry
            print(f"ondevice: mac-check: {compress} done", file=sys.stderr, flush=True)
    del weights
    mlx_draft = load_model(draft)
    report["mlx_draft_step_ms"] = _profile(MLXEngine(mlx_draft.model), STEP_SIZES, measure_context)
    del mlx_draft
    v = load_model(verifier)
    report["verifier_pass_ms"] = _profile(MLXEngine(v.model), VERIFY_SIZES, measure_context)
    return report


def main(args: Any) -> int:
    """`ondevice doctor --mac-check`: run the check and write its JSON to `args.out`."""
    from ondevice.convert.coreml import COMPRESSIONS
    from ondevice.errors import OndeviceError
    from ondevice.sources.catalog import load_catalog

    verifier, draft = args.model, args.draft
    if verifier is None or draft is None:  # the default pair's models (fetched if missing)
        pair = load_catalog().pair()
        verifier = verifier or pair.verifier
        draft = draft or str(pair.draft_model or pair.draft)
    compressions = args.compressions.split(",") if args.compressions else list(COMPRESSIONS)
    unknown = [c for c in compressions if c not in COMPRESSIONS]
    if unknown:
        raise OndeviceError(
            f"unknown compression {unknown[0]!r}; choose from {', '.join(COMPRESSIONS)}."
        )
    report = run_check(verifier, draft, compressions)
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=1))
    print(f"ondevice: mac-check written to {out}", file=sys.stderr)
    return 0

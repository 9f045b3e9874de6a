"""`ondevice-convert --check BUNDLE`: is the bundle intact, and does its draft suit the ANE?

Checks, in order: the manifest (format version), every file's size and sha256, the draft's ops per
function, the Neural Engine lint findings and, on macOS, where Core ML plans to run each op.
Every problem is printed (not just the first); the exit code is 1 if any is an error.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

from ondevice.errors import OndeviceError
from ondevice.models.bundle import open_bundle, read_manifest, verify_files


def _print(text: str = "") -> None:
    print(text, flush=True)


def _ops_summary(ops: Any) -> str:
    """`ops` as `name xN` pairs, whatever collection the lint module hands back."""
    if isinstance(ops, dict):
        counts = Counter({str(k): int(v) for k, v in ops.items()})
    else:
        counts = Counter(str(o) for o in ops)
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in sorted(counts.items()))


def _check_files(root: Path, manifest: dict[str, Any]) -> int:
    problems = verify_files(root, manifest)  # unlisted files included: the loaders read them
    n = len(manifest["files"])
    if problems:
        _print(f"files: {len(problems)} of {n} damaged")
        for p in problems:
            _print(f"  ERROR {p}")
    else:
        _print(f"files: all {n} match their sha256 and size")
    return len(problems)


def _check_draft(mlpackage: Path) -> int:
    """Ops, lint findings and (macOS) the compute plan of the Core ML draft; returns errors."""
    from ondevice.convert import lint
    from ondevice.runtime import coreml_plan

    errors = 0
    try:
        ops = lint.list_ops(mlpackage)
    except Exception as e:  # a damaged package fails inside coremltools in many ways
        _print(f"  ERROR cannot read {mlpackage.name}: {type(e).__name__}: {e}")
        return 1
    if isinstance(ops, dict):
        for fn, fn_ops in ops.items():
            _print(f"  function {fn}: {_ops_summary(fn_ops)}")
    else:
        _print(f"  ops: {_ops_summary(ops)}")

    try:
        findings = lint.check_mlpackage(mlpackage)
    except Exception as e:
        _print(f"  ERROR lint failed on {mlpackage.name}: {type(e).__name__}: {e}")
        return 1
    if not findings:
        _print("  Neural Engine lint: no findings")
    for f in findings:
        severity = str(getattr(f, "severity", "error")).lower()
        errors += severity == "error"
        where = " ".join(filter(None, (getattr(f, "function", None), getattr(f, "op", None))))
        where = f" [{where}]" if where else ""
        _print(f"  {severity.upper()}{where} {getattr(f, 'message', f)}")

    if sys.platform == "darwin":
        try:
            plan = coreml_plan.compute_plan(mlpackage)
        except Exception as e:
            _print(f"  warning: no compute plan ({type(e).__name__}: {e})")
        else:
            _print("  compute plan (MLComputePlan, one per function):")
            for line in _plan_lines(plan):
                _print(f"    {line}")
            for warning in coreml_plan.off_neural_engine(plan):
                _print(f"  warning: {warning}")
    else:
        _print("  compute plan: needs macOS (MLComputePlan); skipped")
    return errors


def _plan_lines(plan: Any) -> list[str]:
    if isinstance(plan, str):
        return plan.splitlines()
    if isinstance(plan, dict):
        return [f"{k}: {v}" for k, v in plan.items()]
    return [str(p) for p in plan]


def _check_tokenizer(manifest: dict[str, Any], verifier_dir: Path) -> int:
    """Whether the verifier's tokenizer was built from a GGUF file the old way (GPT-2's split
    for every vocabulary): a warning when loading repairs it, an error when it cannot."""
    from tokenizers import Tokenizer as HFTokenizer

    from ondevice.models.gguf_tokenizer import stale_bundle_tokenizer

    try:
        tok = HFTokenizer.from_file(str(verifier_dir / "tokenizer.json"))
        stale = stale_bundle_tokenizer(manifest, tok)
    except Exception as e:  # a damaged tokenizer.json; the file check names it too
        _print(f"tokenizer: ERROR cannot read it ({type(e).__name__}: {e})")
        return 1
    if stale is None:
        _print("tokenizer: current")
        return 0
    fixed, line = stale
    _print(f"tokenizer: {'warning (repaired on load)' if fixed else 'ERROR'} {line}")
    return 0 if fixed else 1


def run_check(path: Path) -> int:
    """Print a report on the bundle at `path`; 0 if it is intact and lint finds no errors."""
    root = Path(path).expanduser().resolve()
    manifest = read_manifest(root)  # raises BundleError: not a bundle, bad JSON, unknown version
    _print(
        f"bundle {root}: format {manifest['format_version']}, "
        f"{manifest.get('created_by', 'unknown converter')}, context {manifest['context_length']}"
    )
    errors = _check_files(root, manifest)
    try:
        bundle = open_bundle(root, verify=False)  # the files were checked in full above
    except OndeviceError as e:
        _print(f"  ERROR {e}")
        return 1
    errors += _check_tokenizer(bundle.manifest, bundle.verifier_dir)
    if bundle.mlpackage is None:
        _print("draft: no Core ML package in this bundle")
    else:
        _print(f"draft: {bundle.mlpackage.relative_to(root)}")
        errors += _check_draft(bundle.mlpackage)
    _print("OK" if not errors else f"FAILED: {errors} error(s)")
    return 1 if errors else 0

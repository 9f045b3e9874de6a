"""Where Core ML plans to run each function of a draft package (macOS only): the share of each
function's estimated cost per device, from coremltools' `MLComputePlan`, and the warning when most
of it is off the Neural Engine. Used by the converter, `--check`, the first-load probe and
`doctor --mac-check`."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ondevice.runtime.mil.package import load_program

# Ops that only produce constants (weights, decompressed weights): no runtime placement.
CONST_PREFIXES = ("const", "constexpr_")


@dataclass(frozen=True)
class FunctionPlan:
    """Where Core ML plans to run one function: ops and estimated cost share per device."""

    ops: dict[str, Counter]  # device -> op type counts
    cost: dict[str, float]  # device -> share of the function's estimated cost (sums to 1)

    def share(self, device: str) -> float:
        return self.cost.get(device, 0.0)

    def __str__(self) -> str:
        parts = []
        for device, counts in sorted(self.ops.items(), key=lambda kv: -sum(kv[1].values())):
            top = ", ".join(f"{t} x{k}" for t, k in counts.most_common(6))
            parts.append(
                f"{device} {sum(counts.values())} ops ({100 * self.share(device):.0f}% of cost: "
                f"{top})"
            )
        return "; ".join(parts)


NEURAL_ENGINE_MIN_SHARE = 0.5  # of a function's estimated cost, below which we warn


def off_neural_engine(plan: dict[str, FunctionPlan]) -> list[str]:
    """A warning for each function whose plan puts most of its cost off the Neural Engine."""
    return [
        f"{fn} plans only {100 * p.share('NeuralEngine'):.0f}% of its cost on the Neural Engine"
        for fn, p in plan.items()
        if p.share("NeuralEngine") < NEURAL_ENGINE_MIN_SHARE
    ]


def compute_plan(
    path: str | Path, *, load_plan: Callable[[Path], Any] | None = None
) -> dict[str, FunctionPlan]:
    """Where Core ML plans to run each function's ops (macOS only): one `FunctionPlan` per function.

    `MLComputePlan` plans only a model's default function (coremltools' `load_from_path` has no
    function argument; the other functions' ops come back without a device), so each function
    gets its own plan: a copy of the package whose default function is that one, compiled and
    planned with the compute units the draft engine uses (CPU and Neural Engine). `load_plan`
    (compiled-model path -> plan) replaces coremltools' for tests.
    """
    if load_plan is None:
        if sys.platform != "darwin":
            raise RuntimeError("MLComputePlan needs macOS.")
        load_plan = _load_compute_plan
    from coremltools.models.utils import compile_model

    names = sorted(load_program(Path(path))[1].functions)
    plans: dict[str, FunctionPlan] = {}
    with tempfile.TemporaryDirectory(prefix="ondevice-plan-") as tmp:
        for fname in names:
            package = _with_default_function(Path(path), fname, Path(tmp) / f"{fname}.mlpackage")
            compiled = Path(compile_model(str(package), str(Path(tmp) / f"{fname}.mlmodelc")))
            plans[fname] = _placement(load_plan(compiled), fname)
            shutil.rmtree(package, ignore_errors=True)
    return plans


def _load_compute_plan(compiled: Path) -> Any:
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    return MLComputePlan.load_from_path(str(compiled), compute_units=ct.ComputeUnit.CPU_AND_NE)


def _with_default_function(package: Path, function: str, out: Path) -> Path:
    """A copy of `package` whose default function is `function` (weights copied as they are)."""
    from coremltools.models.utils import _try_get_weights_dir_path, load_spec, save_spec

    spec = load_spec(str(package))
    spec.description.defaultFunctionName = function
    save_spec(spec, str(out), weights_dir=_try_get_weights_dir_path(str(package)))
    return out


def _placement(plan: Any, function: str) -> FunctionPlan:
    program = plan.model_structure.program
    if program is None:
        raise RuntimeError("not an ML Program.")
    ops: dict[str, Counter] = {}
    cost: Counter = Counter()
    for op in program.functions[function].block.operations:
        if op.operator_name.startswith(CONST_PREFIXES):
            continue
        usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
        device = "unknown" if usage is None else _device_name(usage.preferred_compute_device)
        ops.setdefault(device, Counter())[op.operator_name] += 1
        estimate = plan.get_estimated_cost_for_mlprogram_operation(op)
        if estimate is not None:
            cost[device] += estimate.weight
    total = sum(cost.values())
    return FunctionPlan(ops=ops, cost={d: c / total for d, c in cost.items()} if total else {})


def _device_name(device) -> str:
    name = type(device).__name__
    return {
        "MLNeuralEngineComputeDevice": "NeuralEngine",
        "MLCPUComputeDevice": "CPU",
        "MLGPUComputeDevice": "GPU",
    }.get(name, name)

"""Neural Engine lint for a saved ML Program: what would keep (part of) it off the ANE.

Rules, from Apple's ml-ane-transformers article ("Deploying Transformers on the Apple Neural
Engine") and ANEMLL's conversion notes:

* error: a dynamic (symbolic) shape anywhere: the ANE compiles fixed shapes only;
* error: a tensor dimension above 16384 (the ANE's limit; ANEMLL splits LM heads for it), except
  a constant table read only by `gather` (an embedding lookup, which runs on the CPU anyway: the
  ml-ane-transformers README reports exactly those ops on the CPU);
* error: a floating-point tensor that is not float16: the ANE computes in float16, so float32
  tensors send their ops to the CPU or GPU;
* warning: ops outside the list of ops known to run on the ANE; integer index arithmetic on a
  handful of values (position offsets) is reported once per function, as it is expected on the
  CPU and costs microseconds.

`list_ops(path)` counts op types per function; `compute_plan(path)` (macOS only) asks Core ML's
`MLComputePlan` where each op will actually run.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MAX_DIM = 16384
SMALL_INDEX_TENSOR = 64  # integer tensors up to this size are position/index bookkeeping

# Ops that Core ML runs on the Neural Engine in float16 (the op set of ml-ane-transformers and
# ANEMLL models, whose Xcode performance reports show them on the ANE).
ANE_OPS = frozenset(
    {
        "conv",
        "linear",
        "matmul",
        "add",
        "sub",
        "mul",
        "real_div",
        "maximum",
        "minimum",
        "layer_norm",
        "softmax",
        "silu",
        "sigmoid",
        "relu",
        "tanh",
        "gelu",
        "exp",
        "rsqrt",
        "sqrt",
        "reshape",
        "transpose",
        "concat",
        "split",
        "slice_by_index",
        "slice_by_size",
        "slice_update",
        "expand_dims",
        "squeeze",
        "reduce_sum",
        "reduce_mean",
        "reduce_max",
        "read_state",
        "coreml_update_state",
    }
)
# Ops that only produce constants (weights, decompressed weights): no runtime placement.
CONST_PREFIXES = ("const", "constexpr_")


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" | "warning"
    function: str
    op: str  # op type (and name when it concerns one op)
    tensor: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.function}: {self.op}" + (f" [{self.tensor}]" if self.tensor else "")
        return f"{self.severity.upper()} {where}: {self.message}"


def _program(path: str | Path):
    from ondevice.convert.executor import _load_program

    return _load_program(Path(path))[1]


def list_ops(path: str | Path) -> dict[str, Counter]:
    """Op type counts of every function (constants excluded)."""
    prog = _program(path)
    return {
        name: Counter(op.op_type for op in func.operations if op.op_type != "const")
        for name, func in sorted(prog.functions.items())
    }


def _is_const_op(op) -> bool:
    return op.op_type.startswith(CONST_PREFIXES)


def _embedding_table(var) -> bool:
    """True for a constant read only as the table of `gather` ops, directly or through the
    `constexpr_*` ops that decompress it (then the compressed parts count as the table too)."""
    children = list(var.child_ops)
    return bool(children) and all(
        (c.op_type == "gather" and c.inputs.get("x") is var)
        or (c.op_type.startswith("constexpr_") and all(_embedding_table(o) for o in c.outputs))
        for c in children
    )


def check_mlpackage(path: str | Path) -> list[Finding]:
    """Constructs that keep ops of the package off the Neural Engine."""
    from coremltools.converters.mil.mil import types

    findings: list[Finding] = []
    prog = _program(path)
    for fname, func in sorted(prog.functions.items()):
        for name, var in func.inputs.items():
            sym = var.sym_type.wrapped_type() if types.is_state(var.sym_type) else var.sym_type
            shape = var.shape
            if any(not isinstance(d, int) for d in shape):
                findings.append(Finding("error", fname, "input", name, f"dynamic shape {shape}"))
            if types.is_tensor(sym) and sym.get_primitive() in (types.fp32, types.fp64):
                findings.append(
                    Finding("error", fname, "input", name, "float32 input; use float16")
                )
        index_ops: Counter = Counter()
        other_ops: Counter = Counter()
        for op in func.operations:
            const = _is_const_op(op)
            for var in op.outputs:
                if not types.is_tensor(var.sym_type):
                    continue
                shape = var.shape
                if any(not isinstance(d, int) for d in shape):
                    findings.append(
                        Finding("error", fname, op.op_type, var.name, f"dynamic shape {shape}")
                    )
                    continue
                big = [d for d in shape if d > MAX_DIM]
                if big:
                    if const and _embedding_table(var):
                        if not any(c.op_type == "gather" for c in var.child_ops):
                            continue  # a compressed part of the table: reported with the table
                        findings.append(
                            Finding(
                                "warning",
                                fname,
                                op.op_type,
                                var.name,
                                f"embedding table {tuple(shape)} exceeds {MAX_DIM}: the lookup "
                                "runs on the CPU (as in ml-ane-transformers)",
                            )
                        )
                    else:
                        findings.append(
                            Finding(
                                "error",
                                fname,
                                op.op_type,
                                var.name,
                                f"dimension {max(big)} exceeds the Neural Engine limit {MAX_DIM} "
                                f"(shape {tuple(shape)}); split it",
                            )
                        )
                if var.dtype in (types.fp32, types.fp64) and not const:
                    findings.append(
                        Finding(
                            "error",
                            fname,
                            op.op_type,
                            var.name,
                            "float32 tensor; the Neural Engine computes in float16",
                        )
                    )
            if const:
                continue
            if op.op_type in ANE_OPS and not _all_small_int(op, types):
                continue
            if _all_small_int(op, types):
                index_ops[op.op_type] += 1
            elif op.op_type == "gather":
                continue  # the embedding lookup, reported with its table
            else:
                other_ops[op.op_type] += 1
        for op_type, n in sorted(other_ops.items()):
            findings.append(
                Finding(
                    "warning",
                    fname,
                    op_type,
                    None,
                    f"{n} op(s) not in the Neural Engine op list; Core ML may run them elsewhere",
                )
            )
        if index_ops:
            summary = ", ".join(f"{t} x{n}" for t, n in sorted(index_ops.items()))
            findings.append(
                Finding(
                    "warning",
                    fname,
                    "index arithmetic",
                    None,
                    f"integer ops on a few values (position bookkeeping, expected on the CPU): "
                    f"{summary}",
                )
            )
    return findings


def _all_small_int(op, types) -> bool:
    """True if every output is a small integer/bool tensor (index bookkeeping)."""
    for var in op.outputs:
        if not types.is_tensor(var.sym_type):
            return False
        if not (types.is_int(var.dtype) or types.is_bool(var.dtype)):
            return False
        n = 1
        for d in var.shape:
            n *= d if isinstance(d, int) else SMALL_INDEX_TENSOR + 1
        if n > SMALL_INDEX_TENSOR:
            return False
    return True


def compute_plan(path: str | Path) -> dict[str, str]:
    """Where Core ML plans to run each function's ops (macOS only): device -> op count, cost share.

    Uses `coremltools.models.compute_plan.MLComputePlan` on the compiled model, with the compute
    units the draft engine uses (CPU and Neural Engine).
    """
    if sys.platform != "darwin":
        raise RuntimeError("MLComputePlan needs macOS.")
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    compiled = ct.models.MLModel(
        str(path), compute_units=ct.ComputeUnit.CPU_AND_NE
    ).get_compiled_path()
    plan = MLComputePlan.load_from_path(compiled, compute_units=ct.ComputeUnit.CPU_AND_NE)
    program = plan.model_structure.program
    if program is None:
        raise RuntimeError(f"{path} is not an ML Program.")
    lines: dict[str, str] = {}
    for fname, function in program.functions.items():
        count: Counter = Counter()
        cost: Counter = Counter()
        where: dict[str, Counter] = {}
        for op in function.block.operations:
            if op.operator_name.startswith(CONST_PREFIXES):
                continue
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            device = "unknown" if usage is None else _device_name(usage.preferred_compute_device)
            count[device] += 1
            where.setdefault(device, Counter())[op.operator_name] += 1
            estimate = plan.get_estimated_cost_for_mlprogram_operation(op)
            if estimate is not None:
                cost[device] += estimate.weight
        total = sum(cost.values()) or 1.0
        parts = []
        for device, n in count.most_common():
            ops = ", ".join(f"{t} x{k}" for t, k in where[device].most_common(6))
            parts.append(f"{device} {n} ops ({100 * cost[device] / total:.0f}% of cost: {ops})")
        lines[fname] = "; ".join(parts)
    return lines


def _device_name(device) -> str:
    name = type(device).__name__
    return {
        "MLNeuralEngineComputeDevice": "NeuralEngine",
        "MLCPUComputeDevice": "CPU",
        "MLGPUComputeDevice": "GPU",
    }.get(name, name)

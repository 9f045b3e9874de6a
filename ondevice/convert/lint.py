"""Neural Engine lint for a saved ML Program: what would keep (part of) it off the ANE.

`ondevice-convert` runs `check_mlpackage` on every draft it writes and refuses one with errors.
The rules, each with where it comes from:

* error: a dynamic (symbolic) shape anywhere: the ANE compiles fixed shapes only (Apple,
  "Deploying Transformers on the Apple Neural Engine", 2022; ANEMLL exports one fixed-shape
  function per sequence length);
* error: a tensor of rank above 4: the ANE's native layout is 4-D (B, C, H, W) (same article,
  principle 1; "ANE Empirical Laws", alvaro-videla.com/ane-book, law 1);
* error: a tensor dimension above 16384, constant tables and concat outputs included (the ANE
  validator rejects width/height above 16384: ane-guide.readthedocs.io, "Model-design rules";
  ANEMLL splits LM heads for it), except a constant table read only by `gather`, which is on the
  CPU allowlist below;
* error: a floating-point tensor that is not float16: the ANE datapath is float16 (same guide,
  "Dtype rule"), so float32 tensors send their ops to the CPU or GPU;
* error: a state whose last two dimensions are not multiples of 32 (the stateful KV-cache layout
  of Apple's "On Device Llama 3.1 with Core ML" and ANEMLL pads the sequence and head axes so);
* error: a function taking more than 32 tokens per call: longer chunks are outside what is
  reported to work for stateful LLM functions (github.com/Anemll/Anemll/issues/27);
* error: an op neither in ANE_OPS (ops that ml-ane-transformers and ANEMLL models run on the ANE,
  per their Xcode performance reports) nor on CPU_ALLOWLIST: the embedding lookup (the
  ml-ane-transformers README reports embedding lookups on the CPU): `gather` from a constant
  table, and `select` between rows gathered from the pieces of a tied embedding stored as the LM
  head's pieces; and integer arithmetic on a handful of position indices and token ids (reported
  once per function as a warning; it costs microseconds).

`list_ops(path)` counts op types per function; `compute_plan(path)` (macOS only) asks Core ML's
`MLComputePlan` where each function's ops will actually run, one plan per function.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ondevice.convert.layout import MAX_CHUNK, MAX_DIM, STATE_ALIGN
from ondevice.runtime.coreml_plan import CONST_PREFIXES

MAX_RANK = 4
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
# The explicit CPU allowlist: the embedding lookup (`_embedding_rows`), and these ops only on
# small integer tensors (position arithmetic; `cast`/`greater_equal`/`select` are coremltools'
# int16 gather-index guard; `reshape`/`maximum`/`minimum` clamp token ids into the pieces of a
# tied embedding).
CPU_INDEX_OPS = frozenset(
    {"add", "sub", "concat", "cast", "greater_equal", "select", "reshape", "maximum", "minimum"}
)


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
    from ondevice.runtime.mil.package import load_program

    return load_program(Path(path))[1]


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


def _embedding_rows(op) -> bool:
    """True for the embedding lookup: a `gather` from a constant table (its parts decompressed
    by `constexpr_*` ops or not, read by other ops too or not: a tied embedding's table is the
    LM head's pieces), or a `select` between such rows."""
    if op.op_type == "gather":
        table = op.inputs["x"].op
        return table is not None and _is_const_op(table)
    if op.op_type == "select":
        return all(
            v.op is not None and _embedding_rows(v.op) for v in (op.inputs["a"], op.inputs["b"])
        )
    return False


def check_mlpackage(path: str | Path) -> list[Finding]:
    """Constructs that keep ops of the package off the Neural Engine (rules: module docstring)."""
    from coremltools.converters.mil.mil import types

    findings: list[Finding] = []
    prog = _program(path)
    for fname, func in sorted(prog.functions.items()):
        findings += _check_inputs(fname, func, types)
        index_ops: Counter = Counter()
        other_ops: Counter = Counter()
        for op in func.operations:
            const = _is_const_op(op)
            for var in op.outputs:
                if types.is_tensor(var.sym_type):
                    findings += _check_tensor(fname, op, var, const, types)
            if const:
                continue
            small_int = _all_small_int(op, types)
            if op.op_type in ANE_OPS and not small_int:
                continue
            if small_int and op.op_type in CPU_INDEX_OPS:
                index_ops[op.op_type] += 1
            elif _embedding_rows(op):
                continue  # the embedding lookup, reported with its table
            else:
                other_ops[op.op_type] += 1
        for op_type, n in sorted(other_ops.items()):
            findings.append(
                Finding(
                    "error",
                    fname,
                    op_type,
                    None,
                    f"{n} op(s) neither in the Neural Engine op list nor on the CPU allowlist",
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


def _reporter(fname: str, op: str, tensor: str) -> Callable[[str, str], Finding]:
    """`report(severity, message)`: a finding about one tensor of one op of function `fname`."""
    return lambda severity, message: Finding(severity, fname, op, tensor, message)


def _check_inputs(fname: str, func, types) -> list[Finding]:
    found: list[Finding] = []
    for name, var in func.inputs.items():
        state = types.is_state(var.sym_type)
        sym = var.sym_type.wrapped_type() if state else var.sym_type
        shape = var.shape
        report = _reporter(fname, "input", name)
        if types.is_tensor(sym) and sym.get_primitive() in (types.fp32, types.fp64):
            found.append(report("error", "float32 input; use float16"))
        if any(not isinstance(d, int) for d in shape):
            found.append(report("error", f"dynamic shape {shape}"))
            continue
        if len(shape) > MAX_RANK:
            found.append(report("error", f"rank {len(shape)} > {MAX_RANK}"))
        if state and any(d % STATE_ALIGN for d in shape[-2:]):
            found.append(
                Finding(
                    "error",
                    fname,
                    "state",
                    name,
                    f"state shape {tuple(shape)}: its last two dimensions must be multiples "
                    f"of {STATE_ALIGN}",
                )
            )
        if name == "input_ids" and len(shape) == 2 and shape[-1] > MAX_CHUNK:
            found.append(
                report(
                    "error",
                    f"{shape[-1]} tokens per call; at most {MAX_CHUNK} are reported to work",
                )
            )
    return found


def _check_tensor(fname: str, op, var, const: bool, types) -> list[Finding]:
    shape = var.shape
    finding = _reporter(fname, op.op_type, var.name)
    if any(not isinstance(d, int) for d in shape):
        return [finding("error", f"dynamic shape {shape}")]
    found: list[Finding] = []
    table = const and _embedding_table(var)
    # Rank: compressed-weight parts (a palettized weight's rank-6 lookup table) are unpacked at
    # load time, so only tensors that flow at run time count.
    if len(shape) > MAX_RANK and not const:
        found.append(
            finding(
                "error",
                f"rank {len(shape)} tensor {tuple(shape)}; the Neural Engine takes rank <= "
                f"{MAX_RANK}",
            )
        )
    big = [d for d in shape if d > MAX_DIM]
    if big and table:
        if any(c.op_type == "gather" for c in var.child_ops):  # else a compressed part of it
            found.append(
                finding(
                    "warning",
                    f"embedding table {tuple(shape)} exceeds {MAX_DIM}: the lookup runs on the "
                    "CPU (as in ml-ane-transformers)",
                )
            )
    elif big:
        found.append(
            finding(
                "error",
                f"dimension {max(big)} exceeds the Neural Engine limit {MAX_DIM} "
                f"(shape {tuple(shape)}); split it",
            )
        )
    if var.dtype in (types.fp32, types.fp64) and not const:
        found.append(finding("error", "float32 tensor; the Neural Engine computes in float16"))
    return found


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

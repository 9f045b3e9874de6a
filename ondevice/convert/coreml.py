"""The draft model as a Core ML ML Program, built with coremltools' MIL builder from numpy weights.

No torch and no tracing: every op is written here with `coremltools.converters.mil.Builder`, so
the graph is exactly the one described below, and conversion runs on Linux (only prediction
needs macOS). The package holds two functions over the same weights and the same KV cache:

* `decode`: one token (the drafting loop), and
* `chunk`: `chunk` tokens at once (prefill, and catching up after the verifier accepted several
  tokens). A partly filled last chunk is padded; padding only writes cache slots beyond the last
  real token, which later calls overwrite before any query can see them.

Both take `input_ids` (int32, shape (1, L)) and `position` (int32, shape (1,): the position of
the first token) and return float16 logits for every input position, split into pieces
`logits_0 ... logits_{n-1}` of shape (1, L, V_i) that concatenate along the last axis.

Neural Engine rules followed, and where they come from:

* Fixed shapes everywhere (ANE compiles static shapes only; both ml-ane-transformers and ANEMLL
  export one fixed-shape model per sequence length). Prefill and decode are two functions of one
  multifunction program (iOS 18 / macOS 15); identical constants of the two functions get one
  `weight_id`, so the package stores every weight once, as `coremltools.utils.save_multifunction`
  would, without its save/reload/compare round trip (5x faster here).
* Hidden states in the (batch, channels, 1, sequence) "BC1S" layout and every projection a 1x1
  `conv` (ml-ane-transformers, principle 1 "picking the right data format"; ANEMLL uses Conv2d
  for q/k/v/MLP and the LM head).
* No dimension above 16384: the LM head is split along the vocabulary into equal 1x1 convs of at
  most 16384 outputs, each returned as its own output, as ANEMLL's `lm_head8_*` / `lm_head16_*`
  do (concatenating them in the model would recreate the oversized tensor). The embedding table
  is larger than that too; its `gather` runs on the CPU, as the ml-ane-transformers README notes
  for embedding lookups. A tied embedding (Qwen2.5's, SmolLM2's) is stored once, as the LM
  head's pieces: the lookup gathers from each piece and selects each position's row (the head's
  convs are unchanged), where a separate table would cost vocab x hidden x 2 bytes more, since
  `const_deduplication` merges only constants of one shape. No op transforms the shared
  constant (no slice, reshape or transpose that a compiler could fold into a second copy).
* RMSNorm without `pow`: ANEMLL's trick of normalising `concat([x, -x])` with `layer_norm` (the
  mean of that is exactly 0, so layer norm divides by the root mean square) and keeping the first
  half. `layer_norm` is a native ANE op. It squares its input inside, in float16 on the Neural
  Engine, and residual streams are large (the shipped SmolLM2 draft reaches ~1,470 before its
  final norm, Qwen2.5 ~2,180 from its third layer; 2,180^2 is 73x float16's 65,504), so each row
  is first divided by max(1, its largest magnitude): RMSNorm is invariant to that scale up to eps
  (whose weight grows by the scale^2, at most ~1e-3 relative for hidden sizes < 1,000 and eps
  1e-6), and the squares stay <= 1.
* RoPE from precomputed cos/sin tables (ANEMLL's `cos_cached` / `sin_cached`), sliced at the
  position with `slice_by_size`; the causal mask is also a slice of a precomputed table, so no
  comparison or `range` ops run per call. GGUF weights laid out for interleaved ("traditional")
  RoPE are permuted here to the half-split layout, which leaves q.k products unchanged.
* KV cache as two Core ML states, `key_cache` and `value_cache`, each (layers, kv_heads, S, d),
  S the context rounded up to a multiple of 32 and d the head dimension rounded up to a multiple
  of 32 (zero padded), following the stateful KV-cache pattern of Apple's "On Device Llama 3.1
  with Core ML" article and ANEMLL's unified cache. Each layer writes its new rows with
  `slice_update` + `coreml_update_state` and reads its slice back from that update's output,
  exactly the chain coremltools' torch frontend emits for in-place cache writes. (A second
  `read_state` of the same state is merged with the first by the default passes, so the graph
  never reads a state twice.) With kv="io" the caches are plain inputs instead and the function
  returns the new rows (`new_keys`, `new_values`, (layers, kv_heads, L, d)) for the caller to
  store: the fallback for systems where stateful models do not compile for the Neural Engine.
* The attention scale is folded into the query projection (or the qwen3 query norm), saving a
  multiply per layer; grouped-query attention is a reshape of the queries, not a repeat of K/V.

Weight compression (palettize4, palettize6, int8) is `ondevice.convert.compression`'s; the graph
is built by `ondevice.convert.graph` from the weights and dimensions of `ondevice.convert.layout`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ondevice.convert.compression import compress_weights
from ondevice.convert.graph import build_function, convert_program
from ondevice.convert.layout import (
    Dims,
    check_config,
    check_options,
    prepare_weights,
)
from ondevice.convert.probe import RangeReport, probe_float16_range
from ondevice.errors import ConversionError, OndeviceError
from ondevice.models.config import ModelConfig
from ondevice.runtime.memory import release
from ondevice.runtime.mil.numerics import FP16_MAX
from ondevice.runtime.mil.package import FORMAT_VERSION, METADATA_KEY

COMPRESSIONS = ("none", "palettize4", "palettize6", "int8")
KV_MODES = ("state", "io")
DEFAULT_CONTEXT, DEFAULT_CHUNK = 1024, 16  # tokens: the draft's context, and per chunk call
MIN_DEPLOYMENT = "macOS15"  # states and multifunction packages need macOS 15 / iOS 18
# The float16 range probe fails a conversion above a quarter of float16's range: headroom for
# prompts longer or stranger than the probe's.
RANGE_LIMIT = FP16_MAX / 4


# The graph is already float16 and fused the way we want it, so instead of coremltools'
# 95-pass default pipeline (which re-validates the whole program after each pass and dominated
# conversion time) we run only the passes that change something here: int16 gather indices and
# their negative-index guard (Core ML's own choice for embedding lookups), the canonical order of
# state updates that Core ML expects, and clean-up.
_PASSES = (
    "common::const_elimination",
    "common::add_int16_cast",
    "common::guard_negative_gather_indices",
    "common::cast_optimization",
    "common::const_elimination",
    "common::canonicalize_inplace_pattern",
    "common::prefer_state_in_downstream",
    "common::const_deduplication",
    "common::dead_code_elimination",
    "common::dedup_op_and_var_names",
)


def _pass_pipeline():
    import coremltools as ct

    pipeline = ct.PassPipeline.EMPTY
    for name in _PASSES:
        pipeline.append_pass(name)
    return pipeline


def _share_constants(prog) -> None:
    """Give identical constants of different functions one `weight_id`: stored once on export.

    This is what `coremltools.utils.save_multifunction` does after reloading saved functions
    (comparing every pair of weights with `allclose`); keying by content hash is the same
    result in a fraction of the time. Small constants (lookup tables) are shared too: Apple's
    pass notes that leaving them unshared can unshare the palettized indices after compilation.
    """
    groups: dict[tuple, list] = {}
    for fname, func in prog.functions.items():
        for op in func.operations:
            if op.op_type != "const":
                continue
            val = op.outputs[0].val
            if not isinstance(val, np.ndarray) or val.size == 0:
                continue
            digest = hashlib.blake2b(np.ascontiguousarray(val).data, digest_size=16).hexdigest()
            groups.setdefault((val.dtype.str, val.shape, digest), []).append((fname, op))
    for i, members in enumerate(groups.values()):
        if len({fname for fname, _ in members}) > 1:
            for _, op in members:
                op.weight_id = f"shared_{i}"


def _describe(dims: Dims, context: int, chunk: int, kv: str, compress: str, cfg: ModelConfig):
    cache = [dims.layers, dims.kv_heads, dims.state_len, dims.state_head_dim]
    functions: dict[str, Any] = {}
    for name, L in (("decode", 1), ("chunk", chunk)):
        inputs: dict[str, list[int]] = {"input_ids": [1, L], "position": [1]}
        outputs = {f"logits_{j}": [1, L, n] for j, n in enumerate(dims.vocab_splits)}
        states: dict[str, list[int]] = {}
        if kv == "state":
            states = {"key_cache": cache, "value_cache": cache}
        else:
            inputs.update({"key_cache": cache, "value_cache": cache})
            outputs.update(
                {
                    "new_keys": [dims.layers, dims.kv_heads, L, dims.state_head_dim],
                    "new_values": [dims.layers, dims.kv_heads, L, dims.state_head_dim],
                }
            )
        functions[name] = {
            "tokens": L,
            "inputs": inputs,
            "outputs": outputs,
            "states": states,
        }
    return {
        "format": "ondevice-coreml-draft",
        "format_version": FORMAT_VERSION,
        "model_type": cfg.model_type,
        "vocab_size": dims.vocab,
        "hidden_size": dims.hidden,
        "num_layers": dims.layers,
        "context": context,
        "state_length": dims.state_len,
        "chunk": chunk,
        "kv": kv,
        "compression": compress,
        "dtype": "float16",
        "min_deployment_target": MIN_DEPLOYMENT,
        "default_function": "decode",
        "functions": functions,
        "output_vocab": sum(dims.vocab_splits),  # < vocab_size for a truncated draft
        "logits": [f"logits_{j}" for j in range(len(dims.vocab_splits))],
        "vocab_splits": list(dims.vocab_splits),
        "kv_cache": {
            "names": ["key_cache", "value_cache"],
            "shape": cache,
            "head_dim": dims.head_dim,
            "dtype": "float16",
        },
    }


def _refuse_lint_errors(package: Path) -> None:
    from ondevice.convert.lint import check_mlpackage

    errors = [f for f in check_mlpackage(package) if f.severity == "error"]
    if errors:
        listed = "; ".join(str(f) for f in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise ConversionError(
            f"the converted draft breaks Neural Engine rules: {listed}{more}. Nothing was "
            "written; choose a smaller --context/--draft-chunk or another draft."
        )


def _refuse_out_of_range(report: RangeReport) -> None:
    over = report.over(RANGE_LIMIT)
    if over:
        worst = ", ".join(f"{n} ({t}) {v:,.0f}" for n, t, v in over[:5])
        raise ConversionError(
            f"float16 range probe: {len(over)} op(s) of the draft exceed {RANGE_LIMIT:,.0f} "
            f"(a quarter of float16's 65,504) on real prompts: {worst}. On the Neural Engine "
            "they would overflow or come close; nothing was written. This draft needs a graph "
            "change (e.g. scaling that op's inputs) before it can run in float16."
        )


def convert_draft(
    config: ModelConfig,
    weights: dict[str, np.ndarray] | Callable[[], dict[str, np.ndarray]],
    out: Path,
    *,
    context: int = DEFAULT_CONTEXT,
    chunk: int = DEFAULT_CHUNK,
    compress: str = "none",
    kv: str = "state",
    progress: Callable[[str], None] | None = None,
    probe_prompts: Sequence[Sequence[int]] | None = None,
) -> dict:
    """Write the draft as a multifunction `.mlpackage` at `out`; return its description.

    `weights`: float32 numpy arrays with Hugging Face names (`lm_head.weight` absent when tied),
    or a function that makes them, called once: then they are freed as soon as they are laid
    out in float16, before the package is written and checked (2 GB for the 0.5B draft).
    Before the package is moved into place it must pass the Neural Engine lint
    (`ondevice.convert.lint`) and, given `probe_prompts` (token ids of real prompts), the float16
    range probe: no op of the reference-executed package may exceed RANGE_LIMIT on them. Either
    failure raises ConversionError and leaves nothing at `out`.
    The description (functions with their input/output/state shapes, context, chunk, kv mode,
    compression, vocabulary, deployment target) is also stored in the package's user-defined
    metadata under "ondevice.draft", where the draft engines read it.
    """
    say = progress or (lambda _msg: None)
    out = Path(out)
    _check_arguments(config, out, context, chunk, compress, kv)

    t0 = time.perf_counter()
    say("preparing weights")
    w = prepare_weights(config, weights() if callable(weights) else weights)
    del weights  # where the caller passed a function, the only reference to them
    release(collect=True)
    dims = Dims.of(config, context)
    description = _describe(dims, context, chunk, kv, compress, config)

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".draft-", dir=out.parent))
    try:
        model = _build_model(config, w, dims, chunk, kv, compress, say)
        model.author = "ondevice"
        model.short_description = (
            f"{config.model_type} draft for speculative decoding: decode (1 token) and chunk "
            f"({chunk} tokens) functions, context {context}, KV cache as {kv}."
        )
        model.user_defined_metadata[METADATA_KEY] = json.dumps(description)
        final = work / "draft.mlpackage"
        model.save(str(final))
        del model, w  # the checks read the package from disk
        release(collect=True)
        _check_package(final, probe_prompts, description, say)
        final.rename(out)
    except OndeviceError:
        raise
    except Exception as e:
        raise OndeviceError(
            f"Core ML conversion of the draft failed ({type(e).__name__}: {e}); nothing was "
            f"written to {out}."
        ) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    description["size_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    description["conversion_seconds"] = round(time.perf_counter() - t0, 2)
    say(f"wrote {out} in {description['conversion_seconds']:.1f}s")
    return description


def _check_arguments(
    config: ModelConfig, out: Path, context: int, chunk: int, compress: str, kv: str
) -> None:
    """Everything `convert_draft` refuses before any work, in the order the user meets it."""
    if compress not in COMPRESSIONS:
        raise OndeviceError(
            f"unknown compression {compress!r}; choose one of {', '.join(COMPRESSIONS)}."
        )
    if kv not in KV_MODES:
        raise OndeviceError(f"unknown kv mode {kv!r}; choose one of {', '.join(KV_MODES)}.")
    check_options(context, chunk)
    if out.exists():
        raise OndeviceError(f"{out} already exists; remove it or choose another path.")
    check_config(config)


def _build_model(
    config: ModelConfig,
    w: dict[str, np.ndarray],
    dims: Dims,
    chunk: int,
    kv: str,
    compress: str,
    say: Callable[[str], None],
):
    """The two-function program, optimized, as a Core ML model whose weights are stored once."""
    import coremltools as ct
    from coremltools.converters.mil.mil import Program

    compressed = None
    if compress != "none":
        say(f"compressing weights ({compress}; k-means takes a while for palettization)")
        compressed = compress_weights(config, w, dims, kv, compress)
    prog = Program()
    for name, L in (("decode", 1), ("chunk", chunk)):
        say(f"building function {name} ({L} token{'s' if L > 1 else ''})")
        prog.add_function(name, build_function(config, w, dims, L, kv, compressed))
    prog.default_function_name = "decode"
    prog.export_as_multifunction = True
    say("optimizing")
    prog = convert_program(
        prog, "milinternal", _pass_pipeline(), compute_precision=ct.precision.FLOAT16
    )
    _share_constants(prog)
    say("writing the package (weights shared by both functions)")
    return convert_program(prog, "mlprogram", ct.PassPipeline.EMPTY, skip_model_load=True)


def _core_ml_can_plan() -> bool:
    return sys.platform == "darwin"  # MLComputePlan needs Core ML itself


def _check_plan(package: Path, description: dict, say: Callable[[str], None]) -> None:
    """Where Core ML plans each function's cost (recorded in `description`), with a warning
    for a function mostly off the Neural Engine: advice, so a failure to plan is only noted."""
    from ondevice.runtime import coreml_plan

    say("Core ML compute plan")
    try:
        plan = coreml_plan.compute_plan(package)
    except Exception as e:
        say(f"no compute plan ({type(e).__name__}: {e})")
        return
    description["neural_engine_share"] = {
        fn: round(p.share("NeuralEngine"), 3) for fn, p in plan.items()
    }
    for warning in coreml_plan.off_neural_engine(plan):
        print(f"ondevice-convert: warning: {warning}", file=sys.stderr)


def _check_package(
    package: Path,
    probe_prompts: Sequence[Sequence[int]] | None,
    description: dict,
    say: Callable[[str], None],
) -> None:
    """The Neural Engine lint, then (given prompts) the float16 range probe, whose figures are
    added to `description`; either raises ConversionError on what it finds."""
    say("Neural Engine lint")
    _refuse_lint_errors(package)
    release(collect=True)  # the lint's copy of the program
    if _core_ml_can_plan():
        _check_plan(package, description, say)
    if not probe_prompts:
        return
    say(f"float16 range probe on {len(probe_prompts)} prompts (reference executor)")
    t_probe = time.perf_counter()
    report = probe_float16_range(package, probe_prompts)
    release(collect=True)  # the reference executor's weights
    _refuse_out_of_range(report)
    description["float16_probe"] = {
        "seconds": round(time.perf_counter() - t_probe, 1),
        "tokens": report.tokens,
        "peak": report.peak,
        "limit": RANGE_LIMIT,
        "largest": [[n, t, v] for n, t, v in report.peaks[:5]],
    }
    say(f"largest float16 magnitude {report.peak:,.0f} (limit {RANGE_LIMIT:,.0f})")

"""Weight compression of the Core ML draft, computed once per weight and reused by both functions.

Weight compression runs coremltools.optimize.coreml's graph passes (`palettize_weights` with an
`OpPalettizerConfig`, `linear_quantize_weights` with an `OpLinearQuantizerConfig`) in the
conversion pipeline: palettize4/palettize6 (k-means lookup tables per group of output channels,
the granularity Apple recommends for LLM weights since iOS 18) and int8 (per-channel symmetric
linear quantization). Only the projection, LM-head and embedding matrices are compressed; RoPE
and mask tables and norm weights stay float16. Groups are sized so each k-means problem has at
least 10,000 weights: coremltools then uses its exact, deterministic 1-D k-means (kmeans1d), so
both functions get identical tables and share them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ondevice.convert.graph import build_function, cname, convert_program
from ondevice.convert.layout import Dims
from ondevice.models.config import ModelConfig

KMEANS1D_MIN_WEIGHTS = 10_000  # coremltools uses kmeans1d (exact, fast) from this size on
MAX_PALETTES = 16  # lookup tables per matrix: k-means time grows with their number


def _compressible(w: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Const name -> shape of the matrices we compress: embedding, projections, LM head (which
    holds a tied embedding, so its compressed form is the embedding's too)."""
    keys = [k for k in ("embed", "embed_tail") if k in w] + [
        k
        for k in w
        if k.startswith("lm_head_")
        or (k.startswith("l") and k.split(".")[-1] in ("q", "k", "v", "o", "gate", "up", "down"))
    ]
    return {cname(k): w[k].shape for k in keys}


def _compression_config(compress: str, w: dict[str, np.ndarray]):
    """Per-weight coremltools OptimizationConfig, or None for compress="none"."""
    import coremltools.optimize.coreml as cto

    if compress == "none":
        return None
    configs = {}
    for name, shape in _compressible(w).items():
        out_ch, per_channel = shape[0], int(np.prod(shape[1:]))
        if compress == "int8":
            configs[name] = cto.OpLinearQuantizerConfig(
                mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=1
            )
            continue
        group = _palette_group(out_ch, per_channel)
        if group is None:
            continue  # too small for the exact k-means; stays float16 (tiny models only)
        configs[name] = cto.OpPalettizerConfig(
            mode="kmeans",
            nbits=4 if compress == "palettize4" else 6,
            granularity="per_grouped_channel",
            group_size=group,
            channel_axis=0,
            weight_threshold=1,
        )
    return cto.OptimizationConfig(op_name_configs=configs)


def _palette_group(out_channels: int, per_channel: int) -> int | None:
    """Channels per lookup table: a power of two >= 16 dividing out_channels, with at most
    MAX_PALETTES tables per matrix and at least 10k weights per table (else None)."""
    g = 16
    while g <= out_channels:
        enough = g * per_channel >= KMEANS1D_MIN_WEIGHTS and out_channels // g <= MAX_PALETTES
        if out_channels % g == 0 and enough:
            return g
        g *= 2
    if out_channels * per_channel >= KMEANS1D_MIN_WEIGHTS:
        return out_channels
    return None


def compress_weights(
    config: ModelConfig, w: dict[str, np.ndarray], dims: Dims, kv: str, compress: str
) -> dict[str, tuple[str, dict[str, Any]]]:
    """Compress every compressible weight once, with coremltools' own compression pass.

    The pass runs on the decode function alone; the constexpr ops it creates (lookup table and
    indices, or int8 data and scales) are then rebuilt verbatim in both functions, so k-means
    runs once per weight and the two functions hold identical, shareable constants.
    """
    import coremltools as ct
    from coremltools.converters.mil.mil import Program

    name = "compression::" + (
        "linear_quantize_weights" if compress == "int8" else "palettize_weights"
    )
    pipeline = ct.PassPipeline.EMPTY
    pipeline.append_pass(name)
    pipeline.set_options(name, {"config": _compression_config(compress, w)})
    prog = Program()
    prog.add_function("main", build_function(config, w, dims, 1, kv))
    prog = convert_program(prog, "milinternal", pipeline)
    names = sorted(_compressible(w), key=len, reverse=True)
    recipes: dict[str, tuple[str, dict[str, Any]]] = {}
    for op in prog.functions["main"].operations:
        if not op.op_type.startswith("constexpr_"):
            continue
        original = next((n for n in names if op.name.startswith(n + "_")), None)
        if original is None or not all(v.val is not None for v in op.inputs.values()):
            continue  # only rebuild ops made from our named weights with constant inputs
        recipes[original] = (op.op_type, {k: v.val for k, v in op.inputs.items()})
    return recipes

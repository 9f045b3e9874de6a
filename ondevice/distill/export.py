"""Write a trained student as a draft model folder that ondevice and mlx_lm both load.

The folder is a complete small model (config.json, model.safetensors, tokenizer files), written
to a temporary folder and renamed into place, so an interrupted export never leaves half a draft.
To fit a size budget the embedding is quantized (it was frozen at those values during training)
and the layers get the most bits that still fit.

`config.json` carries one extra field when the output vocabulary was truncated:
`"draft_vocab_size": K` means the draft was trained to score only token ids 0..K-1. The model
itself keeps the full tied vocabulary, so any loader works unchanged; a runtime that reads the
field may compute logits for the first K ids only (and treat the rest as probability zero).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ondevice.errors import OndeviceError
from ondevice.models import Tokenizer
from ondevice.models.transformer import Model
from ondevice.models.weights import save_model

DRAFT_VOCAB_FIELD = "draft_vocab_size"


def _quantized_size(n_params: int, bits: int, group: int) -> int:
    return n_params * bits // 8 + n_params // group * 4  # packed values + fp16 scale and bias


def quant_group(width: int) -> int:
    """Weights per scale when quantizing rows `width` long: 64, or 32 where 64 does not divide."""
    return 64 if width % 64 == 0 else 32


def fitting_bits(
    fixed: int, n_params: int, max_bytes: int | None, group: int, what: str
) -> int | None:
    """The most bits per weight at which `n_params` quantizable weights (plus `fixed` bytes)
    fit in `max_bytes`: None where float16 fits (or there is no limit); OndeviceError naming
    `what` where even 2 bits do not."""
    if max_bytes is None or fixed + n_params * 2 <= max_bytes:
        return None
    for bits in (8, 6, 5, 4, 3, 2):
        if fixed + _quantized_size(n_params, bits, group) <= max_bytes:
            return bits
    raise OndeviceError(
        f"{what} does not fit in {max_bytes / 1e6:.0f} MB even with 2-bit weights; raise --max-mb "
        "or make it smaller."
    )


def export_draft(
    student: Model,
    tokenizer: Tokenizer,
    out: Path,
    *,
    vocab: int | None,
    embed_bits: int | None,
    max_bytes: int | None,
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Save `student` into `out` (replacing it); returns how it was stored."""
    out = Path(out)
    model = Model(copy.deepcopy(student.config))
    model.load_weights(list(tree_flatten(student.parameters())))
    model.unfreeze()
    cfg = model.config
    group = quant_group(cfg.hidden_size)
    if embed_bits:
        nn.quantize(
            model,
            group_size=group,
            bits=embed_bits,
            class_predicate=lambda p, m: isinstance(m, nn.Embedding),
        )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save(tmp)
    # The tokenizer counts toward the budget; stored compactly (no indentation) to leave room.
    tokenizer._tok.save(str(tmp / "tokenizer.json"), pretty=False)
    layer_bits = None
    if max_bytes is not None:
        params = tree_flatten(model.parameters())
        fixed = sum(f.stat().st_size for f in tmp.iterdir()) + (64 << 10)  # + config headroom
        fixed += sum(
            v.size * 2 if mx.issubdtype(v.dtype, mx.floating) else v.nbytes
            for k, v in params
            if not k.startswith("model.layers.") or v.ndim == 1
        )
        n_layer = sum(v.size for k, v in params if k.startswith("model.layers.") and v.ndim == 2)
        layer_bits = fitting_bits(
            fixed, n_layer, max_bytes, group, "the draft (use fewer --layers)"
        )
    if layer_bits:
        nn.quantize(
            model,
            group_size=group,
            bits=layer_bits,
            class_predicate=lambda p, m: isinstance(m, nn.Linear) and p.startswith("model.layers."),
        )
    model.set_dtype(mx.float16, lambda d: mx.issubdtype(d, mx.floating))
    save_model(model, tmp)
    conf = json.loads((tmp / "config.json").read_text())
    conf["torch_dtype"] = "float16"
    if vocab is not None:
        conf[DRAFT_VOCAB_FIELD] = vocab
    (tmp / "config.json").write_text(json.dumps(conf, indent=1))
    stored = {"embed_bits": embed_bits, "layer_bits": layer_bits, "group_size": group}
    if info is not None:
        (tmp / "distill.json").write_text(json.dumps({**info, "storage": stored}, indent=1))
    replace_folder(tmp, out)
    return stored


def replace_folder(new: Path, dest: Path) -> None:
    """Put the folder `new` in the place of `dest` (which may not exist): the old copy is moved
    aside first and deleted only after the swap, so `dest` is always one whole folder."""
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(new, dest)
    shutil.rmtree(old, ignore_errors=True)


def draft_vocab_size(folder: Path) -> int | None:
    """The truncated output vocabulary recorded in a draft's config.json, if any."""
    p = Path(folder) / "config.json"
    try:
        return json.loads(p.read_text()).get(DRAFT_VOCAB_FIELD)
    except (OSError, json.JSONDecodeError):
        return None

"""`ondevice-convert`: turn a verifier and a draft into a pair bundle, or check a bundle.

    ondevice-convert --verifier V --draft D -o OUT [options]
    ondevice-convert --check OUT

Conversion order matters for the user's time and disk: the destination is checked before any
model is loaded, the pair's tokenizers before anything is written, and everything is written into
a staging directory that only becomes OUT when complete (see `ondevice.convert.bundle`).
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ondevice.apps.options import DTYPES, QUANTIZE_BITS
from ondevice.convert.coreml import COMPRESSIONS, DEFAULT_CHUNK, DEFAULT_CONTEXT, KV_MODES
from ondevice.errors import OndeviceError
from ondevice.runtime.memory import release


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ondevice-convert",
        description=(
            "Convert a verifier and a draft model into a pair bundle (MLX verifier + Core ML "
            "draft), or check an existing bundle with --check."
        ),
    )
    p.add_argument("--verifier", "--model", dest="verifier", metavar="V",
                   help="verifier: model folder, .gguf file or hub id")  # fmt: skip
    p.add_argument("--draft", "--draft-model", dest="draft", metavar="D",
                   help="draft: model folder, .gguf file or hub id")  # fmt: skip
    p.add_argument("-o", "--output", metavar="OUT", help="bundle directory to create")
    _add_draft_arguments(p)
    p.add_argument(
        "--verifier-quantize",
        choices=("none", *(str(b) for b in QUANTIZE_BITS)),
        default="none",
        help="quantize the verifier's MLX weights to 4 or 8 bits (default none)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="float type of the MLX weights (default: as stored in the checkpoint)",
    )
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show coremltools' own progress bars (one per MIL pass pipeline)",
    )
    p.add_argument(
        "--check",
        metavar="BUNDLE",
        help="verify a bundle's checksums, list the draft's ops and Neural Engine findings",
    )
    return p


def _add_draft_arguments(p: argparse.ArgumentParser) -> None:
    """The Core ML draft's options: `convert_draft`'s arguments, with its defaults and choices."""
    p.add_argument(
        "--context",
        type=int,
        default=DEFAULT_CONTEXT,
        help="draft context length in tokens (default %(default)s)",
    )
    p.add_argument(
        "--draft-chunk",
        type=int,
        default=DEFAULT_CHUNK,
        help="tokens per call of the draft's chunk function (prefill/catch-up; default "
        "%(default)s)",
    )
    p.add_argument(
        "--draft-drop-layers",
        metavar="I,J",
        default="",
        help="leave these decoder layers (indices) out of the draft: a cheaper draft step for "
        "some acceptance (default: none)",
    )
    p.add_argument(
        "--draft-compress",
        choices=COMPRESSIONS,
        default="none",
        help="Core ML weight compression of the draft (default none: float16)",
    )
    p.add_argument(
        "--draft-kv",
        choices=KV_MODES,
        default="state",
        help="KV cache as Core ML state (default) or as model inputs/outputs (io)",
    )
    p.add_argument(
        "--probe-prompts",
        type=int,
        default=2,
        metavar="N",
        help="float16 range probe: run the converted draft on N built-in prompts (32 tokens "
        "each) in the reference executor and refuse a package whose activations come near "
        "float16's limit (default 2; 0 skips it; each prompt costs ~40 s for a 0.5B draft)",
    )
    p.add_argument(
        "--acceptance-tokens",
        type=int,
        default=64,
        metavar="N",
        help="record the pair's draft acceptance per domain (greedy, N tokens from the first "
        "built-in prompt of each category) in the manifest: the baseline that `serve` and the "
        "API compare live acceptance with, to tell when the verifier has drifted from the "
        "draft (default 64; 0 skips it)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check is not None:
        if args.verifier or args.draft or args.output:
            parser.error("--check takes only a bundle; do not combine it with a conversion")
    else:
        missing = [
            f
            for f, v in (
                ("--verifier", args.verifier),
                ("--draft", args.draft),
                ("-o/--output", args.output),
            )
            if not v
        ]
        if missing:
            parser.error(f"missing {', '.join(missing)} (or use --check BUNDLE)")
    try:
        with _sigterm_as_interrupt():
            if args.check is not None:
                from ondevice.convert.check import run_check

                return run_check(Path(args.check))
            return convert(args)
    except OndeviceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; nothing was written.", file=sys.stderr)
        return 130


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C, so the staging directory is cleaned up either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class Phases:
    """One line per phase on stderr, with its duration: the user sees where time goes."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.n = 0
        self.start = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, title: str) -> Iterator[None]:
        self.n += 1
        print(f"[{self.n}/{self.total}] {title} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        yield
        dt = time.perf_counter() - t
        self.times[title] = dt
        print(f"      done in {dt:.1f} s", file=sys.stderr, flush=True)


def _validate(args: argparse.Namespace) -> None:
    """Option ranges the Core ML converter accepts, checked before any model is loaded."""
    from ondevice.convert.layout import check_options

    check_options(args.context, args.draft_chunk)
    if args.probe_prompts < 0:
        from ondevice.errors import BundleError

        raise BundleError(f"--probe-prompts {args.probe_prompts}: use 0 (no probe) or more.")
    if args.acceptance_tokens < 0:
        from ondevice.errors import BundleError

        raise BundleError(
            f"--acceptance-tokens {args.acceptance_tokens}: use 0 (no record) or more."
        )


def _check_pair(verifier: Any, draft: Any, context: int) -> None:
    """Tokenizers, vocabularies and context: everything that makes a pair unusable."""
    from ondevice.convert.layout import check_config
    from ondevice.errors import ModelFormatError
    from ondevice.models.tokenizer import check_pair

    check_pair(verifier.tokenizer, draft.tokenizer, draft_vocab=draft.config.vocab_size)
    # The converter's own architecture check, run now rather than after the verifier is written.
    check_config(draft.config)
    for role, m in (("draft", draft), ("verifier", verifier)):
        if context > m.config.max_position_embeddings:
            raise ModelFormatError(
                f"--context {context} exceeds the {role}'s max_position_embeddings "
                f"({m.config.max_position_embeddings}, {m.path}); pass a smaller --context."
            )


def draft_numpy_weights(model: Any) -> dict[str, Any]:
    """Float32 numpy weights with Hugging Face names; quantized layers (GGUF) are expanded."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from ondevice.models.gguf import dequantize_all

    params = dict(tree_flatten(model.parameters()))
    quant = {
        p: {"group_size": m.group_size, "bits": m.bits}
        for p, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    return dequantize_all(params, quant or None)


def _save_mlx(loaded: Any, path: Path) -> None:
    """MLX weights plus tokenizer files: a folder both ondevice and `mlx_lm.load` read."""
    from ondevice.models.weights import save_model

    # config.json's eos_token_id is where loaders look for stop tokens; make it list every id the
    # tokenizer treats as end of sequence (GGUF files keep end-of-turn separately).
    loaded.model.config.eos_token_id = sorted(
        set(loaded.model.config.eos_token_id) | set(loaded.tokenizer.eos_token_ids)
    )
    save_model(loaded.model, path)
    loaded.tokenizer.save(path)


def _describe(loaded: Any, source: str) -> dict[str, Any]:
    from ondevice.models.weights import quantization_config

    dropped = getattr(loaded.model, "dropped_layers", None)  # `_drop_layers`
    return {
        "source": source,
        "config": loaded.model.config.to_hf_dict(),
        "quantization": quantization_config(loaded.model),
        **({"dropped_layers": dropped} if dropped else {}),
    }


def _probe_prompts(tokenizer: Any, max_tokens: int = 32) -> list[list[int]]:
    """Token ids of real prompts for the converter's float16 range probe: the first built-in
    benchmark prompt of each category through the chat template, cut to `max_tokens` (large
    activations show within the first tokens: Qwen2.5-0.5B's residual peaks on the first; the
    probe runs the draft in numpy, about a second per token for a 0.5B draft)."""
    from ondevice.convert.acceptance import domain_prompts

    return [ids[:max_tokens] for ids in domain_prompts(tokenizer).values()]


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _convert_progress() -> Callable[..., None]:
    """A progress callback for the Core ML converter: prints whatever step it reports."""

    def report(*args: Any, **kwargs: Any) -> None:
        text = " ".join(str(a) for a in args)
        if kwargs:
            text += " " + " ".join(f"{k}={v}" for k, v in kwargs.items())
        if text.strip():
            print(f"      {text.strip()}", file=sys.stderr, flush=True)

    return report


@contextmanager
def _coremltools_progress(shown: bool) -> Iterator[None]:
    """coremltools draws a tqdm bar on stderr for each MIL pass pipeline it runs, half a dozen
    per conversion, between ondevice's own phase lines; hide them unless --verbose."""
    try:
        from coremltools.converters.mil.mil.passes import pass_pipeline
    except ImportError:
        pass_pipeline = None
    bar = getattr(pass_pipeline, "tqdm", None)
    if shown or bar is None:
        yield
        return
    pass_pipeline.tqdm = functools.partial(bar, disable=True)  # tqdm's own switch
    try:
        yield
    finally:
        pass_pipeline.tqdm = bar


def _weights_bytes(source: str) -> int:
    """Bytes of weights in a local model folder or file; 0 for names resolved later."""
    p = Path(source).expanduser()
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(f.stat().st_size for pat in ("*.safetensors", "*.gguf") for f in p.glob(pat))
    return 0


def estimate_bundle_bytes(args: argparse.Namespace) -> int:
    """A low estimate of the bundle's size from its inputs: the verifier (quantized if asked,
    from at most 32-bit weights), the draft's MLX copy and its Core ML copy (float16, from at
    most 32-bit). A full disk that this misses still ends in a clear error and nothing written."""
    verifier = _weights_bytes(args.verifier)
    if args.verifier_quantize != "none":
        verifier = verifier * int(args.verifier_quantize) // 32
    draft = _weights_bytes(args.draft)
    return verifier + draft + draft // 2


def convert(args: argparse.Namespace) -> int:
    from ondevice.convert.bundle import check_destination, recover, staging_dir, total_size

    out = Path(args.output).expanduser().absolute()
    for line in recover(out):  # what conversions killed earlier left behind
        print(f"note: {line}", file=sys.stderr)
    _validate(args)
    check_destination(out, args.force, estimate_bundle_bytes(args))  # before minutes of loading
    phases = Phases(total=9)
    pair = list(_load_pair(args, phases))
    with staging_dir(out, force=args.force) as tmp:
        _write_bundle(args, pair, tmp, phases)
        sizes = {
            "verifier": total_size(tmp / "verifier"),
            "draft.mlpackage": total_size(tmp / "draft" / "draft.mlpackage"),
            "draft/mlx": total_size(tmp / "draft" / "mlx"),
            "tokenizer": total_size(tmp / "tokenizer"),
        }
        total = total_size(tmp)
    elapsed = time.perf_counter() - phases.start
    parts = ", ".join(f"{k} {_mb(v)}" for k, v in sizes.items())
    print(f"wrote {out} ({_mb(total)}: {parts}) in {elapsed:.1f} s", file=sys.stderr)
    return 0


def _load_pair(args: argparse.Namespace, phases: Phases) -> tuple[Any, Any]:
    """The verifier (quantized if asked) and the draft, checked as a pair."""
    from ondevice.models import load_model

    quantize = None if args.verifier_quantize == "none" else int(args.verifier_quantize)
    with phases(f"loading verifier {args.verifier}"):
        verifier = load_model(args.verifier, dtype=args.dtype, quantize=quantize)
    with phases(f"loading draft {args.draft}"):
        draft = _drop_layers(load_model(args.draft, dtype=args.dtype), args.draft_drop_layers)
    with phases("checking the pair (tokenizers, vocabulary, context)"):
        _check_pair(verifier, draft, args.context)
    return verifier, draft


def _drop_layers(draft: Any, spec: str) -> Any:
    """The loaded draft without the decoder layers `spec` names ("3,17"; "" keeps them all):
    the kept layers' own modules, renumbered in order (`LayerSkipView`), which every later
    phase writes and converts as the draft."""
    import dataclasses

    from ondevice.errors import BundleError
    from ondevice.proposers.layer_skip import LayerSkipView

    if not spec.strip():
        return draft
    n = draft.config.num_hidden_layers
    try:
        drop = {int(i) for i in spec.split(",")}
    except ValueError:
        raise BundleError(
            f"--draft-drop-layers {spec!r}: give layer indices separated by commas, e.g. 3,17."
        ) from None
    if not drop <= set(range(n)) or len(drop) >= n:
        raise BundleError(
            f"--draft-drop-layers {spec!r}: the draft {draft.path} has layers 0-{n - 1}; leave "
            "at least one of them in."
        )
    view = LayerSkipView(draft.model, [i for i in range(n) if i not in drop])
    view.dropped_layers = sorted(drop)
    return dataclasses.replace(draft, model=view, config=view.config)


def _measure_acceptance(args: argparse.Namespace, tokenizer: Any, tmp: Path) -> dict | None:
    """The pair's greedy acceptance per domain (`convert.acceptance`), or None if skipped."""
    if not args.acceptance_tokens:
        return None
    from ondevice.convert.acceptance import domain_prompts, measure

    prompts = domain_prompts(tokenizer)
    v, d = _served_as_loaded(tmp)
    record = measure(
        v, d, prompts, args.acceptance_tokens, eos_token_ids=sorted(tokenizer.eos_token_ids)
    )
    rates = ", ".join(
        f"{name} {d['accepted'] / max(d['accepted'] + d['rejected'], 1):.2f}"
        for name, d in record["domains"].items()
    )
    print(f"      acceptance per domain: {rates}", file=sys.stderr, flush=True)
    return record


def _served_as_loaded(tmp: Path) -> tuple[Any, Any]:
    """The models as `ondevice.load` will serve the bundle's written MLX folders in `tmp`: on a
    CPU, dequantized with their products through the CPU kernel (MLX's quantized products on a
    CPU made the acceptance phase alone run for over 20 minutes on a 2-core VM), so the record is
    also what later runs' acceptance is judged against; elsewhere as written (MLX on Metal)."""
    import mlx.core as mx

    from ondevice.models import load_model
    from ondevice.runtime import kernel

    cpu = mx.default_device() == mx.cpu
    opts = {"dequantize": True, "product_dtype": kernel.weight_dtype()} if cpu else {}
    v, d = (load_model(f, **opts).model for f in (tmp / "verifier", tmp / "draft" / "mlx"))
    if cpu:
        kernel.serve_pair(v, d)
    return v, d


def _write_bundle(args: argparse.Namespace, pair: list[Any], tmp: Path, phases: Phases) -> None:
    """Every file of the bundle into the staging directory `tmp`, the manifest last. `pair`
    ([verifier, draft] as loaded) is emptied as each is written (the verifier before the draft's
    conversion, the draft before the acceptance phase, which loads both as they will be served),
    so that no phase holds a copy it does not need (docs/benchmarks.md, "The conversion's
    memory")."""
    from tqdm import tqdm

    from ondevice.convert.bundle import file_entries, total_size, write_manifest

    verifier, draft = pair
    with phases("writing verifier (MLX)"):
        _save_mlx(verifier, tmp / "verifier")
    tokenizer, models = verifier.tokenizer, {"verifier": _describe(verifier, str(args.verifier))}
    pair[0] = verifier = None  # on disk: its memory is the draft's conversion's
    release(collect=True)
    with phases("writing draft (MLX)"):
        _save_mlx(draft, tmp / "draft" / "mlx")
    with (
        phases(
            f"converting draft to Core ML (context {args.context}, chunk {args.draft_chunk}, "
            f"compress {args.draft_compress}, kv {args.draft_kv})"
        ),
        _coremltools_progress(shown=args.verbose),
    ):
        coreml = _convert_draft(args, draft, tmp / "draft" / "draft.mlpackage")
    models["draft"] = _describe(draft, str(args.draft))
    pair.clear()
    del draft
    release(collect=True)  # the loaded draft and the conversion's garbage
    with phases(f"measuring the pair's acceptance per domain ({args.acceptance_tokens} tokens)"):
        acceptance = _measure_acceptance(args, tokenizer, tmp)
    release(collect=True)  # the served copies it measured with
    with phases("writing tokenizer"):
        tokenizer.save(tmp / "tokenizer")
    with phases("computing checksums"):
        with tqdm(
            total=total_size(tmp), unit="B", unit_scale=True, leave=False, file=sys.stderr
        ) as bar:
            files = file_entries(tmp, progress=bar.update)
        write_manifest(tmp, _manifest(args, tokenizer, models, coreml, files, acceptance))


def _convert_draft(args: argparse.Namespace, draft: Any, path: Path) -> dict:
    """The draft as a Core ML package at `path` (lint and float16 probe included)."""
    from ondevice.convert import coreml

    def weights() -> dict[str, Any]:  # made inside, so freed once laid out (`convert_draft`)
        expanded = draft_numpy_weights(draft.model)
        release(collect=True)  # MLX's float32 copies, expanded on the way to numpy
        return expanded

    return coreml.convert_draft(
        draft.model.config,
        weights,
        path,
        context=args.context,
        chunk=args.draft_chunk,
        compress=args.draft_compress,
        kv=args.draft_kv,
        progress=_convert_progress(),
        probe_prompts=_probe_prompts(draft.tokenizer)[: args.probe_prompts],
    )


def _manifest(
    args: argparse.Namespace,
    tokenizer: Any,
    models: dict[str, dict],
    description: dict,
    files: Any,
    acceptance: dict | None = None,
) -> dict[str, Any]:
    """The bundle's manifest fields (`write_manifest` adds the format's own); `models`: the
    verifier's and the draft's `_describe`."""
    return {
        "context_length": args.context,
        "tokenizer": {
            "path": "tokenizer",
            "fingerprint": tokenizer.fingerprint(),
            "vocab_size": tokenizer.vocab_size,
            "eos_token_ids": sorted(tokenizer.eos_token_ids),
            # How a GGUF vocabulary was built (version, pre-tokenizer): a later ondevice tells
            # a tokenizer built the old way from this (models.gguf_tokenizer).
            **({"gguf": tokenizer.origin} if tokenizer.origin else {}),
        },
        "verifier": {"path": "verifier", **models["verifier"]},
        "draft": {
            "mlx": "draft/mlx",
            "mlpackage": "draft/draft.mlpackage",
            **models["draft"],
            "functions": description.get("functions"),
            "coreml": description,
        },
        "options": {
            "context": args.context,
            "draft_chunk": args.draft_chunk,
            "draft_compress": args.draft_compress,
            "draft_kv": args.draft_kv,
            "verifier_quantize": args.verifier_quantize,
            "dtype": args.dtype,
        },
        "files": files,
        **({"acceptance": acceptance} if acceptance is not None else {}),
    }


if __name__ == "__main__":
    sys.exit(main())

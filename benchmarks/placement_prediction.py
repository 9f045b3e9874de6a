"""What the cost model predicts for the default pair on a Mac, from published figures.

    python benchmarks/placement_prediction.py [--machines "M4=120,M4 Pro=273"] [--bits 16]
        [--efficiency 0.73] [--gpu-overhead-ms 0.34] [--verify-growth 0.1] [--ane-ms 18]

No Mac has run this project, so every cost below is estimated from public figures (quoted with
their sources in docs/benchmarks.md, "Issue 26 item 5 / issue 30 item 5: Mac predictions"):

- Memory bandwidth: Apple's specifications, M4 120 GB/s, M4 Pro 273 GB/s (`--machines`).
- A pass on the GPU (MLX) is bound by reading the weights: seconds = bytes read / (bandwidth x
  `--efficiency`) + `--gpu-overhead-ms`. 0.73 is what mlx_lm reached in a published run
  (Qwen3.5-4B 4-bit, about 2.25 GB, 39 tok/s on a base M4: jitesh.dev, 2026-03-31); reports in
  MLX projects' issue trackers range from 0.67 (mlx-lm PR 1569: Qwen3-4B 4-bit, 44.6 tok/s on an
  M3 Pro) to 0.82 (Rapid-MLX issue 567: a 5.1 GB Qwen3.5-9B 4-bit, 43.4 tok/s on an M4 Pro). The
  fixed 0.34 ms is what is left of a small model's step at that efficiency: Qwen3-0.6B 8-bit
  (0.63 GB) at 3.52 ms a token on an M4 Pro (vllm-mlx issue 531). A pass over 9 tokens reads the
  same weights: `--verify-growth` is its extra share (and 8x that at 64 tokens).
- A Core ML draft step on the Neural Engine: `--ane-ms` for the full 0.5B draft (ANEMLL,
  Qwen3.5-0.8B at about 56 tok/s on an M4 Pro's Neural Engine, thedailyscout.com; a runtime on
  private ANE APIs: Qwen2.5-0.5B at 82 tok/s on an M4 Pro, maderix/ANE's inference README). A
  cheaper draft's step is taken in proportion to the 16-bit bytes it reads (an assumption: the
  Neural Engine streams its weights too; a fixed cost per call would make cheap drafts gain less).
- Acceptance: the 0.5B draft's measured greedy agreement with the verifier (issue 26: 0.76 full,
  0.545 with 18 of 24 layers, 0.281 with 12, undistilled; the default's 22 layers: 0.76 x
  0.750 / 0.790, the ratio measured in session 28); with its head cut to the first 32768
  ids 0.76 x 0.928 (docs/benchmarks.md: 92.8% of its greedy tokens lie in that range) or 0.76.
  Medusa heads: this project's held-out agreement per head (docs/distill.md) and Medusa-1's on
  Vicuna-7B (top-1..5 per head as logged in training, FasterDecoding/Medusa
  `assets/medusa_acc.csv`); Hydra's sequential heads: this project's held-out agreement along
  the verifier's path, each level of their tree a GPU pass of its own (docs/distill.md). Self-drafts: this project's measured skip sets of the 1.5B verifier
  (docs/benchmarks.md, issue 30) and SWIFT's setting (skip ratio 0.45 with a 0.90 agreement
  target, hemingkx/SWIFT `eval_llama.sh`).

The predictions use the runtime's own functions: draft chains go through `placement.candidates`
and `placement.choose` (the `CostModel` the decoders use), Medusa trees through
`pass_costs.best_rate` (how the tree proposers size a tree, the heads' own pass added as a fixed
cost per round), a self-draft's cost through `layer_skip.draft_fraction` and
`layer_skip.scaled_profile`, and bytes through `memory.param_bytes` of the real architectures,
built lazily (MLX allocates nothing until evaluated). Host time per round is taken as zero.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ondevice.models.config import ModelConfig
from ondevice.models.transformer import Model
from ondevice.models.weights import _quantize
from ondevice.proposers.layer_skip import draft_fraction, scaled_profile
from ondevice.proposers.medusa import MedusaHeads, SequentialHeads
from ondevice.runtime.memory import param_bytes
from ondevice.runtime.pass_costs import CostProfile, best_rate
from ondevice.runtime.placement import Placement, candidates, choose

# Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct (their config.json; both tie the head)
VERIFIER = {
    "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}  # fmt: skip
DRAFT = {**VERIFIER, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
         "num_attention_heads": 14}  # fmt: skip

FULL_ALPHA = 0.76  # the 0.5B draft on Spec-Bench dev (issue 26)
IN_SUBSET = 0.928  # share of its greedy tokens among the first 32768 ids (docs/benchmarks.md)


@dataclass(frozen=True)
class Draft:
    name: str
    layers: int  # of the 0.5B's 24
    head_rows: int | None  # None: the whole vocabulary
    alpha: float  # measured (or stated) acceptance


DRAFTS = (
    Draft("0.5B (today's)", 24, None, FULL_ALPHA),
    Draft("0.5B, head cut to 32768 ids", 24, 32768, round(FULL_ALPHA * IN_SUBSET, 3)),
    # layers 4 and 9 left out at conversion (`--draft-drop-layers 4,9`, session 28): teacher-forced
    # greedy agreement 0.750 against the full draft's 0.790 on the same Spec-Bench dev answers
    Draft(
        "0.5B, 22 of 24 layers (4, 9 out)",
        22,
        None,
        round(FULL_ALPHA * 0.750 / 0.790, 3),
    ),
    Draft("0.5B, 18 of 24 layers, undistilled", 18, None, 0.545),
    Draft("0.5B, 12 of 24 layers, undistilled", 12, None, 0.281),
)

# Medusa: per head, cumulative top-1..top-r accuracy (head k guesses the token k+1 ahead)
MEDUSA_HEADS = {
    "this project's Medusa heads (6 minutes, 71k positions)": [[0.299], [0.131], [0.070], [0.050]],
    "Medusa-1, Vicuna-7B (Medusa repo)": [
        [0.560, 0.672, 0.727, 0.760, 0.780],
        [0.316, 0.424, 0.485, 0.528, 0.563],
        [0.201, 0.288, 0.348, 0.383, 0.417],
        [0.147, 0.225, 0.274, 0.311, 0.340],
    ],
}
# Hydra (sequential) heads: per head, top-1 agreement along the verifier's own path (head k
# reads the token before its guess), as `ondevice distill --heads hydra` measures it held out
HYDRA_HEADS = {
    "this project's Hydra heads (session 10: 3 of 4, 20 minutes, 71k positions)": [
        [0.385],
        [0.276],
        [0.257],
    ],
    "this project's Hydra heads (shipped: 4, 45 minutes, 144k positions)": [
        [0.402],
        [0.296],
        [0.268],
        [0.261],
    ],
}
MEDUSA_VOCAB = 32768  # the heads' output rows (`ondevice distill --heads medusa` default)
MEDUSA_MAX_NODES = 64  # as `proposers/medusa.py`

# method "self": the 1.5B verifier's layers in the order the search dropped them and the greedy
# agreement after dropping the first n (docs/benchmarks.md, issue 30, run 2)
SKIP_ORDER = (9, 11, 14, 15, 22, 4, 5, 6, 8, 12, 13, 16, 19, 21, 2)
SKIP_AGREEMENT = (1.000, 0.969, 0.938, 0.906, 0.885, 0.885, 0.833, 0.719, 0.656, 0.573, 0.542,
                  0.552, 0.375, 0.302, 0.188)  # fmt: skip
SELF_ROWS = (1, 5, 8, 11)  # skip sets reported
SWIFT_SKIP_RATIO, SWIFT_ALPHA = 0.45, 0.90


def lazy_model(config: dict, bits: int = 16, layers: int | None = None) -> Model:
    """The architecture with `layers` layers, weights in `bits` (16, 8 or 4, as `ondevice` would
    hold them on a Mac), never evaluated: only shapes and dtypes are read."""
    layers = layers or config["num_hidden_layers"]
    cfg = ModelConfig.from_dict({**config, "num_hidden_layers": layers})
    model = Model(cfg)
    model.set_dtype(mx.float16)
    if bits != 16:
        _quantize(model, cfg, bits)
    return model


def pass_bytes(model: Model, head_rows: int | None = None) -> float:
    """Bytes a one-token pass reads: every parameter but an untied embedding's table (one row
    of it is read), the output layer cut to its first `head_rows` rows."""
    total = param_bytes(model)
    if not model.config.tie_word_embeddings:
        total -= param_bytes(model.model.embed_tokens)
    if head_rows is not None:
        total -= param_bytes(model.head) * (1 - head_rows / model.config.vocab_size)
    return float(total)


@dataclass(frozen=True)
class Mac:
    """What passes cost on one Mac (the module says where each figure comes from)."""

    name: str
    gbs: float  # nominal memory bandwidth
    bits: int = 16  # the GPU models' weights
    efficiency: float = 0.73  # the share of `gbs` MLX reaches while decoding
    overhead_ms: float = 0.34  # per GPU pass, beyond reading the weights
    growth: float = 0.1  # a GPU pass over 9 tokens costs (1 + growth) one over 1
    ane_ms: float = 18.0  # the full 0.5B draft's step on the Neural Engine

    def gpu_seconds(self, nbytes: float) -> float:
        return self.overhead_ms / 1000 + nbytes / (self.gbs * 1e9 * self.efficiency)

    def gpu(self, nbytes: float) -> CostProfile:
        """A pass on the GPU over 1, 9 and 64 tokens (the weights are read once for all)."""
        one = nbytes / (self.gbs * 1e9 * self.efficiency)
        extra = (0.0, self.growth, self.growth * 8)
        return CostProfile([1, 9, 64], [self.gpu_seconds(nbytes) + one * g for g in extra])

    def verifier(self) -> tuple[Model, CostProfile]:
        model = lazy_model(VERIFIER, self.bits)
        return model, self.gpu(pass_bytes(model))

    def draft_profiles(self, draft: Draft) -> dict[str, CostProfile]:
        """The draft on the GPU (MLX) and on the Neural Engine (Core ML, float16: its step is
        `ane_ms` scaled by the bytes it reads against the full 0.5B's)."""
        gpu = self.gpu(pass_bytes(lazy_model(DRAFT, self.bits, draft.layers), draft.head_rows))
        share = pass_bytes(lazy_model(DRAFT, 16, draft.layers), draft.head_rows)
        share /= pass_bytes(lazy_model(DRAFT, 16))
        step = self.ane_ms / 1000 * share
        return {"mlx": gpu, "coreml": CostProfile([1, 64], [step, step * 8])}


def best_per_backend(
    verify: CostProfile, drafts: dict[str, CostProfile], alpha: float
) -> dict[str, Placement]:
    """The fastest placement of each backend (`placement.candidates`; `choose` is their max)."""
    best: dict[str, Placement] = {}
    for c in candidates(verify, drafts, alpha=alpha):
        if c.backend not in best or c.tokens_per_second > best[c.backend].tokens_per_second:
            best[c.backend] = c
    return best


def medusa_values(
    accuracy: Sequence[Sequence[float]], max_nodes: int = MEDUSA_MAX_NODES
) -> np.ndarray:
    """Acceptance of the best `max_nodes` nodes of Medusa's cartesian tree, best first: head
    d's rank-r choice is right with probability top_r - top_(r-1), a path with the product
    along it (the paper's and `MedusaProposer`'s independence assumption)."""
    ranks = [np.diff(np.concatenate([[0.0], np.asarray(a, np.float64)])) for a in accuracy]
    values = [
        float(np.prod([ranks[d][r] for d, r in enumerate(path)]))
        for depth in range(1, len(ranks) + 1)
        for path in itertools.product(*(range(len(r)) for r in ranks[:depth]))
    ]
    return np.sort(np.array(values))[::-1][:max_nodes]


def medusa_heads_seconds(
    mac: Mac, verifier: Model, num_heads: int = 4, kind: str = "medusa"
) -> float:
    """The heads' own GPU work after each verification, reading the heads (float32, as
    `medusa.load_heads` holds them) and the verifier's output rows for their subset: one pass
    of every head (Medusa), or a pass per level of the tree (Hydra: each level reads one head,
    over the state and the token before, and the rows again)."""
    d = verifier.config.hidden_size
    rows = param_bytes(verifier.head) * MEDUSA_VOCAB / verifier.config.vocab_size
    if kind == "hydra":
        return num_heads * mac.gpu_seconds(param_bytes(SequentialHeads(d, 1)) + rows)
    return mac.gpu_seconds(param_bytes(MedusaHeads(d, num_heads)) + rows)


def medusa_prediction(
    verify: CostProfile, heads_seconds: float, values: np.ndarray
) -> tuple[int, float, float]:
    """(nodes verified, tokens per pass, tokens per second) of the tree `best_rate` sizes from
    `values` (best first), each round paying the heads' pass besides the verification."""
    n, rate = best_rate(values, verify, fixed=heads_seconds)
    return n, 1.0 + float(np.sum(values[:n])), rate


def self_prediction(
    verify: CostProfile, verifier: Model, skipped: int, alpha: float
) -> tuple[float, Placement]:
    """The verifier drafting with the first `skipped` layers of `SKIP_ORDER` left out, costed as
    the runtime costs it (`draft_fraction`, `scaled_profile`): (draft fraction, best chain)."""
    if skipped > len(SKIP_ORDER):
        raise ValueError(f"at most {len(SKIP_ORDER)} layers (SKIP_ORDER)")
    fraction = draft_fraction(verifier, SKIP_ORDER[:skipped])
    draft = scaled_profile(verify, fraction)
    return fraction, best_per_backend(verify, {"mlx": draft}, alpha)["mlx"]


# -- the report ---------------------------------------------------------------------------------


def _cell(p: Placement, plain: float, chosen: Placement | None = None) -> str:
    """One placement's prediction; bold where it is what `placement.choose` picks."""
    how = " pipelined" if p.pipelined else ""
    speed = f"{p.tokens_per_second / plain:.2f}x"
    bold = f"**{speed}**" if p == chosen else speed
    return f"K={p.k}{how}: {p.tokens_per_second:.0f} tok/s = {bold}"


def report(mac: Mac) -> list[str]:
    """Markdown: the drafts, `medusa` and `self` on `mac`."""
    verifier, verify = mac.verifier()
    plain = 1.0 / float(verify(1))
    out = [
        f"**{mac.name} ({mac.gbs:.0f} GB/s)**, GPU weights in {mac.bits} bits: verifier pass "
        f"{float(verify(1)) * 1000:.1f} ms over 1 token, {float(verify(9)) * 1000:.1f} ms over "
        f"9; plain decoding {plain:.0f} tok/s.",
        "",
        "| draft | GPU step | ANE step | alpha | draft on the GPU (MLX) | on the Neural Engine "
        f"(Core ML) | GPU at alpha {FULL_ALPHA} | ANE at alpha {FULL_ALPHA} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in DRAFTS:
        drafts = mac.draft_profiles(d)
        cells = []
        for alpha in (d.alpha, FULL_ALPHA):
            best = best_per_backend(verify, drafts, alpha)
            pick = choose(verify, drafts, alpha=alpha)
            cells += [_cell(best["mlx"], plain, pick), _cell(best["coreml"], plain, pick)]
        steps = " | ".join(f"{float(drafts[b](1)) * 1000:.1f} ms" for b in ("mlx", "coreml"))
        out.append(f"| {d.name} | {steps} | {d.alpha} | " + " | ".join(cells) + " |")

    out += [
        "",
        "| method `medusa` (GPU) | heads' work a round | nodes verified | tokens/pass | speed |",
        "|---|---|---|---|---|",
    ]
    heads = [("medusa", n, a) for n, a in MEDUSA_HEADS.items()]
    heads += [("hydra", n, a) for n, a in HYDRA_HEADS.items()]
    for kind, name, accuracy in heads:
        # sequential heads grow the tree level by level and stop where a level does not pay
        # (`DraftTreeProposer._pays_to_grow`): the best depth, paying only its levels
        depths = range(1, len(accuracy) + 1) if kind == "hydra" else [len(accuracy)]
        heads_s, n, per_pass, rate = max(
            (
                (s, *medusa_prediction(verify, s, medusa_values(accuracy[:d])))
                for d in depths
                for s in [medusa_heads_seconds(mac, verifier, d, kind=kind)]
            ),
            key=lambda r: r[-1],
        )
        out.append(
            f"| {name} | {heads_s * 1000:.2f} ms | {n} | {per_pass:.2f} | "
            f"{rate:.0f} tok/s = {rate / plain:.2f}x |"
        )

    n_layers = VERIFIER["num_hidden_layers"]
    swift = round(SWIFT_SKIP_RATIO * n_layers)
    rows = [(f"measured skip set, {n} of {n_layers}", n, SKIP_AGREEMENT[n - 1]) for n in SELF_ROWS]
    rows.append((f"SWIFT's setting ({SWIFT_SKIP_RATIO} skipped)", swift, SWIFT_ALPHA))
    out += [
        "",
        "| method `self` (GPU) | layers skipped | draft pass | alpha | speed |",
        "|---|---|---|---|---|",
    ]
    for name, skipped, alpha in rows:
        fraction, p = self_prediction(verify, verifier, skipped, alpha)
        out.append(
            f"| {name} | {skipped} | {fraction:.2f} of a verifier pass | {alpha} | "
            f"{_cell(p, plain)} |"
        )
    return out


def parse_machines(text: str) -> list[tuple[str, float]]:
    try:
        pairs = [part.rsplit("=", 1) for part in text.split(",")]
        return [(name.strip(), float(gbs)) for name, gbs in pairs]
    except ValueError:
        raise SystemExit(f"--machines: expected NAME=GB/s[,NAME=GB/s...], got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--machines",
        default="M4=120,M4 Pro=273",
        help="NAME=GB/s,... (Apple: M4 120, M4 Pro 273, M4 Max 546)",
    )
    ap.add_argument(
        "--bits",
        type=int,
        choices=(16, 8, 4),
        default=16,
        help="the GPU models' weights (a bundle's verifier is 16-bit unless quantized)",
    )
    ap.add_argument("--efficiency", type=float, default=Mac.efficiency)
    ap.add_argument("--gpu-overhead-ms", type=float, default=Mac.overhead_ms)
    ap.add_argument("--verify-growth", type=float, default=Mac.growth)
    ap.add_argument("--ane-ms", type=float, default=Mac.ane_ms, help="the full 0.5B draft's step")
    args = ap.parse_args(argv)
    for name, gbs in parse_machines(args.machines):
        mac = Mac(
            name, gbs, args.bits, args.efficiency, args.gpu_overhead_ms, args.verify_growth,
            args.ane_ms,
        )  # fmt: skip
        print("\n".join(report(mac)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Medusa heads (Cai et al. 2024, Medusa-1): drafting from the verifier's own last hidden state.

Head k (k = 1..K) is a residual block on the verifier's last hidden state h (after the final
norm, the state its output layer reads), `h + SiLU(W_k h + b_k)`, followed by the verifier's own
output matrix (frozen and shared, not stored again) restricted to the first `vocab_subset` ids
(a frequency-ranked subset, as the FR-Spec draft head: byte-level BPE gives the commonest tokens
the smallest ids). From the state at position t the verifier's head predicts token t+1 (the
round's bonus token) and head k token t+k+1, so one verification pass, which the decoder makes
anyway, gives the next round's guesses for K positions: drafting costs K small products.

- Heads live in a folder (`heads.safetensors`: `heads.{k}.weight` (d, d), `heads.{k}.bias`
  (d,), k from 0, the weights float16 or, with `bits` and `group_size` in heads.json, MLX's
  group-wise quantization with `heads.{k}.scales` and `.biases`; `heads.json`: the format, the
  verifier's fingerprint, K, the subset, d and how they were trained), written by `ondevice distill --heads medusa` (`distill/medusa.py`).
  They are given explicitly (`ondevice.load(..., heads=PATH)`, `--heads PATH`) or found in the
  cache beside the model's profiles (`heads_cache_path`).
- `MedusaProposer` builds each round's tree from the heads' top choices, Medusa's cartesian
  product tree grown best first: a node's value is the product of the head probabilities along
  its path (heads do not see the path, so every choice of head d's list may follow every node at
  depth d-1), calibrated per depth by the acceptance observed; the best nodes, as many as the
  verifier's measured pass costs say pay (`cost_budget`), are verified in one pass. Children are
  deterministic draws (a top-k list, as the draft model's dynamic trees), so the multi-candidate
  rule keeps sampling exactly the verifier's law whatever the heads say.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ondevice.errors import OndeviceError
from ondevice.models.transformer import Model, _head_rows, norm_weights
from ondevice.models.weights import expand_quantized
from ondevice.proposers.base import (
    BudgetFn,
    Unavailable,
    Verification,
    cost_budget,
    cost_rate,
    not_beside_a_draft,
)
from ondevice.proposers.draft_tree import DraftTreeProposer, top_tokens
from ondevice.proposers.lookup import PromptLookup
from ondevice.proposers.resources import Calibrations
from ondevice.rules.noise import PositionNoise
from ondevice.rules.token_tree import TokenTree
from ondevice.runtime.engines import innermost
from ondevice.runtime.pass_costs import CostProfile, profiles_dir

if TYPE_CHECKING:
    from ondevice.proposers.resources import Resources, Speculation

FORMAT = "ondevice-medusa-heads"
VERSION = 1
WEIGHTS = "heads.safetensors"
META = "heads.json"
WIDTH = 8  # choices of each head a tree may use
MAX_NODES = 64  # candidates grown before the cost budget picks how many are verified


# -- the heads and their file --------------------------------------------------------------------


class MedusaHeads(nn.Module):
    """K residual blocks over hidden states: (..., d) -> (..., K, d). Each head reads the state
    alone (Medusa); `embeds`, the path's tokens, is accepted for `SequentialHeads`' signature."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.heads = [nn.Linear(hidden_size, hidden_size) for _ in range(num_heads)]

    def __call__(self, h: mx.array, embeds: mx.array | None = None) -> mx.array:
        return mx.stack([h + nn.silu(head(h)) for head in self.heads], axis=-2)


def _unit(x: mx.array) -> mx.array:
    """x scaled to unit root-mean-square (a norm without weights: the heads' inputs, the
    verifier's state and its token embedding, differ in scale by orders of magnitude)."""
    return x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + 1e-6)


def sequential_step(linear: Any, z: mx.array, embed: mx.array) -> mx.array:
    """One sequential head: `z + SiLU(linear([unit(z); unit(embed)]))`, with the head's
    product `linear` (its nn.Linear, or the CPU kernel's int8 copy of it)."""
    return z + nn.silu(linear(mx.concatenate([_unit(z), _unit(embed)], axis=-1)))


class SequentialHeads(nn.Module):
    """Hydra's sequentially dependent heads (Ankner et al. 2024): head k reads the state z_{k-1}
    that head k-1 produced (z_0 = the verifier's state h at t) and the embedding of the token at
    t+k (the verifier's own input embedding, frozen and not stored), `z_k = z_{k-1} +
    SiLU(W_k [unit(z_{k-1}); unit(e_k)] + b_k)`, and z_k gives the logits for token t+k+1 through
    the verifier's output matrix. Head 1 so knows the token its guess follows (the round's bonus
    token, which a Medusa head must guess blind), and head k the path of guesses before it: a
    tree is grown level by level, each level one product of the head over its frontier.

    (..., d), (..., K, d) -> (..., K, d): every head's state over a known path (training)."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.heads = [nn.Linear(2 * hidden_size, hidden_size) for _ in range(num_heads)]

    def step(self, k: int, z: mx.array, embed: mx.array) -> mx.array:
        """Head k (from 0): the next state from `z` (..., d) and the embedding (..., d) of the
        token that follows it."""
        return sequential_step(self.heads[k], z, embed)

    def __call__(self, h: mx.array, embeds: mx.array | None = None) -> mx.array:
        assert embeds is not None, "sequential heads read the path's token embeddings"
        out, z = [], h
        for k in range(len(self.heads)):
            z = self.step(k, z, embeds[..., k, :])
            out.append(z)
        return mx.stack(out, axis=-2)


HEAD_KINDS: dict[str, type[MedusaHeads] | type[SequentialHeads]] = {
    "medusa": MedusaHeads,
    "hydra": SequentialHeads,
}


def embed_tokens(model: Model, tokens: Sequence[int] | np.ndarray) -> mx.array:
    """The verifier's input embedding of `tokens` (as it serves them), float32: (n, d). (The
    CPU kernel's embedding answers in numpy.)"""
    out = model.model.embed_tokens(mx.array(np.asarray(tokens, np.int32)))
    if isinstance(out, mx.array):
        return out.astype(mx.float32)
    return mx.array(np.asarray(out, np.float32))


def head_logits(model: Model, states: mx.array, vocab_subset: int) -> mx.array:
    """Logits over the first `vocab_subset` ids of the verifier's output layer for `states`
    (..., d) (the heads' outputs): the rows of the matrix are independent, so this is exact."""
    return _head_rows(model.head, states, vocab_subset)


def verifier_fingerprint(model: Model) -> str:
    """What identifies the verifier the heads were trained on: its shape and the values of its
    norms, rounded to bfloat16 so that the same weights loaded as float32, float16 or bfloat16
    (or dequantized from a GGUF file) agree. (`layer_skip.weights_fingerprint` keys by the
    loaded dtype and quantization, which heads do not depend on.)"""
    cfg = model.config
    shape = f"{cfg.model_type} {cfg.hidden_size} {len(model.layers)} {cfg.vocab_size}"
    h = hashlib.sha256(shape.encode())
    for a in norm_weights(model):
        h.update(np.array(a.astype(mx.bfloat16).astype(mx.float32)).tobytes())
    return h.hexdigest()[:16]


def heads_cache_path(model: Model) -> Path:
    """Where heads for `model` are found without `heads=`: beside its cached profiles."""
    return profiles_dir() / f"medusa-{verifier_fingerprint(model)}"


def shipped_heads(model: Model) -> Path | None:
    """Heads shipped with ondevice (`Package.resources/heads/*/`, installed as
    `ondevice.resources`) that were trained for `model`, found by the fingerprint in their
    heads.json; None where none was."""
    from importlib.resources import files

    fingerprint = verifier_fingerprint(model)
    root = Path(str(files("ondevice.resources").joinpath("heads")))
    for meta in sorted(root.glob(f"*/{META}")):
        try:
            if json.loads(meta.read_text()).get("verifier_fingerprint") == fingerprint:
                return meta.parent
        except (OSError, ValueError):
            continue  # not a heads folder: the others may still be
    return None


@dataclass
class HeadsInfo:
    """heads.json: what the weights are for and how they were made."""

    fingerprint: str
    hidden_size: int
    num_heads: int
    vocab_subset: int
    extra: dict[str, Any] = field(default_factory=dict)  # verifier name, training, acceptance
    kind: str = "medusa"  # HEAD_KINDS: "medusa" (independent) or "hydra" (sequential)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "verifier_fingerprint": self.fingerprint,
            "hidden_size": self.hidden_size, "num_heads": self.num_heads,
            "vocab_subset": self.vocab_subset, "kind": self.kind, **self.extra,
        }  # fmt: skip

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> HeadsInfo:
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"not {FORMAT} version {VERSION}")
        kind = doc.get("kind", "medusa")  # folders written before sequential heads existed
        if kind not in HEAD_KINDS:
            raise ValueError(f"unknown kind of heads {kind!r} (known: {', '.join(HEAD_KINDS)})")
        keys = ("format", "version", "verifier_fingerprint", "hidden_size", "num_heads",
                "vocab_subset", "kind")  # fmt: skip
        return cls(
            str(doc["verifier_fingerprint"]), int(doc["hidden_size"]), int(doc["num_heads"]),
            int(doc["vocab_subset"]), {k: v for k, v in doc.items() if k not in keys}, kind,
        )  # fmt: skip


TRAIN_HINT = "ondevice distill --heads medusa --verifier MODEL -o HEADS"


def read_heads(folder: Path) -> tuple[dict[str, mx.array], HeadsInfo]:
    """The weights and info of a heads folder (OndeviceError naming the file otherwise)."""
    folder = Path(folder)
    meta, weights = folder / META, folder / WEIGHTS
    for f in (meta, weights):
        if not f.is_file():
            raise OndeviceError(
                f"{f}: not found; a Medusa heads folder holds {META} and {WEIGHTS} (made by "
                f"`{TRAIN_HINT}`)."
            )
    try:
        info = HeadsInfo.from_json(json.loads(meta.read_text()))
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise OndeviceError(
            f"{meta}: not a readable Medusa heads description ({e}); train the heads again with "
            f"`{TRAIN_HINT}`."
        ) from None
    try:
        arrays = mx.load(str(weights))
        if info.extra.get("bits"):  # quantized (`save_heads` under a size limit): float again
            quant = {"group_size": int(info.extra["group_size"]), "bits": int(info.extra["bits"])}
            arrays = expand_quantized(arrays, quant)
    except Exception as e:  # noqa: BLE001 - MLX raises plain exceptions for bad files
        raise OndeviceError(f"{weights}: unreadable ({e}); train the heads again.") from None
    return arrays, info


Heads = MedusaHeads | SequentialHeads


def load_heads(folder: Path, model: Model) -> tuple[Heads, HeadsInfo]:
    """Heads from `folder` for the verifier `model` (float32), checked against it."""
    arrays, info = read_heads(folder)
    meta = Path(folder) / META
    cfg = model.config
    fix = f"train heads for this verifier with `{TRAIN_HINT}`, or pass the heads made for it"
    if info.hidden_size != cfg.hidden_size:
        raise OndeviceError(
            f"{meta}: these heads were trained for a verifier of hidden size {info.hidden_size}, "
            f"this verifier's is {cfg.hidden_size}; {fix}."
        )
    if info.fingerprint != verifier_fingerprint(model):
        raise OndeviceError(
            f"{meta}: these heads were trained for another verifier (fingerprint "
            f"{info.fingerprint}, this verifier's is {verifier_fingerprint(model)}; "
            f"{info.extra.get('verifier', 'unknown')!r}); {fix}."
        )
    if not 1 <= info.vocab_subset <= cfg.vocab_size or info.num_heads < 1:
        raise OndeviceError(f"{meta}: vocab_subset or num_heads out of range; {fix}.")
    heads = HEAD_KINDS[info.kind](info.hidden_size, info.num_heads)
    try:
        heads.load_weights([(k, v.astype(mx.float32)) for k, v in arrays.items()])
    except ValueError as e:
        raise OndeviceError(f"{Path(folder) / WEIGHTS}: {e}; train the heads again.") from None
    mx.eval(heads.parameters())
    return heads, info


# -- the proposer ---------------------------------------------------------------------------------


class MedusaProposer:
    """Trees from Medusa heads over the verifier's hidden state at the last accepted node (see
    the module). The first round drafts from the prompt's last state (`start_from`); where the
    prefill computed none (the prompt cache held the whole prompt) it is a plain step."""

    name = "medusa"
    wants_hidden = True

    def __init__(
        self,
        model: Model,
        heads: MedusaHeads,
        info: HeadsInfo,
        *,
        depth: int | None = None,
        width: int = WIDTH,
        budget: BudgetFn | None = None,
        calibration: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        self.model, self.heads, self.info = model, heads, info
        self.depth = min(depth or info.num_heads, info.num_heads)
        self.width = width
        self.budget = budget or cost_budget(None)
        self.state: np.ndarray | None = None  # (d,) the verifier's state at the last accepted node
        # per depth: summed predicted acceptance of verified nodes, and rounds accepting that deep
        # (`Calibrations`: the pair's, or the prior); the heads' confidence is not their accuracy
        self.predicted, self.realised = calibration or Calibrations().get("medusa", self.depth + 2)
        self._pred: np.ndarray | None = None
        self._tree: TokenTree | None = None  # this proposer's last tree (`observe` calibrates it)

    def reset(self, prompt: Sequence[int]) -> None:
        self.state = None

    def start_from(self, state: np.ndarray) -> None:
        self.state = np.asarray(state, np.float32)

    def head_probs(self, state: np.ndarray) -> np.ndarray:
        """(K, vocab_subset) each head's temperature-1 distribution from one hidden state."""
        out = self.heads(mx.array(state, dtype=mx.float32))
        return np.array(mx.softmax(head_logits(self.model, out, self.info.vocab_subset), axis=-1))

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        tree = TokenTree.root(seq[-1])
        depth = min(self.depth, max_depth)
        self._pred = None
        if self.state is None or depth < 1:
            return tree
        probs = self.head_probs(self.state)[:depth]
        top = np.stack([top_tokens(p, self.width) for p in probs])
        # heads may be over- or underconfident: scaled either way, a value stays <= 1
        calib = self.realised / self.predicted
        # best first: a node's key never exceeds its parent's or its elder sibling's, so nodes
        # pop in the order of their values and every node's parent pops before it
        heap: list[tuple[float, int, int, int, int, float]] = []  # -key, n, parent, d, rank, raw
        nodes: list[tuple[int, int, float, float]] = []  # (parent, token, raw, value)
        order = itertools.count()  # ties: first pushed, first popped

        def push(parent: int, d: int, rank: int) -> None:
            if d > depth or rank >= top.shape[1]:
                return
            raw_parent, key_parent = nodes[parent - 1][2:] if parent else (1.0, 1.0)
            raw = raw_parent * float(probs[d - 1, top[d - 1, rank]])
            key = min(key_parent, raw * float(calib[d]))
            heapq.heappush(heap, (-key, next(order), parent, d, rank, raw))

        push(0, 1, 0)
        while heap and len(nodes) < MAX_NODES:
            neg, _, parent, d, rank, raw = heapq.heappop(heap)
            nodes.append((parent, int(top[d - 1, rank]), raw, -neg))
            push(parent, d, rank + 1)  # the next sibling
            push(len(nodes), d + 1, 0)  # the first child
        values = np.array([v for _, _, _, v in nodes])
        n = max(0, min(int(self.budget(values)), len(nodes)))
        pred = np.zeros(len(self.predicted))
        for parent, token, raw, _ in nodes[:n]:
            node = tree.add(parent, token)
            pred[min(tree.depths[node], len(pred) - 1)] += raw
        self._pred, self._tree = pred, tree
        return tree

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        """A verification's outcome: the state at its last accepted node is where the next
        guesses come from, whoever built the tree (`auto` shows this proposer every round);
        only its own trees calibrate its confidence."""
        hidden = verdict.hidden
        assert hidden is not None, "the tree decoder did not hand over the hidden states"
        self.state = np.asarray(hidden[verdict.path[-1] if verdict.path else 0], np.float32)
        if self._pred is not None and tree is self._tree:
            depths = np.arange(len(self.predicted))
            tried = self._pred > 0
            self.predicted += self._pred
            self.realised += tried & (depths >= 1) & (depths <= len(verdict.path))
        self._pred = self._tree = None


class HeadsDraft:
    """Sequential heads as the draft of a dynamic tree (`DraftTreeProposer`, EAGLE-2's growth
    level by level): `sync` gives the root's children (head 1 over the verifier's state at the
    last accepted node and the root token, the round's bonus), `expand` the children of a
    level's frontier nodes, one product of the next head (and of the output rows) over all of
    them. Each node keeps the state its own guess came from, which its children's head reads.

    Its seconds of work are estimated, not clocked (`auto` must choose the same way on every
    run): `level_cost` per head evaluated, from the verifier's pass cost by the share of the
    bytes a level reads (`level_cost`)."""

    def __init__(
        self,
        model: Model,
        heads: SequentialHeads,
        info: HeadsInfo,
        vocab: int,
        calibration: tuple[np.ndarray, np.ndarray],
        level_cost: float = 0.0,
    ):
        self.model, self.heads, self.info, self.vocab = model, heads, info, vocab
        self.hidden: np.ndarray | None = None  # (d,) the verifier's state at the last accepted node
        self._calibration = calibration
        self.level_cost = level_cost
        self.work = 0.0  # estimated seconds, as `DraftState.work` (auto adds them to a round)
        self.switch_work = 0.0  # nothing to catch up on: the verifier's state is always there
        self._z: dict[int, mx.array] = {}  # node -> the state its token was guessed from
        self._new: mx.array | None = None  # the states the last level made
        self._kernel = _int8_products(model, heads, info)  # (heads, rows) or None

    def calibration(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        return self._calibration

    def reset(self, prompt: Sequence[int]) -> None:
        self.hidden = None

    def _logits(self, k: int, z: mx.array, tokens: Sequence[int]) -> np.ndarray:
        """Head k over states `z` (n, d) followed by `tokens`: (n, vocab_subset) logits (a
        truncated vocabulary, as an FR-Spec draft's: the chooser pads them where it needs
        every id, `sampling.align`)."""
        e = embed_tokens(self.model, tokens)
        if self._kernel is None:
            nz = self.heads.step(k, z, e)
            sub = head_logits(self.model, nz, self.info.vocab_subset).astype(mx.float32)
        else:  # the same step, its products in int8 by the CPU kernel
            steps, rows = self._kernel
            nz = sequential_step(steps[k], z, e)
            sub = rows(nz)
        mx.eval(nz, sub)
        self.work += self.level_cost
        self._new = nz
        return np.array(sub)

    def sync(self, seq: Sequence[int]) -> np.ndarray:
        assert self.hidden is not None, "the proposer drafts only from a verifier's state"
        logits = self._logits(0, mx.array(self.hidden[None]), [seq[-1]])
        assert self._new is not None
        self._z = {0: self._new[0]}
        return logits[0]

    def expand(self, tree: TokenTree, nodes: Sequence[int]) -> np.ndarray:
        depths = {tree.depths[n] for n in nodes}
        assert len(depths) == 1, "a dynamic tree expands one level at a time"
        z = mx.stack([self._z[tree.parents[n]] for n in nodes])
        logits = self._logits(depths.pop(), z, [tree.tokens[n] for n in nodes])
        new = self._new
        assert new is not None
        self._z.update((n, new[i]) for i, n in enumerate(nodes))
        return logits

    def commit(self, tree: TokenTree, path: Sequence[int]) -> None:
        self._z = {}


# (heads, verifier) ids -> (the verifier, weakly: an id is reused after it is freed; products)
_INT8: dict[tuple[int, int], tuple[weakref.ref, tuple[list[Any], Any]]] = {}


def _int8_products(
    model: Model, heads: SequentialHeads, info: HeadsInfo
) -> tuple[list[Any], Any] | None:
    """Where the CPU kernel serves the verifier and the processor has int8 dot products: the
    heads' products and the subset's output rows as int8 products (`kernel.KernelLinear`: a
    quarter of the float32 heads' bytes and half of the bf16 rows', about half a level's
    time: a draft's guesses need not be exact, the verification is). None elsewhere (a Mac:
    MLX on the GPU), where the heads run as trained."""
    from ondevice.runtime import kernel

    if not (kernel.serves(model) and kernel.cpu_has_int8()):
        return None
    head = model.head
    if not isinstance(head, kernel.KernelLinear):
        return None
    key = (id(heads), id(model))  # the heads live as long as the process (`_LOADED`)
    if key not in _INT8 or _INT8[key][0]() is not model:  # once: each generation builds anew
        steps = [kernel.KernelLinear(h.weight, h.bias, "int8") for h in heads.heads]
        _INT8[key] = weakref.ref(model), (steps, head.top(info.vocab_subset, "int8"))
    return _INT8[key][1]


def level_cost(model: Model, info: HeadsInfo, verify_cost: CostProfile | None) -> float:
    """Estimated seconds of one head level: the one-token verifier pass scaled by the bytes a
    level reads (the head's weights and the subset's output rows) against the verifier's."""
    if verify_cost is None:
        return 0.0
    cfg = model.config
    d, inter, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    layer = 2 * d * d + 2 * d * kv + 3 * d * inter
    whole = len(model.layers) * layer + cfg.vocab_size * d
    return float(verify_cost(1)) * (2 * d * d + info.vocab_subset * d) / whole


class HydraProposer(DraftTreeProposer):
    """Trees from sequential heads: a dynamic tree grown as from a draft model (see
    `DraftTreeProposer`), each level one evaluation of the next head. The first round of a
    generation drafts from the prompt's last state (`start_from`), or, where the prefill
    computed none, is a plain step.

    With `lookup` (prompt lookup), what followed the context's tail earlier is added to the
    tree as one more branch where its match pays (`PromptLookup.propose`: learnt per match
    length): the heads guess fresh text, a copy of a passage comes from the lookup, and one
    verification takes whichever the verifier follows (a node both name is shared)."""

    wants_hidden = True

    def __init__(
        self, draft: HeadsDraft, *args: Any, lookup: PromptLookup | None = None, **kwargs: Any
    ):
        super().__init__(draft, *args, **kwargs)
        self.heads_draft = draft
        self.lookup = lookup
        self._proposed: TokenTree | None = None
        self._copied: list[int] = []  # the lookup's branch in the proposed tree (nodes)

    def reset(self, prompt: Sequence[int]) -> None:
        super().reset(prompt)
        if self.lookup is not None:
            self.lookup.reset(prompt)

    def start_from(self, state: np.ndarray) -> None:
        self.heads_draft.hidden = np.asarray(state, np.float32)

    def propose(self, seq: list[int], max_depth: int, noise: PositionNoise) -> TokenTree:
        self._proposed, self._copied = None, []
        if self.heads_draft.hidden is None or max_depth < 1:
            tree = TokenTree.root(seq[-1])
            self._cand, self._depth_pred = None, None  # no heads' tree to calibrate
            self.expected = None
        else:
            tree = self._proposed = super().propose(seq, max_depth, noise)
        if self.lookup is not None:
            copy = self.lookup.propose(seq, max_depth, noise)
            if copy.size:
                self._proposed = tree
                self._copied = tree.add_path(copy.path_tokens(len(copy) - 1))
        return tree

    def observe(self, seq: list[int], tree: TokenTree, verdict: Verification) -> None:
        """As `MedusaProposer.observe`: the next guesses start from the state at the last
        accepted node whoever built the tree; only its own trees calibrate it (the heads by
        the part of the path that is theirs, the lookup by how far its branch was followed)."""
        hidden = verdict.hidden
        assert hidden is not None, "the tree decoder did not hand over the hidden states"
        last = hidden[verdict.path[-1] if verdict.path else 0]
        self.heads_draft.hidden = np.asarray(last, np.float32)
        if self._proposed is None or tree is not self._proposed:
            self._proposed = None
            return
        if self.lookup is not None and self._copied:
            followed = 0
            for a, b in zip(verdict.path, self._copied):
                if a != b:
                    break
                followed += 1
            self.lookup.learn(len(self._copied), followed)
        if self._cand is not None:  # the heads' tree: the nodes it grew (`_kept`) calibrate it
            own = list(itertools.takewhile(lambda n: n < len(self._kept), verdict.path))
            super().observe(seq, tree, replace(verdict, path=own))
        self._proposed = None


_LOADED: dict[tuple[str, float], tuple[Heads, HeadsInfo]] = {}  # this process's heads


def _heads_for(folder: Path, model: Model) -> tuple[Heads, HeadsInfo]:
    """`load_heads`, once per folder version and verifier (by fingerprint) in a process."""
    stamp = max(
        (f.stat().st_mtime for f in (folder / META, folder / WEIGHTS) if f.exists()), default=0.0
    )
    key = (f"{folder.resolve()}|{verifier_fingerprint(model)}", stamp)
    if key not in _LOADED:
        _LOADED[key] = load_heads(folder, model)
    return _LOADED[key]


def check_heads(folder: str | Path, model: Model) -> Path:
    """The heads folder given to `load`, checked against the verifier `model` (loaded once)."""
    if not isinstance(folder, (str, PathLike)) or not str(folder).strip():
        raise OndeviceError(f"heads must be a folder of Medusa heads; got {folder!r}.")
    path = Path(folder).expanduser()
    _heads_for(path, model)
    return path


def build(res: Resources, spec: Speculation) -> MedusaProposer | HydraProposer:
    """The "medusa" method: a tree of the heads' top choices, num_draft_tokens deep (default:
    every head), as many nodes as the verifier's pass costs say pay; sequential heads grow it
    level by level (`HydraProposer`). Heads come from `res.heads` or the cache; without them
    `Unavailable` says how to train them. Not a candidate of `auto` beside a draft model
    (`not_beside_a_draft`)."""
    not_beside_a_draft(res, spec)
    model = getattr(innermost(res.verifier), "model", None)
    if not isinstance(model, Model):
        raise OndeviceError(
            "method 'medusa' reads the verifier's hidden states and needs an MLX verifier."
        )
    folder = res.heads
    if folder is None:
        cached = heads_cache_path(model)
        folder = cached if (cached / META).is_file() else shipped_heads(model)
        if folder is None:
            raise Unavailable(
                "method 'medusa' needs Medusa heads trained for this verifier and found none "
                f"(looked in {cached}). Train them with `{TRAIN_HINT}` and pass heads=HEADS "
                f"(--heads HEADS), or put the folder at {cached}."
            )
    heads, info = _heads_for(Path(folder), model)
    # learnt across the pair's generations, per heads folder (every depth the heads reach)
    calibration = res.calibrations.get(("medusa", str(Path(folder).resolve())), info.num_heads + 2)
    depth = min(spec.num_draft_tokens or info.num_heads, info.num_heads)
    if isinstance(heads, SequentialHeads):
        cost = level_cost(model, info, res.verify_cost)
        draft = HeadsDraft(model, heads, info, res.vocab, calibration, cost)
        return HydraProposer(
            draft, res.vocab, res.chooser, mode="dynamic", depth=depth, topk=WIDTH // 2,
            budget=cost_budget(res.verify_cost, cost), expand_cost=cost,
            rate=cost_rate(res.verify_cost, cost), name="medusa",
            lookup=PromptLookup(branches=1, budget=cost_budget(res.verify_cost)),
        )  # fmt: skip
    return MedusaProposer(
        model, heads, info, depth=depth, budget=cost_budget(res.verify_cost),
        calibration=calibration,
    )  # fmt: skip
